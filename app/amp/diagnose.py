"""fp16 diagnostics: the pre-flight check before step 1, and the overflow report that replays an offending batch.

Both watch every module through hooks for as long as one pass takes, then remove them, and leave no trace in the
training: the global RNG streams (dropout draws from them), the loader's sampler, the weights and the gradients are
put back as they were, so a run with a check is bitwise the run without it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
from accelerate.utils import send_to_device

from app.amp.policy import PrecisionPolicy, wider_range_advice
from app.errors import counted

# The task's loss of a batch: `loss(model, batch)`, a mean over the batch's items.
LossOf = Callable[[torch.nn.Module, dict], torch.Tensor]

FP16_MAX = torch.finfo(torch.float16).max  # 65504
PREFLIGHT_LIMIT = FP16_MAX / 2  # above half the range, the next layer's sum or a larger batch may overflow


@contextlib.contextmanager
def rng_untouched():
    """Everything inside may draw random numbers; afterwards the global streams are as they were."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def eager() -> contextlib.AbstractContextManager:
    """A compiled model (--torch_compile) runs eagerly inside: the passes' hooks would otherwise have torch.compile
    trace a hooked graph of its own for each pass, before the training graph (docs/benchmarks.md#fp16-pre-flight)."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def _floating(value) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, a tuple or a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value.detach()] if value.is_floating_point() and value.numel() else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [tensor for item in items for tensor in _floating(item)]


def _maxima(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[max |x| over the fp16 tensors, max |x| over the others], -1 where there are none; stays on the device.

    Autocast runs matmuls in fp16 but keeps sums, norms and residual streams in fp32: only the fp16 tensors can
    overflow fp16. An fp32 value beyond 65504 is no overflow, but a non-finite one is a fault in any dtype."""
    groups = ([t for t in tensors if t.dtype == torch.float16], [t for t in tensors if t.dtype != torch.float16])
    none = torch.tensor(-1.0, device=device)
    return torch.stack([torch.stack([t.abs().amax().float() for t in g]).amax() if g else none for g in groups])


