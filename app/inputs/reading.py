"""Reading what users give (data files, stdin, text and label cells), with errors that say which file and which line
or row.

The readers underneath (pandas, pyarrow, datasets) report a bad line without the file, or a byte position inside a
chunk, or nothing the user can act on. These helpers turn that into one line: the file, the line where it can be
found, what is wrong there. Rows are counted as a user counts them in a file: from 1, after the header.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import BinaryIO

from app.errors import UsageError, first_line


def stdin_lines(stream: BinaryIO) -> list[str]:
    """Every line of stdin, blank ones included, so that output row i answers input line i. UsageError if not UTF-8."""
    data = stream.read()
    try:
        text = data.decode("utf-8-sig")  # -sig: a byte-order mark, as Windows editors write, is not text
    except UnicodeDecodeError as e:
        raise UsageError(
            f"stdin is not UTF-8 text: {_bad_byte(data, e.start)}; convert it first, e.g. with iconv -f latin1 -t utf-8"
        ) from None
    lines = text.split("\n")  # not splitlines(): it also splits on form feeds and Unicode separators inside a line
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no new one
    return [line.removesuffix("\r") for line in lines]


def _bad_byte(data: bytes, offset: int) -> str:
    line = data.count(b"\n", 0, offset) + 1
    return f"line {line} holds the byte 0x{data[offset]:02x}"


def read_error(kind: str, path: str, error: BaseException) -> str:
    """What went wrong reading a data file of `kind` (csv, json, parquet) with datasets.load_dataset, in one line that
    names the file.

    Args:
        error: what the reader raised for it.
    """
    what, fix = _where(path, kind, error)
    return f"cannot read {path}: {what}; {fix}"


def _where(path: str, kind: str, error: BaseException) -> tuple[str, str]:
    """What is wrong in the file, and where, as the reader or a recheck of the file says; and the fix."""
    with open(path, "rb") as file:
        data = file.read()
    if kind in ("csv", "json"):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            return f"it is not UTF-8 text: {_bad_byte(data, e.start)}", "save it as UTF-8"
        header = text.split("\n", 1)[0]
        if kind == "csv" and "," not in header and (name := other_separator(header)):  # texts with commas: no column
            return f"the header holds {name}, not commas ({_most_specific(error).rstrip('.')})", COMMAS_ONLY
        if kind == "json" and not text.lstrip().startswith("["):  # JSON lines: find the line ourselves
            for number, line in enumerate(text.split("\n"), start=1):
                try:
                    if line.strip():
                        # Python's json takes a lone surrogate escape (\ud800), which no UTF-8 text, nor pyarrow, can
                        json.dumps(json.loads(line), ensure_ascii=False).encode("utf-8")
                except json.JSONDecodeError as e:
                    return f"line {number} is not valid JSON ({e.msg} at column {e.colno})", "fix that line"
                except UnicodeEncodeError:
                    return (
                        f"line {number} holds an escaped lone surrogate (such as \\ud800), which is no character",
                        "fix that line",
                    )
    return _most_specific(error).rstrip("."), "check the file's format"


def _most_specific(error: BaseException) -> str:
    """The message in the chain that places the problem (a line or a row), else the innermost one."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    placed = [first_line(e) for e in chain if " line " in str(e) or " row " in str(e)]
    return placed[0] if placed else first_line(chain[-1])


def row_of(raw, split: str, row: int) -> str:
    """Where row `row` (from 1) of a split is, counted as a user counts the rows of its file: from 1, the header left
    out. A split that a held-out validation split or --max_*_samples selected from its file maps to the file's rows;
    a validation split held out from the training data names the training data. A csv file whose blank lines were
    left out names the row's line instead, as an editor numbers it: counted past the blank lines, a row is not there."""
    row = file_row(raw, split, row)
    held_out = split == "validation" and getattr(raw, "held_out", False)
    if line := _line_past_blank_lines(raw, split, row):
        return f"{line}{' (held out for validation)' if held_out else ''}"
    if held_out:
        return f"row {row} of the train data (held out for validation; rows counted from 1, after the header)"
    return f"row {row} of the {split} data (rows counted from 1, after the header)"


