"""No host reads between log steps: the app's hot loop never pulls a tensor's value to Python except at log steps.

On a GPU every read of a device tensor's value is a host-device sync; scripts/gpu_check.py counts them there with
torch.cuda.set_sync_debug_mode. On the CPU this test watches the same thing: it records every tensor read during
training (`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `cpu`, `numpy`, `nonzero`, `torch.equal`,
`torch.nonzero`, and indexing with a boolean mask, whose result's size depends on the values), by optimizer step and
call site, and lets through only the sites listed in ALLOWED. A non-fused optimizer, for one, would show up here:
GradScaler.step reads its overflow flag on every step for those. In fp16 the headroom probe (app/amp/headroom.py) is
armed at the log steps, and its result is read there, not before.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.harness import build_training, train
from tests.test_loop import inject_inf_at

METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "nonzero")
FUNCTIONS = ("equal", "nonzero")  # torch.equal, torch.nonzero
# Reads that happen while the app runs but are not the app's, with why they are no concern (file, function):
ALLOWED = {
    ("sampler.py", "__iter__"),  # the shuffle's randperm, made on the host
    ("sampling.py", "order"),  # the length-grouped order, made on the host once per epoch
    ("sampling.py", "__iter__"),
    ("dataloader.py", "__init__"),  # a DataLoader iterator's base seed, drawn from its own host generator
    ("scaler.py", "read"),  # OverflowFlag.read: a host buffer that a non-blocking copy filled a step earlier
    ("diagnose.py", "read"),  # the fp16 pre-flight's one read, once, before step 1 (and the alarm's replay)
    # a CPU dropout mask's seed, one draw of torch's CPU generator: those masks are never drawn on a GPU (masks_of_run)
    ("dropout.py", "sfc64_keep_mask"),
    ("dropout.py", "attention"),  # whether a row of the CPU attention mask attends to no key: the same CPU-only mode
    # transformers' own BERT forward checks padding_mask.all() to skip the SDPA mask: the model's read, not the loop's
    ("masking_utils.py", "_ignore_bidirectional_mask_sdpa"),
    ("masking_utils.py", "_ignore_causal_mask_sdpa"),  # the same check in a decoder's forward
}
# The one read the app makes on purpose outside log steps: after a skipped update, the loss-scale watch reads the
# scale (app/amp/watches.py). It runs when that step's flag is settled, one optimizer step after the skip.
AFTER_A_SKIP = "grad_scaler.py:get_scale.item"


def spy_on_reads(monkeypatch, step: dict) -> Counter:
    """Record each read as (optimizer step, "file:function.read") of its caller, until monkeypatch.undo()."""
    reads: Counter = Counter()

    def record(name: str) -> None:
        caller = sys._getframe(2).f_code
        if caller.co_name == "__torch_function__":
            return  # a torch function mode (app/host/dropout.py) passing the call on: recorded at its own caller
        site = (Path(caller.co_filename).name, caller.co_name)
        if site not in ALLOWED:
            reads[(step["now"], f"{site[0]}:{site[1]}.{name}")] += 1

    def spy(original, name):
        def read(*args, **kwargs):
            record(name)
            return original(*args, **kwargs)

        return read

    def index(original):
        def getitem(self, key):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                record("__getitem__[mask]")
            return original(self, key)

        return getitem

    for name in METHODS:
        monkeypatch.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name), name))
    for name in FUNCTIONS:
        monkeypatch.setattr(torch, name, spy(getattr(torch, name), f"torch.{name}"))
    monkeypatch.setattr(torch.Tensor, "__getitem__", index(torch.Tensor.__getitem__))
    return reads


@pytest.mark.parametrize(
    "precision, overflows", [("no", set()), ("fp16", set()), ("fp16", {3})], ids=["fp32", "fp16", "fp16-overflow"]
)
def test_no_tensor_reads_between_log_steps(tiny_model_dir, review_files, monkeypatch, precision, overflows):
    run = build_training(tiny_model_dir, review_files, mixed_precision=precision, max_steps=10, logging_steps=5)
    step, probed = {"now": 0}, set()

    def count(module, args):
        if module.training:
            step["now"] += 1
            if run.model.classifier._forward_hooks:  # the headroom probe's hooks are on
                probed.add(step["now"])

    run.model.register_forward_pre_hook(count)
    inject_inf_at(run.model, overflows, run.optimizer)  # the skipped-step path, at a step that is not logged
    reads = spy_on_reads(monkeypatch, step)
    train(run)
    monkeypatch.undo()

    assert run.state.opt_step == 10 and run.state.skipped_steps == len(overflows)
    expected_outside = {(skipped + 1, AFTER_A_SKIP) for skipped in overflows}
    outside = {key for key in reads if key[0] not in (5, 10)}
    assert outside == expected_outside, f"tensor reads outside log steps (step, site): {sorted(outside)}"
    assert all(reads[key] == 1 for key in expected_outside), "one read of the scale per skip"
    assert {s for s, _ in reads} >= {5, 10}, "the log steps must read (otherwise this test sees nothing)"
    assert probed == ({5, 10} if precision == "fp16" else set()), "the probe is armed at fp16 log steps only"
    probe_reads = {s for s, site in reads if site.startswith("headroom.py:")}
    assert probe_reads == ({5, 10} if precision == "fp16" else set()), "read where it was armed"


def test_the_causal_lm_task_adds_no_reads_between_log_steps(tiny_llama_dir, review_files, monkeypatch):
    """Its batches carry their label counts as host values, and its LM head positions as a tensor that the model
    indexes on the device: the loop weighs micro-batches and the loss is taken without reading anything back."""
    run = build_training(
        tiny_llama_dir,
        review_files,
        mixed_precision="fp16",
        max_steps=6,
        logging_steps=3,
        gradient_accumulation_steps=2,
        task="causal_lm",
        prompt_column="text",
        response_column="label",
        text_column=None,
        label_column=None,
        max_length=48,
    )
    step = {"now": 0}
    run.model.register_forward_pre_hook(lambda m, a: step.__setitem__("now", step["now"] + 1) if m.training else None)
    reads = spy_on_reads(monkeypatch, step)
    train(run)
    monkeypatch.undo()
    log_forwards = {5, 6, 11, 12}  # two micro-batches per optimizer step: forwards 5-6 are step 3's
    outside = sorted(key for key in reads if key[0] not in log_forwards)
    assert outside == [], f"tensor reads outside log steps (forward, site): {outside}"
