"""The frozen base of an adapter run: the dtype it is stored in, the fp16 range check before the cast, a fingerprint
that ties checkpoints to it, and a name that travels with the adapters.

Whatever the base is stored in, everything that trains is float32 (lora.py): a GradScaler refuses fp16 gradients
("Attempting to unscale FP16 gradients"), and an optimizer stepping fp16 weights loses small updates. A half-precision
base must compute under autocast in its own dtype: without autocast, LayerNorm and the residual stream would run in
half precision, and a float16 base under bf16 autocast fails in LayerNorm (mixed dtypes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from app.amp.policy import PrecisionPolicy
from app.errors import UsageError, counted
from app.storage.checkpoints import stored_shapes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP16_MAX = torch.finfo(torch.float16).max


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def base_dtype(requested: str, policy: PrecisionPolicy, use_peft: bool) -> tuple[torch.dtype, str]:
    """The storage dtype of the base, and why. UsageError for a half-precision base that autocast would not match."""
    if not use_peft:
        return torch.float32, "a full fine-tune: every weight trains, in float32"
    if requested == "auto":
        dtype = policy.dtype if policy.autocast_enabled else torch.float32
        return dtype, f"--dtype auto follows the precision ({policy.label})"
    dtype = DTYPES[requested]
    if dtype != torch.float32 and (not policy.autocast_enabled or policy.dtype != dtype):
        computes = f"{policy.mode} autocast" if policy.autocast_enabled else "fp32 without autocast"
        needed = {torch.float16: "fp16 (--amp)", torch.bfloat16: "bf16"}[dtype]
        raise UsageError(
            f"--dtype {requested} needs {needed} autocast to compute in, but this run computes in {computes}; pass "
            f"--mixed_precision {needed.split()[0]}, or --dtype auto or float32"
        )
    return dtype, f"--dtype {requested}"


def refuse_mixed_dtypes_under_fsdp1(dtype: torch.dtype, requested_backend: str | None) -> None:
    """FSDP1 flattens each unit's parameters into one buffer of one dtype: a half-precision base with float32 adapters
    cannot be flattened ("Must flatten tensors with uniform dtype"). FSDP2 shards each parameter on its own."""
    if requested_backend == "FSDP1" and dtype != torch.float32:
        raise UsageError(
            f"adapters on a {dtype_name(dtype)} base cannot run under FSDP1, which flattens a unit's float32 adapters "
            "and its half-precision base into one buffer of one dtype: set fsdp_version: 2 in the launch config (as "
            "accelerate_configs/fsdp.yaml does), or --dtype float32"
        )


def base_dtype_after_fallback(requested: str, policy: PrecisionPolicy) -> torch.dtype:
    """The base's dtype in the precision a fallback switched to: as asked if that still fits, else auto's."""
    try:
        return base_dtype(requested, policy, use_peft=True)[0]
    except UsageError:
        return base_dtype("auto", policy, use_peft=True)[0]


def weight_files(model_path: str) -> list[Path]:
    """The files that hold a local model folder's weights (safetensors first, else PyTorch's .bin)."""
    folder = Path(model_path)
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def outside_fp16_range(model_path: str) -> list[tuple[str, float]]:
    """The stored floating-point weights whose largest |w| fp16 cannot hold (or that are not finite), largest first.

    Read tensor by tensor from the safetensors files, before anything is cast: a float16 copy would hold inf there.
    """
    from safetensors import safe_open

    found = []
    for file in weight_files(model_path):
        if file.suffix != ".safetensors":
            continue
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                tensor = tensors.get_tensor(name)
                if tensor.is_floating_point() and tensor.numel():
                    largest = tensor.abs().max().float().item()
                    if not largest <= FP16_MAX:  # NaN too
                        found.append((name, largest))
    return sorted(found, key=lambda pair: -pair[1] if pair[1] == pair[1] else float("-inf"))


def check_fp16_range(model_path: str, asked: str = "float16") -> None:
    """Refuse a float16 base whose stored weights fp16 cannot hold: they would be inf before step 1. `asked`: the
    --dtype given, "auto" where fp16 AMP chose float16."""
    found = outside_fp16_range(model_path)
    if found:
        named = ", ".join(f"{name} (max |w| = {value:.4g})" for name, value in found[:3])
        dtype = "--dtype float16" if asked == "float16" else "--dtype auto (float16 under fp16 AMP)"
        raise UsageError(
            f"{dtype}: {counted(len(found), 'weight')} of the base beyond fp16's range ({FP16_MAX:g}) would be "
            f"inf: {named}; use --dtype bfloat16 (with --mixed_precision bf16) or float32"
        )


def fingerprint(model_path: str) -> str:
    """A digest of the base's weight files (their names and sha256): another base, or the same one retrained or
    quantized, has another. Hashing reads every byte once (about 0.5 s for 500 MB on a CPU with SHA extensions)."""
    digest = hashlib.sha256()
    for file in weight_files(model_path):
        with open(file, "rb") as stream:
            digest.update(f"{file.name}:{hashlib.file_digest(stream, 'sha256').hexdigest()}".encode())
    return digest.hexdigest()[:20]


def stored_keys(model_path: str) -> set[str] | None:
    """The tensor names a local model folder stores, from the safetensors headers alone; None if they cannot be read
    that way (PyTorch .bin files, a hub id)."""
    shapes = folder_shapes(model_path)
    return None if shapes is None else set(shapes)


def folder_shapes(model_path: str) -> dict[str, list[int]] | None:
    """The tensors a local model folder stores, name -> shape, from the safetensors headers alone; None as above."""
    files = weight_files(model_path)
    if not files or files[0].suffix != ".safetensors":
        return None
    return {name: shape for file in files for name, shape in stored_shapes(file).items()}
