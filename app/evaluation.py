"""When the run evaluates. What an evaluation computes is the task's (app/tasks/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.config import TrainConfig


def evaluates_during_training(cfg: TrainConfig, step: int, total_steps: int) -> bool:
    """Whether the loop evaluates after optimizer step `step`: every --eval_steps, and at the last step where the best
    model or early stopping follows the evaluations, before that step's checkpoint, as HF Trainer does: the checkpoint
    records it, and a resume that trains on compares with it. Otherwise the last step's evaluation is train.py's, after
    the trained model is saved. train.py's final evaluation takes the loop's where there is one."""
    if not cfg.eval_steps:
        return False
    if step >= total_steps:
        return bool(cfg.best_model_flags())
    return step % cfg.eval_steps == 0
