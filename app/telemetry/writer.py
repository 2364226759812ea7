"""The TensorBoard writer of the main process, and the null writer of the other ranks (a two-method logger plus
text, the custom-scalars layout and hparams), so that no code outside this file asks which rank it runs on; and what
an event file left in a run's folder holds (only a start, or curves)."""

from __future__ import annotations

import contextlib
import errno
import sys
import threading
from pathlib import Path
from typing import Callable

from app.errors import first_line
from app.storage.disk import is_full_disk, write_atomically


class TensorBoardWriter:
    """Scalars, text and hparams into one event file at `log_dir`; the main process only. A full disk under it ends
    the curves with one warning, not the run: training, its checkpoints and its model may have a disk of their own."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        self.log_dir, self.purge_step = log_dir, purge_step
        self.replaced_line: str | None = None  # a resume from an older checkpoint: where the line it replaces goes
        self._opened = None
        self._purged = False  # what the run logged from purge_step on is out of its event files
        self._full = False  # the disk filled: nothing more is written
        self._last_step: int | None = None  # of the last points written
        self._earlier_files: list[Path] = []  # the event files of the runs before, found as this one opened its own

    def set_aside_replaced_line(self, name: str, parted: int) -> None:
        """What the run logged past step `parted`, where the line it resumes leaves the line it replaces, goes to
        `log_dir/name` (a run of its own in TensorBoard, beside the checkpoints set aside under that name), not
        away: now, before its checkpoints move (done at the first write, a kill before it left the points to the next
        resume, which took them for a killed run's and removed them). A checkpoint set aside earlier is later than
        `parted`: the replaced line's points between the two went into the resumed line's curves."""
        self.replaced_line, self.purge_step = name, parted + 1
        purge_events(self.log_dir, self.purge_step, self._aside())
        self._purged = True

    def replace_evaluation_at(self, step: int) -> None:
        """A resume with nothing left to train evaluates its checkpoint's step again: the killed run's evaluation
        there goes, so that the step keeps one point per eval tag (this run's own file holds none yet)."""
        at = lambda event: event.step == step and _is_evaluation(event)  # noqa: E731
        self._write(lambda _: purge_events(self.log_dir, None, also=at, files=self._earlier_files))

    def _open(self):
        """The event file, opened at the first write, after what the run logged from purge_step on (past the
        checkpoint it resumes from) is taken out of its event files: a resume that fails before it writes anything
        changes nothing."""
        if self._opened is None:
            from torch.utils.tensorboard import SummaryWriter

            if self.purge_step is not None and not self._purged:  # once: a replaced line's went aside already
                purge_events(self.log_dir, self.purge_step)
            self._earlier_files = event_files(self.log_dir)
            _quiet_writer_threads()
            # The purge step too, for what no rewrite reached (a damaged file): readers that honour it hide the rest.
            self._opened = SummaryWriter(str(self.log_dir), purge_step=self.purge_step)
        return self._opened

    def _aside(self) -> Path | None:
        """The replaced line's folder: its checkpoints' name, numbered on where that name is taken (its checkpoints'
        folder deleted, their curves kept), so that two lines never share a TensorBoard run."""
        if not self.replaced_line:
            return None
        aside, attempt = self.log_dir / self.replaced_line, 1
        while aside.exists():
            attempt += 1
            aside = self.log_dir / f"{self.replaced_line}-{attempt}"
        return aside

    def _write(self, write: Callable, closing: bool = False) -> None:
        if self._full:
            return
        try:
            write(self._open())
        except OSError as error:  # raised here, or by the writer's thread and raised again at its next write
            if not is_full_disk(error, self.log_dir, None):
                raise
            self._full = True
            from tqdm import tqdm

            where = f"after step {self._last_step}" if self._last_step is not None else "before the first step"
            tqdm.write(  # on a line of its own, beside the progress bar
                f"warning: the disk under {self.log_dir} is full ({first_line(error)}): TensorBoard's curves end "
                f"{where}{'' if closing else '; training goes on'}",
                file=sys.stderr,
            )
            if self._opened is not None:  # None where the file could not even be opened
                with contextlib.suppress(OSError):  # its thread stops; what it holds cannot be written
                    self._opened.close()

    def log(self, scalars: dict[str, float], step: int) -> None:
        def add(writer) -> None:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, step)

        self._write(add)
        self._last_step = step if not self._full else self._last_step

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        self._write(lambda writer: writer.add_text(tag, markdown, step))

    def layout(self, layout: dict) -> None:
        """The Custom Scalars tab's charts (telemetry/layout.py); written at start, once per run."""
        self._write(lambda writer: writer.add_custom_scalars(layout))

    def hparams(self, hparams: dict, metric_tags: list[str]) -> None:
        """The HPARAMS tab's row for this run; its metric columns read the scalars already logged under these tags."""
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        def add(writer) -> None:
            # A resume's row replaces the one its run wrote before (TensorBoard shows the first a run holds: the
            # precision and process count of the run before a resume in another).
            purge_events(self.log_dir, None, also=_is_hparams, files=self._earlier_files)
            # SummaryWriter.add_hparams would open a second event file in a sub-run; write into this run's file.
            for summary in hparams_summaries(hparams, {tag: 0.0 for tag in metric_tags}):
                writer.file_writer.add_summary(summary)

        self._write(add, closing=True)

    def close(self) -> None:
        if self._opened is not None:
            self._write(lambda writer: writer.close(), closing=True)


class NullWriter:
    """The writer of the other ranks: accepts everything, writes nothing."""

    def set_aside_replaced_line(self, name: str, parted: int) -> None: ...

    def replace_evaluation_at(self, step: int) -> None: ...

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def text(self, tag: str, markdown: str, step: int = 0) -> None: ...

    def layout(self, layout: dict) -> None: ...

    def hparams(self, hparams: dict, metric_tags: list[str]) -> None: ...

    def close(self) -> None: ...


def open_writer(log_dir: Path, main_process: bool, purge_step: int | None = None) -> TensorBoardWriter | NullWriter:
    """The main process writes to `log_dir`; the others get a NullWriter."""
    return TensorBoardWriter(log_dir, purge_step) if main_process else NullWriter()


def _quiet_writer_threads() -> None:
    """The event file's writing thread prints its traceback when a full disk ends it; the writer's next call raises
    the error again, where the app says it in one line. Other errors, and other threads', are printed as before."""
    if getattr(threading.excepthook, "quiets_writer_threads", False):
        return
    printed = threading.excepthook

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    def hook(args) -> None:
        full = getattr(args.exc_value, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        if not (isinstance(args.thread, _AsyncWriterThread) and full):
            printed(args)

    hook.quiets_writer_threads = True
    threading.excepthook = hook


def purge_events(
    log_dir: Path,
    step: int | None,
    aside: Path | None = None,
    also: Callable | None = None,
    files: list[Path] | None = None,
) -> None:
    """Take every event at `step` or later (and those that `also` picks) out of the event files in
    `log_dir` (or `files` of it), into a file of the same name in `aside` when given. SummaryWriter's purge step
    alone hides them from tensorboard's EventAccumulator, but TensorBoard 2.21's server ignores it and showed a killed
    run's points past its checkpoint beside the resumed run's, at the same steps. Each file is rewritten whole and
    renamed over the old one: a tail cut short (a kill mid-write) is left out, as TensorBoard leaves it out; a file
    whose records cannot be read is left as it is."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    for path in event_files(log_dir) if files is None else files:
        if not path.is_file():
            continue
        try:
            records = list(RawEventFileLoader(str(path)).Load())
            events = [Event.FromString(record) for record in records]
        except Exception:  # whatever a damaged file makes the reader raise
            continue
        taken = [(step is not None and event.step >= step) or (also is not None and also(event)) for event in events]
        if not any(taken):
            continue
        if aside is not None:  # with the file's first event, its version: how readers know its format
            aside.mkdir(parents=True, exist_ok=True)
            write_atomically(aside / path.name, _framed(records[:1] + [r for r, out in zip(records, taken) if out]))
        write_atomically(path, _framed([record for record, out in zip(records, taken) if not out]))


def _is_evaluation(event) -> bool:
    values = event.summary.value
    return bool(values) and all(value.tag.startswith("eval/") for value in values)


def _is_hparams(event) -> bool:
    values = event.summary.value
    return bool(values) and all(value.metadata.plugin_data.plugin_name == "hparams" for value in values)


def event_files(log_dir: Path) -> list[Path]:
    """A TensorBoard run's event files, by name."""
    return sorted(log_dir.glob("events.out.tfevents.*"))


def _framed(records: list[bytes]) -> bytes:
    """Records as an event file frames them (TFRecord: length, its CRC, data, its CRC)."""
    import io

    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    for record in records:
        writer.write(record)
    return buffer.getvalue()


def holds_only_a_start(event_file: Path) -> bool:
    """Whether an event file holds nothing past a run's start: its step-0 texts, layout and an evaluation before
    training, but no scalar of a training step (curves start at step 1). A file that cannot be read as events counts
    as more than a start. A tail cut short (a kill mid-write) is left out, as TensorBoard leaves it out."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        events = EventFileLoader(str(event_file)).Load()
        read_any = False
        for event in events:
            read_any = True
            if event.step > 0 and any(_is_scalar(value) for value in event.summary.value):
                return False
    except Exception:  # whatever a damaged file makes the reader raise: not what a start writes
        return False
    return read_any or event_file.stat().st_size == 0


def _is_scalar(value) -> bool:
    return value.metadata.plugin_data.plugin_name == "scalars" or value.WhichOneof("value") == "simple_value"
