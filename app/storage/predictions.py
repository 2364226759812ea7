"""What predict.py writes: its --output_file checked before any weights load, and the predictions written as CSV or
JSON lines, atomically, as readable as the umask allows, and with the input's own values as they were written."""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from app.errors import DiskFull, UsageError, first_line
from app.storage.disk import free_bytes, is_full_disk, replacing, size


def check_output_file(path: str | None, overwrite: bool) -> None:
    """Look, create nothing: the folder of --output_file must exist and be writable, and the file not exist (as
    train.py keeps an output folder) unless --overwrite_output_file."""
    if path is None:
        return
    if Path(path).is_file() and not overwrite:
        raise UsageError(f"--output_file {path} exists; pass --overwrite_output_file to replace it, or name another")
    if Path(path).is_dir():
        raise UsageError(f"--output_file {path} is a folder; name a file, such as {Path(path) / 'predictions.csv'}")
    try:
        folder = Path(path).resolve().parent
    except RuntimeError:  # Python's word for a loop of symbolic links
        raise UsageError(f"--output_file {path} is a loop of symbolic links; name another file") from None
    if not folder.is_dir():
        raise UsageError(f"--output_file {path}: no folder {folder}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output_file {path} cannot be written: its folder {folder} is not writable for this user")


def write_table(table: pd.DataFrame, path: str | None, before_replacing: Callable[[], None] = lambda: None) -> None:
    """CSV or JSON lines by extension, written to a temporary file and renamed: never a half-written file.
    `before_replacing` may raise, once the file is written, to keep the one there."""
    # A lone carriage return in a cell ends a row for every CSV reader, but the csv module quotes only the characters
    # of its line terminator ("\n"): such a table gets every text quoted, so each row reads back as one.
    quoting = csv.QUOTE_NONNUMERIC if _any_cell_holds(table, "\r") else csv.QUOTE_MINIMAL
    if path is None:
        table.to_csv(sys.stdout, index=False, quoting=quoting)
        return
    try:
        with replacing(Path(path)) as tmp:  # through a link, as the check of its folder looked
            try:
                if Path(path).suffix.lower() == ".jsonl":
                    with open(tmp, "w", encoding="utf-8") as file:
                        for row in table.to_dict(orient="records"):
                            record = {str(k): _as_json(v) for k, v in row.items()}
                            file.write(json.dumps(record, ensure_ascii=False) + "\n")
                else:
                    table.to_csv(tmp, index=False, quoting=quoting)
                before_replacing()
            except OSError as error:
                if not is_full_disk(error, tmp.parent, None):
                    raise
                kept = "; the file there is as it was" if Path(path).exists() else ""
                raise DiskFull(
                    f"no space left on device for --output_file {path}: it needs more than the "
                    f"{size(tmp.stat().st_size)} written before the disk filled, {size(free_bytes(tmp.parent))} "
                    f"are free{kept}"
                ) from None
    except OSError as error:  # the file could not be made or renamed there
        folder = Path(path).resolve().parent
        if is_full_disk(error, folder, None):
            raise DiskFull(
                f"no space left on device for --output_file {path}: {size(free_bytes(folder))} are free"
            ) from None
        raise UsageError(f"--output_file {path} cannot be written ({first_line(error)}); name another file") from None


def _as_json(value):
    """A cell as JSON writes it back: Python's floats in full (pandas' to_json rounds to 10 digits, 1e-12 to 0.0),
    times as ISO text (not milliseconds since 1970), a missing cell as null."""
    if isinstance(value, (list, dict)):
        return value
    if value is None or (pd.api.types.is_scalar(value) and pd.isna(value)):  # NaN, None, pandas' NA and NaT
        return None
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value.tolist() if hasattr(value, "tolist") else value  # numpy's scalars and arrays, as Python's


def _any_cell_holds(table: pd.DataFrame, text: str) -> bool:
    holds = lambda cell: isinstance(cell, str) and text in cell  # noqa: E731
    return any(holds(name) or table[name].map(holds).any() for name in table.columns)  # the header's names too