def file_row(raw, split: str, row: int) -> int:
    """Row `row` (from 1) of a split as the row of its file (from 1): a held-out split's map (inputs/data.Splits),
    else the same row (--max_*_samples keeps a split's first rows)."""
    rows = getattr(raw, "file_rows", {}).get(split)
    return row if rows is None else rows[row - 1] + 1


def _line_past_blank_lines(raw, split: str, row: int) -> str | None:
    """The line of row `row` (from 1) of a split's csv file ("line N of FILE") where reading it left out a blank line
    before that row; else None."""
    path = getattr(raw, "files", {}).get(split)
    if not path or not path.lower().endswith(".csv") or blank_lines_are_rows(len(raw[split].column_names)):
        return None
    lines, first_blank = _csv_row_lines(path)
    moved = first_blank is not None and row <= len(lines) and lines[row - 1] > first_blank
    return f"line {lines[row - 1]} of {path}" if moved else None


def blank_lines_are_rows(columns: int) -> bool:
    """Whether the blank lines (and lines of spaces alone) of a csv file of `columns` columns are rows. In a file of
    one column each is an empty text, as a blank line of stdin is (an empty document, left out with a note); in a file
    of more columns they are no rows, as pandas reads them (predict.py keeps them: data.read_table)."""
    return columns == 1


def lines_before_header(path: str) -> int:
    """How many blank lines (or lines of spaces alone) come before a csv file's header: no rows, where the blank lines
    after it are (predict.py's table), and pandas would read the first of them as the header."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as file:
        return next((count for count, line in enumerate(file) if line.strip(" \t\r\n")), 0)


def _csv_row_lines(path: str) -> tuple[list[int], int | None]:
    """The line (from 1, the header's counted) that each row of a csv file (from 1, after the header) starts on, as
    pandas reads the file: a blank line, or one of spaces alone, is no row; and the first such line left out after the
    header, or None. Reads the whole file: for an error's line only."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as file:
        text = file.read()
    lines, reader = text.split("\n"), csv.reader(io.StringIO(text))
    starts, start, first_blank = [], 1, None
    for _ in reader:
        if reader.line_num > start or lines[start - 1].strip(" \t\r"):
            starts.append(start)
        elif starts and first_blank is None:  # before the header, a blank line moves no row's number
            first_blank = start
        start = reader.line_num + 1
    return starts[1:], first_blank


COMMAS_ONLY = "a .csv file is read with commas between its columns; save it comma-separated, or as .jsonl"


def other_separator(header: str) -> str | None:
    """The separator a csv header of one column holds in place of commas (a spreadsheet's export in many locales, or
    a .tsv renamed), named; else None."""
    return next(
        (name for sep, name in ((";", "semicolons"), ("\t", "tabs"), ("|", "vertical bars")) if sep in header), None
    )


def header_hint(columns: list[str], option: str = "", wanted: str = "") -> str:
    """For a column that is not there: a hint when the header holds another separator (a .csv file written with
    semicolons, as spreadsheets do in many locales, or tabs), which pandas reads as one column, or when the column is
    there with spaces around its name ("text, label"); else nothing."""
    named = [column for column in columns if not column.startswith("__index_level_")]  # pandas' row labels
    if len(named) == 1 and (name := other_separator(named[0])):
        return f" (the header holds {name}: {COMMAS_ONLY})"
    spaced = next((column for column in columns if wanted and column != wanted and column.strip() == wanted), None)
    if spaced is not None:
        return f" ({spaced!r} has spaces around its name: remove them from the header, or pass {option} {spaced!r})"
    return ""


def check_no_row_labels(columns: list[str], path: str) -> None:
    """A csv file whose rows all have more fields than its header: pandas reads the first fields of each row as its
    label (datasets keeps them as `__index_level_0__`), and the text column holds only the rest of each text. Texts
    with commas but no quotes do that, silently, and so do a comma at the end of every row and another separator. A
    column of that name in the header itself is a column like any other."""
    labels = [name for name in columns if name.startswith("__index_level_")]
    if not labels:
        return
    with open(path, encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file), [])
    if all(name in header for name in labels):
        return
    why = header_hint(columns) or (
        f" ({len(labels)} more), so the first field of each row was cut off as a row label: texts with commas but no "
        "quotes, or a comma at the end of every row, do that; quote the fields that hold commas, as csv writers do, "
        "drop the trailing commas, or save the file as .jsonl"
    )
    raise UsageError(f"cannot read {path}: its rows have more fields than its header{why}")


