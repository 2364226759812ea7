"""Two real CPU processes (gloo) through accelerate launch and the shipped cpu_multi.yaml; resumes from one process
count to another."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from app.tasks.classification import SequenceClassification
from app.telemetry import tags
from tests import forked, tb
from tests.conftest import (
    ACCELERATE,
    ROOT,
    TRAIN_SCRIPT,
    LineWatch,
    clean_env,
    free_port,
    launch,
    launched_ranks,
    run_app,
    start_ranks,
)
from tests.workers.record_examples import recording_load


@pytest.mark.slow
def test_two_ranks_in_fp16_print_each_evaluation_once_and_log_the_headroom_and_tokens_per_device(tmp_path, quick_args):
    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    result = launch(tmp_path, flags, [*quick_args, "--amp", "--max_steps", "4", "--eval_steps", "2"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: DDP, 2 processes" in result.stdout, result.stdout[-3000:]
    # step 2: a mid-run evaluation; step 4: the final one.
    assert [result.stdout.count(f"step {step}: eval/loss ") for step in (2, 4)] == [1, 1], result.stdout[-3000:]
    # Every rank measures its own micro-batch and the maxima are reduced over ranks: both must arm at the same steps.
    logged = tb.scalars(tmp_path / "runs" / "test")
    assert sorted(logged[tags.AMP_HEADROOM_BITS]) == [1, 2, 3, 4]
    assert all(math.isfinite(bits) and bits > 0 for bits in logged[tags.AMP_HEADROOM_BITS].values())
    for step, total in logged[tags.PERF_TOKENS_PER_SEC].items():
        assert logged[tags.PERF_TOKENS_PER_SEC_PER_DEVICE][step] == pytest.approx(total / 2), step
    # The command alone, copied from the model card, trained one process: half the examples per step.
    card = (tmp_path / "out" / "README.md").read_text()
    assert (
        "The last command ran in each of 2 processes, started by `accelerate launch` or `torchrun` (16 examples per "
        "optimizer step)."
    ) in card, card


@pytest.mark.slow
def test_the_note_on_an_uneven_epoch_s_repeats_comes_with_a_run_that_reaches_an_epoch_s_end(tmp_path, quick_args):
    # 90 examples on 2 processes x 8: 6 optimizer steps an epoch, the last micro-step 6 short. The note came with
    # --max_steps 2 too, which trains none of the repeats.
    args = [*quick_args, "--max_train_samples", "90", "--eval_steps", "0", "--max_eval_samples", "8"]
    args += ["--mixed_precision", "no", "--skip_amp_preflight", "--save_steps", "2"]
    note = "note: with 90 training examples, each epoch's last micro-step is 6 short on 2 processes x 8"
    said = []
    for more in (["--max_steps", "2"], ["--max_steps", "7", "--resume_from_checkpoint", "latest"]):
        ranks = start_ranks([*args, *more], tmp_path)
        outputs = [rank.communicate(timeout=300) for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1][-3000:]
        said.append(outputs[0][0])
    assert note not in said[0], said[0][-3000:]
    assert said[1].count(note) == 1, said[1][-3000:]  # the resume trains steps 3 to 7: step 6 ends the epoch


RECORDER = ROOT / "tests" / "workers" / "record_examples.py"
PROCESSES = {1: "1 process", 2: "2 processes"}  # as the notes count them
EXAMPLES, BATCH = 88, 8  # 88 = 11 batches of 8: 6 steps of 2 x 8 (the last one padded out), or 11 of 1 x 8
WARMUP_RATIO, LEARNING_RATE = 0.1, 5e-5  # the defaults


def numbered_reviews(tmp_path, review_files) -> Path:
    """The reviews, each prefixed with its row number, so that its tokens tell which example it is."""
    rows = pd.read_csv(review_files["train"]).head(EXAMPLES)
    rows["text"] = [f"example {i}: {text}" for i, text in enumerate(rows["text"])]
    rows.to_csv(tmp_path / "numbered.csv", index=False)
    return tmp_path / "numbered.csv"


def run_recorded(
    tmp_path, processes: int, record: Path, args: list, monkeypatch, capfd, sigterm_at_forward: int | None = None
) -> str:
    """app/train.py with the recorder: in this process, or in two through accelerate launch and cpu_multi.yaml.
    With `sigterm_at_forward`, rank 0 gets a real SIGTERM during that training forward pass, and the run must stop
    with a checkpoint. Returns what the run printed."""
    record.mkdir()
    if processes == 1:
        with monkeypatch.context() as patch:
            load = recording_load(record, "0", SequenceClassification.load_model, sigterm_at_forward)
            patch.setattr(SequenceClassification, "load_model", load)
            capfd.readouterr()
            code, said = run_app(args), capfd.readouterr()
        assert code == (143 if sigterm_at_forward else 0), said.err[-3000:]
        return said.out
    launcher = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu_multi.yaml")]
    launcher += ["--main_process_port", str(free_port())]
    stop = ["--sigterm_at_forward", str(sigterm_at_forward)] if sigterm_at_forward else []
    cmd = [*launcher, str(RECORDER), str(record), *stop, *map(str, args)]
    result = forked.run(cmd, env=clean_env(tmp_path), timeout=300)
    if sigterm_at_forward:
        assert result.returncode != 0 and "stopped by signal 15 at optimizer step" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def trained_examples(record: Path, index: dict) -> list[int]:
    """Every example the recorded training forward passes saw, over all ranks, once per time it was seen."""
    passes = [json.loads(line) for path in sorted(record.glob("forward-*.jsonl")) for line in path.open()]
    return [index[tuple(row)] for rows in passes for row in rows]


def linear_schedule(step: int, total: int) -> float:
    """The LR after `step` updates of an uninterrupted run of `total` steps: HF's linear warmup, then linear decay."""
    warmup = math.ceil(WARMUP_RATIO * total)
    return LEARNING_RATE * (step / warmup if step < warmup else max(0.0, (total - step) / (total - warmup)))


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
@pytest.mark.parametrize(
    "saved_by, resumed_by, resumed_batch, steps_done, kept_as",
    [
        (2, 1, BATCH, 2, (8, 2)),  # 16 examples per step: 1 process x 8 x 2 accumulated
        (1, 2, BATCH, 3, (4, 1)),  # 8 examples per step: 2 processes x 4
        (1, 1, 3, 3, (2, 4)),  # a smaller --per_device_train_batch_size: 8 examples per step as 2 x 4 accumulated
    ],
)
@pytest.mark.slow
def test_a_resume_with_another_process_count_or_batch_size_trains_the_epoch_as_the_uninterrupted_run(
    tmp_path,
    tiny_model_no_dropout,
    review_files,
    strategy,
    saved_by,
    resumed_by,
    resumed_batch,
    steps_done,
    kept_as,
    monkeypatch,
    capfd,
):
    """A run stopped by SIGTERM and resumed without --max_steps, with another process count or per-device batch:
    every example of the epoch once, the uninterrupted run's number of steps and LR at each of them, and the epoch
    ends at 1.0. The two-process legs are real launches; the one-process legs run in this process."""
    train_csv = numbered_reviews(tmp_path, review_files)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_no_dropout)
    texts = pd.read_csv(train_csv)["text"]
    index = {tuple(tokenizer(text, truncation=True, max_length=32)["input_ids"]): i for i, text in enumerate(texts)}
    assert len(index) == EXAMPLES
    args = [
        *("--model_name_or_path", tiny_model_no_dropout, "--train_file", train_csv),
        *("--validation_file", review_files["validation"], "--max_eval_samples", 8, "--max_length", 32),
        *("--train_sampling_strategy", strategy, "--skip_amp_preflight", "--num_train_epochs", 1),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "r"),
        *("--mixed_precision", "no", "--disable_tqdm", "--logging_steps", 1, "--save_steps", 100),
    ]
    first = [*args, "--per_device_train_batch_size", BATCH]
    run_recorded(tmp_path, saved_by, tmp_path / "before", first, monkeypatch, capfd, sigterm_at_forward=steps_done)
    resumed = [*args, "--per_device_train_batch_size", resumed_batch, "--resume_from_checkpoint", "latest"]
    said = run_recorded(tmp_path, resumed_by, tmp_path / "after", resumed, monkeypatch, capfd)

    before, after = trained_examples(tmp_path / "before", index), trained_examples(tmp_path / "after", index)
    global_batch = saved_by * BATCH
    assert len(before) == steps_done * global_batch
    assert not set(before) & set(after), f"trained twice: {sorted(set(before) & set(after))}"
    assert sorted(before + after) == list(range(EXAMPLES)), "each example of the epoch once, none skipped"
    per_device, accumulated = kept_as
    assert (
        f"note: the checkpoint was saved by {PROCESSES[saved_by]} with {global_batch} examples per optimizer step; "
        f"this run keeps them: {PROCESSES[resumed_by]} x {per_device} per device x {accumulated} accumulated, and "
        f"continues at example {len(before)} of epoch 0, so the steps and their LR are the uninterrupted run's and, "
        "on the same training data, no example is trained twice or skipped"  # the data-count note says when it is not
    ) in said

    if resumed_by == 1:  # resumed once more by the same command: it trains as the resume that saved did
        again = run_recorded(tmp_path, 1, tmp_path / "again", resumed, monkeypatch, capfd)
        # It said that its flags, the run's own, asked for another batch than the first resume's shape trained.
        assert "note: the checkpoint was saved by" not in again, again[-3000:]

    total = math.ceil(EXAMPLES / global_batch)  # the uninterrupted run's steps in one epoch
    logged = tb.scalars(tmp_path / "runs" / "r")
    assert sorted(logged[tags.TRAIN_LR]) == list(range(1, total + 1))
    for step, lr in logged[tags.TRAIN_LR].items():  # the LR step N updated with: after N - 1 updates, as HF logs it
        assert lr == pytest.approx(linear_schedule(step - 1, total), rel=1e-6, abs=1e-12), f"the LR at step {step}"
    assert logged[tags.TRAIN_EPOCH][total] == 1.0
    # The share of the epoch's examples trained on, whatever the process count: counted in each leg's batches, which
    # round the epoch's end differently, the resumed curve was off the uninterrupted run's.
    for step, epoch in logged[tags.TRAIN_EPOCH].items():
        assert epoch == pytest.approx(min(step * global_batch, EXAMPLES) / EXAMPLES, rel=1e-6), f"epoch at {step}"


