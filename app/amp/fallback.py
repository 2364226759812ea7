"""`--on_scale_collapse fallback`: when fp16's loss scale collapses, go back to the last checkpoint and carry on in bf16
(where the device has it) or fp32, instead of dying.

The way back is always a checkpoint: with fallback on, a run that starts at step 0 saves `step-0` first, so the
initial weights, optimizer, schedule and RNG streams come back exactly through the same `load_state` as any resume,
at the cost of one save. Checkpoints saved afterwards record the new precision and the fallback (CheckpointRecord),
so `--resume_from_checkpoint latest` continues in it. A run falls back once: an alarm after that stops it (exit 3).
This module decides where to go; the loop switches precision, rewinds and carries on: nothing here trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.amp.policy import PrecisionPolicy, bf16_available
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted
from app.storage.checkpoints import ResumePoint

if TYPE_CHECKING:
    from app.config import TrainConfig

SOURCE = "--on_scale_collapse fallback"


@dataclass(frozen=True)
class Fallback:
    """Where a fallback goes: the precision to carry on in, and the checkpoint to go back to."""

    policy: PrecisionPolicy
    checkpoint: Path
    record: dict  # what later checkpoints record of it: {"from": "fp16", "at_step": N}
    why: str  # why this precision, in words

    def note(self, rewound_to_step: int) -> str:
        return (
            f"fallback at optimizer step {self.record['at_step']}, on the loss-scale alarm: going back to "
            f"{self.checkpoint.name} (optimizer step {rewound_to_step}) and carrying on in {self.policy.label} "
            f"({self.why})"
        )

    def precision_text(self, old: PrecisionPolicy, at_step: int) -> str:
        """The run/precision text from the fallback on: the old decision, until when, and the new one."""
        return f"{old.describe()}\n\nuntil step {at_step}; then\n\n{self.policy.describe()}"


def fall_back(policy: PrecisionPolicy, last_saved: Path | None, alarm_step: int) -> Fallback:
    """Where to go on the loss-scale alarm at `alarm_step`: bf16 where the device has it, else fp32, from the last
    checkpoint (never None with fallback on: the loop saves step 0 first).

    Raises:
        TrainingHalted: the run fell back once already; falling back again would loop.
    """
    if policy.source == SOURCE:
        raise TrainingHalted(
            f"stopped: the loss-scale alarm fired again at optimizer step {alarm_step}, after the fallback to "
            f"{policy.label}; falling back twice would loop",
            NUMERIC_FAULT_EXIT_CODE,
        )
    assert last_saved is not None, "with fallback on, the start is checkpointed before step 1"
    mode = "bf16" if bf16_available(policy.device_type) else "no"
    why = "this device has native bf16" if mode == "bf16" else "this device has no native bf16"
    new = dataclasses.replace(
        policy,
        mode=mode,
        source=SOURCE,
        reason=f"the loss-scale alarm, handled at optimizer step {alarm_step}; {why}",
        picked_by_auto=False,
    )
    return Fallback(new, last_saved, {"from": policy.mode, "at_step": alarm_step}, why)


# The flags that set fp16's loss scaler and its alarm.
SCALER_FLAGS = ("init_loss_scale", "loss_scale_growth_interval", "min_loss_scale", "max_consecutive_skips")


def unused_scaler_notes(cfg: TrainConfig, policy: PrecisionPolicy) -> list[str]:
    """Loss-scaler flags (and --on_scale_collapse fallback) in a run without a loss scale have nothing to act on: said,
    not silently ignored; unless the run has fallen back already, which the resume's note says. A value at its default
    was most likely not asked for."""
    if policy.scaler_enabled or policy.source == SOURCE:
        return []
    defaults = cfg.defaults()
    given = [f"--{name} {_shown(getattr(cfg, name))}" for name in SCALER_FLAGS if getattr(cfg, name) != defaults[name]]
    given += ["--on_scale_collapse fallback"] if cfg.on_scale_collapse == "fallback" else []
    if not given:
        return []
    return [
        f"note: {', '.join(given)} act{'s' if len(given) == 1 else ''} on fp16's loss scale; this run computes in "
        f"{policy.label}, with no loss scale, so {'it has' if len(given) == 1 else 'they have'} nothing to do"
    ]


def _shown(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # a growth interval of 1000000, not 1e+06


def resumed_policy(policy: PrecisionPolicy, resume: ResumePoint | None) -> tuple[PrecisionPolicy, list[str]]:
    """A resume of a run that fell back continues in the fallback precision, unless another one is asked for."""
    fallback = resume.record.fallback if resume else None
    if not fallback or policy.mode != fallback["from"]:
        return policy, []
    new = dataclasses.replace(
        policy,
        mode=resume.record.precision,
        source=SOURCE,
        reason=f"the run fell back from {fallback['from']} at optimizer step {fallback['at_step']}",
    )
    return new, [
        f"note: resuming in {new.label}, not {policy.label}: this run fell back from {fallback['from']} at optimizer "
        f"step {fallback['at_step']} (--on_scale_collapse fallback), and a resume does not go back to "
        f"{fallback['from']}: pass another precision with --mixed_precision, or start a new run in {fallback['from']}"
    ]
