"""The final model: `save_pretrained` of the whole model (gathered from shards where there are any) and the tokenizer,
written atomically into the output folder. With adapters: peft's adapter files, the config the base is loaded with,
and, if asked, the base with the adapters merged into it in a subfolder."""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from app.storage import disk
from app.storage.folders import ADAPTER_BASE_FILE, CONFIG_FILE, MERGED_FOLDER, remove_earlier_model


@dataclass(frozen=True)
class AdaptersBase:
    """What an output folder of adapters says of their base."""

    name: str  # as another machine finds it: a hub id or the user's folder, never a site-packages or cache path
    fingerprint: str | None = None  # adapters/base.fingerprint of its weight files: predict.py refuses another base
    dtype: object = None  # as the base's own config gives it (None: not given), not the dtype it was frozen in
    frozen_in: str | None = None  # the dtype it was frozen in: predict.py rounds the base to it, as it was trained
    gguf_conversion: str | None = None  # a GGUF file's conversion (inputs/gguf.py): its name holds the file's digest
    given_as: str | None = None  # a relative folder as given, where `name` made it absolute: a project copied whole


def save_final_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer,
    output_dir: Path,
    last_checkpoint: Path | None = None,
    base: AdaptersBase | None = None,
) -> None:
    """`save_pretrained` of the full model (gathered from shards where there are any) and the tokenizer. Collective.

    Everything is written into `.staging-model` first and then moved into `output_dir` file by file with os.replace,
    which is atomic: a run killed mid-save leaves no half-written model.safetensors, only the staging folder. A full
    disk stops every rank with exit code 4 and names `last_checkpoint`, which is intact.

    Args:
        base: for a model with adapters (a peft model), its base: the name adapter_config.json gives it, and its
            fingerprint, in ADAPTER_BASE_FILE. Its config (with a classifier's labels, and the dtype of the base's own
            files) is written beside the adapters, so that predict.py can load the base the same way.
    """
    raw = accelerator.unwrap_model(model)
    for adapter in getattr(raw, "peft_config", {}).values() if base else ():
        adapter.base_model_name_or_path = base.name
    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    staging = output_dir / ".staging-model"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed mid-save
    accelerator.wait_for_everyone()

    def write() -> None:
        # peft's save_pretrained picks the adapters out of the state dict before it asks which rank it runs on, and
        # other ranks hold no gathered state dict under FSDP: the main process alone writes adapters.
        if accelerator.is_main_process or not base:
            # The app never resizes the vocabulary, so adapters never carry the embeddings: said here, since peft
            # would otherwise ask the hub for the base's config to find out (a lookup that fails offline).
            embeddings = {"save_embedding_layers": False} if base else {}
            raw.save_pretrained(
                staging,
                state_dict=state_dict,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                **embeddings,
            )
        if accelerator.is_main_process:
            if base:
                write_base_of_adapters(raw.get_base_model(), base, staging)
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
        written = {file.name for file in staging.iterdir()}
        for file in staging.iterdir():
            os.replace(file, output_dir / file.name)
        shutil.rmtree(staging)
        remove_earlier_model(output_dir, keep=written)
    accelerator.wait_for_everyone()


def write_base_of_adapters(model: torch.nn.Module, base: AdaptersBase, folder: Path) -> None:
    """The config the adapters' base is built with (its class, its head's labels), with the dtype that the base's own
    config gives, not the half precision it was frozen in: transformers would load the base in that. And the base's
    name and fingerprint, which predict.py checks."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = base.dtype
    config.save_pretrained(folder)
    record = {"base_model_name_or_path": base.name, "fingerprint": base.fingerprint, "frozen_in": base.frozen_in}
    record |= {"gguf_conversion": base.gguf_conversion} if base.gguf_conversion else {}
    record |= {"given_as": base.given_as} if base.given_as else {}
    (folder / ADAPTER_BASE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def save_merged_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: Path) -> Path:
    """The base with the adapters merged into its weights, in float32, to `<output_dir>/merged`: a plain transformers
    model, loadable without peft. Done last: it merges in place. Collective; the main process writes."""
    target = output_dir / MERGED_FOLDER
    staging = output_dir / f".staging-{MERGED_FOLDER}"

    def write() -> None:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            merged = accelerator.unwrap_model(model).float().merge_and_unload()  # float32 first: no half rounding
            merged.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            if (output_dir / CONFIG_FILE).is_file():  # the run's config: predict.py reads what it was trained with
                shutil.copy(output_dir / CONFIG_FILE, staging / CONFIG_FILE)
            disk.share_as_umask_allows(staging)

    disk.write_on_every_rank(
        accelerator,
        write,
        output_dir,
        "the merged model",
        None,
        "the adapters in the output folder are complete",
        clean_up=lambda: shutil.rmtree(staging, ignore_errors=True),
    )
    if accelerator.is_main_process:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    accelerator.wait_for_everyone()
    return target


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
