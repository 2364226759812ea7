"""The optimizer and the learning-rate schedule.

The LR is a pure function of the number of *applied* updates: the loop steps the schedule only when the scaler did
not skip the update, so overflow steps neither train nor use up the warmup.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from app.config import TrainConfig, recorded_value
from app.errors import UsageError, counted
from app.host.device import device_type

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps")


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, with no weight decay on biases and normalization weights (as in BERT and HF Trainer)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel per step (HF Trainer's default too), and under a GradScaler it skips an overflowed update on
    # the device, without the host sync that the scaler's generic path makes.
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=device_type() in FUSED_ADAMW_DEVICES or None)


# What a resume takes from the run, not from the flags: AdamW's parameter groups keep their learning rate and weight
# decay, the schedule its base learning rate and its warmup (a new length alone recomputes it), the adapters their
# dropout (the rest of their settings must match: adapters/plan.check_resume).
KEPT_BY_A_RESUME = ("learning_rate", "weight_decay", "warmup_ratio", "lora_dropout")


def resumed_settings(cfg: TrainConfig, recorded: dict) -> tuple[TrainConfig, list[str]]:
    """The config of a resume whose run recorded `recorded` (its training_args.yaml): the optimizer's settings as the
    run had them, so that training_args.yaml says what runs, and notes for what the flags changed in vain or changed
    in the schedule. As HF Trainer, the learning-rate schedule follows a new length."""
    kept = {
        name: value
        for name in KEPT_BY_A_RESUME
        if (value := recorded_value(recorded, name)) is not None and value != getattr(cfg, name)
    }
    notes = []
    # A value at its default was most likely not asked for (the run's command without the flag): nothing to say.
    defaults = TrainConfig.defaults()
    if asked := [name for name in kept if getattr(cfg, name) != defaults[name]]:
        ran = " and ".join(f"{name} {kept[name]:g}" for name in asked)
        flags = ", ".join(f"--{name} {getattr(cfg, name):g}" for name in asked)
        them = "them" if len(asked) > 1 else "it"
        notes.append(
            f"note: a resume continues the run's training as it was set: {ran} as the run had {them}, not {flags}; "
            f"a new run can change {them}"
        )
    steps, epochs = recorded.get("max_steps"), recorded.get("num_train_epochs")
    if (
        isinstance(steps, int)
        and isinstance(epochs, (int, float))
        and (was := _length(steps, epochs)) != (now := _length(cfg.max_steps, cfg.num_train_epochs))
    ):
        notes.append(
            f"note: the run was set to {was}, this resume to {now}: the learning-rate schedule is recomputed for the "
            "new length, so the learning rate changes from the checkpoint's"
        )
    return dataclasses.replace(cfg, **kept), notes


def check_resume_length(max_steps: int, resumed_step: int, checkpoint) -> None:
    """A --max_steps that ends before the checkpoint's step would train nothing and save the checkpoint's later model
    as if it were the shorter run's: UsageError. (A length in epochs is known once the data is batched: train.py
    says so then.)"""
    if 0 < max_steps < resumed_step:
        raise UsageError(
            f"--max_steps {max_steps} ends before --resume_from_checkpoint {checkpoint} (optimizer step "
            f"{resumed_step}): nothing would train, and the model saved would be step {resumed_step}'s; give "
            f"--max_steps {resumed_step} or more, or resume from a checkpoint at step {max_steps} or before"
        )


def nothing_left_note(resumed_step: int, total_steps: int) -> list[str]:
    """What a resume at or past the run's last step does, which no step's line would show."""
    if resumed_step < total_steps:
        return []
    if resumed_step == total_steps:
        return [
            f"note: the checkpoint is at step {resumed_step}, the run's last: nothing is left to train; the model is "
            "saved and evaluated again"
        ]
    return [
        f"note: the checkpoint is at step {resumed_step}, past this run's {counted(total_steps, 'optimizer step')}: "
        f"nothing trains, and the model saved is step {resumed_step}'s"
    ]


def _length(max_steps: int, epochs: float) -> str:
    return counted(max_steps, "optimizer step") if max_steps > 0 else counted(float(epochs), "epoch")


def total_optimizer_steps(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    """Optimizer steps in the run: --max_steps, or the epochs' worth."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch(cfg, micro_batches_per_epoch)))


def steps_per_epoch(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    """An epoch's optimizer steps: a last partial accumulation counts as one."""
    return math.ceil(micro_batches_per_epoch / cfg.gradient_accumulation_steps)


def ends_an_epoch(from_step: int, to_step: int, per_epoch: int) -> bool:
    """Whether the optimizer steps after `from_step` up to `to_step` finish an epoch of `per_epoch` steps."""
    return to_step // per_epoch > from_step // per_epoch


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """Linear warmup over --warmup_ratio of the steps, then linear decay to 0."""
    warmup = math.ceil(cfg.warmup_ratio * total_steps)

    def factor(update: int) -> float:  # of the peak LR, after `update` applied updates: HF Trainer's linear schedule
        if update < warmup:
            return update / max(1, warmup)
        return max(0.0, (total_steps - update) / max(1, total_steps - warmup))

    # Written here rather than imported from transformers.optimization, whose module imports peft (1.8 s at start).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def follow_the_schedule(schedule: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's learning rate to what `schedule` gives at its step. A resume loads the checkpoint's LR
    with the optimizer's state: after a new length, the old schedule's value, which would drive the first update."""
    schedule.last_epoch -= 1  # step() moves it back and sets every group's LR from the schedule, as after an update
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()": on purpose here
        schedule.step()
