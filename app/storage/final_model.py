"""The final model: `save_pretrained` of the whole model (gathered from shards where there are any) and the tokenizer,
written atomically into the output folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

from app.storage import disk


def save_final_model(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: Path, last_checkpoint: Path | None = None
) -> None:
    """`save_pretrained` of the full model (gathered from shards where there are any) and the tokenizer. Collective.

    Everything is written into `.staging-model` first and then moved into `output_dir` file by file with os.replace,
    which is atomic: a run killed mid-save leaves no half-written model.safetensors, only the staging folder. A full
    disk stops every rank with exit code 4 and names `last_checkpoint`, which is intact.
    """
    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    staging = output_dir / ".staging-model"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
    accelerator.wait_for_everyone()

    def write() -> None:
        accelerator.unwrap_model(model).save_pretrained(
            staging, state_dict=state_dict, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(staging)
            disk.share_as_umask_allows(staging)  # safetensors writes model.safetensors 0600, whoever calls it

    # Agreeing on the outcome is also the barrier: save_pretrained creates the folder on every rank.
    disk.write_on_every_rank(
        accelerator,
        write,
        output_dir,
        "the final model",
        sum(t.numel() * t.element_size() for t in state_dict.values()) or None,
        f"the last checkpoint {last_checkpoint} is intact" if last_checkpoint else "no checkpoint of this run is kept",
        clean_up=lambda: shutil.rmtree(staging, ignore_errors=True),
    )
    if accelerator.is_main_process:
        for file in staging.iterdir():
            os.replace(file, output_dir / file.name)
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()


def is_sharded(model: torch.nn.Module) -> bool:
    """Sharded by FSDP1 (wrapper modules) or FSDP2 (DTensor parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model gathered into CPU memory on the main process (other ranks get an empty dict). Collective.

    accelerator.get_state_dict would hand back shards under FSDP, which save_pretrained cannot write as one model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
