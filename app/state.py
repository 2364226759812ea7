"""TrainState: the counters that say where training stands. Saved in every checkpoint; a resume continues from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed, per rank: the data position
    # The same position in examples over all ranks, recorded at each checkpoint (sampling.DataPosition): a resume
    # with another process count continues from it. None in checkpoints written before it was recorded.
    samples_in_epoch: int | None = None
    opt_step: int = 0  # optimizer steps taken, applied or skipped
    applied_updates: int = 0  # steps whose update reached the weights; the LR schedule follows these
    skipped_steps: int = 0  # steps the scaler skipped because the fp16 gradients overflowed
    consecutive_skips: int = 0
    best_step: int | None = None  # the step of the best evaluation so far (app/best.py), when one is tracked
    best_metric: float | None = None
    # Where best_step's checkpoint was saved, absolute: resumes and branches of branches find it there. None in
    # checkpoints written before it was recorded.
    best_checkpoint: str | None = None
    # What best_metric measures: its tag and direction. None in checkpoints written before they were recorded.
    best_metric_tag: str | None = None
    best_greater_is_better: bool | None = None
    evals_without_improvement: int = 0  # early stopping's patience counter
    # The logging interval a checkpoint cuts (telemetry/meters.py): each rank's loss sum and items since the last
    # logged step, and [opt_step, skipped_steps] there, so that a resume logs the uninterrupted run's train/loss and
    # amp/skip_rate. None in checkpoints written before they were recorded, and in a fresh run.
    interval_losses: list[float] | None = None
    interval_items: list[int] | None = None
    interval_start: list[int] | None = None

    def record_outcome(self, skipped: bool) -> None:
        """Settle a taken optimizer step as applied or skipped (the loop counted it in opt_step when it was taken)."""
        self.applied_updates += not skipped
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
