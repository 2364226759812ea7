"""What app/wiring.py wires from the precision policy and the config into the parts: padding and the optimizer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig
from app.optim import build_optimizer
from app.tasks.classification import Columns, LabelSpace, SequenceClassification
from tests.harness import build_training, train


@pytest.mark.parametrize("precision, pad_flag", [("bf16", None), ("no", None), ("bf16", 8)])
def test_on_a_cpu_batches_are_padded_only_when_asked(tiny_model_dir, review_files, precision, pad_flag):
    # Batches of 2 up to the tiny model's 128 positions: most end at a length of their own, so padding shows.
    run = build_training(
        tiny_model_dir,
        review_files,
        mixed_precision=precision,
        max_steps=6,
        max_length=128,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        pad_to_multiple_of=pad_flag,
    )
    batches = []
    run.model.register_forward_pre_hook(
        lambda m, args, kwargs: batches.append(kwargs["attention_mask"]) if m.training else None, with_kwargs=True
    )
    train(run)
    batches += [batch["attention_mask"] for batch in run.eval_loader]

    longest = [int(mask.sum(dim=1).max()) for mask in batches]
    assert any(n % 8 for n in longest), "no batch of this data would need padding: the test would see nothing"
    lengths = [mask.shape[1] for mask in batches]
    if pad_flag is None:  # a CPU has no tensor cores: just the longest row, no wasted positions, in any precision
        assert lengths == longest
    else:  # --pad_to_multiple_of still pads where it is asked for
        assert lengths == [pad_flag * math.ceil(n / pad_flag) for n in longest]


@pytest.mark.parametrize("mode, device, expected", [("fp16", "cuda", 8), ("bf16", "cuda", 8), ("no", "cuda", None)])
def test_autocast_on_a_gpu_pads_to_multiples_of_8_for_tensor_cores(mode, device, expected):
    assert PrecisionPolicy(mode, device, "test", "test").pad_to_multiple_of == expected
    assert PrecisionPolicy(mode, "cpu", "test", "test").pad_to_multiple_of is None


def test_weight_decay_skips_biases_and_layer_norm_weights(tiny_model_dir):
    task = SequenceClassification(Columns("text", None, "label"), LabelSpace(("great", "other"), True), None, 64)
    model = task.load_model(str(tiny_model_dir), torch.float32, lambda line: None)
    optimizer = build_optimizer(model, replace(TrainConfig(), weight_decay=0.05))
    decay = {id(param): group["weight_decay"] for group in optimizer.param_groups for param in group["params"]}
    names = dict(model.named_parameters())
    assert len(decay) == len(names), "every trainable parameter is optimized, once"
    for name, param in names.items():
        # As BERT and HF Trainer do: no decay on biases and LayerNorm weights; all other weights (embeddings too) decay.
        expected = 0.0 if name.endswith(".bias") or "LayerNorm" in name else 0.05
        assert decay[id(param)] == expected, name
    assert {0.0, 0.05} == set(decay.values())
