"""Evaluation: loss, accuracy and macro-F1 over the validation set, gathered from every rank without duplicates."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from app.amp.policy import PrecisionPolicy
from app.telemetry.tags import EVAL_ACCURACY, EVAL_F1, EVAL_LOSS


def evaluates_during_training(eval_steps: int, step: int, total_steps: int) -> bool:
    """Whether the loop evaluates after optimizer step `step`. The last step's evaluation is the caller's (train.py)."""
    return bool(eval_steps) and step % eval_steps == 0 and step < total_steps


@torch.no_grad()
def evaluate(accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module, loader) -> dict[str, float]:
    """Loss, accuracy and macro-F1 over the whole validation set, gathered from every rank without duplicates."""
    model.eval()
    losses, predictions, references = [], [], []
    for batch in loader:
        with policy.autocast():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        per_example = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        gathered = accelerator.gather_for_metrics((per_example, logits.argmax(dim=-1), batch["labels"]))
        for store, values in zip((losses, predictions, references), gathered):
            store.append(values)
    model.train()
    loss, predicted, labels = (torch.cat(values).cpu() for values in (losses, predictions, references))
    return {
        EVAL_LOSS: loss.mean().item(),
        EVAL_ACCURACY: (predicted == labels).float().mean().item(),
        EVAL_F1: macro_f1(predicted, labels),
    }


def macro_f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """F1 averaged over the classes that occur in the labels or the predictions (as sklearn's average="macro")."""
    scores = []
    for cls in torch.unique(torch.cat([predicted, labels])):
        true_pos = ((predicted == cls) & (labels == cls)).sum()
        errors = (predicted == cls).sum() + (labels == cls).sum() - 2 * true_pos  # false positives + false negatives
        scores.append(2 * true_pos / (2 * true_pos + errors))
    return torch.stack(scores).mean().item()
