"""Runs under a locale that is not UTF-8: LC_ALL=C with Python's UTF-8 mode off (PYTHONUTF8=0), as in some cron jobs,
containers and CI images. There Python's default encoding is ASCII, and every text file read or written without an
encoding, and stdout, failed on a "très": train.py once the model was trained (its card), predict.py once every
prediction was made (its CSV on stdout).

    python -m pytest -q tests/test_locale.py
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys

import pandas as pd

from tests.conftest import ROOT, TRAIN_SCRIPT, clean_env

ASCII_LOCALE = {"LC_ALL": "C", "PYTHONUTF8": "0"}


def text_file_calls_without_an_encoding(source: str) -> list[int]:
    """The lines of `source` that read or write text in the locale's encoding: open() and Path.open() in text mode,
    read_text() and write_text(), none given an encoding (os.open is a file descriptor, no text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or any(keyword.arg == "encoding" for keyword in node.keywords):
            continue
        func = node.func
        is_method = isinstance(func, ast.Attribute)
        name = func.attr if is_method else getattr(func, "id", None)
        if name == "open" and not (is_method and isinstance(func.value, ast.Name) and func.value.id == "os"):
            position = 0 if is_method else 1  # Path.open(mode), open(file, mode)
            given = node.args[position] if len(node.args) > position else None
            mode = next((keyword.value for keyword in node.keywords if keyword.arg == "mode"), given)
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                found.append(node.lineno)
        elif name in ("read_text", "write_text"):
            found.append(node.lineno)
    return sorted(found)


def test_the_check_finds_each_text_file_opened_without_an_encoding():
    source = (
        "open('a')\nopen('a', 'rb')\nopen('a', encoding='utf-8')\nPath('a').read_text()\nos.open('a', 0)\n"
        "Path('a').open('w')\nPath('a').write_text('x', encoding='utf-8')\nPath('a').open(mode='rb')\n"
        "Path('a').write_text('x')\n"
    )
    assert text_file_calls_without_an_encoding(source) == [1, 4, 6, 9]


def test_the_app_and_its_scripts_name_the_encoding_of_every_text_file():
    calls = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("app", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in text_file_calls_without_an_encoding(path.read_text(encoding="utf-8"))
    ]
    assert calls == [], "give these encoding='utf-8': " + ", ".join(calls)


def test_a_run_and_its_predictions_under_an_ascii_locale_keep_their_utf8(tmp_path, tiny_model_no_dropout):
    env = clean_env(tmp_path, **ASCII_LOCALE)
    probe = [sys.executable, "-c", "import locale, sys; print(locale.getpreferredencoding(), sys.stdout.encoding)"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.split() == ["ANSI_X3.4-1968", "ascii"]
    rows = [f"great coffee {i},très bon" if i % 2 else f"stale tea {i},mauvais" for i in range(24)]
    (tmp_path / "train.csv").write_text("text,étiquette\n" + "\n".join(rows) + "\n", encoding="utf-8")
    (tmp_path / "run.yaml").write_text("# the YAML is UTF-8 too: thé\nrun_name: tea\n", encoding="utf-8")
    args = [
        *("--model_name_or_path", tiny_model_no_dropout, "--train_file", tmp_path / "train.csv"),
        *("--output_dir", tmp_path / "model", "--logdir", tmp_path / "runs", "--config", tmp_path / "run.yaml"),
        *("--label_column", "étiquette"),  # a column named on the command line: Python holds its bytes as surrogates
        *("--max_steps", 2, "--eval_steps", 0, "--max_length", 16, "--mixed_precision", "no", "--disable_tqdm"),
    ]
    trained = subprocess.run([sys.executable, TRAIN_SCRIPT, *map(str, args)], env=env, capture_output=True)
    assert trained.returncode == 0, trained.stderr.decode("utf-8", "replace")[-2000:]
    card = (tmp_path / "model" / "README.md").read_text(encoding="utf-8")
    assert "| labels | mauvais, très bon |" in card and "--label_column 'étiquette'" in card
    assert (tmp_path / "runs" / "tea").is_dir()

    predict = [ROOT / "app" / "predict.py", "café crème", "--model_name_or_path", tmp_path / "model"]
    predicted = subprocess.run([sys.executable, *map(str, predict), "--disable_tqdm"], env=env, capture_output=True)
    assert predicted.returncode == 0, predicted.stderr.decode("utf-8", "replace")[-2000:]
    table = pd.read_csv(io.StringIO(predicted.stdout.decode("utf-8")))
    assert table["text"].tolist() == ["café crème"]
    assert table["predicted_label"].isin(["mauvais", "très bon"]).all()


def test_a_path_this_locale_cannot_name_is_one_line_before_any_work(tmp_path, tiny_model_no_dropout):
    # TensorBoard's writer gave a traceback at its first write (the bytes Python holds for "é" there are no UTF-8).
    args = ["--model_name_or_path", tiny_model_no_dropout, "--output_dir", tmp_path / "model", "--logdir", "runsé"]
    env = clean_env(tmp_path, **ASCII_LOCALE)
    done = subprocess.run([sys.executable, TRAIN_SCRIPT, *map(str, args)], env=env, capture_output=True, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode("utf-8") == (
        "error: --logdir 'runsé' is not ASCII, and this locale's file names are (LC_ALL=C without Python's UTF-8 "
        "mode); run with PYTHONUTF8=1 or LC_ALL=C.UTF-8, or give an ASCII name\n"
    )
    assert not (tmp_path / "model").exists() and [path.name for path in tmp_path.iterdir()] in ([], ["hf_home"])
    # An ASCII link to a folder that is not: recorded as it resolves, the bytes of "é" made a training_args.yaml that
    # no later run could read back.
    (tmp_path / "données").mkdir()
    (tmp_path / "données" / "train.csv").write_text("text,label\ngreat,1\nbad,0\n", encoding="utf-8")
    (tmp_path / "data").symlink_to(tmp_path / "données")
    args = ["--train_file", "data/train.csv", "--output_dir", "out"]
    done = subprocess.run([sys.executable, TRAIN_SCRIPT, *args], env=env, capture_output=True, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.decode("utf-8") == (
        f"error: --train_file data/train.csv leads to '{tmp_path / 'données' / 'train.csv'}', which is not ASCII, and "
        "this locale's file names are (LC_ALL=C without Python's UTF-8 mode); run with PYTHONUTF8=1 or "
        "LC_ALL=C.UTF-8, or give a path that resolves to ASCII\n"
    )
    # A working directory that is not ASCII: the run's records name it (its paths absolute), and its card could not
    # be written once the model was trained.
    (tmp_path / "café").mkdir()
    done = subprocess.run([sys.executable, TRAIN_SCRIPT], env=env, capture_output=True, cwd=tmp_path / "café")
    assert done.returncode == 2 and done.stderr.decode("utf-8") == (
        f"error: the working directory '{tmp_path / 'café'}' is not ASCII, and this locale's file names are (LC_ALL=C "
        "without Python's UTF-8 mode); run with PYTHONUTF8=1 or LC_ALL=C.UTF-8, or from ASCII folders\n"
    )
