"""Dropout masks on CPUs where torch draws them one element at a time.

On a CPU, torch draws a dropout mask with `bernoulli_`. Only on Intel CPUs (and builds with MKL) does that run MKL's
vectorised, multi-threaded generator; everywhere else (AMD, ARM) it is a serial loop that draws a double-precision
uniform, two 32-bit Mersenne Twister outputs, per element. In the default job that loop was a fifth of a training
step (docs/benchmarks.md).

`FastDropout` computes what torch's dropout computes and only draws the mask another way, with one of two
`keep_mask` functions:
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
`F.scaled_dot_product_attention`. Attention with dropout takes torch's math path on a CPU anyway (its fused kernels
have no dropout); `attention` writes that path out with public operators and the drawn mask: softmax(Q K^T scale +
mask), zeroed where the mask drops and the rest scaled by 1 / (1 - p), times V, with torch's casts (autocast's dtype
first under autocast, float32 for float16 and bfloat16). It is faster than torch's path given the mask
(docs/benchmarks.md). A call it does not take (`computes_itself`), and anything else, passes through unchanged.

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
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from transformers import PretrainedConfig

from app.amp.policy import cpuinfo_text
from app.config import TrainConfig


def intel_cpu() -> bool:
    """Whether this machine's CPU is Intel's (torch asks cpuinfo the same question before using MKL's Bernoulli)."""
    text = cpuinfo_text()
    return "GenuineIntel" in text if text else "intel" in platform.processor().lower()  # no /proc/cpuinfo: not Linux


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


# What autocast casts to its dtype before F.scaled_dot_product_attention (a lower-precision op): not float64.
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _cast_by_autocast(dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype autocast gives a floating input of F.scaled_dot_product_attention (a lower-precision op) here."""
    if torch.is_autocast_enabled(device) and dtype in _AUTOCAST_CASTS:
        return torch.get_autocast_dtype(device)
    return dtype


def computes_itself(query, key, value, attn_mask, is_causal: bool, options: dict) -> bool:
    """Whether `attention` takes this call. Anything else goes to torch's own attention, with its own masks; and what
    torch refuses (mixed dtypes or devices, a mask of another dtype, a causal call with a mask, heads that do not
    divide, too few dimensions), torch refuses with its own error."""
    if query.is_nested or set(options) - {"enable_gqa"} or (is_causal and attn_mask is not None):
        return False  # nested tensors, a newer torch's options, or torch's own error
    device = query.device
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if any(tensor.device != device for tensor in tensors):
        return False
    dtype = _cast_by_autocast(query.dtype, device.type)
    if not dtype.is_floating_point or any(_cast_by_autocast(t.dtype, device.type) != dtype for t in (key, value)):
        return False
    if attn_mask is not None and attn_mask.dtype != torch.bool:  # torch takes bool, float32 or the query's dtype
        if _cast_by_autocast(attn_mask.dtype, device.type) not in (torch.float32, dtype):
            return False
    gqa = options.get("enable_gqa", False)
    if min(query.dim(), key.dim(), value.dim()) < (3 if gqa else 2) or query.shape[-1] == 0:
        return False
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        return False
    batch, kv_batches = query.shape[:-2], [key.shape[:-2], value.shape[:-2]]
    if gqa:
        heads = query.shape[-3]
        if any(kv[-1] == 0 or heads % kv[-1] for kv in kv_batches):
            return False
        kv_batches = [(*kv[:-1], heads) for kv in kv_batches]
    scores = (*query.shape[:-1], key.shape[-2])
    try:  # broadcast to the query's batch, and the mask to the scores, as torch's own attention requires
        return torch.broadcast_shapes(batch, *kv_batches) == batch and (
            attn_mask is None or torch.broadcast_shapes(attn_mask.shape, scores) == scores
        )
    except RuntimeError:
        return False


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    p: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with `keep` as its dropout mask (True: kept), as torch computes it on a CPU
    with dropout (its math path): under autocast, the inputs cast to autocast's dtype first (and the whole computed
    below autocast); float16 and bfloat16 computed in float32 and the output cast back; grouped-query heads repeated;
    a row whose mask lets it attend to no key gives zeros (torch's safe softmax), with zero gradients (torch also
    zeroes a row whose scores overflow to -inf throughout, which this does not look for: a pass over every score).
    For a call that `computes_itself` accepts."""
    device = query.device.type
    query, key, value, attn_mask = (
        tensor if tensor is None else tensor.to(_cast_by_autocast(tensor.dtype, device))
        for tensor in (query, key, value, attn_mask)
    )
    dtype = query.dtype
    with torch.autocast(device, enabled=False):
        if dtype in (torch.float16, torch.bfloat16):
            query, key, value = query.float(), key.float(), value.float()
        if enable_gqa:  # each key and value head serves a group of query heads (a copy only where groups are > 1)
            heads = query.shape[-3]
            key, value = (
                t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], -3) for t in (key, value)
            )
        if is_causal:
            attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        scores = (query * scale) @ key.transpose(-2, -1)  # the query scaled: a quarter of the scores' size or less
        attends_to_none = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    ~attn_mask, float("-inf")
                )
            attends_to_none = torch.isneginf(attn_mask).all(-1, keepdim=True)  # on the mask: small, broadcast
            if attends_to_none.any():
                attn_mask = attn_mask.masked_fill(attends_to_none, 0)  # a finite softmax there, zeroed below
            else:
                attends_to_none = None
            scores = scores + attn_mask
        weights = scores.softmax(-1)
        if attends_to_none is not None:
            weights = weights.masked_fill(attends_to_none, 0)
        return (_KeptScaled.apply(weights, keep, p, False) @ value).to(dtype)


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
            if (
                0 < dropout_p < 1
                and query.device.type == "cpu"
                and computes_itself(query, key, value, attn_mask, is_causal, options)
            ):
                keep = self.keep_mask((*query.shape[:-1], key.shape[-2]), dropout_p)
                return attention(query, key, value, keep, dropout_p, attn_mask, is_causal, scale, **options)
        return func(*args, **kwargs)


