"""Output folders written by an earlier version of the app (tests/fixtures/old_run, see make_old_run.py there) still
resume and predict: the layout on disk is a promise, whatever moves inside app/."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, run_app

FIXTURES = ROOT / "tests" / "fixtures"
INPUTS = FIXTURES / "old_inputs"
# The fixture was written on another CPU (and maybe another thread count), whose kernels may round differently.
ACROSS_MACHINES = dict(rtol=1e-5, atol=1e-6)


def resume_flags(output_dir, tmp_path, *extra) -> list:
    return [
        *("--model_name_or_path", INPUTS / "base_model", "--train_file", INPUTS / "train.csv"),
        *("--validation_file", INPUTS / "validation.csv", "--output_dir", output_dir, "--logdir", tmp_path / "runs"),
        *("--per_device_train_batch_size", 4, "--max_length", 16, "--save_steps", 2, "--logging_steps", 2),
        *("--mixed_precision", "no", "--disable_tqdm", *extra),
    ]


def test_an_old_checkpoint_resumes_where_the_old_run_went(tmp_path):
    old = tmp_path / "old_run"
    shutil.copytree(FIXTURES / "old_run", old)
    step_2 = old / "checkpoints" / "step-2"
    args = resume_flags(old, tmp_path, "--max_steps", 4, "--resume_from_checkpoint", step_2, "--run_name", "again")
    assert run_app(args) == 0
    resumed, recorded = load_file(old / "model.safetensors"), load_file(FIXTURES / "old_run" / "model.safetensors")
    before = load_file(step_2 / "model.safetensors")
    assert resumed.keys() == recorded.keys()
    for name in recorded:
        assert torch.allclose(resumed[name], recorded[name], **ACROSS_MACHINES), name
    # The tolerance is far below what two steps of training move: a resume that lost its place would show.
    moved = max((recorded[k] - before[f"bert.{k}" if f"bert.{k}" in before else k]).abs().max() for k in recorded)
    assert moved > 20 * ACROSS_MACHINES["atol"]


def test_an_old_run_continues_from_latest_and_its_model_predicts(tmp_path, capsys):
    from app.predict import main as predict

    old = tmp_path / "old_run"
    shutil.copytree(FIXTURES / "old_run", old)
    assert run_app(resume_flags(old, tmp_path, "--max_steps", 6, "--resume_from_checkpoint", "latest")) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (old / "checkpoints" / "step-6").is_dir()
    assert predict(["great coffee, review 7", "--model_name_or_path", str(FIXTURES / "old_run"), "--disable_tqdm"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "text,predicted_label,probability"
    assert rows[1].split(",")[-2] in ("great", "other")
