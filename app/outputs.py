"""The run's folders: its name, the checks that keep earlier work safe, and the final model.

Nothing is created or deleted until every input has been checked: `check_*` only look, and `prepare` (main process,
after the checks) creates folders and, with `--overwrite_output_dir` only, deletes the old checkpoints.
"""

from __future__ import annotations

import datetime
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from app.checkpoint import ResumePoint
from app.config import TrainConfig
from app.errors import UsageError

CONFIG_FILE = "training_args.yaml"


@dataclass(frozen=True)
class RunPaths:
    run_name: str
    output_dir: Path
    log_dir: Path  # <logdir>/<run_name>: this run's TensorBoard folder


def resolve_paths(cfg: TrainConfig, precision_label: str, resume: ResumePoint | None) -> RunPaths:
    """Name the run and place its folders; a resumed run keeps its name, so its curves continue in TensorBoard."""
    run_name = cfg.run_name or (resume.info.run_name if resume else None) or _unique_run_name(precision_label)
    default_output_dir = resume.output_dir if resume else Path("outputs") / run_name
    output_dir = Path(cfg.output_dir) if cfg.output_dir else default_output_dir
    return RunPaths(run_name, output_dir, Path(cfg.logdir) / run_name)


def _unique_run_name(precision_label: str) -> str:
    # Ranks may straddle a second boundary: the main process names the run for all.
    stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
    broadcast_object_list(stamp)
    return f"{stamp[0]}-{precision_label}"


def check_output_dir(paths: RunPaths, resuming: bool, overwrite: bool) -> None:
    _check_writable(paths.output_dir, "--output_dir")
    busy = paths.output_dir.is_dir() and any(paths.output_dir.iterdir())
    if busy and not (resuming or overwrite):
        raise UsageError(
            f"--output_dir {paths.output_dir} is not empty; pass --resume_from_checkpoint latest to continue that run, "
            "--overwrite_output_dir to replace it, or another --output_dir"
        )


def check_log_dir(paths: RunPaths, resuming: bool) -> None:
    _check_writable(paths.log_dir.parent, "--logdir")
    if not resuming and paths.log_dir.is_dir() and any(paths.log_dir.glob("events.out.tfevents.*")):
        raise UsageError(
            f"TensorBoard run {paths.log_dir} already exists and would mix two runs; "
            "pass another --run_name, or leave it unset for a unique one"
        )


def _check_writable(path: Path, flag: str) -> None:
    """Look, without creating anything: the nearest existing ancestor must be a writable folder."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} cannot be written: no write permission on {existing}")


def prepare(paths: RunPaths, cfg: TrainConfig, overwrite_checkpoints: bool) -> None:
    """Create the folders and record the resolved config in both. Main process, after all checks."""
    if overwrite_checkpoints:
        shutil.rmtree(paths.output_dir / "checkpoints", ignore_errors=True)
    for folder in (paths.output_dir, paths.log_dir):
        folder.mkdir(parents=True, exist_ok=True)
        write_config(cfg, folder)


def write_config(cfg: TrainConfig, folder: Path) -> None:
    """The resolved config as `training_args.yaml`, the name HF Trainer users know (its `training_args.bin`, in YAML
    that `--config` reads back). The one config file of an output folder; predict.py reads `max_length` from it."""
    (folder / CONFIG_FILE).write_text(cfg.to_yaml())


def save_final_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: Path) -> None:
    """`save_pretrained` of the full model (gathered from shards where there are any) and the tokenizer. Collective.

    Everything is written into `.staging-model` first and then moved into `output_dir` file by file with os.replace,
    which is atomic: a run killed mid-save leaves no half-written model.safetensors, only the staging folder.
    """
    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    staging = output_dir / ".staging-model"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        staging, state_dict=state_dict, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(staging)
    accelerator.wait_for_everyone()  # save_pretrained creates the folder on every rank: all are done with it
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