class ModuleWatch:
    """Forward hooks on every named module: each output's max |x| (fp16 and other dtypes apart) in execution order;
    optionally, in the backward pass's order, the gradient of each module's output and of each trained parameter."""

    def __init__(self, model: torch.nn.Module, gradients: bool = False):
        self.forward: dict[str, torch.Tensor] = {}  # kept on the device until the pass ends: no sync per module
        self.backward: dict[str, torch.Tensor] = {}  # modules' output gradients and parameters' gradients
        self.parameters: set[str] = set()  # the names in `backward` that are parameters'
        self.other_dtypes: dict[str, torch.dtype] = {}  # the dtype of a module's non-fp16 output, for messages
        self._gradients = gradients
        self._handles = [
            module.register_forward_hook(self._hook(name)) for name, module in model.named_modules() if name
        ]
        if gradients:  # a parameter's gradient is a sum over the batch: in fp16 it can overflow where no input did
            trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
            self.parameters = {name for name, _ in trained}
            self._handles += [param.register_hook(self._gradient_hook(name)) for name, param in trained]

    def _hook(self, name: str):
        def record(module, inputs, output):
            tensors = _floating(output)
            if not tensors or name in self.forward:
                return
            self.forward[name] = _maxima(tensors, tensors[0].device)
            others = [t.dtype for t in tensors if t.dtype != torch.float16]
            if others:
                self.other_dtypes[name] = others[0]
            first = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
            if self._gradients and isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(self._gradient_hook(name))

        return record

    def _gradient_hook(self, name: str):
        def record(grad: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
            if name not in self.backward:
                self.backward[name] = _maxima([grad.detach()], grad.device)
                self.other_dtypes.setdefault(name, grad.dtype)

        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def read(self, values: dict[str, torch.Tensor]) -> list[tuple[str, float, float]]:
        """(module, max |x| of its fp16 tensors, of its other tensors), -1 for none, in execution order."""
        if not values:
            return []
        host = torch.stack(list(values.values())).tolist()  # host sync: once, after the pass
        return [(name, half, other) for name, (half, other) in zip(values, host)]


def _not_finite(value: float) -> bool:
    return not math.isfinite(value)


def overflow_in(half: float, other: float, limit: float) -> tuple[float, bool] | None:
    """(the value that overflows, whether it is fp16's): an fp16 one at or beyond `limit`, or a non-finite one in any
    dtype; None if there is none."""
    if _not_finite(half) or half >= limit:
        return half, True
    return (other, False) if _not_finite(other) else None


def _shown(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def first_training_batch(loader, device: torch.device) -> dict:
    """This rank's first batch of the run's first epoch, built from the dataset: the loader's own state is untouched."""
    sampler = loader.get_sampler()
    generator = getattr(sampler, "generator", None)
    saved = generator.get_state() if generator is not None else None
    indices = next(iter(loader.batch_sampler))  # the seedable sampler reseeds from (seed, epoch) on each pass
    if generator is not None:
        generator.set_state(saved)
    batch = loader.collate_fn([loader.dataset[i] for i in indices])
    return send_to_device(dict(batch), device)


def stored_in_bf16(config) -> bool:
    # transformers 5 reads an older config.json's torch_dtype into dtype; asking for torch_dtype itself only warns.
    return str(getattr(config, "dtype", None)).removeprefix("torch.") == "bfloat16"


def preflight(policy: PrecisionPolicy, model: torch.nn.Module, loss: LossOf, batch: dict, model_config) -> list[str]:
    """Before the first fp16 step: a warning if the model was stored in bf16, and one hooked forward pass of `batch`
    that names the first modules whose output exceeds half of fp16's range. Returns the lines to say.

    Args:
        model: the raw model (no DDP wrapper: this pass is this rank's alone).
    """
    started = time.perf_counter()
    lines = []
    if stored_in_bf16(model_config):
        lines.append(
            f"warning: the model config says its weights were stored in bfloat16; activations trained in bf16 often "
            f"exceed fp16's range (max {FP16_MAX:g}); try {wider_range_advice(policy.device_type)}"
        )
    was_training = model.training
    watch = ModuleWatch(model)
    try:
        with rng_untouched(), eager(), torch.no_grad(), policy.autocast():
            model.eval()  # no dropout: the check sees the weights, not a random mask
            loss(model, batch)
    finally:
        watch.remove()
        model.train(was_training)
    outputs = watch.read(watch.forward)
    seconds = time.perf_counter() - started
    found = [(name, hit[0]) for name, half, other in outputs if (hit := overflow_in(half, other, PREFLIGHT_LIMIT))]
    if found:
        named = ", ".join(f"{name} (max |x| = {_shown(value)})" for name, value in found[:3])
        lines.append(
            f"warning: amp pre-flight: {counted(len(found), 'module output')} of the first batch over half of fp16's "
            f"range ({PREFLIGHT_LIMIT:g}) or not finite; first in execution order: {named}. Expect loss-scale skips; "
            f"consider {wider_range_advice(policy.device_type)} ({seconds:.2f} s)"
        )
    else:
        largest = max((half for _, half, _ in outputs), default=0.0)
        lines.append(
            f"amp pre-flight: clean, largest fp16 module output {largest:.4g} < {PREFLIGHT_LIMIT:g} ({seconds:.2f} s)"
        )
    kept_wide = [(name, other) for name, _, other in outputs if other > FP16_MAX]
    if kept_wide:
        name, value = max(kept_wide, key=lambda pair: pair[1])
        lines.append(
            f"note: {counted(len(kept_wide), 'module output')} beyond fp16's range, kept in fp32 by autocast, cannot "
            f"overflow it (largest: {name}, max |x| = {value:.4g})"
        )
    return lines


def overflow_report(
    policy: PrecisionPolicy,
    model: torch.nn.Module,
    loss: LossOf,
    batch: dict | None,
    multiplier: float,
    no_sync: Callable[[], contextlib.AbstractContextManager],
    dropout_masks: Callable[[], contextlib.AbstractContextManager],
) -> str | None:
    """Replay `batch` forward and backward under the run's autocast and dropout masks, its loss times `multiplier`;
    name the first module whose output or gradient, or the first parameter whose gradient, is not finite or beyond
    fp16's range: None where none is. Weights, gradients and RNG streams are left as they were.

    Args:
        multiplier: what the failing step multiplied this batch's loss by: the loss scale it ran at, times the
            batch's share of an accumulated step.
        model: the raw model; `no_sync` keeps the wrapper's gradient reduction out of this rank's replay.
        dropout_masks: what the training forward runs under besides autocast (host/dropout.py), so that the replay
            takes the training's own path through dropout.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    watch = ModuleWatch(model, gradients=True)
    try:
        with rng_untouched(), eager(), no_sync():
            with policy.autocast(), dropout_masks():
                replayed = loss(model, batch)
            (replayed.float() * multiplier).backward()  # as the failing step did: the same gradients
    finally:
        watch.remove()
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    for forward, values in ((True, watch.forward), (False, watch.backward)):
        for name, half, other in watch.read(values):
            hit = overflow_in(half, other, limit=math.inf)  # fp16 cannot hold a finite value beyond its range
            if hit is not None:
                kind = "forward output" if forward else "parameter gradient" if name in watch.parameters else "gradient"
                dtype = "float16" if hit[1] else str(watch.other_dtypes.get(name)).removeprefix("torch.")
                return f"first overflow: {name} ({kind}, max |x| = {_shown(hit[0])} in {dtype})"
    return None


def overflow_said(found: list[str | None], replayed: bool) -> str:
    """The overflow report of a run whose processes replayed their own batches: `found`, each one's first overflow
    (overflow_report), in rank order; the first process that found one is named, where there are several.
    `replayed`: whether there was a batch to replay."""
    if not replayed:
        return "overflow report: no batch to replay"
    hits = [(rank, line) for rank, line in enumerate(found) if line]
    if hits:
        rank, line = hits[0]
        return line if len(found) == 1 else f"{line}, in the batch of process {rank}"
    batches = "batch stays" if len(found) == 1 else f"batches of all {len(found)} processes stay"
    return f"overflow report: the replayed {batches} within fp16's range (the overflow came from another batch)"
