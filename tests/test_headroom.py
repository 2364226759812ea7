"""amp/headroom_bits (app/amp/headroom.py): what the probe measures on a small model with known outputs, and when the
loop arms it. The curve of a model that overflows is in test_diagnose.py; the host reads in test_host_syncs.py."""

from __future__ import annotations

import math

import pytest
import torch

from app.amp.headroom import HeadroomProbe, headroom_bits
from tests import harness


def no_reduce(maxima: torch.Tensor) -> torch.Tensor:
    return maxima  # one process: the max over ranks is this rank's


class Known(torch.nn.Module):
    """Under fp16 autocast `big` (1000 x, called three times) outputs fp16, and so does `norm`; `wide` outputs fp32
    (1e6 x), which fp16 never holds."""

    def __init__(self):
        super().__init__()
        self.big, self.norm, self.wide = torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4), torch.nn.Identity()
        with torch.no_grad():
            self.big.weight.copy_(1000 * torch.eye(4))

    def forward(self, x):
        return self.norm(self.big(x)), self.big(2 * x), self.big(x / 2), self.wide(x * 1e6)


def hooks_left(model: torch.nn.Module) -> int:
    return sum(len(module._forward_hooks) for module in model.modules())


def test_headroom_bits_counts_doublings_to_65504():
    assert headroom_bits(65504.0) == 0.0
    assert headroom_bits(65504.0 / 8) == pytest.approx(3.0)
    assert headroom_bits(65504.0 * 2) == pytest.approx(-1.0)
    assert headroom_bits(0.0) == math.inf


@pytest.mark.parametrize("largest", [math.inf, math.nan])
def test_a_non_finite_activation_is_no_headroom_logged_as_minus_one_bit(largest):
    """inf and NaN leave no headroom. -1 is finite, so that TensorBoard draws it, and no finite fp16 value reaches it:
    the largest, 65504, gives 0."""
    assert headroom_bits(largest) == -1.0


def test_the_probe_names_the_largest_fp16_output_and_leaves_no_hooks():
    model, probe = Known(), HeadroomProbe()
    x = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    with torch.autocast("cpu", dtype=torch.float16), probe.armed(model, active=True):
        assert hooks_left(model) == 3  # every named module
        model(x)
    assert hooks_left(model) == 0
    found = probe.take(no_reduce)
    # |-6000| from the Linear's second call (its first and last give 3000 and 1500); the normalised output is about
    # 1.5, and wide's 3e6 is fp32, which cannot overflow fp16.
    assert found.module == "big" and found.largest == 6000.0
    assert found.bits == pytest.approx(math.log2(65504 / 6000))
    assert probe.take(no_reduce) is None, "read once"


@pytest.mark.parametrize(
    "precision, active", [("fp16", False), ("bf16", True), ("fp32", True)], ids=["inactive", "bf16", "fp32"]
)
def test_the_probe_does_nothing_unless_active_under_fp16_autocast(precision, active):
    model, probe = Known(), HeadroomProbe()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"), probe.armed(model, active=active):
        assert hooks_left(model) == 0
        model(torch.ones(1, 4))
    assert probe.take(no_reduce) is None


def test_a_disabled_probe_does_nothing():  # under --torch_compile
    model, probe = Known(), HeadroomProbe(enabled=False)
    with torch.autocast("cpu", dtype=torch.float16), probe.armed(model, active=True):
        assert hooks_left(model) == 0
        model(torch.ones(1, 4))
    assert probe.take(no_reduce) is None


def test_an_output_passed_on_by_its_container_is_measured_once(monkeypatch):
    linear = torch.nn.Linear(4, 4)
    model, probe, measured = torch.nn.Sequential(torch.nn.Sequential(linear)), HeadroomProbe(), []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda tensor: measured.append(tensor) or aminmax(tensor))  # a spy
    with torch.autocast("cpu", dtype=torch.float16), probe.armed(model, active=True):
        model(torch.ones(1, 4))
    assert len(measured) == 1, "the inner Sequential returns the Linear's output: one measurement, not two"
    assert probe.take(no_reduce).module == "0.0", "named after the Linear that computed it"


def test_an_overflow_gives_minus_one_bit():
    model, probe = Known(), HeadroomProbe()
    with torch.autocast("cpu", dtype=torch.float16), probe.armed(model, active=True):
        model(torch.full((1, 4), 100.0))  # 1000 x 100 = 1e5 > 65504: inf in fp16
    found = probe.take(no_reduce)
    assert found.module == "big" and found.largest == math.inf and found.bits == -1.0


def test_a_nan_output_is_worse_than_any_finite_one():
    model, probe = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), HeadroomProbe()
    with torch.no_grad():
        model[0].weight.copy_(1000 * torch.eye(4))  # 1000: finite, and first in execution order
        model[1].weight.fill_(math.nan)
    with torch.autocast("cpu", dtype=torch.float16), probe.armed(model, active=True):
        model(torch.ones(1, 4))
    found = probe.take(no_reduce)
    assert found.module == "1" and math.isnan(found.largest) and found.bits == -1.0


def test_the_loop_arms_the_probe_on_the_last_micro_batch_of_log_steps_only(tiny_model_dir, review_files):
    # 2 micro-batches per step, logging every 2 steps, 3 steps: log steps 2 and 3 end on micro-batches 4 and 6.
    run = harness.build_training(
        tiny_model_dir, review_files, amp=True, gradient_accumulation_steps=2, logging_steps=2, max_steps=3
    )
    micro_batch, armed = {"now": 0}, set()

    def watch(module, args):
        if module.training:
            micro_batch["now"] += 1
            if hooks_left(run.model.classifier):
                armed.add(micro_batch["now"])

    run.model.register_forward_pre_hook(watch)
    harness.train(run)
    assert micro_batch["now"] == 6 and armed == {4, 6}
    assert hooks_left(run.model) == 0


def test_under_torch_compile_the_probe_is_off_and_a_note_says_so(tiny_model_dir, review_files, capsys):
    # Hooks added to a compiled model at each log step would recompile it: the run skips the probe, in one line.
    run = harness.build_training(tiny_model_dir, review_files, amp=True, torch_compile=True, max_steps=1)
    run.close()
    notes = [line for line in capsys.readouterr().out.splitlines() if "amp/headroom_bits" in line]
    assert not run.telemetry.headroom.enabled
    assert notes == ["note: amp/headroom_bits is not measured under --torch_compile (hooks would recompile)"]
