"""Which device a process trains on, read from the launch before the Accelerator exists: what autocast, the scaler and
the precision's `auto` are decided for. Nothing here reads the config, so the config's own checks can ask it."""

from __future__ import annotations

import os

import torch
from accelerate.utils import parse_flag_from_env

from app.errors import UsageError


def device_type() -> str:
    """The device type Accelerate will train on: the CPU where the launch asks for it (`accelerate launch --cpu`, a
    config's `use_cpu: true`), else the GPU-like accelerator if there is one, else the CPU. Autocast and the scaler are
    built for this type: on a GPU host under cpu.yaml, CUDA's would leave the CPU's matmuls in fp32."""
    if launched_on_cpu():
        return "cpu"
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cuda" if torch.cuda.is_available() else "cpu"


def launched_world_size() -> int:
    """WORLD_SIZE as a launcher sets it; 1 where it is unset or no number (one left over in a shell may be anything)."""
    world = os.environ.get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() else 1


def launched_on_cpu() -> bool:
    """ACCELERATE_USE_CPU, as Accelerate's state reads it (launch --cpu, use_cpu: true): a text that is no yes or no
    is a UsageError here, where Accelerate would raise a ValueError later."""
    try:
        return parse_flag_from_env("ACCELERATE_USE_CPU")
    except ValueError:
        raise UsageError(
            f"ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']!r} is neither yes nor no; set it to 1 or 0, or "
            "unset it"
        ) from None
