"""LoRA adapters (peft) on a frozen base, with trl's flag names: which layers get adapters, which modules train in
full, and the one rule that makes the classic fp16 failure impossible: everything that trains is float32.

The classic failure ("ValueError: Attempting to unscale FP16 gradients", peft #341 and its kin): the base is loaded in
float16, peft copies a module to train in full (`modules_to_save`, such as a classifier head) in float16 too, and the
GradScaler refuses its fp16 gradients. Here every trainable parameter is cast to float32 once the adapters are on,
whatever the base is stored in; autocast computes with them in the run's half precision and their gradients are fp32.

What trains is decided from the model built on the meta device, before any weight loads (`plan_adapters`), so that a
bad target is one line and exit 2, and the memory estimate can be printed first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.pytorch_utils import Conv1D

from app.adapters.forward import add_updates_in_place
from app.config import ALL_LINEAR, TrainConfig
from app.errors import UsageError, counted

# peft trains a classification head in full under the SEQ_CLS task type, found by these names.
HEAD_NAMES = ("classifier", "score")
ADAPTABLE = (torch.nn.Linear, Conv1D, torch.nn.Embedding)  # layers peft's LoRA wraps
LINEAR = (torch.nn.Linear, Conv1D)
TASK_TYPES = {"sequence_classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}


@dataclass(frozen=True)
class AdapterPlan:
    """What --use_peft builds on a model: the layers that get adapters and the modules trained in full (full module
    names of the model before peft wraps it), and the adapters' shape."""

    targets: tuple[str, ...]
    trained_in_full: tuple[str, ...]
    r: int
    alpha: int
    dropout: float
    rslora: bool
    asked: tuple[str, ...]  # --lora_target_modules as given: (all-linear,) or names
    seed: int  # the adapters' initial weights come from it alone (add_adapters)
    max_rank: tuple[str, int]  # the target whose update can have the highest rank, and that rank (its smaller side)
    conv1d: bool = False  # every target is GPT-2's Conv1D, whose weight is stored transposed (peft's fan_in_fan_out)

    def record(self, base: str) -> dict:
        """What every checkpoint records of the adapters; a resume must match it (storage/checkpoints.py)."""
        return {
            "base": base,
            "r": self.r,
            "alpha": self.alpha,
            "use_rslora": self.rslora,
            "target_modules": list(self.targets),
            "modules_to_save": list(self.trained_in_full),
        }

    def lora_config(self, task: str):
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            use_rslora=self.rslora,
            target_modules=list(self.targets),
            modules_to_save=list(self.trained_in_full) or None,
            task_type=TASK_TYPES[task],
            fan_in_fan_out=self.conv1d,  # else peft warns, on every GPT-2 run, that it sets it itself
        )

    def describe(self) -> str:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.targets})
        what = f"{ALL_LINEAR}: " if self.asked == (ALL_LINEAR,) else ""
        full = f"; trained in full: {', '.join(self.trained_in_full)}" if self.trained_in_full else ""
        scale = (
            f"alpha/sqrt(r) = {self.alpha / self.r**0.5:.3g}" if self.rslora else f"alpha/r = {self.alpha / self.r:.3g}"
        )
        return (
            f"adapters: LoRA r={self.r}, {scale}, dropout {self.dropout:g} on {counted(len(self.targets), 'layer')} "
            f"({what}{', '.join(kinds)}){full}"
        )

    def rank_warning(self) -> str | None:
        """A warning when --lora_r is at least every target's own rank: each adapter then holds more weights than its
        layer and learns nothing that training the layer in full could not."""
        name, rank = self.max_rank
        if self.r < rank:
            return None
        return (
            f"warning: --lora_r {self.r} is at least the rank of every adapted layer (at most {rank}, the smaller side "
            f"of {name}): each adapter holds more weights than its layer and can learn no more than training it in "
            f"full; use --lora_r below {rank}, or drop --use_peft to train every weight"
        )


