"""fp16 headroom: how far the largest fp16 activation of a forward pass is from overflowing, before the scaler reacts.

`amp/headroom_bits` = log2(65504 / max |x|), over every module output that is float16 in the forward pass, the
smallest over modules: how many doublings the largest activation can take before it overflows. 0 means an
activation reached fp16's largest value. An inf or a NaN leaves no headroom: it gives -1 (NO_HEADROOM), a finite
value, so that TensorBoard draws it (it draws no point for inf or NaN), and one that no finite fp16 activation gives.
Scaled gradients are left out: the loss scaler drives them toward overflow on purpose and backs off when they get
there.

The loop arms the probe around the forward of a log step's last micro-batch only. Forward hooks on every module keep
each fp16 output's max |x| on the device, with no host sync, and are removed as the forward returns; telemetry reads
the result at the log step, in the same read as its other meters. On every other micro-batch, and outside fp16
autocast (fp32, bf16, after a fallback), the probe registers nothing and costs nothing.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel

FP16_MAX = torch.finfo(torch.float16).max  # 65504
NO_HEADROOM = -1.0  # an inf or NaN activation; every finite fp16 activation gives 0 or more


@dataclass(frozen=True)
class Headroom:
    bits: float  # log2(65504 / max |x|), the smallest over modules
    module: str  # the module whose output sets it
    largest: float  # that output's max |x|

    def said(self) -> str:
        """The amp/headroom_module text."""
        if not math.isfinite(self.largest):
            said = f"none, its output holds {self.largest} (logged as {NO_HEADROOM:g} bit)"
            return f"`{self.module}` sets the fp16 headroom: {said}"
        return f"`{self.module}` sets the fp16 headroom: {self.bits:.2f} bits (max |x| = {self.largest:.4g})"


def headroom_bits(largest: float) -> float:
    """log2(65504 / largest): NO_HEADROOM for an inf or NaN, inf for an output of zeros."""
    if not math.isfinite(largest):
        return NO_HEADROOM
    if largest == 0:
        return math.inf
    return math.log2(FP16_MAX) - math.log2(largest)


def fp16_tensors(value):
    """The non-empty float16 tensors in a module's output: a tensor, a tuple or list, or a dict (a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.float16 and value.numel():
            yield value
        return
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        yield from fp16_tensors(item)


def fp16_autocast_on(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16


class HeadroomProbe:
    """Armed around one forward pass; read at the log step. `enabled=False` (under --torch_compile, where hooks
    would recompile the model) makes it inert."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._names: list[str] = []
        self._maxima: torch.Tensor | None = None  # per module, in execution order, on the device

    @contextlib.contextmanager
    def armed(self, model: torch.nn.Module, active: bool):
        """Hooks on every module of `model` for the forward pass inside, if `active` and under fp16 autocast.

        Enter it inside the autocast context: the probe asks autocast whether it runs in fp16.
        """
        model = extract_model_from_parallel(model)  # DDP's wrapper: hook the modules under their own names
        device_type = next(model.parameters()).device.type
        if not (active and self.enabled and fp16_autocast_on(device_type)):
            yield
            return
        recorded: list[tuple[str, tuple[torch.Tensor, torch.Tensor]]] = []  # (module, its output's (min, max))
        seen: dict[int, weakref.ref] = {}  # the tensors measured in this pass
        handles = [
            module.register_forward_hook(self._record(name, recorded, seen))
            for name, module in model.named_modules()
            if name
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self._names, self._maxima = largest_per_module(recorded)

    @staticmethod
    def _record(name: str, recorded: list, seen: dict[int, weakref.ref]):
        def hook(module, inputs, output):
            for tensor in fp16_tensors(output):
                # A container passes on a child's output: measured once, under the child that computed it. A weak
                # reference, since an id may be reused once its tensor is freed.
                measured = seen.get(id(tensor))
                if measured is not None and measured() is tensor:
                    continue
                seen[id(tensor)] = weakref.ref(tensor)
                recorded.append((name, torch.aminmax(tensor.detach())))  # one pass, no |x| copy; NaN propagates

        return hook

    def take(self, reduce) -> Headroom | None:
        """The last armed pass's headroom, once (None if nothing was measured since the last take).

        Args:
            reduce: the max over ranks of a device tensor (e.g. `lambda t: accelerator.reduce(t, "max")`); every rank
                calls take at the same steps, with the same modules measured.
        """
        if self._maxima is None:
            return None
        maxima = reduce(self._maxima).tolist()  # host sync: at log steps only, with telemetry's own read
        self._maxima = None
        # Ties go to the first module in execution order: an inf or NaN spreads downstream from where it began.
        index = max(range(len(maxima)), key=lambda i: _order(maxima[i]))
        return Headroom(headroom_bits(maxima[index]), self._names[index], maxima[index])


def largest_per_module(recorded: list) -> tuple[list[str], torch.Tensor | None]:
    """Each module's max |x| (fp32, on the device, in execution order) from the (min, max) pairs its hooks recorded;
    a module called more than once, or with several fp16 outputs, keeps the largest."""
    if not recorded:
        return [], None
    names = list(dict.fromkeys(name for name, _ in recorded))
    extremes = torch.stack([bound for _, pair in recorded for bound in pair]).float()
    per_output = extremes.abs().view(-1, 2).amax(dim=1)
    if len(names) == len(recorded):
        return names, per_output
    position = {name: i for i, name in enumerate(names)}
    index = torch.tensor([position[name] for name, _ in recorded], device=per_output.device)
    largest = torch.zeros(len(names), device=per_output.device)
    return names, largest.scatter_reduce(0, index, per_output, "amax", include_self=False)


def _order(largest: float) -> float:
    return math.inf if math.isnan(largest) else largest  # a NaN output is the worst of all
