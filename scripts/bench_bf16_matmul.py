"""One layer's matmul of the default job in fp32 and under bf16 autocast, on this CPU: what `auto` weighs.

    python scripts/bench_bf16_matmul.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_bf16_matmul.py   # as without AVX512-BF16

A 2048 x 384 input (16 reviews of 128 tokens) through MiniLM's 384 -> 1536 feed-forward layer: the median of
`--rounds` timed calls each, after warm-up, interleaved so that a slower stretch falls on both. On a CPU without
native bf16 (AVX512-BF16 or AMX) bf16 is emulated, and the app warns when it is asked for (docs/precision.md).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


def milliseconds(layer: torch.nn.Module, x: torch.Tensor, context) -> float:
    with context(), torch.no_grad():
        started = time.perf_counter()
        layer(x)
        return (time.perf_counter() - started) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(384, 1536), torch.randn(16 * 128, 384)
    contexts = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    times = {name: [] for name in contexts}
    for round_ in range(args.rounds + 3):  # the first three warm up
        for name, context in contexts.items():
            took = milliseconds(layer, x, context)
            if round_ >= 3:
                times[name].append(took)
    fp32, bf16 = (statistics.median(times[name]) for name in contexts)
    print(f"fp32 {fp32:.2f} ms, bf16 autocast {bf16:.2f} ms, bf16 / fp32 {bf16 / fp32:.2f} (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
