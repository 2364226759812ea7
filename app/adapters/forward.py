"""The adapter's forward pass: the LoRA update added into the base layer's output by one matrix product.

peft computes a LoRA linear layer as `base(x) + lora_B(lora_A(dropout(x))) * scaling`: besides the base's output,
three more tensors of that size (B's output, its scaled copy, the sum), of which one is kept. On a CPU those are
memory traffic that costs time, and freed blocks between the activations that autograd keeps, which the heap cannot
reuse: on SmolLM2 with adapters on its 210 linear layers, a 0.7 GiB larger heap after one forward, batch 8 x 128
(docs/benchmarks.md). Here the base's output takes the update in place, `out += scaling * a @ B^T` with
`a = lora_A(dropout(x))` (torch.addmm_: the scale and the sum inside the matrix product), on the output itself rather
than a view of it, so that autograd keeps no copy for the backward pass either. The same parameters, the same files,
and the same result to rounding: merged adapters, and peft's own forward in predict.py, give what training computed.

Layers where peft does more than plain LoRA (DoRA and other variants, several or mixed adapters, disabled or merged
adapters, embeddings) keep peft's forward.
"""

from __future__ import annotations

import types

import torch


def add_in_place(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft `lora.Linear`'s forward: `base(x) + scaling * lora_B(lora_A(dropout(x)))`, summed into base(x)."""
    active = layer.active_adapters
    if (
        args
        or kwargs
        or layer.disable_adapters
        or layer.merged
        or len(active) != 1
        or active[0] not in layer.lora_A
        or active[0] in layer.lora_variant
    ):
        return type(layer).forward(layer, x, *args, **kwargs)
    name = active[0]
    rows = x.reshape(-1, x.shape[-1])  # 2-D, so that the base's output is a tensor of its own, not a view
    out = layer.base_layer(rows)
    down = layer.lora_A[name](layer.lora_dropout[name](rows))
    # Under autocast `down` and `out` are in its dtype; an in-place product is not cast, so B is cast as autocast
    # casts it for a linear layer (differentiably: its gradient is float32).
    out.addmm_(down, layer.lora_B[name].weight.t().to(out.dtype), alpha=layer.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


def add_updates_in_place(model: torch.nn.Module) -> int:
    """Give each of peft's LoRA linear layers in `model` the forward above. Returns how many."""
    from peft.tuners.lora.layer import Linear

    layers = [module for module in model.modules() if type(module) is Linear]
    for layer in layers:
        layer.forward = types.MethodType(add_in_place, layer)
    return len(layers)