def new_modules(model: torch.nn.Module, stored: set[str] | None) -> list[str]:
    """The modules whose weights the checkpoint does not hold, which loading initialises at random (a classifier's
    head, a pooler the checkpoint lacks): outermost names only. `stored`: the checkpoint's tensor names, or None when
    they cannot be read without loading (then: what lies outside the base model, e.g. `classifier`)."""
    prefix = getattr(model, "base_model_prefix", "")
    stored = as_loaded(model, stored) if stored is not None else None
    missing = []
    for name, _ in model.named_parameters():  # tied weights are named once, where they are stored
        bare = name.removeprefix(f"{prefix}.")
        present = name in stored or bare in stored if stored is not None else bare != name
        if not present:
            missing.append(name.rsplit(".", 1)[0])
    outermost = []
    for module in sorted(set(missing), key=len):
        if not any(module.startswith(f"{outer}.") for outer in outermost):
            outermost.append(module)
    return sorted(outermost)


def as_loaded(model: torch.nn.Module, stored: set[str]) -> set[str]:
    """The checkpoint's tensor names as transformers renames them while loading (its conversion mapping): a
    GPT-NeoX's `embed_out` is `lm_head`, an older BERT's `LayerNorm.gamma` is `LayerNorm.weight`. Taken as stored,
    they looked new, and LoRA trained those modules in full. The stored names too, where transformers has no mapping
    API (before 5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except Exception:  # another transformers: its names as stored
        return stored
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return stored | {rename_source_key(name, renamings, converters)[0] for name in stored}


def _matches(name: str, wanted: str) -> bool:
    return name == wanted or name.endswith(f".{wanted}")  # peft's rule for a name in target_modules


def plan_adapters(cfg: TrainConfig, model: torch.nn.Module, new: list[str], classifier: bool) -> AdapterPlan:
    """The adapters --lora_* ask for on `model` (built on the meta device). UsageError for names that match nothing,
    or that name a module which trains in full."""
    modules = dict(model.named_modules())
    heads = [name for name in HEAD_NAMES if classifier and name in modules]
    full = list(dict.fromkeys([*new, *heads]))
    for wanted in cfg.lora_modules_to_save or ():
        found = [name for name in modules if name and _matches(name, wanted)]
        if not found:
            raise UsageError(f"--lora_modules_to_save {wanted!r} matches no module of the model")
        full += [name for name in found if name not in full]
    # The outermost module alone: RoBERTa's new head is classifier with classifier.dense and classifier.out_proj in
    # it, and peft saves nested modules_to_save in a layout it cannot load back.
    full = [name for name in full if not any(name.startswith(f"{outer}.") for outer in full)]
    in_full = lambda name: any(name == f or name.startswith(f"{f}.") for f in full)  # noqa: E731
    adaptable = {name: m for name, m in modules.items() if isinstance(m, ADAPTABLE)}
    if cfg.lora_target_modules == [ALL_LINEAR]:
        output = model.get_output_embeddings()
        targets = [
            name for name, m in adaptable.items() if isinstance(m, LINEAR) and m is not output and not in_full(name)
        ]
    else:
        targets = []
        for wanted in cfg.lora_target_modules:
            found = [name for name in adaptable if _matches(name, wanted)]
            if not found:
                known = sorted({name.rsplit(".", 1)[-1] for name in adaptable if not in_full(name)})
                raise UsageError(
                    f"--lora_target_modules {wanted!r} matches no layer that LoRA can adapt; the model's are named "
                    f"{', '.join(known[:12])}{', ...' if len(known) > 12 else ''} (or pass {ALL_LINEAR})"
                )
            # A layer inside a module that trains in full (RoBERTa's classifier.dense for `dense`) is not a target.
            outside = [name for name in found if not in_full(name)]
            if not outside:
                raise UsageError(
                    f"--lora_target_modules {wanted!r} names {found[0]}, which trains in full (a new or "
                    "classification head, or --lora_modules_to_save): drop it from the targets"
                )
            targets += [name for name in outside if name not in targets]
    if not targets and cfg.lora_modules_to_save and any(in_full(name) for name in adaptable):
        raise UsageError(
            f"--lora_modules_to_save {' '.join(cfg.lora_modules_to_save)} trains every layer that LoRA could adapt in "
            "full, so no adapter is left; name smaller modules, or drop --use_peft for a full fine-tune"
        )
    if not targets:
        raise UsageError("--lora_target_modules: the model has no linear layer to adapt; name its layers instead")
    tied = tied_embeddings(model)
    if adapted := next((name for name in targets if name in tied), None):
        raise UsageError(
            f"--lora_target_modules: {adapted} shares its weight with {' and '.join(n for n in tied if n != adapted)} "
            "(the model ties its embeddings), so merging its adapters would change both: the merged model and "
            "predict.py's would not be the one trained; adapt other layers"
        )
    max_rank = max(((name, min(_sides(modules[name]))) for name in targets), key=lambda pair: pair[1])
    return AdapterPlan(
        tuple(targets),
        tuple(full),
        cfg.lora_r,
        cfg.lora_alpha,
        cfg.lora_dropout,
        cfg.use_rslora,
        tuple(cfg.lora_target_modules),
        cfg.seed,
        max_rank,
        all(isinstance(modules[name], Conv1D) for name in targets),
    )


def tied_embeddings(model: torch.nn.Module) -> tuple[str, ...]:
    """The input embedding and output head of a model that ties them (one weight), by name; else ()."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is not inputs.weight:
        return ()
    return tuple(name for name, module in model.named_modules() if module is inputs or module is outputs)


