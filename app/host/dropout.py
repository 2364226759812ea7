"""Dropout masks on CPUs where torch draws them one element at a time.

On a CPU, torch draws a dropout mask with `bernoulli_`. Only on Intel CPUs (and builds with MKL) does that run MKL's
vectorised, multi-threaded generator; everywhere else (AMD, ARM) it is a serial loop that draws a double-precision
uniform, two 32-bit Mersenne Twister outputs, per element. In the default job that loop was a fifth of a training
step (docs/benchmarks.md).

`FastDropout` keeps torch's dropout and only draws the mask another way, with one of two `keep_mask` functions:
- `sfc64_keep_mask` (what new runs draw): 32 random bits per element from numpy's SFC64 generator, kept where they
  are at least p * 2^32, the SFC64 stream seeded by one draw from torch's default generator per mask. A 16 x 12 x
  128 x 128 attention mask of the default job: 3.0 to 3.2 ms against 8.1 to 9.2 ms for the float32 uniforms below on
  an AVX2-only EPYC, 7.7 against 8.4 ms on one with AVX512-BF16 (docs/benchmarks.md).
- `uniform_keep_mask` (runs that started with it, as their checkpoints record): one float32 uniform per element from
  torch's default generator (`torch.rand`), kept where it is >= p.
Each element is kept with probability 1 - p (to 2^-32, or 2^-24), the survivors scaled by 1 / (1 - p), as in
`torch.nn.functional.dropout`. As every mask starts from torch's default CPU generator, `torch.manual_seed` and the
RNG state in checkpoints govern it as before.

It covers the two ways models drop out: `F.dropout` (every `nn.Dropout`) and attention dropout inside
`F.scaled_dot_product_attention`, where torch's CPU kernels fall back to their math path anyway when dropout_p > 0;
that same math path is called here with the mask (its `dropout_mask` argument), so masking, scaling and precision
stay torch's own. Anything else passes through unchanged. That path is a private operator of torch's: a run draws
these masks only once `math_path_mismatch` has found it applying a given mask as the public SDPA would.

Gradient checkpointing runs a layer's forward again in the backward pass, outside the mode; torch puts the RNG state
and autocast back for that recomputation, but no TorchFunctionMode. `recompute_under_the_masks_mode` enters the mode
there whenever the forward ran under it, so the recomputation draws the very masks of the forward.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from app.config import TrainConfig
from app.errors import first_line

# The math path asks callers that pass their own mask to be tests; here the mask is a real one, drawn as below. (Set
# for the process: torch raises the warning only once the outer SDPA call returns, past any local filter.)
warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")


def intel_cpu() -> bool:
    """Whether this machine's CPU is Intel's (torch asks cpuinfo the same question before using MKL's Bernoulli)."""
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux
        return "intel" in platform.processor().lower()


def serial_bernoulli(mkl: bool, intel: bool) -> bool:
    """Whether torch draws CPU dropout masks in its serial loop: unless it was built with MKL and runs on Intel."""
    return not (mkl and intel)


def uniform_keep_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """True where an element survives dropout with probability p: one float32 uniform each, kept where >= p."""
    return torch.rand(shape, dtype=torch.float32) >= p


def sfc64_keep_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """True where an element survives dropout with probability p (to 2^-32): 32 bits each from numpy's SFC64, seeded
    by one draw of torch's default generator, kept where they are >= p * 2^32."""
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    count = math.prod(shape)
    words = np.random.SFC64(seed).random_raw((count + 1) // 2)  # 64 bits each: two elements
    threshold = np.uint32(min(math.ceil(p * 2**32), 2**32 - 1))
    return torch.from_numpy(words.view(np.uint32)[:count] >= threshold).view(shape)


def _dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **options):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, options


class _KeptScaled(torch.autograd.Function):
    """`x * keep / (1 - p)`, which keeps only the boolean mask for the backward pass (a byte an element, as torch's own
    dropout keeps it), not a float copy of it: four times less memory for every dropout of the step, and the
    float32 copies of a float16 or bfloat16 input that LoRA's dropout would otherwise keep on 200 layers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        ctx.p = p
        ctx.save_for_backward(keep)
        noise = keep.to(x.dtype).div_(1 - p)
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad * keep.to(grad.dtype).div_(1 - ctx.p), None, None, None


class FastDropout(TorchFunctionMode):
    """While active, CPU dropout draws its masks with `keep_mask` (see the module docstring)."""

    def __init__(self, keep_mask: Callable[[tuple[int, ...], float], torch.Tensor] = sfc64_keep_mask):
        super().__init__()
        self.keep_mask = keep_mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _dropout_args(*args, **kwargs)
            if training and 0 < p < 1 and x.device.type == "cpu":
                return _KeptScaled.apply(x, self.keep_mask(x.shape, p), p, inplace)
        elif func is F.scaled_dot_product_attention:
            query, key, value, attn_mask, dropout_p, is_causal, scale, options = _sdpa_args(*args, **kwargs)
            if 0 < dropout_p < 1 and query.device.type == "cpu" and not query.is_nested:
                if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does before its math path
                    attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
                keep = self.keep_mask((*query.shape[:-1], key.shape[-2]), dropout_p)
                output, _ = torch.ops.aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, keep, scale=scale, **options
                )
                return output
        return func(*args, **kwargs)


def recompute_under_the_masks_mode() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn`, called as a checkpointed forward starts: (the forward's context, the
    recomputation's). The recomputation runs under the forward's `FastDropout`, if any, as torch does for a device
    context (from the same stack); from the RNG state torch restores, it then draws the forward's masks."""
    modes = [mode for mode in _get_current_function_mode_stack() if isinstance(mode, FastDropout)]
    return contextlib.nullcontext(), FastDropout(modes[-1].keep_mask) if modes else contextlib.nullcontext()


@functools.cache
def math_path_mismatch() -> str | None:
    """None where `FastDropout`'s attention, through torch's math path, equals the public SDPA's with the mask it
    drew applied to the attention weights; else what differs. Checked once per process (milliseconds), before a run
    relies on the private operator, the only way to hand attention a mask.

    With the identity as values, attention returns its weights: the public path without dropout gives
    softmax(QK^T scale + mask), and the mode must give those weights, zeroed where its mask drops and the rest scaled
    by 1 / (1 - p). Three calls, on the mode's three ways in: an additive mask with -inf entries and a scale; a boolean
    mask with grouped-query heads; causal."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_attention_math"):
        return f"torch {torch.__version__} has no _scaled_dot_product_attention_math"
    generator = torch.Generator().manual_seed(0)  # its own: the global stream, that dropout draws from, stays as it is
    heads, length, p = 4, 5, 0.25
    query = torch.randn(1, heads, length, 8, generator=generator)
    attends = ~torch.ones(length, length, dtype=torch.bool).triu(2)  # each row attends to 2 keys or more
    additive = torch.randn(length, length, generator=generator).masked_fill(~attends, float("-inf"))
    calls = (
        (heads, {"attn_mask": additive, "scale": 0.3}),
        (heads // 2, {"attn_mask": attends, "enable_gqa": True}),
        (heads, {"is_causal": True}),
    )
    for key_heads, options in calls:
        key = torch.randn(1, key_heads, length, 8, generator=generator)
        identity = torch.eye(length).expand(1, key_heads, length, length)
        weights = F.scaled_dot_product_attention(query, key, identity, **options)
        state = torch.get_rng_state()  # the mask and the mode draw the same mask from here; then it is put back
        keep = sfc64_keep_mask(weights.shape, p)
        torch.set_rng_state(state)
        try:
            with FastDropout(sfc64_keep_mask):
                output = F.scaled_dot_product_attention(query, key, identity, dropout_p=p, **options)
        except Exception as e:  # a torch whose private operator changed its arguments or what it returns
            return f"it raised {type(e).__name__}: {first_line(e)}"
        finally:
            torch.set_rng_state(state)
        expected = weights.masked_fill(~keep, 0) / (1 - p)
        if output.shape != expected.shape:
            return f"start-up check with {', '.join(options)}: shape {tuple(output.shape)}, not {tuple(expected.shape)}"
        if not torch.allclose(output, expected, rtol=1e-5, atol=1e-6):
            off = (output - expected).abs().max().item()
            return f"start-up check with {', '.join(options)}: {off:.3g} off"
    return None


class DropoutMasks(str, enum.Enum):
    """How a run draws its CPU dropout masks; its checkpoints record which (as the value), and a resume keeps it."""

    SFC64 = "sfc64"  # FastDropout with sfc64_keep_mask: what --fast_cpu_dropout gives a new run
    UNIFORM = "uniform"  # FastDropout with uniform_keep_mask: runs started before SFC64 masks
    TORCH = "torch"  # torch's own; also what a checkpoint from before the choice means

    @property
    def said(self) -> str:
        return {
            DropoutMasks.SFC64: "32 bits of SFC64 per element",
            DropoutMasks.UNIFORM: "one float32 uniform per element",
            DropoutMasks.TORCH: "torch's own",
        }[self]

    @classmethod
    def recorded(cls, value: str | None) -> DropoutMasks:
        """The kind a checkpoint records; torch's for one written before the choice, or with a value this version
        does not know (the integrity record vouches for the file, so it is not damage)."""
        try:
            return cls(value)
        except ValueError:
            return cls.TORCH


def masks_of_run(
    cfg: TrainConfig,
    device: torch.device,
    started_with: DropoutMasks | None = None,
    say: Callable[[str], object] = lambda line: None,
) -> DropoutMasks:
    """How this run draws its dropout masks: SFC64 or UNIFORM (`FastDropout`), or TORCH (torch's own).

    SFC64 with --fast_cpu_dropout on a CPU where torch's masks come from the serial loop. A resumed run keeps the way
    it started (`started_with`, from its checkpoint), so that it draws the masks an uninterrupted run would have drawn.
    Compiled, or on a GPU: TORCH (a compiled graph and the GPU draw their masks in their own kernels). SFC64 or
    UNIFORM only where torch's attention math path passes `math_path_mismatch`; else TORCH, with a note to `say`."""
    if cfg.torch_compile or device.type != "cpu":
        return DropoutMasks.TORCH
    wanted = started_with
    if wanted is None:
        serial = serial_bernoulli(torch.backends.mkl.is_available(), intel_cpu())
        wanted = DropoutMasks.SFC64 if cfg.fast_cpu_dropout and serial else DropoutMasks.TORCH
    if wanted != DropoutMasks.TORCH and (mismatch := math_path_mismatch()) is not None:
        say(
            f"note: dropout masks: torch's own, as its attention math path does not apply a given mask as "
            f"F.scaled_dot_product_attention does ({mismatch})"
        )
        return DropoutMasks.TORCH
    return wanted


def masks_context(masks: DropoutMasks) -> Callable[[], contextlib.AbstractContextManager]:
    """What the training forward runs under for `masks`."""
    if masks == DropoutMasks.TORCH:
        return contextlib.nullcontext
    keep_mask = sfc64_keep_mask if masks == DropoutMasks.SFC64 else uniform_keep_mask
    return functools.partial(FastDropout, keep_mask)
