"""The TensorBoard writer of the main process, and the null writer of the other ranks (a two-method logger plus
text, the custom-scalars layout and hparams), so that no code outside this file asks which rank it runs on."""

from __future__ import annotations

from pathlib import Path


class TensorBoardWriter:
    """Scalars, text and hparams into one event file at `log_dir`; the main process only."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides what a killed run logged after the checkpoint it is resumed from.
        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)

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
        self._writer.close()


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