def check_label_cells(raw, split: str, label_column: str, values: list | None = None) -> None:
    """An empty label cell turns a column of ints into floats with a gap; say where the gap is, not "float 0.0".
    `values`: the column, if already read."""
    for row, value in enumerate(raw[split][label_column] if values is None else values, start=1):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise UsageError(
                f"label column {label_column!r} is empty in {row_of(raw, split, row)}; fill in a label or drop the row"
            )


def check_text_cells(raw, split: str, column: str, may_be_empty: bool = False, blank_is_empty: bool = True) -> None:
    """Every cell of a text column holds a string. An empty cell (None: how an empty CSV field is read), or with
    `blank_is_empty` a string of spaces alone (how JSON writes one), is refused with its row where a text is needed;
    `may_be_empty` lets it through (an empty prompt), as the empty text."""
    path = getattr(raw, "files", {}).get(split)
    mixed = type(raw[split].features.get(column)).__name__ == "Json"  # datasets' type for a JSON column of mixed types
    if mixed and path and not getattr(raw, "held_out", False):  # the file's rows in order, at most cut short
        refuse_decoded_strings(path, column, raw[split][column])
    for row, value in enumerate(raw[split][column], start=1):
        blank = blank_is_empty and isinstance(value, str) and not value.strip()
        if (value is None or blank) and not may_be_empty:
            raise UsageError(f"column {column!r} is empty in {row_of(raw, split, row)}; fill it in or drop the row")
        if value is not None and not isinstance(value, str):
            raise UsageError(
                f"column {column!r} holds {type(value).__name__} {value!r} in {row_of(raw, split, row)}; texts must be "
                "strings"
            )


def json_rows(path: str) -> list[dict] | None:
    """A .json or .jsonl file's records as Python reads them: one object per line of a .jsonl, a .json's list of
    objects, its object of columns (lists of one length) or its one object. None for another layout, which
    datasets' reading gives instead."""
    with open(path, encoding="utf-8-sig") as file:
        text = file.read()
    lines = lambda: [json.loads(line) for line in text.splitlines() if line.strip()]  # noqa: E731
    try:
        if path.lower().endswith(".jsonl"):  # a file of one line is one record, not a .json's object of columns
            rows = lines()
        else:
            try:
                rows = json.loads(text)
            except json.JSONDecodeError:  # JSON lines in a .json file, as datasets reads them too
                rows = lines()
    except json.JSONDecodeError:
        return None
    if isinstance(rows, dict):
        rows = [dict(zip(rows, values)) for values in zip(*rows.values())] if is_columns_object(rows) else [rows]
    return rows if isinstance(rows, list) and all(isinstance(row, dict) for row in rows) else None


def is_columns_object(value) -> bool:
    """Whether a JSON value is an object of columns: lists of one length under each key (a table's layout, not a
    record's)."""
    columns = list(value.values()) if isinstance(value, dict) else []
    return bool(columns) and all(isinstance(c, list) for c in columns) and len({len(c) for c in columns}) == 1


def refuse_decoded_strings(path: str, column: str, read: list) -> None:
    """datasets types a JSON column of mixed types (strings and numbers) as Json and decodes its strings as JSON: the
    text "true" became True, "0042" 42, "null" None, and a check of its cells named such a row for the number that
    was in another. UsageError naming the string it changed and the first value that is not a string, from the file;
    nothing where no string was changed (the checks of the cells name the odd one)."""
    rows = json_rows(path) or []
    written = [record.get(column) for record in rows]
    changed = next(
        (row for row, (w, r) in enumerate(zip(written, read), start=1) if isinstance(w, str) and w != r), None
    )
    if changed is None:
        return
    odd = next(((row, w) for row, w in enumerate(written, start=1) if w is not None and not isinstance(w, str)), None)
    where = f"; {odd[1]!r} in row {odd[0]} is {type(odd[1]).__name__}" if odd else ""
    raise UsageError(
        f"{path}: column {column!r} mixes strings and other values, and datasets reads its strings as JSON (row "
        f"{changed}'s {written[changed - 1]!r} as {read[changed - 1]!r}){where}; write every value of it as a string"
    )
