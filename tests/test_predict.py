"""app/predict.py on a model trained here: labels, order (1 and 2 processes), --compare_fp32, and bad input.

The expected probabilities come from a plain transformers forward pass, one text at a time and unpadded, so a batch
put back in the wrong order or a wrong padding mask shows up as a mismatch.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests import forked
from tests.conftest import ACCELERATE, ROOT, LineWatch, clean_env, free_port, launched_ranks, run_app

PREDICT = ROOT / "app" / "predict.py"
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, review_files):
    """A tiny classifier trained for a few steps, saved as app/train.py saves it."""
    tmp = tmp_path_factory.mktemp("trained")
    args = [
        *("--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--output_dir", tmp / "model", "--logdir", tmp / "runs"),
        *("--per_device_train_batch_size", "8", "--max_length", MAX_LENGTH, "--max_steps", "12", "--eval_steps", "0"),
        *("--learning_rate", "3e-3", "--mixed_precision", "no", "--disable_tqdm"),
    ]
    assert run_app(args) == 0
    return tmp / "model"


def reference(model_dir, texts: list[str]) -> torch.Tensor:
    """Class probabilities in fp32, one text at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.stack(
            [
                model(**tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"))
                .logits[0]
                .softmax(-1)
                for text in texts
            ]
        )


def predict(*args) -> int:
    from app.predict import main

    return main([str(a) for a in args])


def assert_predictions_match(output: pd.DataFrame, source: pd.DataFrame, model_dir, order_shows: bool = True) -> None:
    """`order_shows`: the rows are many enough that one out of place changes the probabilities measurably."""
    assert list(output.columns) == [*source.columns, "predicted_label", "probability"]
    assert list(output["text"]) == list(source["text"]), "the rows are not in the input's order"
    expected = reference(model_dir, list(source["text"]))
    id2label = AutoModelForSequenceClassification.from_pretrained(model_dir).config.id2label
    assert list(output["predicted_label"]) == [id2label[i] for i in expected.argmax(-1).tolist()]
    got, want = torch.tensor(output["probability"].values), expected.max(-1).values.double()
    assert (got - want).abs().max() < 1e-6  # fp32, batched and padded vs one by one: measured 6e-8
    if order_shows:  # the tiny model's probabilities differ little from text to text; over many rows enough to show
        assert (got - want.roll(1)).abs().max() > 1e-5, "the probabilities cannot tell a shifted order apart"


def test_predict_a_csv_keeps_its_rows_and_columns_and_names_the_labels(tmp_path, trained, review_files):
    out = tmp_path / "predicted.csv"
    assert (
        predict(
            "--model_name_or_path",
            trained,
            "--input_file",
            review_files["validation"],
            "--output_file",
            out,
            "--per_device_eval_batch_size",
            "8",
            "--mixed_precision",
            "no",
            "--disable_tqdm",
        )
        == 0
    )
    output, source = pd.read_csv(out), pd.read_csv(review_files["validation"])
    assert set(output["predicted_label"]) <= set(pd.read_csv(review_files["train"])["label"]), "labels are names"
    assert_predictions_match(output, source, trained)


def test_the_inputs_own_columns_come_back_as_written(tmp_path, trained, capsys):
    # Read with guessed types, an ID lost its leading zeros, a column with an empty cell became floats (1 -> 1.0),
    # and texts that read as numbers were refused as not strings.
    source = tmp_path / "in.csv"
    source.write_text("text,id,zip,flag\nFresh coffee,1,00123,true\n42,,02134,\nStale tea,3,10001,false\n")
    assert predict("--model_name_or_path", trained, "--input_file", source, "--disable_tqdm") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "text,id,zip,flag,predicted_label,probability"
    assert [line.rsplit(",", 2)[0] for line in lines[1:]] == [
        "Fresh coffee,1,00123,true",
        "42,,02134,",
        "Stale tea,3,10001,false",
    ]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_whole_numbers_of_a_column_with_empty_cells_come_back_whole(tmp_path, trained, kind):
    # An order_id 1001 came back as 1001.0 where another row's was null, from jsonl and parquet alike.
    rows = pd.DataFrame({"text": ["Fresh coffee", "Stale tea"], "order_id": pd.array([1001, None], dtype="Int64")})
    source = tmp_path / f"in.{kind}"
    rows.to_json(source, orient="records", lines=True) if kind == "jsonl" else rows.to_parquet(source)
    for out in (tmp_path / "out.jsonl", tmp_path / "out.csv"):
        assert predict("--model_name_or_path", trained, "--input_file", source, "--output_file", out) == 0
    assert [json.loads(line)["order_id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [1001, None]
    assert [line.split(",")[1] for line in (tmp_path / "out.csv").read_text().splitlines()] == ["order_id", "1001", ""]


def test_a_text_with_a_lone_carriage_return_stays_one_row(tmp_path, trained, capsys):
    # Written unquoted, "awful\rthing" read back as two rows: "awful" without predictions, then "thing" with them.
    source = tmp_path / "in.csv"
    source.write_bytes(b'text,id\n"awful\rthing",1\nFresh coffee,2\n')
    out = tmp_path / "out.csv"
    assert predict("--model_name_or_path", trained, "--input_file", source, "--output_file", out) == 0
    assert predict("--model_name_or_path", trained, "--input_file", source) == 0
    for written in (out.read_bytes().decode(), capsys.readouterr().out):
        table = pd.read_csv(io.StringIO(written), dtype=str, keep_default_na=False)
        assert list(table["text"]) == ["awful\rthing", "Fresh coffee"] and list(table["id"]) == ["1", "2"], written
        assert all(table["predicted_label"] != ""), written
    # In a column's name too: the header was split in two.
    (tmp_path / "named.jsonl").write_text('{"text": "awful", "no\\rte": "a"}\n{"text": "good", "no\\rte": "b"}\n')
    named = tmp_path / "named.csv"
    assert (
        predict("--model_name_or_path", trained, "--input_file", tmp_path / "named.jsonl", "--output_file", named) == 0
    )
    table = pd.read_csv(io.StringIO(named.read_bytes().decode()), dtype=str, keep_default_na=False)
    assert list(table.columns)[:2] == ["text", "no\rte"] and list(table["no\rte"]) == ["a", "b"]


@pytest.mark.slow
def test_two_processes_split_the_input_and_keep_its_order(tmp_path, trained, review_files):
    source = pd.read_csv(review_files["validation"]).head(45)  # odd: the ranks get unequal shares
    source.to_csv(tmp_path / "in.csv", index=False)
    cmd = [
        *(ACCELERATE, "launch", "--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml"),
        *("--main_process_port", free_port(), PREDICT, "--model_name_or_path", trained),
        *("--input_file", tmp_path / "in.csv", "--output_file", tmp_path / "out.jsonl"),
        *("--per_device_eval_batch_size", "4", "--mixed_precision", "no"),
    ]
    result = forked.run(cmd, env=clean_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes" in result.stderr
    # The bar counted the main process's batches twice: 6 of them, the last of 3, so it ended at 46 of 45 (which tqdm
    # writes as "46text", without the total).
    counts = [int(n) for n in re.findall(r"\b(\d+)(?:/45|text) \[", result.stderr)]
    assert max(counts) == 45, result.stderr[-3000:]
    assert_predictions_match(pd.read_json(tmp_path / "out.jsonl", lines=True), source, trained)
    # One text for two processes: the second had none to tokenize, an IndexError.
    source.head(1).to_csv(tmp_path / "one.csv", index=False)
    one = [tmp_path / "one.csv" if part == tmp_path / "in.csv" else part for part in cmd]
    one = [tmp_path / "one.jsonl" if part == tmp_path / "out.jsonl" else part for part in one]
    result = forked.run(one, env=clean_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_predictions_match(pd.read_json(tmp_path / "one.jsonl", lines=True), source.head(1), trained, False)


def test_a_signal_while_a_bug_unwinds_keeps_the_bugs_traceback():
    # torchrun's SIGTERM, once another process ended of the same bug, came while this one unwound its own: "stopped by
    # SIGTERM" took the place of the bug's traceback.
    from app.errors import TrainingHalted
    from app.predict import Terminated, interrupted, non_finite_rows

    try:
        try:
            non_finite_rows([0.5])  # a bug in the app's code: a list where a tensor belongs
        except TypeError:
            raise Terminated from None  # `from None` hides the context from a traceback, not from __context__
    except Terminated as interrupt:
        with pytest.raises(Terminated):
            interrupted(interrupt)
    # An exception that a library handles itself is no bug: a Ctrl-C that landed in pandas' `except KeyError`, as the
    # predictions' column was added, gave a traceback and exit code 1.
    try:
        try:
            pd.DataFrame({"text": ["Fine."]}).columns.get_loc("predicted_label")
        except KeyError:
            raise KeyboardInterrupt from None
    except KeyboardInterrupt as interrupt:
        try:
            halt = interrupted(interrupt)
        except KeyboardInterrupt:  # raised again, as for a bug: caught here, or it would stop pytest
            halt = None
        assert halt is not None and halt.exit_code == 130
    try:
        raise Terminated
    except Terminated as interrupt:
        halt = interrupted(interrupt)
    assert isinstance(halt, TrainingHalted) and halt.exit_code == 143 and str(halt).startswith("stopped by SIGTERM")
    # A process gone is no bug: torchrun's SIGTERM while this one found it gone gave gloo's traceback and no line.
    try:
        try:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        except RuntimeError:
            raise Terminated from None
    except Terminated as interrupt:
        assert interrupted(interrupt).exit_code == 143


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_process_killed_while_predicting_leaves_one_line_and_no_output_file(tmp_path, trained, review_files, killed):
    # The process left printed gloo's traceback, or nothing (torchrun's SIGTERM killed it first); with rank 0 gone,
    # the SIGTERM's line was rank 0's to say, and nobody said it.
    pd.read_csv(review_files["validation"]).head(40).to_csv(tmp_path / "in.csv", index=False)
    cmd = [
        *(ACCELERATE, "launch", "--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml"),
        *("--main_process_port", free_port(), PREDICT, "--model_name_or_path", trained),
        *("--input_file", tmp_path / "in.csv", "--output_file", tmp_path / "out.csv", "--mixed_precision", "no"),
    ]
    launcher = forked.popen(cmd, env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watch = LineWatch(launcher)
    try:
        watch.wait_for("backend: ")  # the model loads next, then each process predicts its share, then they gather
        launched_ranks(launcher, 2)[killed].kill()
        said = watch.finish(timeout=120)
    finally:
        launcher.kill()
    stops = [line for line in said.splitlines() if line.startswith("stopped")]
    # Which comes first: its collective failing, or torchrun's SIGTERM (sent once it has seen the other process end).
    assert stops in (
        [
            "stopped: another process of this run ended (killed or crashed), so this one stops too: nothing was "
            f"written to --output_file {tmp_path / 'out.csv'}; run the same command again"
        ],
        [
            "stopped by SIGTERM (the launcher sends it to every process on a stop, or once one of them has ended); an "
            "--output_file is written whole or not at all"
        ],
    ), said[-3000:]
    assert "by peer" not in said, said[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["in.csv"]


def test_compare_fp32_on_fp32_agrees_fully(trained, review_files, capsys):
    assert (
        predict(
            "--model_name_or_path",
            trained,
            "--input_file",
            review_files["validation"],
            "--compare_fp32",
            "--mixed_precision",
            "no",
            "--disable_tqdm",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "compare_fp32: fp32 vs fp32 on 48 texts: label agreement 1.0 (48/48), max probability difference 0\n" in err


def test_a_count_of_one_takes_the_singular():
    from app.errors import counted

    assert [counted(n, "optimizer step") for n in (0, 1, 2)] == [
        "0 optimizer steps",
        "1 optimizer step",
        "2 optimizer steps",
    ]
    assert [counted(n, "epoch") for n in (1.0, 0.5, 3.0)] == ["1 epoch", "0.5 epochs", "3 epochs"]
    assert [counted(n, "process") for n in (1, 4)] == ["1 process", "4 processes"]


def test_one_text_predicted_is_said_as_one_text(trained, capsys):
    # "predicted 1 texts", "on 1 texts".
    assert predict("Great coffee.", "--model_name_or_path", trained, "--compare_fp32", "--mixed_precision", "no") == 0
    err = capsys.readouterr().err
    assert re.search(r"^predicted 1 text in [0-9.]+ s: [0-9.]+ texts/s ", err, re.MULTILINE), err
    assert "compare_fp32: fp32 vs fp32 on 1 text: label agreement 1.0 (1/1)" in err


def test_texts_from_the_command_line_and_from_stdin(trained, capsys, monkeypatch):
    texts = ["Great coffee, will buy again.", "Stale, bitter and overpriced."]
    assert predict(*texts, "--model_name_or_path", trained, "--mixed_precision", "no", "--disable_tqdm") == 0
    from_args = pd.read_csv(io.StringIO(capsys.readouterr().out))
    # Two texts may come out within 1e-6 of each other: the order is checked on many rows in the CSV tests.
    assert_predictions_match(from_args, pd.DataFrame({"text": texts}), trained, order_shows=False)
    monkeypatch.setattr(sys, "stdin", stdin_of("\n".join(texts).encode() + b"\n"))
    assert predict("--model_name_or_path", trained, "--mixed_precision", "no", "--disable_tqdm") == 0
    assert pd.read_csv(io.StringIO(capsys.readouterr().out)).equals(from_args)


def stdin_of(data: bytes) -> io.TextIOWrapper:
    """What a pipe into the process looks like: text over bytes."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def test_every_stdin_line_gives_one_row_in_order_blank_lines_too(trained, capsys, monkeypatch):
    lines = ["Great coffee.", "", "Stale and bitter.", "   ", "Would buy again."]
    monkeypatch.setattr(sys, "stdin", stdin_of("\r\n".join(lines).encode() + b"\r\n"))  # as a Windows file
    assert predict("--model_name_or_path", trained, "--mixed_precision", "no", "--disable_tqdm") == 0
    rows = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert list(rows["text"]) == lines
    assert_predictions_match(rows, pd.DataFrame({"text": lines}), trained, order_shows=False)


def test_every_line_of_a_csv_gives_one_row_blank_lines_too(trained, tmp_path, capsys):
    # pandas skipped the blank and space-only lines: 4 rows predicted for 6, exit 0, without a word. A text of spaces
    # is how pandas itself writes one, unquoted, in a file of one column.
    texts = ["Fresh coffee.", "", "Stale.", "   ", "Would buy again.", "\t"]
    path = tmp_path / "one_column.csv"
    path.write_text("text\n" + "\n".join(texts) + "\n")
    out = tmp_path / "predicted.csv"
    assert predict("--model_name_or_path", trained, "--input_file", path, "--output_file", out, "--disable_tqdm") == 0
    predicted = pd.read_csv(out, dtype=str, keep_default_na=False, skip_blank_lines=False)
    assert list(predicted["text"]) == texts
    # So in a file of several columns: a row of empty cells, its text an empty one. pandas skipped it, so that the
    # output's rows no longer lined up with the input's lines, where a file of one column kept it.
    path.write_text("text,id\nFresh coffee.,1\n\nStale.,2\n")
    assert (
        predict("--model_name_or_path", trained, "--input_file", path, "--output_file", out, "--overwrite_output_file")
        == 0
    )
    predicted = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert list(predicted["id"]) == ["1", "", "2"] and list(predicted["text"]) == ["Fresh coffee.", "", "Stale."]
    # Blank lines before the header are no rows: pandas read the first as the header, a traceback.
    for header, rows in (("text,id", "Fresh coffee.,1\n\nStale.,2\n"), ("text", "Fresh coffee.\n\nStale.\n")):
        path.write_text(f"\n \n{header}\n{rows}")
        code = predict(
            "--model_name_or_path", trained, "--input_file", path, "--output_file", out, "--overwrite_output_file"
        )
        assert code == 0, capsys.readouterr().err
        predicted = pd.read_csv(out, dtype=str, keep_default_na=False, skip_blank_lines=False)
        assert list(predicted["text"]) == ["Fresh coffee.", "", "Stale."], header


def test_the_output_file_the_input_and_their_traces_refused_in_one_line(trained, tmp_path, capsys, monkeypatch):
    import datasets

    def refused(*args) -> str:
        capsys.readouterr()
        assert predict("--model_name_or_path", trained, *args, "--disable_tqdm") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        return err.removeprefix("error: ").strip()

    # A UTF-8 text under a locale that is not (LC_ALL=C, no UTF-8 mode) arrives as surrogates: it was called not
    # UTF-8, with advice to convert it that would have encoded it twice.
    out = tmp_path / "utf8.csv"
    assert predict("caf\udcc3\udca9", "--model_name_or_path", trained, "--output_file", out, "--disable_tqdm") == 0
    assert pd.read_csv(out)["text"].tolist() == ["café"]
    # Tracebacks: a text the shell passed in Latin-1, an --output_file that is a loop of links.
    assert refused("caf\udce9") == (
        "text 1 on the command line is not UTF-8 (it holds the byte 0xe9); convert it first, e.g. with iconv -f "
        "latin1 -t utf-8"
    )
    (tmp_path / "loop.csv").symlink_to(tmp_path / "loop.csv")
    assert refused("Fine.", "--output_file", tmp_path / "loop.csv") == (
        f"--output_file {tmp_path / 'loop.csv'} is a loop of symbolic links; name another file"
    )
    # "cannot be written", with no reason; a named pipe was "no such file".
    (tmp_path / "folder.csv").mkdir()
    assert refused("Fine.", "--output_file", tmp_path / "folder.csv") == (
        f"--output_file {tmp_path / 'folder.csv'} is a folder; name a file, such as "
        f"{tmp_path / 'folder.csv' / 'predictions.csv'}"
    )
    os.mkfifo(tmp_path / "pipe.csv")
    assert refused("--input_file", tmp_path / "pipe.csv") == f"--input_file {tmp_path / 'pipe.csv'}: not a regular file"
    # The input was copied into datasets' shared cache, that of a refused run too, and never removed.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    (tmp_path / "exists.csv").write_text("kept\n")
    path = tmp_path / "input.csv"
    path.write_text("text\nFresh coffee.\n")
    refused("--input_file", path, "--output_file", tmp_path / "exists.csv")
    assert predict("--model_name_or_path", trained, "--input_file", path, "--disable_tqdm") == 0
    assert not (tmp_path / "datasets_cache").exists() or not any((tmp_path / "datasets_cache").rglob("*.arrow"))


def test_ctrl_c_while_predicting_is_one_line_and_exit_130(trained, capsys, monkeypatch):
    import app.predict

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(app.predict, "predict_and_write", interrupted)
    assert predict("--model_name_or_path", trained, "Fine.") == 130
    assert capsys.readouterr().err == ("stopped by SIGINT (Ctrl-C); an --output_file is written whole or not at all\n")


def test_sigterm_while_predicting_is_one_line_and_exit_143_and_writes_nothing(tmp_path, trained, review_files):
    # It ended at once, silently (the signal's default), leaving a partial --output_file beside the file if it came
    # while writing it.
    cmd = [sys.executable, PREDICT, "--model_name_or_path", trained, "--input_file", review_files["validation"]]
    cmd += ["--output_file", tmp_path / "out.csv", "--mixed_precision", "no"]
    process = forked.popen(cmd, env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watch = LineWatch(process)
    try:
        watch.wait_for("backend: ")
        process.send_signal(signal.SIGTERM)
        said = watch.finish(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, said[-3000:]
    assert said.strip().splitlines()[-1] == "stopped by SIGTERM; an --output_file is written whole or not at all"
    assert [path.name for path in tmp_path.iterdir() if path.is_file()] == []


@pytest.mark.parametrize(
    "phase, signum",
    [
        ("backend: ", signal.SIGINT),  # the model loads, then predicts
        ("predicted ", signal.SIGINT),  # the file is written and renamed into place
        ("predicted ", signal.SIGTERM),
        ("predictions written", signal.SIGINT),  # the run's end, the process's
    ],
)
def test_ctrl_c_pressed_again_and_again_leaves_one_line_and_the_file_whole(
    tmp_path, trained, review_files, phase, signum
):
    # The handler raised on every Ctrl-C, and main gave the handlers back before the process ended: a Ctrl-C more raised
    # in the stop's unwinding (killed by SIGINT, a KeyboardInterrupt traceback, no line), in tqdm's __del__ or atexit
    # ("Exception ignored in ..."), or, for SIGTERM, killed the process (exit -15).
    many = tmp_path / "many.csv"
    pd.concat([pd.read_csv(review_files["validation"])] * 40).to_csv(many, index=False)
    out = tmp_path / "out.csv"
    out.write_text("kept\n")
    cmd = [sys.executable, PREDICT, "--model_name_or_path", trained, "--input_file", many, "--output_file", out]
    cmd += ["--overwrite_output_file", "--mixed_precision", "no", "--disable_tqdm"]
    process = forked.popen(cmd, env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watch = LineWatch(process)
    try:
        watch.wait_for(phase)
        while process.poll() is None:
            process.send_signal(signum)
            time.sleep(0.002)
        said = watch.finish(timeout=120)
    finally:
        process.kill()
    after = said[said.index(phase) :].splitlines()[1:]
    stop = "stopped by SIGINT (Ctrl-C)" if signum == signal.SIGINT else "stopped by SIGTERM"
    stopped = [f"{stop}; an --output_file is written whole or not at all"]
    # A signal once the handlers are let go, as the process ends, is ignored: the predictions are written by then.
    assert (process.returncode, after) in [(128 + signum, stopped), (0, [])], said[-3000:]
    assert out.read_text() == "kept\n" or len(pd.read_csv(out)) == 40 * 48, out.read_text()[-300:]
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["many.csv", "out.csv"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_python_swallowed_still_stops_the_run_and_writes_nothing(
    tmp_path, trained, monkeypatch, capsys, signum
):
    # A signal's raise that lands in a __del__ (regex's, as the model loads) is printed and dropped by Python: the run
    # went on, replaced the --output_file and exited 0. The handler no longer raises there; the next check does.
    import app.predict

    class RaisesInItsDel:
        def __del__(self):
            os.kill(os.getpid(), signum)
            for _ in range(
                1000
            ):  # the handler runs here, inside __del__ (at a loop's turn), as a signal from outside may
                pass

    def describe_backend_after_a_del(accelerator):
        RaisesInItsDel()
        return describe_backend(accelerator)

    describe_backend = app.predict.describe_backend
    monkeypatch.setattr(app.predict, "describe_backend", describe_backend_after_a_del)
    out = tmp_path / "out.csv"
    out.write_text("kept\n")
    code = predict("--model_name_or_path", trained, "Fresh coffee.", "--output_file", out, "--overwrite_output_file")
    assert code == 128 + signum, capsys.readouterr().err
    assert out.read_text() == "kept\n" and [path.name for path in tmp_path.iterdir()] == ["out.csv"]


@pytest.mark.parametrize("name", ["out.csv", "out.jsonl"])
def test_a_table_stopped_before_it_is_renamed_into_place_leaves_the_file_there(tmp_path, name):
    # The last check for a signal that Python swallowed: written whole, not yet renamed over the file.
    from app.storage.predictions import write_table

    def stopped():
        raise KeyboardInterrupt

    out = tmp_path / name
    out.write_text("kept\n")
    with pytest.raises(KeyboardInterrupt):
        write_table(pd.DataFrame({"text": ["a", "b"]}), str(out), before_replacing=stopped)
    assert out.read_text() == "kept\n" and [path.name for path in tmp_path.iterdir()] == [name]
    write_table(pd.DataFrame({"text": ["a", "b"]}), str(out))
    assert out.read_text() != "kept\n"


def test_a_datasets_cache_that_cannot_be_used_is_named_not_the_data_file(
    tmp_path, trained, tiny_model_dir, review_files
):
    # A read-only ~/.cache (or HF_DATASETS_CACHE) was "cannot read train.csv: ...; check the file's format", and a
    # traceback in predict.py. Root writes everywhere: a cache below a file is one no user can use.
    (tmp_path / "a_file").write_text("")
    env = clean_env(tmp_path, HF_DATASETS_CACHE=str(tmp_path / "a_file" / "datasets"))
    train = [ROOT / "app" / "train.py", "--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"]]
    train += ["--output_dir", tmp_path / "out", "--max_steps", "1"]
    predict = [PREDICT, "--model_name_or_path", trained, "--input_file", review_files["validation"]]
    for cmd in (train, predict):
        result = subprocess.run([sys.executable, *map(str, cmd)], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.splitlines()[-1] == (
            f"error: datasets' cache {tmp_path / 'a_file' / 'datasets'} cannot be used (Not a directory: "
            f"{tmp_path / 'a_file' / 'datasets'}); set HF_DATASETS_CACHE, or HF_HOME, to a folder you can write"
        ), result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_stdin_that_is_not_utf8_is_one_line_and_exit_2(trained, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", stdin_of("fine\ncafé au lait\n".encode("latin-1")))
    assert predict("--model_name_or_path", trained, "--disable_tqdm") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().count("\n") == 0, err
    assert err.startswith("error: stdin is not UTF-8 text: line 2 holds the byte 0xe9; convert it first"), err


@pytest.mark.parametrize(
    "case",
    [
        "missing column",
        "semicolons",
        "unreadable file",
        "no classification head",
        "head weights missing",
        "no weight files",
        "another file's weights alone",
        "a shard missing",
        "another model's config",
        "empty file",
        "the model's config file for its folder",
        "empty stdin",
        "output is the input",
        "max_length beyond the model",
        "max_length below the special tokens",
        "max_new_tokens for a classifier",
        "an empty --input_file",
        "unreadable training_args.yaml",
        "no tokenizer files",
        "a run that saved no model yet",
        "a run still training",
        "weights cut short",
        "conversations",
        "numbers as texts",
        "an output file that exists",
        "body weights missing",
        "shards without their index",
        "bin shards without their index",
        "a regression model",
        "a multi-label model",
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(
    tmp_path, trained, tiny_model_dir, review_files, case, capsys, monkeypatch
):
    (tmp_path / "garbage.parquet").write_bytes(b"this is not parquet")
    (tmp_path / "empty.csv").write_text("text,label\n")
    (tmp_path / "semicolons.csv").write_text("text;label\nFresh coffee;1\n")
    monkeypatch.setattr(sys, "stdin", stdin_of(b""))
    model, source = trained, ["--input_file", review_files["validation"]]
    if case == "missing column":
        source += ["--text_column", "review"]
    elif case == "semicolons":
        source = ["--input_file", tmp_path / "semicolons.csv"]
    elif case == "unreadable file":
        source = ["--input_file", tmp_path / "garbage.parquet"]
    elif case == "no classification head":
        model = tiny_model_dir  # a base BertModel, as the training starts from
    elif case == "head weights missing":  # a base's weights copied over: a random head predicted, exit 0
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        shutil.copy(tiny_model_dir / "model.safetensors", model / "model.safetensors")
    elif case == "no weight files":  # a copy cut short: transformers' OSError, a traceback
        model = Path(shutil.copytree(trained, tmp_path / "copied", ignore=shutil.ignore_patterns("*.safetensors")))
    elif case == "another file's weights alone":  # any *.safetensors passed: transformers' OSError
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        (model / "model.safetensors").rename(model / "embeddings_cache.safetensors")
    elif case == "a shard missing":  # transformers' FileNotFoundError
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        weights = load_file(model / "model.safetensors")
        (model / "model.safetensors").unlink()
        names = sorted(weights)
        shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
        save_file(
            {name: weights[name] for name in shards["model-00002-of-00002.safetensors"]},
            model / "model-00002-of-00002.safetensors",
            metadata={"format": "pt"},
        )
        index = {"metadata": {}, "weight_map": {name: shard for shard, held in shards.items() for name in held}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "another model's config":  # 3 labels for a head of 2: transformers' size mismatch, a traceback
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        config = json.loads((model / "config.json").read_text())
        config["id2label"] = {"0": "a", "1": "b", "2": "c"}
        config["label2id"] = {"a": 0, "b": 1, "c": 2}
        (model / "config.json").write_text(json.dumps(config))
    elif case == "empty file":
        source = ["--input_file", tmp_path / "empty.csv"]
    elif case == "the model's config file for its folder":  # "Repo id must be in the form ...", from the tokenizer
        model = trained / "config.json"
    elif case == "output is the input":
        source = ["--input_file", tmp_path / "out" / ".." / "out" / "predicted.csv"]  # the same file, spelt otherwise
    elif case == "max_length beyond the model":
        source += ["--max_length", 129]
    elif case == "an empty --input_file":  # "$UNSET": the texts were read from stdin instead
        source = ["--input_file", ""]
    elif case == "max_new_tokens for a classifier":  # ignored without a word
        source += ["--max_new_tokens", 5]
    elif case == "max_length below the special tokens":  # a long text was not cut: a traceback past 128 positions
        source += ["--max_length", 1]
    elif case == "unreadable training_args.yaml":
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        (model / "training_args.yaml").write_text("max_length: [64\n")  # cut short
    elif case == "a run that saved no model yet":
        model = tmp_path / "unfinished"
        (model / "checkpoints" / "step-2").mkdir(parents=True)
    elif case == "a run still training":  # it was told to resume a run that was still going
        from app.storage.lease import Lease

        model = tmp_path / "training"
        (model / "checkpoints" / "step-2").mkdir(parents=True)
        Lease.take(model)  # held by this process, which is alive: as the training run's
    elif case == "conversations":  # the error spanned two lines, numpy's repr of the list
        turns = [{"role": "user", "content": f"Review {i}: fresh coffee."} for i in range(3)]
        conversations = tmp_path / "conversations.jsonl"
        pd.DataFrame({"text": ["Fine.", turns]}).to_json(conversations, orient="records", lines=True)
        source = ["--input_file", conversations]
    elif case == "an output file that exists":
        pass  # a good input, a good model
    elif case == "body weights missing":  # said, then predicted from a layer made at random, exit 0
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        weights = load_file(model / "model.safetensors")
        del weights["bert.encoder.layer.0.attention.self.query.weight"]
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    elif case in ("shards without their index", "bin shards without their index"):  # `cp *.safetensors`: a traceback
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        weights = load_file(model / "model.safetensors")
        (model / "model.safetensors").unlink()
        names = sorted(weights)
        for number, held in ((1, names[:5]), (2, names[5:])):
            shard = {name: weights[name] for name in held}
            if case.startswith("bin"):
                torch.save(shard, model / f"pytorch_model-0000{number}-of-00002.bin")
            else:
                save_file(shard, model / f"model-0000{number}-of-00002.safetensors", metadata={"format": "pt"})
    elif case in ("a regression model", "a multi-label model"):  # every row LABEL_0 with probability 1.0, exit 0
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        config = json.loads((model / "config.json").read_text())
        kind = "regression" if case == "a regression model" else "multi_label_classification"
        (model / "config.json").write_text(json.dumps(config | {"problem_type": kind}))

    elif case == "numbers as texts":  # numpy's int was called "a list", with the advice on conversations
        numbers = tmp_path / "numbers.jsonl"
        numbers.write_text('{"text": 0}\n{"text": 1}\n')
        source = ["--input_file", numbers]
    elif case == "weights cut short":  # a traceback after the model's line
        model = Path(shutil.copytree(trained, tmp_path / "copied"))
        (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-100])
    elif case == "no tokenizer files":  # copied without them: transformers would build a tokenizer of [UNK]s
        model = Path(shutil.copytree(trained, tmp_path / "copied", ignore=shutil.ignore_patterns("tokenizer*")))
    else:
        source = []
    out = tmp_path / "out" / "predicted.csv"
    out.parent.mkdir()
    out.write_text("earlier results\n")
    # The file may be replaced: each refusal must still leave it as it was.
    overwrite = ["--overwrite_output_file"] if case != "an output file that exists" else []
    code = predict("--model_name_or_path", model, *source, "--output_file", out, *overwrite, "--disable_tqdm")
    err = capsys.readouterr().err
    assert code == 2
    if case == "body weights missing":  # found by the load itself (names as transformers maps them), after these
        assert err.startswith("precision: ") and "\nbackend: " in err, err
        err = err.splitlines(keepends=True)[-1]
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    expected = {
        "missing column": "--text_column 'review' is not in the input; its columns are: text, label",
        "semicolons": "the input has no column 'text', where the texts are looked for by default; its columns are: "
        "text;label; give --text_column with the column of texts, one plain text per row (the header holds "
        "semicolons: a .csv file is read with commas between its columns; save it comma-separated, or as .jsonl)",
        "unreadable file": "cannot read",
        "no classification head": "has no trained classification head (architectures: BertModel)",
        "head weights missing": f"{tmp_path / 'copied'} lacks the weights of its trained head (classifier.weight, "
        "classifier.bias): made at random, they would predict at random; copy the whole output folder again",
        "no weight files": "copied holds a config.json but no weight files (model.safetensors): copy the whole folder",
        "another file's weights alone": "copied holds a config.json but no weight files (model.safetensors)",
        "a shard missing": "copied lacks model-00001-of-00002.safetensors, a weight file that "
        "model.safetensors.index.json names: copy the whole folder",
        "another model's config": "copied: its weight classifier.weight is [2, 32] in the weight files but [3, 32] by "
        "its config.json, which belongs to another model (another label count?)",
        "empty file": f"{tmp_path / 'empty.csv'} has no rows to predict; add examples to it",
        "the model's config file for its folder": f"--model_name_or_path {trained / 'config.json'} is a file of a "
        f"model; give the folder that holds it ({trained})",
        "empty stdin": "the input has no texts to predict",
        "output is the input": "is the --input_file: the predictions would replace the file they are made from",
        "max_length beyond the model": "--max_length 129 is beyond the model's 128 positions; use --max_length 128 or",
        "max_length below the special tokens": "--max_length 1 leaves no room for text: the tokenizer adds 2 special",
        "max_new_tokens for a classifier": "--max_new_tokens is for causal LMs; this model is a sequence classifier",
        "an empty --input_file": "--input_file is empty; give a value, or leave the flag out",
        "unreadable training_args.yaml": "training_args.yaml cannot be read (while parsing a flow sequence); restore "
        "it, or pass --max_length",
        "a run that saved no model yet": "holds no model yet (no config.json), only a run's checkpoints: resume that "
        "run with --resume_from_checkpoint, or give the output folder of a run that has ended",
        "a run still training": f"--model_name_or_path {tmp_path / 'training'} holds no model yet (no config.json): "
        f"its run is still training (process {os.getpid()} on",
        "conversations": "column 'text' holds a list in row 2 of the input ([{'role': 'user', 'content': 'Review 0: "
        "fresh coffee.'}, {'role': 'user', [...]); texts must be strings, one prompt each, not conversations",
        "numbers as texts": "column 'text' holds int in row 1 of the input (0); texts must be strings\n",
        # it was replaced without a word
        "an output file that exists": f"--output_file {out} exists; pass --overwrite_output_file to replace it, or "
        "name another\n",
        "body weights missing": f"{tmp_path / 'copied'} lacks weights that app/train.py saved "
        "(bert.encoder.layer.0.attention.self.query.weight): made at random, they would predict at random; copy the "
        "whole output folder again\n",
        "shards without their index": f"{tmp_path / 'copied'} holds sharded weights (model-00001-of-00002.safetensors, "
        "...) but not their index (model.safetensors.index.json): copy the whole folder\n",
        "bin shards without their index": "holds sharded weights (pytorch_model-00001-of-00002.bin, ...) but not their "
        "index (pytorch_model.bin.index.json): copy the whole folder\n",
        "a regression model": f"--model_name_or_path {tmp_path / 'copied'} is a regression model (one score per "
        "text); predict.py gives a text the one label of a softmax over its classes: read this model's outputs with "
        "transformers (AutoModelForSequenceClassification)\n",
        "a multi-label model": "is a multi-label classifier (a sigmoid per label, any number of labels per text)",
        "weights cut short": "model.safetensors cannot be read (Error while deserializing header: incomplete "
        "metadata, file not fully covered): the file is damaged or cut short; copy or save it again",
        "no tokenizer files": "its tokenizer has 5 tokens for the model's 30522 token embeddings: the tokenizer's "
        "files (tokenizer.json, or vocab.txt, vocab.json, tokenizer.model) are missing",
    }[case]
    assert expected in err
    assert out.read_text() == "earlier results\n" and [p.name for p in out.parent.iterdir()] == ["predicted.csv"]


def test_a_damaged_training_args_yaml_is_not_needed_with_max_length_given(trained, tmp_path, capsys):
    # Its error said "or pass --max_length", and passing it gave the same error.
    model = Path(shutil.copytree(trained, tmp_path / "copied"))
    (model / "training_args.yaml").write_text("max_length: [64\n")
    flags = ("--model_name_or_path", model, "--mixed_precision", "no", "--disable_tqdm", "--max_length", 32)
    assert predict("Great coffee, will buy again.", *flags) == 0
    assert len(pd.read_csv(io.StringIO(capsys.readouterr().out))) == 1


def test_a_misspelt_flag_gets_the_nearest_one_and_a_stray_text_says_where_texts_go(trained, capsys):
    assert predict("--model_name_or_path", trained, "--input_fle", "reviews.csv") == 2
    assert capsys.readouterr().err == "error: unknown flag '--input_fle'; did you mean --input_file?\n"
    assert predict("Fresh coffee.", "--model_name_or_path", trained, "--fp16") == 2  # HF's name for it
    assert capsys.readouterr().err == "error: unknown flag '--fp16'; use --mixed_precision fp16\n"
    assert predict("Fresh coffee.", "--model_name_or_path", trained, "--amp") == 2  # train.py's name for it
    assert capsys.readouterr().err == "error: unknown flag '--amp'; use --mixed_precision fp16\n"
    assert predict("Fresh coffee.", "--model_name_or_path", trained, "--num_processes", "2") == 2
    assert "a flag of accelerate launch: give it before app/predict.py" in capsys.readouterr().err
    assert predict("Fresh coffee.", "--model_name_or_path", trained, "--local-rank=0") == 2  # torch's old launcher
    assert capsys.readouterr().err.startswith("error: unknown flag '--local-rank=0'; drop it: launch with accelerate")
    assert predict("Fresh coffee.", "--model_name_or_path", trained, "Stale tea, sadly.") == 2
    assert capsys.readouterr().err == (
        "error: unexpected argument 'Stale tea, sadly.': give the texts in one run, all before the flags or all after "
        "them, or use --input_file\n"
    )


@pytest.mark.parametrize(
    "flag, advice",
    [
        ("--no_amp", "use --mixed_precision no"),  # train.py's `--amp false`; predict.py has no --amp
        ("--tf32", "drop it: TF32 for fp32 matmuls on a GPU is torch's setting"),
        ("--bf16_full_eval", "drop it: evaluation and app/predict.py run under the autocast of --mixed_precision"),
        ("--half_precision_backend", "drop it: the app drives autocast itself"),
        ("--no_cuda", "use accelerate launch --cpu app/predict.py"),  # train.py's named app/train.py
        ("--debug", "drop it: predict.py refuses predictions from NaN or inf logits"),  # not the launcher's --debug
    ],
)
def test_hf_trainer_flag_names_get_train_py_s_advice_where_it_holds(flag, advice):
    # They got "see python app/predict.py --help", where train.py names what to do; checked before any model loads.
    from app.errors import UsageError
    from app.predict import parse_args

    with pytest.raises(UsageError, match=f"^{re.escape(f'unknown flag {flag!r}; {advice}')}"):
        parse_args(["--model_name_or_path", "model", flag, "Fresh coffee."])


def test_predict_s_advice_names_only_flags_that_predict_or_accelerate_launch_has():
    import dataclasses

    from accelerate.commands.launch import launch_command_parser

    from app.cli import OTHER_NAMES, PREDICT_OTHER_NAMES, SAID_TO_PREDICT_TOO
    from app.predict import PredictConfig

    flags = {field.name for field in dataclasses.fields(PredictConfig)}
    launcher = {option.lstrip("-") for action in launch_command_parser()._actions for option in action.option_strings}
    assert not flags & set(PREDICT_OTHER_NAMES)
    assert all(PREDICT_OTHER_NAMES[name] is OTHER_NAMES[name] for name in SAID_TO_PREDICT_TOO)  # one table, no copy
    for name, advice in PREDICT_OTHER_NAMES.items():
        assert all(flag in flags or flag in launcher for flag in re.findall(r"--(\w+)", advice)), (name, advice)
    # An HF name that train.py has advice for, and accelerate launch a flag of the same name (HF's --debug
    # underflow_overflow is not the launcher's --debug): predict.py needs its own, or calls it the launcher's.
    for name in OTHER_NAMES.keys() & launcher - flags:
        assert name in PREDICT_OTHER_NAMES, name


def test_a_pair_model_predicts_from_both_texts_by_default_and_refuses_half_its_input(
    tmp_path, tiny_model_dir, review_files, trained, capsys
):
    # It predicted from the first text alone, silently, unless --text_pair_column was given again.
    frames = {}
    for split, path in review_files.items():
        frame = pd.read_csv(path)
        frames[split] = pd.DataFrame(
            {"premise": frame["text"], "hypothesis": frame["text"].str[:20], "label": frame["label"]}
        )
        frames[split].to_csv(tmp_path / f"pairs-{split}.csv", index=False)
    args = [
        *("--model_name_or_path", tiny_model_dir, "--train_file", tmp_path / "pairs-train.csv"),
        *("--validation_file", tmp_path / "pairs-validation.csv", "--output_dir", tmp_path / "pairs"),
        *("--logdir", tmp_path / "runs", "--text_column", "premise", "--text_pair_column", "hypothesis"),
        *("--per_device_train_batch_size", "8", "--max_length", MAX_LENGTH, "--max_steps", "4", "--eval_steps", "0"),
        *("--mixed_precision", "no", "--disable_tqdm"),
    ]
    assert run_app(args) == 0
    model_dir, source = tmp_path / "pairs", frames["validation"].head(8)
    source.to_csv(tmp_path / "input.csv", index=False)
    out = tmp_path / "predicted.csv"
    source_flags = ["--input_file", tmp_path / "input.csv", "--output_file", out, "--mixed_precision", "no"]
    assert predict("--model_name_or_path", model_dir, *source_flags) == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        pairs = (list(source["premise"]), list(source["hypothesis"]))
        encoded = tokenizer(*pairs, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        expected = model(**encoded).logits.softmax(-1).max(-1).values.double()
    got = torch.tensor(pd.read_csv(out)["probability"].values)
    assert (got - expected).abs().max() < 1e-6, "not the pair's prediction"
    capsys.readouterr()

    assert predict("a cat sat", "--model_name_or_path", model_dir) == 2
    assert capsys.readouterr().err == (
        f"error: {model_dir} was trained on text pairs (--text_column premise --text_pair_column hypothesis): give an "
        "--input_file with both columns\n"
    )
    assert (
        predict(
            "--model_name_or_path",
            trained,
            "--input_file",
            tmp_path / "input.csv",
            "--text_pair_column",
            "hypothesis",
            "--text_column",
            "premise",
        )
        == 2
    )
    assert capsys.readouterr().err == (
        f"error: {trained} was trained on single texts (its training_args.yaml names no text_pair_column); drop "
        "--text_pair_column\n"
    )
    # The model card's command: a text alone, refused above; a file of pairs, with the columns named.
    card = (model_dir / "README.md").read_text()
    assert "where `pairs.csv` has the columns `premise` and `hypothesis`." in card
    command = next(line.split() for line in card.splitlines() if "app/predict.py" in line)
    assert command[:2] == ["python", "app/predict.py"] and "a text" not in " ".join(command)
    shutil.copy(tmp_path / "input.csv", tmp_path / "pairs.csv")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert predict(*command[2:], "--mixed_precision", "no") == 0
    capsys.readouterr()
    # One column given, the other as trained, and both the same: the model read (hypothesis, hypothesis).
    assert predict("--model_name_or_path", model_dir, *source_flags, "--text_column", "hypothesis") == 2
    assert capsys.readouterr().err == (
        "error: --text_column and --text_pair_column both name the column 'hypothesis' (one of them as "
        "training_args.yaml records it): each role takes its own column; give the other one too\n"
    )


def test_predict_says_how_many_texts_it_cut_to_max_length(trained, review_files, capsys):
    # Training notes what it cuts; predict.py cut long texts without a word.
    texts = list(pd.read_csv(review_files["validation"])["text"])
    tokenizer = AutoTokenizer.from_pretrained(trained)
    longer = sum(len(ids) > MAX_LENGTH for ids in tokenizer(texts)["input_ids"])
    assert 0 < longer < len(texts)
    assert predict("--model_name_or_path", trained, "--input_file", review_files["validation"], "--disable_tqdm") == 0
    note = f"note: {longer} of {len(texts)} texts were cut to --max_length {MAX_LENGTH} tokens"
    assert note in capsys.readouterr().err.splitlines()
    assert predict("Fresh coffee.", "--model_name_or_path", trained) == 0
    assert "were cut" not in capsys.readouterr().err


def test_texts_cut_are_counted_with_a_tokenizer_of_either_backend():
    # A fast tokenizer keeps what truncation cut off; a Python one (ByT5's) does not, and is asked again.
    from transformers import ByT5Tokenizer

    from app.inputs.model import embedded_model_dir
    from app.tasks.classification import LabelPredictor

    texts = [["abc", "abcdefgh", "abcdefghijklmnop", "a b"]]  # ByT5: bytes and EOS, 4, 9, 17, 4; MiniLM: 3, 6, 10, 4
    for tokenizer, expected in ((ByT5Tokenizer(), 2), (AutoTokenizer.from_pretrained(embedded_model_dir()), 1)):
        predictor = LabelPredictor.__new__(LabelPredictor)  # the counting alone: no model to load
        predictor.tokenizer, predictor.max_length = tokenizer, 8
        encoded = tokenizer(*texts, truncation=True, max_length=8)
        assert predictor._cut(encoded, texts) == expected, type(tokenizer).__name__


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory, overflow_model_dir, review_texts) -> dict[str, Path]:
    """A classifier and a causal LM whose activations overflow fp16 on the way to the logits: fine in fp32 and bf16."""
    from transformers import AutoModelForCausalLM

    from tests.lm_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("overflowing")
    AutoModelForSequenceClassification.from_pretrained(overflow_model_dir, num_labels=2).save_pretrained(folder / "cls")
    AutoTokenizer.from_pretrained(overflow_model_dir).save_pretrained(folder / "cls")
    lm = save_tiny_llama(folder / "lm", review_texts)
    model = AutoModelForCausalLM.from_pretrained(lm)
    with torch.no_grad():
        model.get_submodule("model.layers.1.mlp.down_proj").weight.mul_(1e6)
    model.save_pretrained(lm)
    return {"classifier": folder / "cls", "causal LM": lm}


@pytest.mark.parametrize("kind", ["classifier", "causal LM"])
def test_predictions_from_non_finite_logits_are_never_written(tmp_path, overflowing, kind, capsys):
    # fp16 overflow made NaN logits: a causal LM wrote NUL bytes and replacement characters (NaN's argmax is token 0),
    # a classifier NaN probabilities, and predict.py exited 0.
    output = tmp_path / "predicted.csv"
    args = ["Tasty coffee.", "Stale.", "--model_name_or_path", overflowing[kind], "--output_file", output]
    extra = ["--max_new_tokens", 4] if kind == "causal LM" else []
    assert predict(*args, *extra, "--mixed_precision", "fp16", "--disable_tqdm") == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("precision: fp16 autocast on cpu (from --mixed_precision"), "inference scales no loss"
    assert err[-1] == (
        "error: 2 of 2 predictions came from NaN or inf logits in fp16, so none was written: the model's activations "
        "overflow fp16 (as when its training fell back to bf16); pass --mixed_precision bf16 or no"
    )
    assert not output.exists()
    assert predict(*args, *extra, "--mixed_precision", "no", "--disable_tqdm") == 0
    assert len(pd.read_csv(output)) == 2


def test_tokens_a_model_s_generation_settings_ban_are_no_non_finite_logits(tmp_path, review_texts):
    # no_repeat_ngram_size in the model's generation_config.json sets the banned tokens' scores to -inf before the
    # watch for NaN logits saw them: every prediction was refused as "from NaN or inf logits in fp32", exit 3.
    from tests.lm_models import save_tiny_llama

    model = save_tiny_llama(tmp_path / "lm", review_texts)
    settings = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**settings, "no_repeat_ngram_size": 2}))
    output = tmp_path / "predicted.csv"
    args = ["Tasty coffee, great", "Stale tea", "--model_name_or_path", model, "--output_file", output]
    assert predict(*args, "--max_new_tokens", 20, "--mixed_precision", "no", "--disable_tqdm") == 0
    assert len(pd.read_csv(output, keep_default_na=False)) == 2


@pytest.mark.parametrize("model", ["gpt2 without a pad token", "llama whose config names another pad token"])
def test_a_decoder_classifier_pads_with_a_token_its_head_skips(
    tmp_path, tiny_gpt2_dir, tiny_llama_dir, review_files, model, capfd
):
    # GPT-2's tokenizer has no pad token: a batch could not be padded, a traceback after the weights loaded. A config
    # whose pad_token_id is not the tokenizer's: the head read padding as the last token, and a text's probability
    # changed with the batch it was in.
    folder = tmp_path / "base"
    shutil.copytree(tiny_gpt2_dir if model.startswith("gpt2") else tiny_llama_dir, folder)
    if model.startswith("llama"):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 2}))
    out = tmp_path / "out"
    flags = ["--model_name_or_path", folder, "--train_file", review_files["train"], "--validation_file"]
    flags += [review_files["validation"], "--task", "sequence_classification", "--max_steps", 2, "--max_length", 32]
    flags += ["--output_dir", out, "--logdir", tmp_path / "runs", "--mixed_precision", "no", "--disable_tqdm"]
    assert run_app(flags) == 0, capfd.readouterr().err[-2000:]
    said = capfd.readouterr().out
    assert ("note: the tokenizer has no pad token" in said) == model.startswith("gpt2"), said
    assert ("the classifier reads the last token before the tokenizer's padding" in said) == model.startswith("llama")
    found = {}
    for batch in (1, 16):
        output = tmp_path / f"batch-{batch}.csv"
        args = ["--model_name_or_path", out, "--input_file", review_files["validation"], "--output_file", output]
        assert predict(*args, "--per_device_eval_batch_size", batch, "--mixed_precision", "no", "--disable_tqdm") == 0
        found[batch] = pd.read_csv(output)["probability"].to_numpy()
    assert np.allclose(found[1], found[16], atol=1e-6), "a text's probability changed with its batch"


@pytest.mark.parametrize("kind", ["xlm", "gemma3"])
def test_classifiers_whose_configs_lack_a_field_of_their_own_train_and_predict(
    tmp_path, tiny_model_dir, tiny_llama_dir, review_files, kind, capfd
):
    # XLM's config has no is_decoder, Gemma 3's (text and vision) no pad_token_id of its own: a traceback in
    # train.py and predict.py once the pad token was checked for every classifier.
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, XLMConfig, XLMModel

    folder = tmp_path / kind
    torch.manual_seed(0)
    if kind == "xlm":
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        config = XLMConfig(vocab_size=tokenizer.vocab_size, emb_dim=32, n_layers=1, n_heads=2, pad_token_id=0)
        XLMModel(config).save_pretrained(folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
        text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "pad_token_id": 0}
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
        vision |= {"image_size": 28, "patch_size": 14}
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    flags = ["--model_name_or_path", folder, "--train_file", review_files["train"], "--validation_file"]
    flags += [review_files["validation"], "--task", "sequence_classification", "--max_steps", 1, "--max_length", 32]
    flags += ["--output_dir", out, "--logdir", tmp_path / "runs", "--mixed_precision", "no", "--disable_tqdm"]
    assert run_app(flags) == 0, capfd.readouterr().err[-2000:]
    assert predict("great coffee", "--model_name_or_path", out, "--mixed_precision", "no", "--disable_tqdm") == 0


def test_a_model_trained_on_the_embedded_reviews_reads_their_review_column_by_default(tmp_path, trained, capsys):
    # Its training_args.yaml records no text_column (the embedded data's default, review): predict.py read `text`,
    # and a user who exported those reviews was told the column is missing.
    model_dir = tmp_path / "embedded"
    shutil.copytree(trained, model_dir)
    record = (model_dir / "training_args.yaml").read_text()
    record = "\n".join(
        f"{line.split(':')[0]}: null" if line.split(":")[0] in ("train_file", "validation_file") else line
        for line in record.splitlines()
    )
    (model_dir / "training_args.yaml").write_text(record + "\n")
    texts = ["Great coffee, would buy again.", "Stale and bitter."]
    pd.DataFrame({"review": texts, "score": ["great", "other"]}).to_csv(tmp_path / "reviews.csv", index=False)
    out = tmp_path / "predicted.csv"
    flags = ["--input_file", tmp_path / "reviews.csv", "--mixed_precision", "no"]
    assert predict("--model_name_or_path", model_dir, *flags, "--output_file", out) == 0
    got = pd.read_csv(out)
    assert list(got["review"]) == texts
    expected = reference(model_dir, texts).max(-1).values.double()
    assert (torch.tensor(got["probability"].values) - expected).abs().max() < 1e-6
    capsys.readouterr()
    # A file of the user's own, with `text`: told which column the model reads and what the file has.
    pd.DataFrame({"text": texts}).to_csv(tmp_path / "own.csv", index=False)
    assert predict("--model_name_or_path", model_dir, "--input_file", tmp_path / "own.csv") == 2
    assert capsys.readouterr().err == (  # it said "--text_column 'review'", a flag the user did not give
        "error: the input has no column 'review', where the texts are looked for by default; its columns are: text; "
        "give --text_column with the column of texts, one plain text per row\n"
    )


def test_a_full_disk_under_the_output_file_is_one_line_exit_4_and_the_old_file_stays(
    trained, review_files, tmp_path, tiny_disk
):
    # A traceback (exit 1), and the partial temporary file left beside the output.
    (tiny_disk / "old.csv").write_text("keep\n")
    result = forked.run(
        [sys.executable, PREDICT, "--model_name_or_path", trained, "--input_file", review_files["train"]]
        + ["--output_file", tiny_disk / "old.csv", "--overwrite_output_file", "--mixed_precision", "no"],
        env=clean_env(tmp_path),
    )
    assert result.returncode == 4, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    said = f"error: no space left on device for --output_file {tiny_disk / 'old.csv'}: it needs more than the "
    assert last.startswith(said) and " kB written before the disk filled, " in last, last
    assert last.endswith("are free; the file there is as it was"), last
    assert [p.name for p in tiny_disk.iterdir()] == ["old.csv"] and (tiny_disk / "old.csv").read_text() == "keep\n"


def test_an_output_file_name_near_the_limit_is_written(trained, tmp_path, capsys):
    # `.{name}.{pid}.tmp` beside a name of 246 characters was longer than a name may be: a traceback after predicting.
    out = tmp_path / ("p" * 246 + ".csv")
    assert predict("a text", "--model_name_or_path", trained, "--output_file", out, "--mixed_precision", "no") == 0
    assert pd.read_csv(out)["text"].tolist() == ["a text"]
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_error_line_is_said_before_the_process_group_ends(trained, review_files, capsys, monkeypatch):
    # Said after it: under accelerate launch, rank 1 exited first, torchrun stopped rank 0 before its line (2 runs in
    # 10 printed no error, only torchrun's summary naming local_rank 1).
    import app.predict

    said_by_then = []
    monkeypatch.setattr(app.predict, "end_accelerator", lambda _: said_by_then.append(capsys.readouterr().err))
    flags = ["--input_file", review_files["validation"], "--text_column", "nope"]
    assert predict("--model_name_or_path", trained, *flags) == 2
    assert said_by_then[0].startswith("error: --text_column 'nope' is not in the input"), said_by_then


@pytest.mark.parametrize("kind", ["jsonl", "json", "one-line jsonl"])
def test_a_json_inputs_own_values_come_back_as_written(tmp_path, trained, kind):
    # Its time came back as milliseconds since 1970 (read by arrow as a timestamp), 1e-12 as 0.0 (pandas' to_json
    # writes 10 decimals), and the probability cut to 10 decimals as well.
    rows = [
        {"id": 1, "when": "2024-01-02 10:00:00", "x": 1e-12, "tags": ["a", "b"], "text": "Fresh coffee"},
        {"id": 2, "when": "2024-01-03 11:30:00", "x": None, "tags": [], "text": "Stale tea"},
    ]
    if kind == "one-line jsonl":  # read as an object of columns, then by arrow, which made its time a timestamp
        rows = rows[:1]
    source = tmp_path / f"in.{kind.split()[-1]}"
    source.write_text("\n".join(map(json.dumps, rows)) + "\n" if source.suffix == ".jsonl" else json.dumps(rows))
    out = tmp_path / "out.jsonl"
    flags = ["--input_file", source, "--output_file", out, "--mixed_precision", "no"]
    assert predict("--model_name_or_path", trained, *flags) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: row[k] for k in rows[0]} for row in written] == rows
    expected = reference(trained, [row["text"] for row in rows]).max(-1).values.double()
    assert [row["probability"] for row in written] == pytest.approx(expected.tolist(), abs=1e-6)
    assert any(len(repr(row["probability"]).split(".")[1]) > 10 for row in written), "cut to 10 decimals"


def test_a_word_after_a_switch_is_its_value_or_a_text_and_never_both_silently(trained, capsys):
    # "No" after --disable_tqdm was its value (false) and its row was gone; "wonderful" there was "Truthy value
    # expected"; a fix that took every word but true and false for a text turned `--disable_tqdm False` on.
    flags = ["--model_name_or_path", trained, "--mixed_precision", "no"]
    assert predict(*flags, "--disable_tqdm", "wonderful", "No") == 0  # not a yes or a no: a text, the switch on
    assert pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)["text"].tolist() == [
        "wonderful",
        "No",
    ]
    assert predict("Great coffee.", *flags, "--disable_tqdm", "False") == 0  # HF's way: its value
    assert pd.read_csv(io.StringIO(capsys.readouterr().out))["text"].tolist() == ["Great coffee."]
    assert predict(*flags, "--disable_tqdm", "No", "Great coffee.") == 2  # its value, or the first of two texts?
    assert capsys.readouterr().err == (
        "error: 'No' after --disable_tqdm could be its value or a text: write --disable_tqdm=no for its value, or "
        "give the texts before the flags, or after --\n"
    )
    assert predict(*flags, "--disable_tqdm", "--", "No", "-5") == 0  # after --, words alone
    assert pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)["text"].tolist() == ["No", "-5"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_the_predictions_are_as_readable_as_the_umask_allows(trained, tmp_path, umask, mode):
    # Written through a temporary file of mkstemp's, they were 0600: the owner's alone.
    before = os.umask(umask)
    try:
        for name in ("p.csv", "p.jsonl"):
            assert predict("a text", "--model_name_or_path", trained, "--output_file", tmp_path / name) == 0
            assert (tmp_path / name).stat().st_mode & 0o777 == mode, name
        (tmp_path / "p.csv").chmod(0o600)  # the user's own choice, kept by a replacement
        flags = ["--output_file", tmp_path / "p.csv", "--overwrite_output_file"]
        assert predict("a text", "--model_name_or_path", trained, *flags) == 0
        assert (tmp_path / "p.csv").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(before)


def test_a_full_disk_under_datasets_cache_is_said_as_such_not_blamed_on_the_input(
    tmp_path, tiny_disk, trained, monkeypatch, capsys
):
    # predict.py's input read into its own cache on datasets' disk (a 16 KB one here): "cannot read big.csv: [Errno 28]
    # No space left on device; check the file's format", exit 2, blamed the file.
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tiny_disk / "datasets"))
    big = tmp_path / "big.csv"
    big.write_text("text\n" + "".join(f"review {i}: fresh coffee, would buy again\n" for i in range(20000)))
    assert predict("--model_name_or_path", trained, "--input_file", big, "--disable_tqdm") == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"error: no space left on device for datasets' copy of {big} in "), err
    assert err.endswith("free some space, or set HF_DATASETS_CACHE to a folder on a larger disk\n")
    assert not any((tiny_disk / "datasets").iterdir()), "the input's own cache is removed"
