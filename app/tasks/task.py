"""The `Task` protocol, and which task a run trains: --task, or what the model config says, with its reason.

The loop, the precision policy, telemetry and checkpoints see only this protocol; classification.py and causal_lm.py
implement it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from accelerate import Accelerator
from datasets import DatasetDict
from transformers import PretrainedConfig

from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig, metric_tag
from app.errors import UsageError
from app.inputs.model import is_decoder
from app.storage.checkpoints import names_mismatch
from app.tasks.causal_lm import CausalLM
from app.tasks.classification import SequenceClassification

TASK_CLASSES = {"sequence_classification": SequenceClassification, "causal_lm": CausalLM}  # --task's choices

LM_HEADS = ("ForCausalLM", "LMHeadModel")


class Task(Protocol):
    name: str
    pipeline_tag: str  # the model card's Hugging Face pipeline
    summary: str  # what the trained model is, for the model card
    metrics: tuple[str, ...]  # the eval tags that evaluate() returns
    notes: list[str]  # what preparing the data had to change (cut examples), printed at start

    def tokenize(self, raw: DatasetDict, accelerator: Accelerator) -> DatasetDict:
        """Token ids and labels, the "train" and "validation" splits."""

    def collator(self, pad_to_multiple_of: int | None) -> Callable[[list[dict]], dict]:
        """Pads a list of tokenized examples into a batch (on the host)."""

    def empty_model(self, model_config: PretrainedConfig) -> torch.nn.Module:
        """The model on the meta device: its layers and sizes without memory."""

    def load_model(self, model_path: str, dtype: torch.dtype, say: Callable[[str], None]) -> torch.nn.Module:
        """The model with its weights in `dtype` (float32, or a frozen base's half precision); the weights the
        checkpoint lacked (a new head) said through `say`."""

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The mean loss over the batch's items."""

    def items(self, batch: dict) -> int:
        """How many items (examples, label tokens) the batch's loss is a mean over: known on the host, no sync."""

    def evaluate(
        self, accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module, loader
    ) -> dict[str, float]:
        """The metrics over the whole validation set, gathered from every rank without duplicates."""

    def card(self) -> dict[str, str]:
        """Lines for the model card."""


def resolve_task(requested: str | None, model_config: PretrainedConfig) -> tuple[str, str]:
    """The task, and why: --task, or what the model config says it is."""
    if requested:
        return requested, "asked for with --task"
    architectures = model_config.architectures or []
    for architecture in architectures:
        if architecture.endswith(LM_HEADS):
            return "causal_lm", f"the model config's architecture is {architecture}"
        if architecture.endswith("ForSequenceClassification"):
            return "sequence_classification", f"the model config's architecture is {architecture}"
    kind = model_config.model_type
    if is_decoder(model_config):
        return "causal_lm", f"model type {kind} is a decoder, which transformers loads as a causal LM"
    return "sequence_classification", f"model type {kind} is not a decoder, so it gets a classification head"


def task_of_weights(names: set[str], model_config: PretrainedConfig, besides: str) -> str | None:
    """The task other than `besides` whose model for `model_config` holds exactly the weights `names` (a checkpoint's),
    or None: a checkpoint of this model trained for another task. Names alone: a classifier's label count is its
    own."""
    for name in TASK_CLASSES:
        if name != besides and (model := _bare_model(name, model_config)) and not names_mismatch(names, model):
            return name
    return None


def _bare_model(task: str, model_config: PretrainedConfig) -> torch.nn.Module | None:
    """The model of `task` for `model_config` on the meta device, with transformers' default head; None where
    transformers has none (an encoder without a causal LM)."""
    try:
        with torch.device("meta"):
            return TASK_CLASSES[task].auto_model.from_config(model_config)
    except ValueError:
        return None


def build_task(name: str, cfg: TrainConfig, raw: DatasetDict, tokenizer, model_config: PretrainedConfig) -> Task:
    """The task for this data: its columns and labels checked (UsageError if they don't fit)."""
    task = TASK_CLASSES[name].from_data(cfg, raw, tokenizer, model_config)
    tag = metric_tag(cfg.metric_for_best_model)
    if tag not in task.metrics:
        raise UsageError(
            f"--metric_for_best_model {tag} is not computed for --task {name} on this data; use one of "
            f"{', '.join(task.metrics)}"
        )
    return task
