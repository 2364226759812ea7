"""Causal-LM inputs at their edges, on the tiny decoders: data errors that name the column and the row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import run_app

PROMPTS = ["--prompt_column", "prompt", "--response_column", "response"]


def edited_copy(source: Path, target: Path, **files: dict) -> Path:
    """A copy of a model folder with keys of its JSON files changed: `tokenizer_config={"bos_token": None}` sets
    tokenizer_config.json's bos_token to null."""
    shutil.copytree(source, target)
    for name, changes in files.items():
        path = target / f"{name}.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return target


def write_pairs(folder: Path, kind: str, split: str, prompts: list[str], responses: list[str]) -> Path:
    """Prompt/response pairs as CSV (an empty prompt is an empty cell) or JSON lines (an empty string)."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame({"prompt": prompts, "response": responses})
    path = folder / f"{split}.{kind}"
    if kind == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True)
    return path


def train_args(tmp_path: Path, model_dir: Path, train: Path, validation: Path, *extra) -> list:
    return [
        *("--model_name_or_path", model_dir, "--train_file", train, "--validation_file", validation),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "lm", "--disable_tqdm"),
        *("--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 2, "--max_length", 32),
        *("--max_steps", 1, "--mixed_precision", "no", *PROMPTS, *extra),
    ]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---- data errors name the column, and count rows from 1 ----------------------------------------------------------
@pytest.mark.parametrize(
    "case, expected",
    [
        ("train file without responses", "--response_column 'response' is not in the train data; its columns are: "),
        ("validation file without responses", "--response_column 'response' is not in the validation data; its "),
        (
            "an empty response cell",
            "column 'response' is empty in row 3 of the validation data (rows counted from 1, after the header); "
            "fill it in or drop the row",
        ),
        (
            "a number where a prompt belongs",
            "column 'prompt' holds int 7 in row 2 of the train data (rows counted from 1, after the header); texts "
            "must be strings",
        ),
    ],
)
def test_data_errors_name_the_column_and_the_row_counted_from_1(tmp_path, tiny_gpt2_dir, capsys, case, expected):
    data = tmp_path / "data"
    data.mkdir()
    good = write_pairs(data, "csv", "good", ["Fresh coffee.", "Stale tea.", "Tasty."], ["great", "other", "great"])
    train, validation = good, good
    if case == "train file without responses":
        train = data / "prompts.csv"
        train.write_text("prompt\nFresh coffee.\nStale tea.\n")
    elif case == "validation file without responses":
        validation = data / "prompts.csv"
        validation.write_text("prompt\nFresh coffee.\nStale tea.\n")
    elif case == "an empty response cell":
        validation = data / "gap.csv"
        validation.write_text("prompt,response\nFresh coffee.,great\nStale tea.,other\nTasty.,\n")
    else:
        train = data / "number.jsonl"
        train.write_text('{"prompt": "Fresh coffee.", "response": "great"}\n{"prompt": 7, "response": "other"}\n')
        validation = data / "fine.jsonl"
        validation.write_text('{"prompt": "Tasty.", "response": "great"}\n')
    assert run_app(train_args(tmp_path, tiny_gpt2_dir, train, validation)) == 2
    assert expected in one_error_line(capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
