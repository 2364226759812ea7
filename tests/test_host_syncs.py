"""No host reads between log steps: the app's hot loop never pulls a tensor's value to Python except at log steps.

On a GPU every read of a device tensor's value is a host-device sync; scripts/gpu_check.py counts them there with
torch.cuda.set_sync_debug_mode. On the CPU this test watches the same thing: it records every tensor read
(`item`, `tolist`, `__bool__`, `__float__`, `__int__`) during training, by optimizer step and call site, and lets
through only the sites listed in ALLOWED. A non-fused optimizer, for one, would show up here: GradScaler.step reads
its overflow flag on every step for those.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.harness import build_run, train

READS = ("item", "tolist", "__bool__", "__float__", "__int__")
# Reads that happen while the app runs but are not the app's, with why they are no concern (file, function):
ALLOWED = {
    ("sampler.py", "__iter__"),  # the shuffle's randperm, made on the host
    ("sampling.py", "order"),  # the length-grouped order, made on the host once per epoch
    ("sampling.py", "__iter__"),
    ("dataloader.py", "__init__"),  # a DataLoader iterator's base seed, drawn from its own host generator
    ("precision.py", "read"),  # OverflowFlag.read: a host buffer that a non-blocking copy filled a step earlier
    # transformers' own BERT forward checks padding_mask.all() to skip the SDPA mask: the model's read, not the loop's
    ("masking_utils.py", "_ignore_bidirectional_mask_sdpa"),
}


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_no_tensor_reads_between_log_steps(tiny_model_dir, review_files, monkeypatch, precision):
    run = build_run(tiny_model_dir, review_files, mixed_precision=precision, max_steps=10, logging_steps=5)
    step = {"now": 0}
    run.model.register_forward_pre_hook(lambda m, a: step.__setitem__("now", step["now"] + 1) if m.training else None)
    reads: Counter = Counter()

    def spy(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            site = (Path(caller.co_filename).name, caller.co_name)
            if site not in ALLOWED:
                reads[(step["now"], f"{site[0]}:{site[1]}.{name}")] += 1
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    train(run)
    monkeypatch.undo()

    assert run.state.opt_step == 10 and run.state.skipped_steps == 0
    outside = sorted(key for key in reads if key[0] not in (5, 10))
    assert not outside, f"tensor reads outside log steps (step, site): {outside}"
    assert {s for s, _ in reads} == {5, 10}, "the log steps must read (otherwise this test sees nothing)"
