"""Watches: the loss-scale alarm, and the watch that never lets a non-finite loss pass unseen.

Neither reads the device on ordinary steps (why that matters: the loop's docstring). Non-finite losses are read at
log steps and before every checkpoint, so a bad state is never saved.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from accelerate import Accelerator

from app.amp.policy import wider_range_advice
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted, counted
from app.state import TrainState


class ScaleWatch:
    """Fires when the scale falls below `min_scale` or more than `max_consecutive` steps in a row are skipped.
    `on_collapse`: what the run does then (--on_scale_collapse), so that the advice does not offer it again;
    `device_type`: where it trains, whose precisions the advice offers."""

    def __init__(self, min_scale: float, max_consecutive: int, on_collapse: str, device_type: str, history: int = 8):
        self.min_scale, self.max_consecutive, self.on_collapse = min_scale, max_consecutive, on_collapse
        self.wider_range = wider_range_advice(device_type)  # bf16 where the device has it natively, else fp32
        self.history: deque[tuple[int, float]] = deque(maxlen=history)
        self._fired_this_run_of_skips = False

    def after_step(self, state: TrainState, skipped: bool, scaler: torch.amp.GradScaler) -> str | None:
        """The alarm's diagnostic if it fires at this step, else None (at most once per run of skipped steps)."""
        if not skipped:
            self._fired_this_run_of_skips = False
            return None
        scale = scaler.get_scale()  # host sync, on skipped steps only
        self.history.append((state.opt_step, scale))
        too_small = scale < self.min_scale
        too_many = state.consecutive_skips > self.max_consecutive
        if self._fired_this_run_of_skips or not (too_small or too_many):
            return None
        self._fired_this_run_of_skips = True
        why = (
            f"the loss scale fell to {scale:g}, below --min_loss_scale {self.min_scale:g}"
            if too_small
            else f"{state.consecutive_skips} steps in a row were skipped, "
            f"more than --max_consecutive_skips {self.max_consecutive}"
        )
        history = ", ".join(f"{step}: {value:g}" for step, value in self.history)
        return (
            f"loss-scale alarm at optimizer step {state.opt_step}: {why}; fp16 gradients keep overflowing.\n"
            f"  loss scale after each recent skipped step (step: scale): {history}\n"
            f"  skipped so far: {state.skipped_steps} of {counted(state.opt_step, 'step')}\n"
            f"  what to try: a lower --learning_rate; {self.wider_range}; check the data for extreme or broken examples"
            + ("; --on_scale_collapse warn to keep going" if self.on_collapse == "stop" else "")
        )


class LossWatch:
    """Counts applied updates whose loss was NaN or inf. With loss scaling on, such steps are skipped, never applied."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self._bad_updates = torch.zeros((), device=accelerator.device, dtype=torch.int64)
        self._first_unchecked_step = 1

    def after_step(self, step_loss: torch.Tensor, overflowed: torch.Tensor) -> None:
        """Count the step if its loss was not finite and the scaler did not skip it; on the device, no sync."""
        self._bad_updates += (~torch.isfinite(step_loss) & ~overflowed).long()

    def check(self, opt_step: int, last_checkpoint: Path | None) -> None:
        """Raise on every rank if a non-finite loss reached the weights on any rank since the last check. Collective."""
        if self.accelerator.reduce(self._bad_updates, "sum").item():  # host sync, at log steps and before checkpoints
            kept = (
                f"the last good checkpoint is kept: {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
            )
            steps = (
                f"at optimizer step {opt_step}"
                if self._first_unchecked_step == opt_step
                else f"between optimizer steps {self._first_unchecked_step} and {opt_step}"
            )
            raise TrainingHalted(
                f"numeric fault: a NaN/inf loss was applied to the weights {steps} (nothing skips a step when loss "
                "scaling is off). "
                f"Stopped without saving; {kept}. Try a lower --learning_rate, check the data, or --max_grad_norm.",
                NUMERIC_FAULT_EXIT_CODE,
            )
        self._first_unchecked_step = opt_step + 1