def _sides(layer: torch.nn.Module) -> tuple[int, int]:
    """The two sides of an adaptable layer's weight: an adapter of rank r on it holds r x (the sum of both)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        return tuple(layer.weight.shape)
    return layer.num_embeddings, layer.embedding_dim


def adapter_parameters(model: torch.nn.Module, plan: AdapterPlan) -> int:
    """How many parameters the adapters of `plan` add to `model` (built on the meta device)."""
    modules = dict(model.named_modules())
    return sum(plan.r * sum(_sides(modules[name])) for name in plan.targets)


def add_adapters(model: torch.nn.Module, plan: AdapterPlan, task: str) -> torch.nn.Module:
    """The model with peft's adapters on, every trainable parameter in float32 (see the module docstring).

    peft draws each adapter's A from torch's default generator. Drawn from the seed alone, the adapters are the same
    whatever loaded before them, and the same as a peft user's who calls `set_seed(seed)` right before
    `get_peft_model`; the generator's own stream goes on as if they had not been drawn.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.seed)
        wrapped = get_peft_model(model, plan.lora_config(task))
    keep_trainable_in_fp32(wrapped)
    for layer in wrapped.modules():
        # peft casts each layer's input to its adapters' float32 before their dropout. Under autocast the adapters
        # compute in the autocast dtype all the same, so the cast only doubles what dropout draws and what the step
        # keeps for backward (about a third of the LM job's step and 1 GiB); without autocast the input is float32.
        if hasattr(layer, "cast_input_dtype_enabled"):
            layer.cast_input_dtype_enabled = False
    add_updates_in_place(wrapped)
    return wrapped


def keep_trainable_in_fp32(model: torch.nn.Module) -> None:
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def trainable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def keep_trainable_weights(models: list, weights: list, output_dir: str) -> None:
    """Accelerate's save-state hook: a checkpoint holds what trains (adapters, modules trained in full), not the
    frozen base, which every run loads from its own files."""
    for i, model in enumerate(models):
        keep = trainable_names(model)
        weights[i] = {name: tensor for name, tensor in weights[i].items() if name in keep}
