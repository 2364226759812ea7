"""Output folders written by an earlier version of the app (tests/fixtures/old_run, see make_old_run.py there) still
resume and predict: the layout on disk is a promise, whatever moves inside app/."""

from __future__ import annotations

import shutil

import pytest
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


def notes_on_the_examples(capsys) -> list[str]:
    """The notes of a resume that say how its examples or batches differ from the run's."""
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:") and "examples" in line]


def resume_step_2(tmp_path, *flags):
    """A copy of the old run, resumed from its step-2 checkpoint to step 4 with these flags added; its folder."""
    old = tmp_path / "old_run"
    shutil.copytree(FIXTURES / "old_run", old)
    step_2 = old / "checkpoints" / "step-2"
    args = resume_flags(old, tmp_path, "--max_steps", 4, "--resume_from_checkpoint", step_2, "--run_name", "again")
    assert run_app([*args, *flags]) == 0
    return old


# The checkpoints have no batch record: the run's training_args.yaml says 4 per device, 1 accumulated; not the flags.
KEPT = "this run keeps them: 1 process x 4 per device x 1 accumulated, and continues at example 8 of epoch 0"


@pytest.mark.parametrize(
    "flags", [(), ("--per_device_train_batch_size", 8), ("--gradient_accumulation_steps", 2)], ids=str
)
def test_an_old_checkpoint_resumes_where_the_old_run_went(tmp_path, capsys, flags):
    old = resume_step_2(tmp_path, *flags)
    notes = notes_on_the_examples(capsys)
    assert len(notes) == (1 if flags else 0) and all(KEPT in note for note in notes), notes
    step_2 = old / "checkpoints" / "step-2"
    resumed, recorded = load_file(old / "model.safetensors"), load_file(FIXTURES / "old_run" / "model.safetensors")
    before = load_file(step_2 / "model.safetensors")
    assert resumed.keys() == recorded.keys()
    for name in recorded:
        assert torch.allclose(resumed[name], recorded[name], **ACROSS_MACHINES), name
    # The tolerance is far below what two steps of training move: a resume that lost its place would show.
    moved = max((recorded[k] - before[f"bert.{k}" if f"bert.{k}" in before else k]).abs().max() for k in recorded)
    assert moved > 20 * ACROSS_MACHINES["atol"]


def test_an_old_checkpoint_resumed_with_another_strategy_says_its_order_is_not_the_runs(tmp_path, capsys):
    resume_step_2(tmp_path, "--train_sampling_strategy", "random")  # the run's training_args.yaml: group_by_length
    assert notes_on_the_examples(capsys) == [
        "note: --train_sampling_strategy changed since the checkpoint, so the rest of the epoch is not the examples "
        "the run would have seen"
    ]


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
