"""The best model and early stopping, with HF Trainer's names and rules.

After each evaluation the loop calls `BestModel.after_eval`: it keeps the best step and its metric in the TrainState
(so they live in every checkpoint and survive a resume), and counts evaluations without improvement for early
stopping. With --load_best_model_at_end every evaluation writes a checkpoint (HF requires save steps to fall on
evaluations for the same reason: the best step must have a checkpoint to come back to), and pruning spares the best.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from app.checkpoint import Checkpoints
from app.errors import UsageError
from app.evaluation import evaluates_during_training
from app.state import TrainState
from app.telemetry.tags import EVAL_ACCURACY, EVAL_EXACT_MATCH, EVAL_F1, EVAL_LOSS, EVAL_PERPLEXITY

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.run import Run

# Every task's metrics; the task says which of them it computes (tasks.check_metric).
METRICS = {
    "loss": EVAL_LOSS,
    "accuracy": EVAL_ACCURACY,
    "f1": EVAL_F1,
    "perplexity": EVAL_PERPLEXITY,
    "exact_match": EVAL_EXACT_MATCH,
}
LOWER_IS_BETTER = {EVAL_LOSS, EVAL_PERPLEXITY}


def metric_tag(name: str | None) -> str:
    """The eval tag that --metric_for_best_model names: "eval/loss", "eval_loss" and "loss" are all eval/loss."""
    bare = (name or "loss").removeprefix("eval/").removeprefix("eval_")
    if bare not in METRICS:
        raise UsageError(
            f"--metric_for_best_model {name!r} is not an evaluation metric; use one of {', '.join(METRICS.values())}"
        )
    return METRICS[bare]


def check_best_model_flags(cfg: TrainConfig) -> None:
    """Part of TrainConfig.validate."""
    metric_tag(cfg.metric_for_best_model)
    if cfg.early_stopping_patience is not None and cfg.early_stopping_patience < 1:
        raise UsageError(f"--early_stopping_patience must be 1 or more, got {cfg.early_stopping_patience}")
    if cfg.early_stopping_threshold < 0:
        raise UsageError(f"--early_stopping_threshold must be 0 or more, got {cfg.early_stopping_threshold}")
    for flag, on in (
        ("--load_best_model_at_end", cfg.load_best_model_at_end),
        ("--early_stopping_patience", cfg.early_stopping_patience is not None),
    ):
        if on and cfg.eval_steps < 1:
            raise UsageError(f"{flag} needs evaluations during training: pass --eval_steps N (N >= 1)")


class BestModel:
    """Tracks the best evaluation in `state` and decides on early stopping."""

    def __init__(self, cfg: TrainConfig, state: TrainState):
        self.tag = metric_tag(cfg.metric_for_best_model)
        default = self.tag not in LOWER_IS_BETTER
        self.greater_is_better = cfg.greater_is_better if cfg.greater_is_better is not None else default
        self.active = cfg.load_best_model_at_end or cfg.early_stopping_patience is not None
        self.patience, self.threshold = cfg.early_stopping_patience, cfg.early_stopping_threshold
        self.state = state

    def after_eval(self, step: int, metrics: dict[str, float]) -> str | None:
        """Record an evaluation; returns why training should stop early, or None."""
        if not self.active:
            return None
        value, best = metrics[self.tag], self.state.best_metric
        better = best is None or (value > best if self.greater_is_better else value < best)
        # As HF: the best follows any improvement, but only one beyond the threshold resets the patience.
        if better and (best is None or abs(value - best) > self.threshold):
            self.state.evals_without_improvement = 0
        else:
            self.state.evals_without_improvement += 1
        if better:
            self.state.best_metric, self.state.best_step = value, step
        if not self.out_of_patience():
            return None
        return (
            f"early stopping at optimizer step {step}: {self.tag} has not improved on {self.state.best_metric:.4f} "
            f"(step {self.state.best_step}) by more than {self.threshold} for {self.patience} evaluation(s)"
        )

    def out_of_patience(self) -> bool:
        return self.patience is not None and self.state.evals_without_improvement >= self.patience

    def best_checkpoint(self, checkpoints: Checkpoints) -> Path | None:
        """The checkpoint to load at the end, or None when the model in memory is already the best."""
        if self.state.best_step is None or self.state.best_step == self.state.opt_step:
            return None
        return checkpoints.path(self.state.best_step)


def end_with_best(run: Run, final: dict[str, float]) -> dict[str, float]:
    """After the final evaluation: let it compete for best, then load the best weights if asked.

    Returns:
        The evaluation metrics of the model that will be saved.
    """
    cfg, state, accelerator = run.cfg, run.state, run.accelerator
    best = BestModel(cfg, state)
    if not evaluates_during_training(cfg.eval_steps, state.opt_step, run.total_steps):  # else the loop counted it
        best.after_eval(state.opt_step, final)
    path = best.best_checkpoint(run.checkpoints) if cfg.load_best_model_at_end else None
    if path is None:
        return final
    run.checkpoints.load_model_weights(run.model, path)
    accelerator.print(
        f"loaded the best model, step {state.best_step} ({best.tag} {state.best_metric:.4f}), from {path} in place "
        f"of step {state.opt_step}'s"
    )
    return run.evaluate()
