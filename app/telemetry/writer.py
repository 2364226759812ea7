"""The TensorBoard writer of the main process, and the null writer of the other ranks (a two-method logger plus
text, the custom-scalars layout and hparams), so that no code outside this file asks which rank it runs on; and what
an event file left in a run's folder holds (only a start, or curves)."""

from __future__ import annotations

from pathlib import Path


class TensorBoardWriter:
    """Scalars, text and hparams into one event file at `log_dir`; the main process only."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        self.log_dir, self.purge_step = log_dir, purge_step
        self._opened = None

    @property
    def _writer(self):
        """The event file, opened at the first write. purge_step hides what the run logged after the checkpoint it
        resumes from, from then on: a resume that fails before it writes anything hides nothing."""
        if self._opened is None:
            from torch.utils.tensorboard import SummaryWriter

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

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def text(self, tag: str, markdown: str, step: int = 0) -> None: ...

    def layout(self, layout: dict) -> None: ...

    def hparams(self, hparams: dict, metric_tags: list[str]) -> None: ...

    def close(self) -> None: ...


def open_writer(log_dir: Path, main_process: bool, purge_step: int | None = None) -> TensorBoardWriter | NullWriter:
    """The main process writes to `log_dir`; the others get a NullWriter."""
    return TensorBoardWriter(log_dir, purge_step) if main_process else NullWriter()


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
