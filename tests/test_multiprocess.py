"""Two real CPU processes (gloo) through accelerate launch and the shipped cpu_multi.yaml."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from app.telemetry import tags
from tests import tb
from tests.conftest import ACCELERATE, ROOT, clean_env, free_port, launch


def test_two_ranks_train_on_different_shards_and_end_identical(tmp_path, tiny_model_dir, review_files):
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "cpu_multi.yaml"),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests" / "workers" / "ddp_worker.py"),
        str(tmp_path),
        str(tiny_model_dir),
        str(review_files["train"]),
        str(review_files["validation"]),
    ]
    result = subprocess.run(cmd, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks), "the two processes did not form one job"
    rows0, rows1 = set(ranks[0]["rows"]), set(ranks[1]["rows"])
    assert len(ranks[0]["rows"]) == len(ranks[1]["rows"]) == 4 * 8, "each rank runs 4 steps of 8 examples"
    assert not rows0 & rows1, "the ranks saw the same examples"
    assert ranks[0]["eval"] == ranks[1]["eval"], "evaluation is gathered: every rank gets the same figures"

    params = [torch.load(tmp_path / f"params-{r}.pt") for r in (0, 1)]
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), f"{name} differs between the ranks"


def test_each_evaluation_line_is_printed_once_under_two_ranks(tmp_path, quick_args):
    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    result = launch(tmp_path, flags, [*quick_args, "--max_steps", "4", "--eval_steps", "2"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: DDP, 2 process(es)" in result.stdout, result.stdout[-3000:]
    # step 2: a mid-run evaluation; step 4: the final one.
    assert [result.stdout.count(f"step {step}: eval/loss ") for step in (2, 4)] == [1, 1], result.stdout[-3000:]


def test_two_ranks_in_fp16_log_the_headroom_and_tokens_per_device(tmp_path, quick_args):
    # Every rank measures its own micro-batch and the maxima are reduced over ranks: both must arm at the same steps.
    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    result = launch(tmp_path, flags, [*quick_args, "--amp", "--max_steps", "3", "--eval_steps", "0"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = tb.scalars(tmp_path / "runs" / "test")
    assert sorted(logged[tags.AMP_HEADROOM_BITS]) == [1, 2, 3]
    assert all(math.isfinite(bits) and bits > 0 for bits in logged[tags.AMP_HEADROOM_BITS].values())
    for step, total in logged[tags.PERF_TOKENS_PER_SEC].items():
        assert logged[tags.PERF_TOKENS_PER_SEC_PER_DEVICE][step] == pytest.approx(total / 2), step
