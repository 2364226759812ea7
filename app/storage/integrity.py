"""Each checkpoint's record of its files (name, size, sha256), and the check against it before a resume.

The record is written last, into the staging folder, after every rank has written its part and before the folder is
renamed into place: a checkpoint with a record is one whose every file was complete when it was published. A file
that is later truncated, deleted or changed no longer matches, and the check names it before any model loads.

sha256, hashlib's fastest where the CPU has SHA extensions; what it costs: docs/benchmarks.md. Main process only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from app.storage.disk import write_atomically

RECORD = "checkpoint_files.json"
RANDOM_STATES = "random_states_{}.pkl"  # Accelerate's name for process i's RNG state


def write_record(folder: Path) -> int:
    """Record every file under `folder`: its size and sha256, written atomically. Returns the bytes recorded."""
    files = {
        str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != RECORD
    }
    write_atomically(folder / RECORD, json.dumps({"files": files}, indent=1))
    return sum(entry["bytes"] for entry in files.values())


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def is_recorded(folder: Path) -> bool:
    return (folder / RECORD).is_file()


def damage(folder: Path, only: set[str] | None = None) -> str | None:
    """What is wrong with a recorded checkpoint, naming the file; None if every recorded file (or each of `only`) is
    as recorded.

    A missing random state is not damage (see missing_random_states): Accelerate resumes without it, not exactly.
    """
    try:
        files = json.loads((folder / RECORD).read_text(encoding="utf-8"))["files"]
        entries = [(name, entry["bytes"], entry["sha256"]) for name, entry in files.items() if not only or name in only]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not the record's shape: edited or garbled
        return f"{folder / RECORD} cannot be read as the record of its files"
    for name, size, checksum in entries:
        path = folder / name
        if not path.is_file():
            if _is_random_state(name):
                continue
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes where its record says {size}"
        if _sha256(path) != checksum:
            return f"{path} does not match its checksum: it changed after it was written"
    return None


def _is_random_state(name: str) -> bool:
    return name.startswith("random_states_") and name.endswith(".pkl")


def missing_random_states(folder: Path, num_processes: int) -> list[int]:
    """The processes (of the first `num_processes`) whose RNG state file is not in the checkpoint."""
    return [rank for rank in range(num_processes) if not (folder / RANDOM_STATES.format(rank)).is_file()]


def recorded_bytes(folder: Path) -> int | None:
    """A checkpoint's size as recorded, else as it is on disk; None for no checkpoint."""
    try:
        files = json.loads((folder / RECORD).read_text(encoding="utf-8"))["files"]
        return sum(entry["bytes"] for entry in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else None
    return sum(sizes) if sizes is not None else None
