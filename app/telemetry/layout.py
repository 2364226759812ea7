"""The Custom Scalars layout: the app's tags (tags.py) arranged into charts, the same four categories in every run.

TensorBoard sorts the Scalars tab alphabetically, so an fp16 run's story (scale, skips, gradient norm, loss) is spread
over four groups. Its custom-scalars plugin shows charts in the order a layout gives, and merges the layouts of all
runs in a logdir: categories of the same title share their charts, in the order of the first run (by name) that has
them. So every run writes the four categories in the same order, each with only the charts whose tags it writes
(a chart with no data in any run would be an empty box): no scaler charts without a scaler, no GPU memory on a CPU.

A chart is a multiline chart: its regexes pick tags, and it draws each (run, tag) pair that matches as one line,
coloured by run. So the comparison of scripts/compare_amp.py writes one run per precision, <name>/<fp16|bf16|fp32>,
each with the same compare/ tags: its charts then draw one line per precision, in that precision's own colour.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.telemetry import tags
from app.telemetry.writer import TensorBoardWriter

AMP_HEALTH, LEARNING, SPEED, MEMORY = "AMP health", "Learning", "Speed", "Memory"
CATEGORIES = (AMP_HEALTH, LEARNING, SPEED, MEMORY)

Layout = dict[str, dict[str, list]]  # category -> chart title -> ["Multiline", [tag regex, ...]], as torch writes it


def exactly(*names: str) -> list:
    """A multiline chart of these tags and no others."""
    return ["Multiline", [f"^{re.escape(name)}$" for name in names]]


# The charts of the task's eval metrics besides the loss (tasks' `metrics`), by the tags that each chart draws.
METRIC_CHARTS = {
    "eval accuracy and macro-F1": (tags.EVAL_ACCURACY, tags.EVAL_F1),
    "eval perplexity": (tags.EVAL_PERPLEXITY,),
    "eval exact match": (tags.EVAL_EXACT_MATCH,),
}


def run_layout(scaler: bool, headroom: bool, device_type: str, mfu: bool, eval_metrics: tuple[str, ...]) -> Layout:
    """The layout of a training run, with the charts of the tags it writes.

    Args:
        scaler: loss scaling is on (fp16): the amp/ scaler tags are written.
        headroom: amp/headroom_bits is measured (fp16 autocast, not compiled).
        device_type: "cuda" gets the GPU allocator's tags, anything else the process's resident memory.
        mfu: perf/mfu_pct is written (a GPU whose peak for the dtype is known).
        eval_metrics: the eval/ tags of the run's task.
    """
    amp_health = {}
    if scaler:
        amp_health |= {
            "loss scale": exactly(tags.AMP_LOSS_SCALE),
            "skipped steps (cumulative)": exactly(tags.AMP_SKIPPED_STEPS),
            "skip rate (per log interval)": exactly(tags.AMP_SKIP_RATE),
            "consecutive skips": exactly(tags.AMP_CONSECUTIVE_SKIPS),
        }
    amp_health["gradient norm (inf/NaN on overflow steps)"] = exactly(tags.TRAIN_GRAD_NORM)
    if headroom:
        amp_health["fp16 headroom (bits; 0 = at 65504)"] = exactly(tags.AMP_HEADROOM_BITS)
    speed = {
        "samples/s (all ranks)": exactly(tags.PERF_SAMPLES_PER_SEC),
        "tokens/s (all ranks, per device)": exactly(tags.PERF_TOKENS_PER_SEC, tags.PERF_TOKENS_PER_SEC_PER_DEVICE),
        "step time (ms)": exactly(tags.PERF_STEP_TIME_MS),
    }
    if mfu:
        speed["MFU (%)"] = exactly(tags.PERF_MFU_PCT)
    speed["padding fraction"] = exactly(tags.PERF_PADDING_FRACTION)
    if device_type == "cuda":
        memory = {
            "GPU memory (GiB)": exactly(
                tags.MEMORY_ALLOCATED_GIB, tags.MEMORY_RESERVED_GIB, tags.MEMORY_PEAK_ALLOCATED_GIB
            ),
            "peak share of the device (%)": exactly(tags.MEMORY_PEAK_ALLOCATED_PCT, tags.MEMORY_PEAK_RESERVED_PCT),
            "allocator retries and OOMs (cumulative)": exactly(tags.MEMORY_ALLOC_RETRIES, tags.MEMORY_OOMS),
        }
    else:
        memory = {"resident memory (GiB)": exactly(tags.MEMORY_RSS_GIB)}
    return {
        AMP_HEALTH: amp_health,
        LEARNING: {
            "train and eval loss": exactly(tags.TRAIN_LOSS, tags.EVAL_LOSS),
            "learning rate": exactly(tags.TRAIN_LR),
            **{title: exactly(*drawn) for title, drawn in METRIC_CHARTS.items() if set(drawn) <= set(eval_metrics)},
        },
        SPEED: speed,
        MEMORY: memory,
    }


def comparison_layout() -> Layout:
    """The comparison's charts, in the same four categories: each draws the compare/ runs, one line per precision.
    The same for every comparison, so that several in one logdir share these charts."""
    return {
        AMP_HEALTH: {"gradient norm by precision": exactly(tags.COMPARE_GRAD_NORM)},
        LEARNING: {
            "train loss by precision": exactly(tags.COMPARE_TRAIN_LOSS),
            "eval loss by precision": exactly(tags.COMPARE_EVAL_LOSS),
        },
        SPEED: {"samples/s by precision": exactly(tags.COMPARE_SAMPLES_PER_SEC)},
        MEMORY: {"peak memory (GiB) by precision": exactly(tags.COMPARE_PEAK_MEMORY_GIB)},
    }


def comparison_curves(curves: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """One compared run's curves (tag -> {step: value}) under the compare/ tags that comparison_layout charts."""
    memory = tags.MEMORY_PEAK_ALLOCATED_GIB if tags.MEMORY_PEAK_ALLOCATED_GIB in curves else tags.MEMORY_RSS_GIB
    renamed = {
        tags.TRAIN_GRAD_NORM: tags.COMPARE_GRAD_NORM,
        tags.TRAIN_LOSS: tags.COMPARE_TRAIN_LOSS,
        tags.EVAL_LOSS: tags.COMPARE_EVAL_LOSS,
        tags.PERF_SAMPLES_PER_SEC: tags.COMPARE_SAMPLES_PER_SEC,
        memory: tags.COMPARE_PEAK_MEMORY_GIB,
    }
    return {target: curves[source] for source, target in renamed.items() if curves.get(source)}


def write_comparison(runs: dict[str, dict[str, dict[int, float]]], folder: Path) -> None:
    """One TensorBoard run per precision under `folder`, with its compared curves and the comparison's layout.

    Args:
        runs: precision label ("fp32", "fp16", "bf16") -> that run's curves, tag -> {step: value}.
    """
    for label, curves in runs.items():
        writer = TensorBoardWriter(folder / label)
        writer.layout(comparison_layout())
        for tag, curve in comparison_curves(curves).items():
            for step, value in sorted(curve.items()):
                writer.log({tag: value}, step)
        writer.close()
