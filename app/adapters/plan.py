"""What trains and what stays frozen, decided before any weight loads: a full fine-tune (every weight, in float32) or
LoRA adapters on a frozen base in its storage dtype. Then the loading itself, and the lines that say what happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from app.adapters import base as base_model
from app.adapters.lora import AdapterPlan, adapter_parameters, add_adapters, new_modules, plan_adapters
from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig
from app.errors import UsageError, counted
from app.storage.checkpoints import MODEL_FILE, stored_shapes, weights_mismatch
from app.tasks.first_token import compute_the_first_token_alone
from app.tasks.task import Task, task_of_weights
from app.telemetry.footprint import Footprint


@dataclass(frozen=True)
class ModelPlan:
    dtype: torch.dtype  # the base's storage dtype: float32 for a full fine-tune
    why: str  # why that dtype, in words
    adapters: AdapterPlan | None  # None: every weight trains
    base: str | None  # the base's fingerprint (adapters only): checkpoints record it, a resume must match it
    footprint: Footprint
    task: str  # the task's name: adapters record it, and a resume of any checkpoint must match it

    def record(self) -> dict | None:
        """What checkpoints record of the adapters (None for a full fine-tune)."""
        return {**self.adapters.record(self.base), "task": self.task} if self.adapters else None


def plan_model(
    cfg: TrainConfig, policy: PrecisionPolicy, task: Task, model_config: PretrainedConfig, model_path: str
) -> ModelPlan:
    """The plan for this run, from the model built on the meta device and the base's files. UsageError for adapters
    that name no layer, a base dtype autocast cannot compute with, or float16 weights beyond fp16's range."""
    dtype, why = base_model.base_dtype(cfg.dtype, policy, cfg.use_peft)
    empty = task.empty_model(model_config)
    if cfg.gradient_checkpointing and not getattr(empty, "supports_gradient_checkpointing", False):
        raise UsageError(  # transformers' own refusal came after the weights had loaded and the folders were made
            f"--gradient_checkpointing: {type(empty).__name__} does not support it in transformers; drop the flag, "
            "or lower --per_device_train_batch_size to save memory"
        )
    if not cfg.use_peft:
        footprint = Footprint(0, dtype, sum(p.numel() for p in empty.parameters()))
        return ModelPlan(dtype, why, None, None, footprint, task.name)
    new = new_modules(empty, base_model.stored_keys(model_path))
    adapters = plan_adapters(cfg, empty, new, classifier=task.name == "sequence_classification")
    if dtype == torch.float16:
        base_model.check_fp16_range(model_path, asked=cfg.dtype)
    modules = dict(empty.named_modules())
    copied = sum(p.numel() for name in adapters.trained_in_full for p in modules[name].parameters())
    parameters = sum(p.numel() for p in empty.parameters())
    trainable = adapter_parameters(empty, adapters) + copied
    footprint = Footprint(parameters, dtype, trainable)
    return ModelPlan(dtype, why, adapters, base_model.fingerprint(model_path), footprint, task.name)


def load_model(
    task: Task, model_path: str, plan: ModelPlan, say: Callable[[str], None], first_token_alone: bool = True
) -> torch.nn.Module:
    """The model as the plan says: every weight in float32, or the base in its dtype with float32 adapters on.
    `first_token_alone`: a classifier's last layer computes only the row its head reads, where it can
    (tasks/first_token.py); False for a run that began computing every row."""
    model = task.load_model(model_path, plan.dtype, say)
    if first_token_alone:
        compute_the_first_token_alone(model)
    return add_adapters(model, plan.adapters, task.name) if plan.adapters else model


def reload_base(model: torch.nn.Module, task: Task, model_path: str, dtype: torch.dtype) -> None:
    """The frozen base's weights loaded again from its files in `dtype` (a precision fallback from fp16 to bf16 or
    fp32): what trains stays as it is. `model`: the model with adapters, unwrapped."""
    fresh = dict(task.load_model(model_path, dtype, lambda line: None).named_parameters())  # its new head is unused
    for name, param in model.named_parameters():
        if not param.requires_grad:  # peft's names of a base weight: under base_layer, or a module's original_module
            stored = (
                name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
            )
            param.data = fresh[stored].data.to(param.device)  # loaded on the CPU; the model may be on a GPU


