"""Two real CPU processes (gloo) through accelerate launch and the shipped cpu_multi.yaml; resumes from one process
count to another."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from app.tasks.classification import SequenceClassification
from app.telemetry import tags
from tests import tb
from tests.conftest import ACCELERATE, ROOT, clean_env, free_port, launch, run_app
from tests.workers.record_examples import recording_load


@pytest.mark.slow
def test_two_ranks_in_fp16_print_each_evaluation_once_and_log_the_headroom_and_tokens_per_device(tmp_path, quick_args):
    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    result = launch(tmp_path, flags, [*quick_args, "--amp", "--max_steps", "4", "--eval_steps", "2"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: DDP, 2 process(es)" in result.stdout, result.stdout[-3000:]
    # step 2: a mid-run evaluation; step 4: the final one.
    assert [result.stdout.count(f"step {step}: eval/loss ") for step in (2, 4)] == [1, 1], result.stdout[-3000:]
    # Every rank measures its own micro-batch and the maxima are reduced over ranks: both must arm at the same steps.
    logged = tb.scalars(tmp_path / "runs" / "test")
    assert sorted(logged[tags.AMP_HEADROOM_BITS]) == [1, 2, 3, 4]
    assert all(math.isfinite(bits) and bits > 0 for bits in logged[tags.AMP_HEADROOM_BITS].values())
    for step, total in logged[tags.PERF_TOKENS_PER_SEC].items():
        assert logged[tags.PERF_TOKENS_PER_SEC_PER_DEVICE][step] == pytest.approx(total / 2), step


RECORDER = ROOT / "tests" / "workers" / "record_examples.py"
EXAMPLES, BATCH = 88, 8  # 88 = 11 batches: whole steps of 1 x 8 and, from where each resume starts, of 2 x 8


def numbered_reviews(tmp_path, review_files) -> Path:
    """The reviews, each prefixed with its row number, so that its tokens tell which example it is."""
    rows = pd.read_csv(review_files["train"]).head(EXAMPLES)
    rows["text"] = [f"example {i}: {text}" for i, text in enumerate(rows["text"])]
    rows.to_csv(tmp_path / "numbered.csv", index=False)
    return tmp_path / "numbered.csv"


def run_recorded(tmp_path, processes: int, record: Path, args: list, monkeypatch, capfd) -> str:
    """app/train.py with the recorder: in this process, or in two through accelerate launch and cpu_multi.yaml.
    Returns what the run printed."""
    record.mkdir()
    if processes == 1:
        with monkeypatch.context() as patch:
            load = recording_load(record, "0", SequenceClassification.load_model)
            patch.setattr(SequenceClassification, "load_model", load)
            capfd.readouterr()
            code, said = run_app(args), capfd.readouterr()
        assert code == 0, said.err[-3000:]
        return said.out
    launcher = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu_multi.yaml")]
    launcher += ["--main_process_port", str(free_port())]
    cmd = [*launcher, str(RECORDER), str(record), *map(str, args)]
    result = subprocess.run(cmd, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def trained_examples(record: Path, index: dict) -> list[int]:
    """Every example the recorded training forward passes saw, over all ranks, once per time it was seen."""
    passes = [json.loads(line) for path in sorted(record.glob("forward-*.jsonl")) for line in path.open()]
    return [index[tuple(row)] for rows in passes for row in rows]


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
@pytest.mark.parametrize("saved_by, resumed_by, steps_done", [(2, 1, 2), (1, 2, 3)])
@pytest.mark.slow
def test_a_resume_with_another_process_count_trains_each_example_of_the_epoch_once(
    tmp_path, tiny_model_no_dropout, review_files, strategy, saved_by, resumed_by, steps_done, monkeypatch, capfd
):
    """The two-process leg is a real launch; the one-process leg runs in this process."""
    train_csv = numbered_reviews(tmp_path, review_files)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_no_dropout)
    texts = pd.read_csv(train_csv)["text"]
    index = {tuple(tokenizer(text, truncation=True, max_length=32)["input_ids"]): i for i, text in enumerate(texts)}
    assert len(index) == EXAMPLES
    args = [
        *("--model_name_or_path", tiny_model_no_dropout, "--train_file", train_csv),
        *("--validation_file", review_files["validation"], "--max_eval_samples", 8, "--max_length", 32),
        *("--per_device_train_batch_size", BATCH, "--train_sampling_strategy", strategy, "--skip_amp_preflight"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "r"),
        *("--mixed_precision", "no", "--disable_tqdm", "--logging_steps", 1),
    ]
    first = [*args, "--max_steps", steps_done, "--save_steps", steps_done]
    run_recorded(tmp_path, saved_by, tmp_path / "before", first, monkeypatch, capfd)
    rest_steps = (EXAMPLES - steps_done * saved_by * BATCH) // (resumed_by * BATCH)  # to the end of the epoch
    resumed = [*args, "--max_steps", steps_done + rest_steps, "--resume_from_checkpoint", "latest"]
    said = run_recorded(tmp_path, resumed_by, tmp_path / "after", resumed, monkeypatch, capfd)
    before, after = trained_examples(tmp_path / "before", index), trained_examples(tmp_path / "after", index)
    assert len(before) == steps_done * saved_by * BATCH
    assert not set(before) & set(after), f"trained twice: {sorted(set(before) & set(after))}"
    assert sorted(before + after) == list(range(EXAMPLES)), "each example of the epoch once, none skipped"
    assert (
        f"note: the checkpoint was saved by {saved_by} process(es) with {saved_by * BATCH} examples per optimizer "
        f"step; this run has {resumed_by} with {resumed_by * BATCH}: it continues at example {len(before)} of epoch 0"
    ) in said