def save_bert_that_overflows_on(word: str, folder: Path) -> Path:
    """A tiny BERT whose first attention query overflows fp16 for inputs holding `word` alone: the embeddings' first
    dimension is about 0 after LayerNorm for every other token, and the query weighs that dimension 3e5 times."""
    import torch
    from transformers import BertModel

    from tests.conftest import save_tiny_bert

    path = save_tiny_bert(folder, dropout=0.0)
    model, tokenizer = BertModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        embeddings = model.embeddings
        for table in (embeddings.word_embeddings, embeddings.position_embeddings, embeddings.token_type_embeddings):
            table.weight[:, 0] = table.weight[:, 1:].mean(1)
        words = embeddings.word_embeddings.weight
        row = tokenizer.convert_tokens_to_ids(word)
        words[row, 0] = words[row, 1:].mean() + 20 * words[row, 1:].std()
        model.encoder.layer[0].attention.self.query.weight[:, 0] *= 3e5
    model.save_pretrained(path)
    return path


@pytest.mark.slow
def test_the_overflow_report_names_what_overflowed_in_another_process_s_batch(tmp_path):
    # Each rank replays its own batch; only the main process said, from its own: "the replayed batch stays within
    # fp16's range (the overflow came from another batch)" when the overflowing example was on rank 1.
    model = save_bert_that_overflows_on("zebra", tmp_path / "model")
    words = "good bad great awful tasty stale fresh rotten".split()
    texts = [" ".join(words[(i + k) % 8] for k in range(2 + i % 5)) for i in range(24)]
    texts[5] = "bad zebra"  # with --seed 7, in process 1's batch of the first step
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(24)]}).to_csv(tmp_path / "train.csv", index=False)
    pd.DataFrame({"text": words[:4], "label": [0, 1, 0, 1]}).to_csv(tmp_path / "val.csv", index=False)
    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    args = [
        *("--model_name_or_path", model, "--train_file", tmp_path / "train.csv"),
        *("--validation_file", tmp_path / "val.csv", "--max_length", "16", "--per_device_train_batch_size", "3"),
        *("--mixed_precision", "fp16", "--skip_amp_preflight", "--min_loss_scale", "40000", "--seed", "7"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "r", "--disable_tqdm"),
    ]
    result = launch(tmp_path, flags, args, timeout=300)
    assert result.returncode != 0 and "loss-scale alarm at optimizer step 1" in result.stdout, result.stderr[-3000:]
    report = (
        "first overflow: bert.encoder.layer.0.attention.self.query (forward output, max |x| = inf in float16), in the "
        "batch of process 1"
    )
    assert result.stderr.count(report) == 1, result.stderr[-3000:]
    assert tb.texts(tmp_path / "runs" / "r")[tags.AMP_OVERFLOW_REPORT] == report