def recompute_under_the_masks_mode() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn`, called as a checkpointed forward starts: (the forward's context, the
    recomputation's). The recomputation runs under the forward's `FastDropout`, if any, as torch does for a device
    context (from the same stack); from the RNG state torch restores, it then draws the forward's masks."""
    modes = [mode for mode in _get_current_function_mode_stack() if isinstance(mode, FastDropout)]
    return contextlib.nullcontext(), FastDropout(modes[-1].keep_mask) if modes else contextlib.nullcontext()


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


def masks_of_run(cfg: TrainConfig, device: torch.device, started_with: DropoutMasks | None = None) -> DropoutMasks:
    """How this run draws its dropout masks: SFC64 or UNIFORM (`FastDropout`), or TORCH (torch's own).

    SFC64 with --fast_cpu_dropout on a CPU where torch's masks come from the serial loop. A resumed run keeps the way
    it started (`started_with`, from its checkpoint), so that it draws the masks an uninterrupted run would have drawn.
    Compiled, or on a GPU: TORCH (a compiled graph and the GPU draw their masks in their own kernels)."""
    if cfg.torch_compile or device.type != "cpu":
        return DropoutMasks.TORCH
    if started_with is not None:
        return started_with
    serial = serial_bernoulli(torch.backends.mkl.is_available(), intel_cpu())
    return DropoutMasks.SFC64 if cfg.fast_cpu_dropout and serial else DropoutMasks.TORCH


def drops_out(model: torch.nn.Module) -> bool:
    """Whether training `model` draws a dropout mask: a dropout module, or a rate in a model config that the model
    passes to `F.dropout` or to attention as a number (OPT's `dropout`, Llama's `attention_dropout`, Falcon's
    `hidden_dropout`), above 0. Not LayerDrop, which skips whole layers and draws no mask."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        config = getattr(module, "config", None)
        rates = vars(config).items() if isinstance(config, PretrainedConfig) else ()
        if any("drop" in name and "layerdrop" not in name and _positive(value) for name, value in rates):
            return True
    return False


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def masks_context(masks: DropoutMasks) -> Callable[[], contextlib.AbstractContextManager]:
    """What the training forward runs under for `masks`."""
    if masks == DropoutMasks.TORCH:
        return contextlib.nullcontext
    keep_mask = sfc64_keep_mask if masks == DropoutMasks.SFC64 else uniform_keep_mask
    return functools.partial(FastDropout, keep_mask)
