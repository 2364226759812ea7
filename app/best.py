"""The best model and early stopping, with HF Trainer's names and rules.

After each evaluation the loop calls `BestModel.after_eval`: it keeps the best step and its metric in the TrainState
(so they live in every checkpoint and survive a resume), and counts evaluations without improvement for early
stopping. With --load_best_model_at_end every evaluation writes a checkpoint (HF requires save steps to fall on
evaluations for the same reason: the best step must have a checkpoint to come back to), and pruning spares the best.
"""

from __future__ import annotations

import math
from pathlib import Path

from app.config import TrainConfig, metric_tag, recorded_value
from app.errors import UsageError, counted
from app.evaluation import evaluates_during_training
from app.state import TrainState
from app.storage.checkpoints import another_line, best_checkpoint, weights_unusable
from app.telemetry.tags import EVAL_LOSS, EVAL_PERPLEXITY

LOWER_IS_BETTER = {EVAL_LOSS, EVAL_PERPLEXITY}


class BestModel:
    """Tracks the best evaluation in `state` and decides on early stopping."""

    def __init__(self, cfg: TrainConfig, state: TrainState):
        self.tag = metric_tag(cfg.metric_for_best_model)
        default = self.tag not in LOWER_IS_BETTER
        self.greater_is_better = cfg.greater_is_better if cfg.greater_is_better is not None else default
        self.active = bool(cfg.best_model_flags())
        self.patience, self.threshold = cfg.early_stopping_patience, cfg.early_stopping_threshold
        self.state = state

    def after_eval(self, step: int, metrics: dict[str, float]) -> str | None:
        """Record an evaluation; returns why training should stop early, or None."""
        if not self.active:
            return None
        value, best = metrics[self.tag], self.state.best_metric
        # fp16 overflowing before a fallback, or NaN weights (the loss check stops those). A NaN loss marks the
        # evaluation whatever the metric: some logits NaN give an accuracy of the rest, a number of part of the data.
        if math.isnan(value) or math.isnan(metrics.get(EVAL_LOSS, 0.0)):
            return None  # never the best, and nothing to weigh for patience: stopping would save the NaN model
        # Any number beats a NaN best that an earlier version recorded.
        better = best is None or math.isnan(best) or (value > best if self.greater_is_better else value < best)
        # As HF: the best follows any improvement, but only one beyond the threshold resets the patience.
        if better and (best is None or math.isnan(best) or abs(value - best) > self.threshold):
            self.state.evals_without_improvement = 0
        else:
            self.state.evals_without_improvement += 1
        if better:
            self.state.best_metric, self.state.best_step = value, step
            self.state.best_checkpoint = None  # until a checkpoint of this step is saved (Checkpoints.save)
            self.state.best_metric_tag, self.state.best_greater_is_better = self.tag, self.greater_is_better
        if not self.out_of_patience():
            return None
        return (
            f"early stopping at optimizer step {step}: {self.tag} has not improved on {self.state.best_metric:.4f} "
            f"(step {self.state.best_step}) by more than {self.threshold} for {counted(self.patience, 'evaluation')}"
        )

    def out_of_patience(self) -> bool:
        return self.patience is not None and self.state.evals_without_improvement >= self.patience

    def step_to_load(self) -> int | None:
        """The step whose checkpoint to load at the end, or None when the model in memory is already the best."""
        if self.state.best_step is None or self.state.best_step == self.state.opt_step:
            return None
        return self.state.best_step


def stopped_early(cfg: TrainConfig, state: TrainState) -> bool:
    """Whether the run in `state` has stopped early already (a resume of it trains nothing)."""
    return BestModel(cfg, state).out_of_patience()


def check_resume_best(cfg: TrainConfig, state: TrainState, checkpoint) -> None:
    """A resume keeps tracking the best model by the metric and direction its run tracked it by: another metric's
    values compared against the recorded best would pick a step on a number of another kind. UsageError if they
    differ."""
    if state.best_step is None or state.best_metric_tag is None:  # nothing tracked yet, or not recorded
        return
    now = BestModel(cfg, state)
    if not now.active or (now.tag, now.greater_is_better) == (state.best_metric_tag, state.best_greater_is_better):
        return
    rule = lambda tag, greater: f"{tag} ({'higher' if greater else 'lower'} is better)"  # noqa: E731
    raise UsageError(
        f"--resume_from_checkpoint {checkpoint} tracks the best model by "
        f"{rule(state.best_metric_tag, state.best_greater_is_better)}, this resume asks for "
        f"{rule(now.tag, now.greater_is_better)}: resume with --metric_for_best_model "
        f"{state.best_metric_tag.removeprefix('eval/')} (and its --greater_is_better), or start a new run in another "
        "--output_dir"
    )


def untracked_by_a_resume(cfg: TrainConfig, recorded: dict) -> list[str]:
    """A note for a resume whose command leaves out the run's --load_best_model_at_end or --early_stopping_patience
    (its training_args.yaml: `recorded`): they are flags of each command, as in HF Trainer, and the model the run
    saves changes with them."""
    dropped, effects = [], []
    if recorded.get("load_best_model_at_end") is True and not cfg.load_best_model_at_end:
        dropped.append("--load_best_model_at_end")
        effects.append("the model saved is the last step's, not the best")
    patience = recorded_value(recorded, "early_stopping_patience")
    if patience is not None and cfg.early_stopping_patience is None:
        dropped.append(f"--early_stopping_patience {patience}")
        effects.append("it does not stop early")
    if not dropped:
        return []
    return [
        f"note: the run was started with {' and '.join(dropped)}, this resume without: {', and '.join(effects)}; "
        "pass them again to keep them"
    ]


def check_best_checkpoint(cfg: TrainConfig, record, resumed: Path) -> None:
    """With --load_best_model_at_end, the run's best checkpoint so far is loaded at the end: checked now, as the one
    resumed from is, and not found gone or damaged after the training. UsageError if it cannot be loaded.
    `record`: the checkpoint resumed from (storage/checkpoints.CheckpointRecord)."""
    state = record.state
    if not cfg.load_best_model_at_end or state.best_step is None or state.best_step == state.opt_step:
        return
    best = best_checkpoint(state, resumed, commands=record.commands)
    if problem := weights_unusable(best) or another_line(best, state, record.commands):
        raise UsageError(
            f"--load_best_model_at_end: the run's best checkpoint so far, step {state.best_step}, cannot be loaded: "
            f"{problem}; restore it, or resume with --load_best_model_at_end false (the model saved is then the last "
            "step's)"
        )


def final_competes(cfg: TrainConfig, state: TrainState, total_steps: int, final: dict[str, float]) -> int | None:
    """After the final evaluation: let it compete for best (unless the loop already counted it).

    Returns:
        With --load_best_model_at_end, the step of the best checkpoint to load in place of the last step's weights;
        else None.
    """
    best = BestModel(cfg, state)
    if not evaluates_during_training(cfg, state.opt_step, total_steps):  # else the loop counted it
        best.after_eval(state.opt_step, final)
    return best.step_to_load() if cfg.load_best_model_at_end else None
