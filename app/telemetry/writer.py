"""The TensorBoard writer of the main process, and the null writer of the other ranks (a two-method logger plus
text, the custom-scalars layout and hparams), so that no code outside this file asks which rank it runs on; and what
an event file left in a run's folder holds (only a start, or curves)."""

from __future__ import annotations

from pathlib import Path

from app.storage.disk import write_text_atomically


class TensorBoardWriter:
    """Scalars, text and hparams into one event file at `log_dir`; the main process only."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        self.log_dir, self.purge_step = log_dir, purge_step
        self.replaced_line: str | None = None  # a resume from an older checkpoint: where the line it replaces goes
        self._opened = None

    def set_aside_replaced_line(self, name: str) -> None:
        """What the run logged past the checkpoint it resumes from goes to `log_dir/name` (a run of its own in
        TensorBoard, beside the checkpoints set aside under that name), not away."""
        self.replaced_line = name

    @property
    def _writer(self):
        """The event file, opened at the first write, after what the run logged from purge_step on (past the
        checkpoint it resumes from) is taken out of its event files: a resume that fails before it writes anything
        changes nothing."""
        if self._opened is None:
            from torch.utils.tensorboard import SummaryWriter

            if self.purge_step is not None:
                aside = self.log_dir / self.replaced_line if self.replaced_line else None
                purge_events(self.log_dir, self.purge_step, aside)
            # The purge step too, for what no rewrite reached (a damaged file): readers that honour it hide the rest.
            self._opened = SummaryWriter(str(self.log_dir), purge_step=self.purge_step)
        return self._opened

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        self._writer.add_text(tag, markdown, step)

    def layout(self, layout: dict) -> None:
        """The Custom Scalars tab's charts (telemetry/layout.py); written at start, once per run."""
        self._writer.add_custom_scalars(layout)

    def hparams(self, hparams: dict, metric_tags: list[str]) -> None:
        """The HPARAMS tab's row for this run; its metric columns read the scalars already logged under these tags."""
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # SummaryWriter.add_hparams would open a second event file in a sub-run; write into this run's file instead.
        for summary in hparams_summaries(hparams, {tag: 0.0 for tag in metric_tags}):
            self._writer.file_writer.add_summary(summary)

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()


class NullWriter:
    """The writer of the other ranks: accepts everything, writes nothing."""

    def set_aside_replaced_line(self, name: str) -> None: ...

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def text(self, tag: str, markdown: str, step: int = 0) -> None: ...

    def layout(self, layout: dict) -> None: ...

    def hparams(self, hparams: dict, metric_tags: list[str]) -> None: ...

    def close(self) -> None: ...


def open_writer(log_dir: Path, main_process: bool, purge_step: int | None = None) -> TensorBoardWriter | NullWriter:
    """The main process writes to `log_dir`; the others get a NullWriter."""
    return TensorBoardWriter(log_dir, purge_step) if main_process else NullWriter()


def purge_events(log_dir: Path, step: int, aside: Path | None = None) -> None:
    """Take every event at `step` or later out of the event files in `log_dir`, into a file of the same name in
    `aside` when given. SummaryWriter's purge step alone hides them from tensorboard's EventAccumulator, but
    TensorBoard 2.21's server ignores it and showed a killed run's points past its checkpoint beside the resumed
    run's, at the same steps. Each file is rewritten whole and renamed over the old one; a file that cannot be read
    to its end (a damaged one) is left as it is."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        if not path.is_file():
            continue
        try:
            records = list(RawEventFileLoader(str(path)).Load())
            steps = [Event.FromString(record).step for record in records]
        except Exception:  # whatever a damaged file makes the reader raise
            continue
        later = [record for record, at in zip(records, steps) if at >= step]
        if not later:
            continue
        if aside is not None:  # with the file's first event, its version: how readers know its format
            aside.mkdir(parents=True, exist_ok=True)
            write_text_atomically(aside / path.name, _framed(records[:1] + later))
        write_text_atomically(path, _framed([record for record, at in zip(records, steps) if at < step]))


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