def test_a_world_size_left_in_the_shell_is_said_before_the_process_waits_for_the_others(tmp_path):
    # RANK, WORLD_SIZE and MASTER_* exported in a shell, then plain python: it waited for a second process, without a
    # word, for torch's 30 minutes, and predict.py heard neither Ctrl-C nor SIGTERM meanwhile.
    leftovers = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, ROOT / "app" / "predict.py", "--model_name_or_path", tmp_path / "model", "Fresh coffee."]
    process = forked.popen(
        list(map(str, cmd)),
        env=clean_env(tmp_path, **leftovers),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    watch = LineWatch(process)
    try:
        watch.wait_for("note: WORLD_SIZE=2 in the environment, and no launcher started this process", timeout=60)
    finally:
        process.kill()
    said = watch.finish(timeout=30)
    assert f"still waiting after 10 s at 127.0.0.1:{leftovers['MASTER_PORT']} for the other 1 process" in said, said
    assert "unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to run alone)\n" in said  # the line whole


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the worker waits for the stop in /proc")
def test_the_count_of_processes_left_answers_when_the_store_s_host_froze(tmp_path):
    # store.add waited without end for a store whose machine hangs (its timeout does not bound it): the process left
    # never said its line. The first process to count itself says it, the next not; a frozen store: each says it.
    result = subprocess.run(
        [sys.executable, ROOT / "tests" / "workers" / "frozen_store.py"],
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "first True second False", result.stdout + result.stderr[-2000:]
    word, answer, seconds = lines[1].split()
    assert (word, answer) == ("frozen", "True") and float(seconds) < 15, lines


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 2])
def test_of_three_processes_one_killed_the_two_left_say_so_in_one_line(tmp_path, quick_args, killed):
    # Each process left said it: two lines (the main process may be the one gone, so it cannot be the one to say it).
    config = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--num_processes", "3"]
    cmd = [ACCELERATE, "launch", *config, "--main_process_port", free_port(), TRAIN_SCRIPT, *quick_args]
    launcher = forked.popen(
        [*map(str, cmd), "--max_steps", "2"], env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    watch = LineWatch(launcher)
    try:
        watch.wait_for("backend: ")  # rank 0 claims the run's folders next, and tells the others: a collective
        launched_ranks(launcher, 3)[killed].kill()
        said = watch.finish(timeout=120)
    finally:
        launcher.kill()
    lost = [line for line in said.splitlines() if line.startswith("stopped: another process of this run ended")]
    assert len(lost) == 1, said[-3000:]
    assert "by peer" not in said, said[-3000:]  # gloo's traceback (torchrun's own follows, of every launch that fails)
