"""TrainState: the counters that say where training stands. Saved in every checkpoint; a resume continues from them."""

from __future__ import annotations

from dataclasses import dataclass, field

# How each precision mode (amp/policy.py) is named where a run's steps are listed by the precision they ran in.
STEP_PRECISIONS = {
    "no": "fp32",
    "fp16": "fp16 with loss scaling",
    "bf16": "bf16",
    None: "a precision not recorded (an earlier version)",
}


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
    # The precision the steps ran in, carried across resumes and rewound by a fallback: [first step, mode] where a run
    # of steps in one mode ("no", "fp16", "bf16") begins. Steps before the first entry were taken by a version of the
    # app that did not record it (its checkpoints have none).
    precisions: list[list] = field(default_factory=list)

    def take_step(self, mode: str) -> None:
        """Count an optimizer step taken in precision `mode` (settled as applied or skipped later: record_outcome)."""
        self.opt_step += 1
        if not self.precisions or self.precisions[-1][1] != mode:
            self.precisions.append([self.opt_step, mode])

    def record_outcome(self, skipped: bool) -> None:
        """Settle a taken optimizer step as applied or skipped (the loop counted it in opt_step when it was taken)."""
        self.applied_updates += not skipped
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0

    def precision_runs(self) -> list[tuple[int, int, str | None]]:
        """Steps 1 to opt_step as runs of one precision: (first step, last step, mode), mode None where unrecorded."""
        starts = [(first, mode) for first, mode in self.precisions]  # none beyond opt_step: take_step adds them
        if self.opt_step and (not starts or starts[0][0] > 1):
            starts.insert(0, (1, None))
        ends = [first - 1 for first, _ in starts[1:]] + [self.opt_step]
        return [(first, last, mode) for (first, mode), last in zip(starts, ends)]

    def may_have_skipped(self) -> bool:
        """Whether any step ran with fp16's loss scaler (or in a precision not recorded), so could have been skipped."""
        return bool(self.skipped_steps) or any(mode in ("fp16", None) for *_, mode in self.precision_runs())

    def said_outcome(self, skipped: str = "skipped") -> str:
        """The steps' outcome: "(4 applied, 1 skipped)", or "(loss scaling off)" where none could be skipped."""
        if not self.may_have_skipped():
            return "(loss scaling off)"
        return f"({self.applied_updates} applied, {self.skipped_steps} {skipped})"

    def said_precisions(self) -> str:
        """The steps by the precision they ran in: "fp16 with loss scaling for steps 1-4, then fp32 for steps 5-8"."""
        return ", then ".join(
            f"{STEP_PRECISIONS[mode]} for " + (f"step {first}" if first == last else f"steps {first}-{last}")
            for first, last, mode in self.precision_runs()
        )
