"""The adapters' forward pass (app/adapters/forward.py): peft's LoRA result, computed with one product into the base
layer's output, and with fewer tensors of that size made on the way.

    python -m pytest -q tests/test_adapter_forward.py
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from app.adapters.forward import add_updates_in_place

IN, OUT, ROWS = 24, 40, 6


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(IN, OUT), torch.nn.Linear(OUT, IN, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def adapted(dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["up", "down"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a nonzero update, so that the test sees it
            torch.nn.init.normal_(param, std=0.5)
    return model


def step(model: torch.nn.Module, x: torch.Tensor, autocast: torch.dtype | None) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(1)  # the same dropout masks for both
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(x)
    out.float().square().sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("shape", [(ROWS, IN), (2, 3, IN)], ids=["2-d", "3-d"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_the_in_place_update_gives_peft_s_result_and_gradients(shape, dropout):
    x = torch.randn(shape)
    peft_out, peft_grads = step(adapted(dropout), x, None)
    model = adapted(dropout)
    assert add_updates_in_place(model) == 2
    out, grads = step(model, x, None)
    assert out.shape == peft_out.shape
    torch.testing.assert_close(out, peft_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == peft_grads.keys() and all(g.dtype == torch.float32 for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads[name], peft_grads[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_the_in_place_update_is_as_close_to_exact_as_peft_s(autocast):
    """Half precision rounds peft's three steps (B's product, its scaling, the sum) one by one, the in-place product
    once: against the float64 result, its error over 16 inputs is within peft's (x1.5). One input alone can go either
    way, a few roundings deciding: drawn from the global random state, it made the test depend on the tests before."""
    errors, peft_errors = {}, {}
    off = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    for seed in range(16):
        x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(seed))
        exact_out, exact_grads = step(adapted().double(), x.double(), None)
        peft_out, peft_grads = step(adapted(), x, autocast)
        model = adapted()
        add_updates_in_place(model)
        out, grads = step(model, x, autocast)
        assert out.dtype == peft_out.dtype == autocast
        assert all(grad.dtype == torch.float32 for grad in grads.values())
        for name, ours, theirs, exact in [
            ("output", out, peft_out, exact_out),
            *((name, grads[name], peft_grads[name], exact_grads[name]) for name in grads),
        ]:
            errors[name] = errors.get(name, 0.0) + off(ours, exact)
            peft_errors[name] = peft_errors.get(name, 0.0) + off(theirs, exact)
    for name in errors:
        assert errors[name] <= 1.5 * peft_errors[name] + 1e-6, (name, errors[name], peft_errors[name])


class OutputSized(TorchDispatchMode):
    """Counts the operators that make (or copy into) a tensor the size of the layer's output."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made, self.copies = numel, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        sized = [t for t in outputs if isinstance(t, torch.Tensor) and t.numel() == self.numel]
        if sized and func._schema.name.startswith("aten::") and not func._schema.name.endswith("_"):
            if func.overloadpacket not in (torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.t):
                (self.copies if "copy" in func._schema.name or "clone" in func._schema.name else self.made).append(
                    func._schema.name
                )
        return result


def test_one_output_sized_tensor_per_layer_and_no_copy_of_it_for_backward():
    torch.manual_seed(0)
    base = torch.nn.Linear(IN, OUT)
    model = get_peft_model(torch.nn.Sequential(base), LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    x = torch.randn(2, 3, IN, requires_grad=True)  # an activation, as inside a model

    def count(model) -> OutputSized:
        with OutputSized(2 * 3 * OUT) as seen:
            out = model(x)
        with OutputSized(2 * 3 * OUT) as backward:
            out.sum().backward()
        seen.copies += backward.copies
        return seen

    stock = count(model)
    assert len(stock.made) >= 3, stock.made  # base(x), B's output, its scaled copy, the sum
    add_updates_in_place(model)
    assert isinstance(model.base_model.model[0], LoraLinear)
    fused = count(model)
    assert len(fused.made) == 1 and not fused.copies, (fused.made, fused.copies)


def test_merged_or_disabled_adapters_keep_peft_s_forward():
    x = torch.randn(ROWS, IN)
    model = adapted()
    add_updates_in_place(model)
    block = model.base_model.model
    with torch.no_grad():
        expected = model(x)
        without = block.down.base_layer(torch.relu(block.up.base_layer(x)))
        with model.disable_adapter():
            torch.testing.assert_close(model(x), without, rtol=0, atol=0)
        model.merge_adapter()  # the update in the base's weights: peft's path runs the base alone
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        model.unmerge_adapter()
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without, expected)  # the adapters change the output: the checks above can fail
