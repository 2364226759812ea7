"""Attention dropout on a CPU: the app's attention with its drawn mask against torch's math path given the same mask.

    python scripts/bench_attention.py                      # the precision `make train` gets here (auto)
    python scripts/bench_attention.py --mixed_precision no --rounds 40 --step_rounds 10 --json attention.json

On a CPU, attention with dropout takes torch's math path: its fused kernels have no dropout. The app's masks reach
attention through app/host/dropout.attention, the same math written with public operators. Two measures, each
interleaved in one process, so that a slower stretch of a noisy machine falls on every contender:
  layer   one attention's forward and backward at the default job's shape (16 x 12 heads x 128 x 32, padding masks):
          the app's `attention`; torch's attention given the same mask (the reference: SDPA's autocast casts, then
          its math path `_scaled_dot_product_attention_math`, a private operator, below autocast); the fused kernel
          without dropout (attention with nothing dropped)
  step    the embedded MiniLM's forward and backward of a 16 x 128 batch under the app's masks (`FastDropout`), its
          attention as the app computes it, and with torch's math path in its place; then torch's own masks
          (`bernoulli_`, what a run draws on Intel's CPUs with MKL) under the mode, with the app's attention and
          dropout, against no mode at all: torch's own masks, dropout and attention. Both of these draw the same
          masks (torch's serial loop here, MKL's on Intel), so what parts them is the app's attention and dropout
          alone: whether those would gain where torch's masks are already fast.
Medians in ms, and the ratios app / torch's math path, app / torch's own (no mode: what the mode gains on this
CPU), and with torch's masks app / torch's own (below 1: the app is faster). The layer's two attentions compute
the same thing: their largest difference is printed too (float32 roundings; one bf16 rounding of the output).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import warnings
from pathlib import Path

from bench_job import ROOT, _device_name

sys.path.insert(0, str(ROOT))

BATCH, HEADS, HEAD_DIM, P = 16, 12, 32, 0.1  # the default job: MiniLM, batch 16


def interleaved(contenders: dict, rounds: int) -> dict[str, float]:
    """Median ms of each contender, called in turn `rounds` times after two untimed calls each."""
    for run in contenders.values():
        run(), run()
    seconds = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {name: round(1000 * sorted(times)[rounds // 2], 2) for name, times in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixed_precision", choices=("auto", "no", "bf16", "fp16"), default="auto")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the layer's three contenders")
    parser.add_argument("--step_rounds", type=int, default=10, help="rounds of the model step's four contenders")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (the default job's max_length)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification

    from app.amp.policy import resolve_precision
    from app.host.dropout import (
        FastDropout,
        _cast_by_autocast,
        _sdpa_args,
        attention,
        computes_itself,
        sfc64_keep_mask,
    )
    from app.host.memory import keep_freed_memory
    from app.inputs.model import embedded_model_dir
    from app.telemetry.console import show_library_notices

    keep_freed_memory()  # as app/train.py does before a run
    length = args.length
    show_library_notices(False)
    warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")  # torch's
    policy, _ = resolve_precision(False, args.mixed_precision, "cpu", launcher=None)

    def torchs_attention(query, key, value, attn_mask, dropout_p, is_causal, keep, **options):
        """What torch computes for attention with dropout on a CPU, given the mask: SDPA's autocast casts, then its
        math path below autocast (`_scaled_dot_product_attention_math`, a private operator). Given a mask, that path
        zeroes the dropped weights and scales V by 1 / (1 - p), where with its own mask it scales the weights: a
        little less work (V is smaller), so the ratio slightly favours torch."""
        query, key, value, attn_mask = (
            tensor if tensor is None else tensor.to(_cast_by_autocast(tensor.dtype, "cpu"))
            for tensor in (query, key, value, attn_mask)
        )
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # the math path adds a mask: make it -inf
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
        with torch.autocast("cpu", enabled=False):
            math_path = torch.ops.aten._scaled_dot_product_attention_math
            return math_path(query, key, value, attn_mask, dropout_p, is_causal, keep, **options)[0]

    class TorchsMathPath(FastDropout):
        """The app's masks, with attention as torch computes it given the mask."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not F.scaled_dot_product_attention:
                return super().__torch_function__(func, types, args, kwargs)
            query, key, value, attn_mask, dropout_p, is_causal, scale, options = _sdpa_args(*args, **(kwargs or {}))
            if not (0 < dropout_p < 1 and computes_itself(query, key, value, attn_mask, is_causal, options)):
                return super().__torch_function__(func, types, args, kwargs)  # the calls the app's mode takes
            keep = self.keep_mask((*query.shape[:-1], key.shape[-2]), dropout_p)
            return torchs_attention(query, key, value, attn_mask, dropout_p, is_causal, keep, scale=scale, **options)

    def torchs_keep_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
        """torch's own mask: what its dropout and attention would draw from the same generator state."""
        return torch.empty(shape, dtype=torch.bool).bernoulli_(1 - p)

    # ---- one layer's attention ----------------------------------------------------------------------------------
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator).to(policy.dtype) for _ in range(4)
    )
    lengths = torch.randint(length // 3, length + 1, (BATCH,), generator=generator)
    attends = (torch.arange(length) < lengths[:, None])[:, None, None, :].expand(BATCH, 1, length, length)
    keep = sfc64_keep_mask((BATCH, HEADS, length, length), P)

    def layer(compute):
        def run():
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            with policy.autocast():
                out = compute(*inputs)
            out.backward(grad)
            return out

        return run

    layer_runs = {
        "app": layer(lambda q, k, v: attention(q, k, v, keep, P, attends)),
        "torch_math_path": layer(lambda q, k, v: torchs_attention(q, k, v, attends, P, False, keep)),
        "fused_no_dropout": layer(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attends)),
    }
    difference = (layer_runs["app"]().float() - layer_runs["torch_math_path"]().float()).abs().max().item()
    layer_ms = interleaved(layer_runs, args.rounds)

    # ---- the model's step ---------------------------------------------------------------------------------------
    model = AutoModelForSequenceClassification.from_pretrained(str(embedded_model_dir()), num_labels=2).train()
    batch = {
        "input_ids": torch.randint(1000, 20000, (BATCH, length), generator=generator),
        "attention_mask": (torch.arange(length) < lengths[:, None]).long(),
        "labels": torch.randint(0, 2, (BATCH,), generator=generator),
    }

    def step(mode):
        def run():
            with mode(), policy.autocast():
                loss = model(**batch).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    steps = {
        "app": step(FastDropout),
        "torch_math_path": step(TorchsMathPath),
        "app_torch_masks": step(functools.partial(FastDropout, torchs_keep_mask)),
        "torch_own": step(contextlib.nullcontext),
    }
    step_ms = interleaved(steps, args.step_rounds)

    result = {
        "device": _device_name(),
        "precision": policy.mode,
        "threads": torch.get_num_threads(),
        "batch": [BATCH, length],
        "layer_ms": layer_ms,
        "layer_max_abs_difference": difference,
        "step_ms": step_ms,
        "layer_app_vs_math_path": round(layer_ms["app"] / layer_ms["torch_math_path"], 3),
        "step_app_vs_math_path": round(step_ms["app"] / step_ms["torch_math_path"], 3),
        "step_app_vs_torch_own": round(step_ms["app"] / step_ms["torch_own"], 3),
        "step_torch_masks_app_vs_torch_own": round(step_ms["app_torch_masks"] / step_ms["torch_own"], 3),
    }
    print(f"{result['device']}; {policy.mode}, {result['threads']} threads; medians in ms")
    print(
        f"  layer ({BATCH} x {HEADS} x {length} x {HEAD_DIM}, forward and backward): "
        + ", ".join(f"{name} {ms}" for name, ms in layer_ms.items())
        + f"; app / math path {result['layer_app_vs_math_path']}; outputs differ by {difference:.3g} at most"
    )
    print(
        f"  step (MiniLM, {BATCH} x {length}, forward and backward): "
        + ", ".join(f"{name} {ms}" for name, ms in step_ms.items())
        + f"; app / math path {result['step_app_vs_math_path']}"
        + f"; app / torch's own {result['step_app_vs_torch_own']}"
        + f"; with torch's masks, app / torch's own {result['step_torch_masks_app_vs_torch_own']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
