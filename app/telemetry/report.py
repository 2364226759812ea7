"""What a run tells people: its set-up as TensorBoard text at start, and a summary table and hparams at the end."""

from __future__ import annotations

import accelerate
import torch
import transformers

from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig
from app.host.runtime import backend_name, device_name, tf32_convolutions, tf32_matmuls
from app.telemetry import tags
from app.telemetry.footprint import Footprint, size
from app.telemetry.meters import Telemetry, high_water_mark_gib


def write_start_texts(writer, cfg: TrainConfig, accelerator, policy: PrecisionPolicy, notes: list[str]) -> None:
    """The resolved config, the environment, the precision decision with its notes, and the TF32 flags."""
    environment = {
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "device": device_name(accelerator.device),
        "processes": accelerator.num_processes,
        "backend": backend_name(accelerator),
    }
    tf32 = {  # the settings' names in torch 2.9+, then the older ones
        "CUDA fp32 matmuls (torch.backends.cuda.matmul.fp32_precision, allow_tf32)": _tf32(tf32_matmuls()),
        "cuDNN fp32 convolutions (torch.backends.cudnn.conv.fp32_precision, allow_tf32)": _tf32(tf32_convolutions()),
    }
    writer.text(tags.RUN_CONFIG, _code_block(cfg.to_yaml()))
    writer.text(tags.RUN_ENVIRONMENT, _table(environment))
    writer.text(tags.RUN_PRECISION, "\n\n".join([policy.describe(), *notes, scaler_note(policy)]))
    writer.text(tags.RUN_TF32, _table(tf32))


def _tf32(on: bool) -> str:
    return "TF32 (tensor cores, a 10-bit mantissa)" if on else "full fp32"


def scaler_note(policy: PrecisionPolicy) -> str:
    """What the run/precision text says about the scaler's tags, which only fp16 writes."""
    if policy.scaler_enabled:
        return "AMP on: fp16 with loss scaling, so the scaler's tags (amp/loss_scale, skips, updates) are written."
    why = "bf16 autocast needs none: bf16 has fp32's exponent range" if policy.autocast_enabled else "fp32 needs none"
    return (
        f"AMP off: no loss scaler ({why}), so this run writes none of the scaler's tags "
        f"({', '.join(tags.SCALER_TAGS)}); their absence means AMP off."
    )


def hparams(cfg: TrainConfig, policy: PrecisionPolicy, accelerator, state) -> dict:
    """The columns of TensorBoard's HPARAMS tab, so AMP-on and AMP-off runs line up side by side. The precision is the
    run's steps' (`state`): a run resumed in another one, or fallen back, shows both ("fp16 then no")."""
    modes = [mode or "unrecorded" for *_, mode in state.precision_runs()] or [policy.mode]
    return {
        "precision": " then ".join(modes),
        "loss_scaling": str(state.may_have_skipped() if state.opt_step else policy.scaler_enabled).lower(),  # not 0/1
        "device": accelerator.device.type,
        "processes": accelerator.num_processes,
        "model": cfg.model_name_or_path or "all-MiniLM-L6-v2 (embedded)",
        "learning_rate": cfg.learning_rate,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_length": cfg.max_length,
        "seed": cfg.seed,
    }


def summary_table(
    wall_seconds: float, telemetry: Telemetry, state, final: dict[str, float], estimate: Footprint | None = None
) -> str:
    if not telemetry.run_steps:  # a resume with nothing left to train
        samples_per_sec = f"n/a: no step trained in this run (it resumed at step {state.opt_step}, where training ends)"
        peak_memory = "n/a: no step trained in this run"
    else:  # the first step of a run is warm-up, left out of throughput: a run of one step has nothing to measure
        samples_per_sec = (
            f"{telemetry.samples_per_sec:.1f} (all ranks, warm-up and evaluation excluded)"
            if telemetry.samples_per_sec is not None
            else "n/a (fewer than 2 steps)"
        )
        peak_memory = (
            f"{telemetry.peak_memory_gib:.2f} GiB ({telemetry.peak_memory_kind}, max over ranks)"
            if telemetry.peak_memory_gib > 0
            else "n/a (no step was logged)"
        )
    if telemetry.peak_memory_kind == "CPU RSS" and (high_water := high_water_mark_gib()):
        peak_memory += f"; high-water mark {high_water:.2f} GiB (the main process, loading and evaluation included)"
    if estimate:
        peak_memory += f"; estimated at start: {size(estimate.total_bytes)} for weights, gradients and AdamW state"
    rows = [
        ("wall time", f"{wall_seconds:.1f} s"),
        ("samples/s", samples_per_sec),
        ("peak memory", peak_memory),
        ("optimizer steps", optimizer_steps_row(state)),
        *((tag, f"{value:.4f}") for tag, value in final.items()),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["run summary", *(f"  {name:<{width}}  {value}" for name, value in rows)])


def optimizer_steps_row(state) -> str:
    """The run's steps, applied and skipped, from its totals (an earlier process's, or before a fallback, count), and
    the precisions they ran in where there were several."""
    steps = f"{state.opt_step} {state.said_outcome()}"
    return steps + (f"; {state.said_precisions()}" if len(state.precision_runs()) > 1 else "")


def _code_block(text: str) -> str:
    # TensorBoard renders text as markdown; indenting by four spaces keeps the YAML verbatim.
    return "\n".join("    " + line for line in text.splitlines())


def _table(values: dict) -> str:
    return "\n".join(["| name | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in values.items())])
