"""One run per folder: a lease that claims a folder for one run, refreshed while the run lives, taken over once stale.

A lease is a file `.claim-<generation>.json` in the folder, naming its holder (host, process id, start time); the
highest generation holds the folder. Taking a folder is creating the next generation with os.link, which fails if
that file exists: of any number of runs racing for a folder, exactly one creates it, and never a half-written one (the
content is complete before the link); hard links are the classic lock of shared filesystems such as NFS. The winner
then checks that no higher generation appeared meanwhile and removes the older ones.

A lease is stale when its holder is gone: on this machine, when its process no longer runs (a kill -9, a crash); on
another machine, whose processes cannot be seen from here, when it has not been refreshed for STALE_AFTER seconds. A
daemon thread refreshes the leases of a running run every REFRESH_EVERY seconds, whatever the length of a step.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

STALE_AFTER = 180.0  # seconds: a few missed refreshes, so a busy filesystem does not hand a live run's folder away
REFRESH_EVERY = 30.0
_LEASE = re.compile(r"^\.claim-(\d+)\.json$")


def is_lease_file(name: str) -> bool:
    return bool(_LEASE.match(name)) or name.startswith(".claim-new-")


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, and enough to tell from another process whether it is still there."""

    host: str
    machine: str  # boot id and pid namespace: on the same machine, the process id can be checked
    pid: int
    process_start: str  # when the process started, in kernel ticks: a reused process id is another process
    started: str  # when it took the lease, for people
    token: str  # this lease, as opposed to another one of the same process

    @classmethod
    def this_process(cls) -> Holder:
        pid, started = os.getpid(), datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(socket.gethostname(), _machine(), pid, _process_start(pid), started, uuid.uuid4().hex)

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}, started {self.started}"

    def gone(self, refreshed: float) -> str | None:
        """Why this holder no longer holds its lease (refreshed at `refreshed`, a time.time()), or None if it may."""
        if self.machine == _machine():
            now = _process_start(self.pid)
            return "its process is gone" if now == "" or now not in ("?", self.process_start) else None
        silent = time.time() - refreshed
        return f"its lease was not refreshed for {silent / 60:.0f} min" if silent > STALE_AFTER else None


def _machine() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: the host name is the best there is
        return socket.gethostname()


def _process_start(pid: int) -> str:
    """The process's start time in kernel ticks; "" if it does not run; "?" if it runs but /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:  # it runs, as another user
        pass
    return "?"


class Held(Exception):
    """The folder is held by another run, which is still there."""

    def __init__(self, holder: Holder | None):
        super().__init__(str(holder) if holder else "a run whose lease cannot be read")
        self.holder = holder


class Lease:
    """This run's claim on one folder, taken with `Lease.take`."""

    def __init__(self, folder: Path, generation: int, holder: Holder):
        self.folder, self.generation, self.holder = folder, generation, holder
        self.path = folder / f".claim-{generation}.json"

    @classmethod
    def take(cls, folder: Path) -> tuple[Lease, str | None]:
        """Claim an existing folder. Returns the lease and, if a stale one was taken over, a note saying whose.

        Raises:
            Held: another run holds the folder.
        """
        me = Holder.this_process()
        for _ in range(100):  # each round ends when some run created a generation; 100 rounds is many racers
            newest = _generations(folder)[-1:]
            note, generation = None, 1
            if newest:
                generation = newest[0] + 1
                holder, refreshed = _read(folder / f".claim-{newest[0]}.json")
                if refreshed is None:
                    continue  # released or replaced while we looked
                why = holder.gone(refreshed) if holder else _unreadable_gone(refreshed)
                if why is None:
                    raise Held(holder)
                note = f"{holder or 'a run whose lease cannot be read'} held it, but {why}: taking it over"
            if not _create(folder / f".claim-{generation}.json", me):
                continue  # another run created this generation first: look again
            lease = cls(folder, generation, me)
            if _generations(folder)[-1] != generation:  # a newer one appeared meanwhile: it wins
                lease.release()
                continue
            for older in _generations(folder)[:-1]:
                (folder / f".claim-{older}.json").unlink(missing_ok=True)
            return lease, note
        raise Held(None)

    def refresh(self) -> bool:
        """Mark the lease alive. False if it was lost: taken over, or removed, while this run did not refresh it."""
        holder, _ = _read(self.path)
        if holder is None or holder.token != self.holder.token:
            return False
        os.utime(self.path)
        return _generations(self.folder)[-1:] == [self.generation]

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def live_holder(folder: Path) -> Holder | None:
    """The run that holds `folder` now (its newest lease, not gone), or None."""
    try:
        newest = _generations(folder)[-1:]
    except OSError:
        return None
    if not newest:
        return None
    holder, refreshed = _read(folder / f".claim-{newest[0]}.json")
    return holder if holder is not None and refreshed is not None and holder.gone(refreshed) is None else None


def _generations(folder: Path) -> list[int]:
    return sorted(int(m.group(1)) for name in os.listdir(folder) if (m := _LEASE.match(name)))


def _read(path: Path) -> tuple[Holder | None, float | None]:
    """The lease's holder (None if unreadable) and when it was last refreshed (None if the file is gone)."""
    try:
        refreshed = path.stat().st_mtime
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    try:
        return Holder(**json.loads(text)), refreshed
    except (ValueError, TypeError):
        return None, refreshed


def _unreadable_gone(refreshed: float) -> str | None:
    silent = time.time() - refreshed
    return f"its lease cannot be read and was not refreshed for {silent / 60:.0f} min" if silent > STALE_AFTER else None


def _create(path: Path, holder: Holder) -> bool:
    """Create the lease file with its content in one step; False if it exists already."""
    draft = path.with_name(f".claim-new-{holder.token}.json")
    try:
        # A full disk fails here: the empty draft goes too.
        draft.write_text(json.dumps(asdict(holder)), encoding="utf-8")
        os.link(draft, path)  # atomic, and fails if the name exists: the whole race is decided here
        return True
    except FileExistsError:  # NFS may retry a link that worked and then report it as existing: ask the file
        found, _ = _read(path)
        return found is not None and found.token == holder.token
    finally:
        draft.unlink(missing_ok=True)


class Refresher:
    """A daemon thread that keeps this run's leases fresh, and says so once if one was lost."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []  # replaced, never changed in place, by the claims' owner (folders.FolderClaims)
        self._stop = threading.Event()
        self._lost: set[Path] = set()
        self._thread = threading.Thread(target=self._run, name="lease-refresher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(REFRESH_EVERY):
            for lease in self.leases:
                if not lease.refresh() and lease.path not in self._lost:
                    self._lost.add(lease.path)
                    print(
                        f"warning: this run lost its claim on {lease.folder}: another run took it over after this one "
                        f"went more than {STALE_AFTER:.0f} s without refreshing it",
                        file=sys.stderr,
                    )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
