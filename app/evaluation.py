"""When the run evaluates. What an evaluation computes is the task's (app/tasks/)."""

from __future__ import annotations


def evaluates_during_training(eval_steps: int, step: int, total_steps: int) -> bool:
    """Whether the loop evaluates after optimizer step `step`. The last step's evaluation is the caller's (train.py)."""
    return bool(eval_steps) and step % eval_steps == 0 and step < total_steps
