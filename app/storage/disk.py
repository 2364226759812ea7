"""Files on disk: what the run writes is as readable as the umask allows, free space is looked at before a save, and a
full disk stops every rank together with one line and exit code 4 instead of a library's traceback.

What a full disk raises depends on the writer: OSError(ENOSPC) from Python, a RuntimeError without an errno from
torch.save ("unexpected pos"), an error from safetensors. So a failed write counts as a full disk when the error says
so or when the disk has less room left than the write needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator

from app.errors import DiskFull, TrainingHalted

_FULL = {errno.ENOSPC, errno.EDQUOT}
_MIB = 1 << 20
_OK, _OTHER_FAILURE, _FULL_DISK = 0, 1, 2  # what a rank reports after a write; the worst one wins


def umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            return int(next(line.split()[1] for line in status if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):
        current = os.umask(0o022)
        os.umask(current)
        return current


def share_as_umask_allows(folder: Path) -> None:
    """Give every file under `folder` the mode a plain open() would: safetensors writes 0600 whoever calls it, so on
    a shared filesystem nobody else could read the model."""
    mode = 0o666 & ~umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def write_atomically(path: Path, text: str | bytes) -> None:
    """`path` holds the old text (or bytes) or the new, never part of one (see `replacing`)."""
    with replacing(path) as tmp:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A file to write in place of `path`, renamed over it when the block ends (a rename within one folder is
    atomic), removed if it raises: a failed write (a full disk) leaves no partial file. It lies beside the file a
    link points to, under a short name of its own (a name near 255 bytes could take no suffix) without "tfevents"
    (TensorBoard reads every file whose name holds it, a partial one too), with the mode of the file it replaces,
    else the one a plain open() would give."""
    target = Path(path).resolve()
    handle, name = tempfile.mkstemp(prefix=".partial-", suffix=".tmp", dir=target.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.is_file() else 0o666 & ~umask())  # not mkstemp's 0600
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def free_bytes(path: Path) -> int:
    """Free space for this user on the filesystem that holds `path` (or would hold it, if it does not exist yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"  # "0.0 MB" of a small file said nothing


def short_of_space(folder: Path, needed: int | None, what: str) -> str | None:
    """A warning line when `folder` has less room than `needed` bytes (the size of the last such write), else None."""
    free = free_bytes(folder)
    if needed is None or free >= needed:
        return None
    return f"warning: {size(free)} free in {folder}, and the last {what} took {size(needed)}: this one may not fit"


def is_full_disk(error: BaseException, folder: Path, needed: int | None) -> bool:
    seen = []
    while error is not None and error not in seen:
        if getattr(error, "errno", None) in _FULL or "No space left on device" in str(error):
            return True
        seen.append(error)
        error = error.__cause__ or error.__context__
    return free_bytes(folder) < max(needed or 0, _MIB)  # torch.save's error has no errno: look at the disk


def write_on_every_rank(
    accelerator: Accelerator,
    write: Callable[[], None],
    folder: Path,
    what: str,
    needed: int | None,
    intact: str,
    clean_up: Callable[[], None],
) -> None:
    """Run `write` on every rank, then agree on the outcome (collective), so that no rank waits at a barrier for one
    that failed. On a failure every rank stops, after the main process ran `clean_up`: with DiskFull (exit 4) if the
    disk is full, else with the error itself on the rank that had it.

    Args:
        folder: where the files go (free space is measured there).
        what: what is written, for the message ("checkpoint step-8").
        needed: the bytes it should take (the last one's size), if known.
        intact: what the user still has, for the message ("the previous checkpoint ... is intact").
    """
    failure, outcome = None, _OK
    try:
        write()
    except Exception as e:  # any writer's error; classified below, and re-raised unless it is a full disk
        failure, outcome = e, _FULL_DISK if is_full_disk(e, folder, needed) else _OTHER_FAILURE
    outcome = _worst(accelerator, outcome)
    if outcome == _OK:
        return
    written = folder_bytes(folder) if accelerator.is_main_process else 0
    if accelerator.is_main_process:
        clean_up()
    if outcome == _FULL_DISK:
        need = f"about {size(needed)}" if needed else f"more than the {size(written)} written before the disk filled"
        raise DiskFull(
            f"no space left on device for {what} in {folder}: it needs {need}, {size(free_bytes(folder))} are "
            f"free; {intact}"
        ) from None
    if failure is not None:
        raise failure
    raise TrainingHalted(f"stopped: another process failed to write {what}; its error says why", 1)


def _worst(accelerator: Accelerator, outcome: int) -> int:
    """The worst outcome over the ranks. Collective when there are several processes."""
    if accelerator.num_processes == 1:
        return outcome
    flag = torch.tensor([outcome], device=accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())