def describe_trainable(model: torch.nn.Module, plan: ModelPlan) -> list[str]:
    """What is frozen in which dtype and what trains in float32, counted on the loaded model."""
    frozen: dict[torch.dtype, int] = {}
    trained = 0
    for param in model.parameters():
        if param.requires_grad:
            trained += param.numel()
        else:
            frozen[param.dtype] = frozen.get(param.dtype, 0) + param.numel()
    trains = f"trained in float32: {_count(trained)} parameters ({_mib(trained * 4)})"
    if not plan.adapters:
        return [f"{trains}: every weight (a full fine-tune; --use_peft trains adapters instead)"]
    held = ", ".join(
        f"{_count(n)} in {base_model.dtype_name(d)} ({_mib(n * d.itemsize)})"
        for d, n in sorted(frozen.items(), key=str)
    )
    warning = plan.adapters.rank_warning()
    return [plan.adapters.describe(), *([warning] if warning else []), f"frozen base ({plan.why}): {held}; {trains}"]


def check_resume(saved: dict | None, plan: ModelPlan, checkpoint: Path, empty: torch.nn.Module) -> None:
    """A checkpoint continues only the run that wrote it: the same kind (full or adapters), base and adapters; a
    full fine-tune's weights of the names and shapes of this run's model (`empty`, on the meta device, for its task:
    another model, task or label count would otherwise fail inside Accelerate's load)."""
    now = plan.record()
    where = f"--resume_from_checkpoint {checkpoint}"
    if saved is None and now is None:
        check_full_weights(checkpoint, empty, plan.task)
        return
    if saved is None:
        raise UsageError(
            f"{where} holds a full fine-tune, not adapters: resume it without --use_peft, or start the adapters in "
            "another --output_dir"
        )
    if now is None:
        raise UsageError(
            f"{where} holds LoRA adapters: resume with --use_peft and the --lora_* flags it was saved with"
        )
    if saved.get("task", plan.task) != plan.task:  # checkpoints from before the task was recorded: the shape check
        raise UsageError(
            f"{where} holds adapters trained for --task {saved['task']}, not this run's --task {plan.task}: resume "
            f"with --task {saved['task']}, or start the new task in another --output_dir"
        )
    if saved["base"] != now["base"]:
        raise UsageError(
            f"{where} holds adapters of another base model (fingerprint {saved['base']}, this one {now['base']}): "
            "resume with the --model_name_or_path they were trained on"
        )
    differ = [key for key in _SHAPE_FLAGS if not _same(saved[key], now[key])]
    if differ:
        flags = ", ".join(_SHAPE_FLAGS[key] for key in differ)
        was = ", ".join(f"{_SHAPE_FLAGS[key]} {_shown(saved[key], now[key])}" for key in differ)
        raise UsageError(f"{where} holds adapters of another shape ({was}): resume with the same {flags}")


def check_full_weights(checkpoint: Path, empty: torch.nn.Module, task: str) -> None:
    """A full fine-tune's checkpoint holds every weight of this run's model (`empty`, for `task`), and no other."""
    stored = stored_shapes(checkpoint / MODEL_FILE)
    if stored is None or not (mismatch := weights_mismatch(stored, empty)):
        return
    where = f"--resume_from_checkpoint {checkpoint}"
    if trained_for := task_of_weights(set(stored), empty.config, besides=task):
        raise UsageError(
            f"{where} holds a {trained_for} model, not one for this run's --task {task} ({mismatch}): resume with "
            f"--task {trained_for}, or start the new task in another --output_dir"
        )
    raise UsageError(
        f"{where} holds the weights of another model ({mismatch}): resume with the model and labels it was trained "
        "with, or start the new model in another --output_dir"
    )


def check_resume_labels(saved: list[str] | None, now: list[str] | None, checkpoint: Path) -> None:
    """A classifier's checkpoint continues on data with the same labels: class id i must keep meaning label i."""
    if saved is None or now is None or saved == now:
        return
    shown = lambda names: ", ".join(f"{i}: {name}" for i, name in enumerate(names))  # noqa: E731
    raise UsageError(
        f"--resume_from_checkpoint {checkpoint} was trained on the labels {shown(saved)}; this data's are "
        f"{shown(now)}, so class ids would change meaning: resume on data with the run's labels, or start a new run "
        "in another --output_dir"
    )


_SHAPE_FLAGS = {
    "r": "--lora_r",
    "alpha": "--lora_alpha",
    "use_rslora": "--use_rslora",
    "target_modules": "--lora_target_modules",
    "modules_to_save": "--lora_modules_to_save",
}


def _same(saved, now) -> bool:
    """Module lists as sets: `--lora_target_modules v_proj q_proj` adapts the layers that `q_proj v_proj` did."""
    return set(saved) == set(now) if isinstance(saved, list) and isinstance(now, list) else saved == now


def _shown(value, now) -> str:
    """A checkpoint's value where this run's differs; for modules, one that only one side has."""
    if not isinstance(value, list):
        return str(value)
    if only_saved := [name for name in value if name not in now]:
        return f"on {counted(len(value), 'module')}, {only_saved[0]} among them"
    missing = next(name for name in now if name not in value)
    return f"on {counted(len(value), 'module')}, not {missing}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
