"""`--on_scale_collapse fallback`: when fp16's loss scale collapses, go back to the last checkpoint and carry on in bf16
(where the device has it) or fp32, instead of dying.

The way back is always a checkpoint: with fallback on, a run that starts at step 0 saves `step-0` first, so the
initial weights, optimizer, schedule and RNG streams come back exactly through the same `load_state` as any resume,
at the cost of one save. Checkpoints saved afterwards record the new precision and the fallback (checkpoint.RunInfo),
so `--resume_from_checkpoint latest` continues in it. A run falls back once: an alarm after that stops it (exit 3).
The loop carries on from the restored state itself: nothing here trains.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from app.amp.policy import PrecisionPolicy, bf16_available
from app.checkpoint import ResumePoint
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted
from app.telemetry import tags

if TYPE_CHECKING:
    from app.run import Run

SOURCE = "--on_scale_collapse fallback"


def keep_start_point(run: Run) -> None:
    """With fallback on and nothing saved yet, checkpoint the start: the point to come back to. Collective."""
    if run.cfg.on_scale_collapse == "fallback" and run.checkpoints.last_saved is None:
        run.checkpoints.save(run.state)


def fall_back(run: Run, alarm_step: int) -> None:
    """Switch `run` to the fallback precision and rewind it to its last checkpoint, from where the loop carries on."""
    old = run.policy
    if old.source == SOURCE:
        raise TrainingHalted(
            f"stopped: the loss-scale alarm fired again at optimizer step {alarm_step}, after the fallback to "
            f"{old.label}; falling back twice would loop",
            NUMERIC_FAULT_EXIT_CODE,
        )
    mode = "bf16" if bf16_available(old.device_type) else "no"
    why = "this device has native bf16" if mode == "bf16" else "this device has no native bf16"
    new = dataclasses.replace(
        old, mode=mode, source=SOURCE, reason=f"the loss-scale alarm, handled at optimizer step {alarm_step}; {why}"
    )
    path = run.checkpoints.last_saved  # never None: keep_start_point saved step 0
    run.switch_precision(new, record={"from": old.mode, "at_step": alarm_step})
    run.rewind_to(path)  # the saved scaler state was fp16's: ScalerCheckpoint keeps the fresh, disabled one
    note = (
        f"fallback at optimizer step {alarm_step}, on the loss-scale alarm: going back to {path.name} "
        f"(optimizer step {run.state.opt_step}) and carrying on in {new.label} ({why})"
    )
    run.accelerator.print(note)
    run.telemetry.writer.text(tags.AMP_FALLBACK, note, alarm_step)
    run.telemetry.writer.text(
        tags.RUN_PRECISION, f"{old.describe()}\n\nuntil step {alarm_step}; then\n\n{new.describe()}", alarm_step
    )


def resumed_policy(policy: PrecisionPolicy, resume: ResumePoint | None) -> tuple[PrecisionPolicy, list[str]]:
    """A resume of a run that fell back continues in the fallback precision, unless another one is asked for."""
    fallback = resume.info.fallback if resume else None
    if not fallback or policy.mode != fallback["from"]:
        return policy, []
    new = dataclasses.replace(
        policy,
        mode=resume.info.precision,
        source=SOURCE,
        reason=f"the run fell back from {fallback['from']} at optimizer step {fallback['at_step']}",
    )
    return new, [
        f"note: resuming in {new.label}, not {policy.label}: this run fell back from {fallback['from']} at optimizer "
        f"step {fallback['at_step']} (--on_scale_collapse fallback); to train in another precision, "
        "pass it with --mixed_precision"
    ]
