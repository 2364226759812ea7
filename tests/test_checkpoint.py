"""Checkpoints: exact resume after kill -9, atomic writes, preemption, the scaler's state, numeric faults."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from app.host.preemption import ACKNOWLEDGED, ACKNOWLEDGED_WHILE_LOADING
from app.storage.checkpoints import completed_checkpoints, find_checkpoint
from app.telemetry import tags
from tests import forked, tb
from tests.conftest import ROOT, TRAIN_SCRIPT, LineWatch, clean_env, data_flags, run_app, start_ranks

KILLER = ROOT / "tests" / "workers" / "kill_during_checkpoint.py"
TRAINING_STARTED = "training: "  # the line the app prints once its signal handlers are in place


def data_args(tiny_model_dir, review_files) -> list:
    return [
        *data_flags(tiny_model_dir, review_files),
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "64",
        "--disable_tqdm",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--seed",
        "7",
    ]


def kill_run(tmp_path, point: str, nth: int, args: list) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(KILLER), point, str(nth), *map(str, args)]
    return forked.run(cmd, env=clean_env(tmp_path), timeout=240)


@pytest.mark.parametrize(
    "precision, extra",
    [
        (
            "no",
            ["--gradient_accumulation_steps", "2", "--logging_steps", "3", "--max_steps", "10", "--save_steps", "4"],
        ),  # epoch ends at step 6; the checkpoint cuts the logging interval of steps 4 to 6
        (
            "fp16",
            ["--logging_steps", "2", "--max_steps", "16", "--save_steps", "5", "--loss_scale_growth_interval", "3"],
        ),  # epoch ends at step 12; the interval of steps 5 and 6 is cut
    ],
)
@pytest.mark.slow
def test_kill_9_then_resume_is_bitwise(tmp_path, tiny_model_dir, review_files, precision, extra, capfd, one_thread):
    """The killed run is a real process; the uninterrupted run and the resume run in this one (the process boundary
    is the kill's alone), so the resumed weights must match across processes too."""
    common = [*data_args(tiny_model_dir, review_files), "--mixed_precision", precision, "--run_name", "r", *extra]
    here = ["--output_dir", tmp_path / "run", "--logdir", tmp_path / "runs"]
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_run, tmp_path, "published", 1, [*common, *here])
        # Signal handlers can only be installed from the main thread: the in-process run stays on it.
        reference = run_app([*common, "--output_dir", tmp_path / "ref", "--logdir", tmp_path / "ref_runs"])
        killed = killed.result()
    assert reference == 0, capfd.readouterr().err[-2000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "run" / "model.safetensors").exists(), "the killed run must not have finished"
    first = completed_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in first] == [f"step-{extra[-1] if precision == 'no' else 5}"]

    capfd.readouterr()
    resumed = run_app([*common, *here, "--resume_from_checkpoint", "latest"])
    said = capfd.readouterr()
    assert resumed == 0, said.err[-2000:]
    assert f"resumed from {first[0]}" in said.out

    expected, got = load_file(tmp_path / "ref" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs from the uninterrupted run"
    reference_curves, resumed_curves = tb.scalars(tmp_path / "ref_runs" / "r"), tb.scalars(tmp_path / "runs" / "r")
    # train/loss and amp/skip_rate are means over the logging interval: the resume continues the one it cut.
    for tag in (tags.TRAIN_LOSS, tags.AMP_LOSS_SCALE, tags.TRAIN_LR, tags.AMP_SKIPPED_STEPS, tags.AMP_SKIP_RATE):
        assert resumed_curves.get(tag) == reference_curves.get(tag), (
            f"{tag}: the resumed curve departs from the uninterrupted one"
        )
    assert (tags.AMP_LOSS_SCALE in resumed_curves) == (precision == "fp16"), "the scaler's tags in fp16 only"


@pytest.mark.slow
def test_a_kill_while_writing_leaves_nothing_latest_would_pick(tmp_path, tiny_model_dir, review_files, capfd):
    """The killed run is a real process; the resume runs in this one."""
    args = [
        *data_args(tiny_model_dir, review_files),
        "--mixed_precision",
        "no",
        "--max_steps",
        "12",
        "--save_steps",
        "4",
        "--output_dir",
        tmp_path / "out",
        "--logdir",
        tmp_path / "runs",
        "--run_name",
        "w",
    ]
    killed = kill_run(tmp_path, "staged", 2, args)  # dies after writing step 8's state, before publishing it
    assert killed.returncode == -signal.SIGKILL
    root = tmp_path / "out" / "checkpoints"
    assert (root / ".staging-step-8" / "model.safetensors").is_file(), "the kill should land mid-write"
    assert [p.name for p in completed_checkpoints(root)] == ["step-4"]
    assert find_checkpoint("latest", str(tmp_path / "out")) == root / "step-4"

    assert run_app([*args, "--resume_from_checkpoint", "latest"]) == 0, capfd.readouterr().err[-2000:]
    assert not list(root.glob(".staging-*")), "leftover staging folders are removed"
    assert [p.name for p in completed_checkpoints(root)] == ["step-8", "step-12"], "pruned to --save_total_limit 2"


@pytest.mark.slow
def test_sigterm_stops_both_ranks_with_one_checkpoint_and_exit_143(tmp_path, tiny_model_dir, review_files):
    """Two gloo ranks started as srun/torchrun start them; the scheduler sends SIGTERM to both."""
    args = [
        *data_args(tiny_model_dir, review_files),
        "--mixed_precision",
        "no",
        "--max_steps",
        "100000",
        "--save_steps",
        "0",
        "--output_dir",
        tmp_path / "out",
        "--logdir",
        tmp_path / "runs",
    ]
    ranks = start_ranks(args, tmp_path, stderr=subprocess.STDOUT)
    watches = [LineWatch(rank) for rank in ranks]
    try:
        watches[0].wait_for(TRAINING_STARTED, timeout=180)  # printed once every rank's handler is in place
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        outputs = [watch.finish(timeout=120) for watch in watches]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [143, 143], outputs
    saved = completed_checkpoints(tmp_path / "out" / "checkpoints")
    assert len(saved) == 1, saved
    assert {p.name for p in saved[0].glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert f"stopped by signal 15 at optimizer step {saved[0].name.removeprefix('step-')}" in outputs[0]
    # Acknowledged at once, on the main process only, once for the run.
    assert [output.count(f"SIGTERM received: {ACKNOWLEDGED}") for output in outputs] == [1, 0], outputs
    assert "kills this process" not in outputs[0], "no launcher that kills: ranks started as torchrun starts them"


def test_sigint_checkpoints_and_exits_130(tmp_path, quick_args):
    process = forked.popen(
        [
            sys.executable,
            str(TRAIN_SCRIPT),
            *map(str, quick_args),
            "--max_steps",
            "100000",
            "--eval_steps",
            "0",
            "--save_steps",
            "0",
        ],
        env=clean_env(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    watch = LineWatch(process)
    try:
        watch.wait_for(TRAINING_STARTED, timeout=180)
        process.send_signal(signal.SIGINT)
        output = watch.finish(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, output[-2000:]
    assert len(completed_checkpoints(tmp_path / "out" / "checkpoints")) == 1
    assert output.count(f"SIGINT received: {ACKNOWLEDGED}\n") == 1, output[-2000:]  # plain python: no launcher
    assert len(tb.hparams_rows(tmp_path / "runs" / "test")) == 1, "a stopped run has its HPARAMS row too"


def test_scaler_state_survives_a_resume(tmp_path, quick_args, capfd):
    # A low start keeps fp16 clear of overflow, so the scale only grows: 1024 -> 8192 after 6 steps.
    scaler_flags = ["--amp", "--init_loss_scale", "1024", "--loss_scale_growth_interval", "2", "--eval_steps", "0"]
    assert run_app([*quick_args, *scaler_flags, "--max_steps", "6", "--save_steps", "6"]) == 0
    before = tb.scalars(tmp_path / "runs" / "test")[tags.AMP_LOSS_SCALE][6]
    assert before == 8192, "the scale should have grown before the save"
    resume = [
        *quick_args,
        *scaler_flags,
        "--max_steps",
        "7",
        "--resume_from_checkpoint",
        tmp_path / "out" / "checkpoints" / "step-6",
    ]
    assert run_app(resume) == 0
    after = tb.scalars(tmp_path / "runs" / "test")[tags.AMP_LOSS_SCALE][7]
    assert after == before, "the loss scale was reset by the resume (a fresh scaler would be back at 1024)"
    capfd.readouterr()


@pytest.mark.parametrize(
    "saved_with, resumed_with, toggle", [("no", "--amp", "off -> on"), ("fp16", "--mixed_precision=no", "on -> off")]
)
def test_toggling_amp_between_save_and_resume(tmp_path, quick_args, capfd, saved_with, resumed_with, toggle):
    assert (
        run_app(
            [*quick_args, "--mixed_precision", saved_with, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0"]
        )
        == 0
    )
    capfd.readouterr()
    code = run_app(
        [*quick_args, resumed_with, "--max_steps", "3", "--eval_steps", "0", "--resume_from_checkpoint", "latest"]
    )
    out = capfd.readouterr().out
    assert code == 0
    assert f"note: loss scaling toggled since the checkpoint ({toggle}): starting a fresh scaler state" in out
    assert out.count("note: loss scaling toggled") == 1
    scales = tb.scalars(tmp_path / "runs" / "test").get(tags.AMP_LOSS_SCALE, {})
    # Saved without a scaler, the run logs no scale before the resume; resumed without one, none after it.
    assert scales == ({3: 65536.0} if toggle == "off -> on" else {1: 65536.0, 2: 65536.0})


def test_non_finite_loss_without_amp_stops_with_exit_3_and_keeps_the_last_good_checkpoint(tmp_path, quick_args, capfd):
    # An absurd learning rate blows the weights up after the first update; the second loss is NaN.
    code = run_app(
        [
            *quick_args,
            "--mixed_precision",
            "no",
            "--learning_rate",
            "1e30",
            "--warmup_ratio",
            "0",
            "--max_steps",
            "10",
            "--save_steps",
            "1",
            "--logging_steps",
            "5",
            "--eval_steps",
            "0",
        ]
    )
    err = capfd.readouterr().err
    assert code == 3
    assert "numeric fault: a NaN/inf loss was applied to the weights at optimizer step 2 (" in err
    assert [p.name for p in completed_checkpoints(tmp_path / "out" / "checkpoints")] == ["step-1"]
    assert "the last good checkpoint is kept" in err and "step-1" in err


def test_a_numeric_fault_after_a_resume_names_the_checkpoint_resumed_from(tmp_path, quick_args, capfd):
    # The first update with this LR leaves finite but absurd weights, saved at step 1; the next loss is NaN.
    blow_up = [
        *quick_args,
        "--mixed_precision",
        "no",
        "--learning_rate",
        "1e30",
        "--warmup_ratio",
        "0",
        "--eval_steps",
        "0",
    ]
    assert run_app([*blow_up, "--max_steps", "1", "--save_steps", "1"]) == 0
    capfd.readouterr()
    code = run_app(
        [
            *blow_up,
            "--max_steps",
            "3",
            "--logging_steps",
            "3",
            "--save_steps",
            "0",
            "--resume_from_checkpoint",
            "latest",
        ]
    )
    err = capfd.readouterr().err
    assert code == 3
    assert f"the last good checkpoint is kept: {tmp_path / 'out' / 'checkpoints' / 'step-1'}" in err


def test_a_non_finite_loss_is_a_numeric_fault_at_an_evaluation_too(tmp_path, quick_args, capfd):
    # Evaluations on no log or save step came before the loss was checked: early stopping alone stopped on the NaN
    # model's evaluation, logged train/loss nan, saved the NaN weights as the final model and exited 0.
    flags = ["--mixed_precision", "no", "--learning_rate", "1e30", "--warmup_ratio", "0", "--max_steps", "10"]
    flags += ["--logging_steps", "10", "--save_steps", "0", "--eval_steps", "1", "--early_stopping_patience", "1"]
    assert run_app([*quick_args, *flags]) == 3
    assert "numeric fault: a NaN/inf loss was applied to the weights" in capfd.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("killed, signalled", [(1, True), (0, False)])
def test_a_rank_killed_mid_run_leaves_the_other_one_line_naming_the_checkpoint_to_resume(
    tmp_path, tiny_model_dir, review_files, killed, signalled
):
    # The survivor printed 20 lines of gloo's traceback ("Connection reset by peer"), after its promise to checkpoint.
    out = tmp_path / "out"
    args = [*data_args(tiny_model_dir, review_files), "--mixed_precision", "no", "--max_steps", "100000"]
    args += ["--save_steps", "2", "--output_dir", out, "--logdir", tmp_path / "runs"]
    ranks = start_ranks(args, tmp_path)
    gone, survivor = ranks[killed], ranks[1 - killed]
    try:
        deadline = time.monotonic() + 180
        while not completed_checkpoints(out / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.1)
        gone.send_signal(signal.SIGSTOP)  # no collective completes from here on: no checkpoint can be written
        if signalled:
            survivor.send_signal(signal.SIGTERM)  # as torchrun's agent does once a worker has died
        gone.kill()
        err = survivor.communicate(timeout=120)[1]
    finally:
        for rank in ranks:
            rank.kill()
    assert survivor.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    unwritten = "the checkpoint that SIGTERM asked for could not be written" if signalled else "this one stops too"
    assert line.startswith(f"stopped: another process of this run ended (killed or crashed), so {unwritten}"), line
    newest = completed_checkpoints(out / "checkpoints")[-1]
    assert line.endswith(f"; resume with --resume_from_checkpoint {newest} (or latest)"), line


@pytest.mark.slow
@pytest.mark.parametrize("killed, signalled", [(1, True), (0, False)])
def test_a_rank_killed_while_the_run_loads_leaves_the_other_one_line_and_no_folders_of_its_own(
    tmp_path, tiny_model_dir, review_files, killed, signalled
):
    # The survivor printed gloo's traceback; under accelerate launch, often nothing at all: torchrun's SIGTERM came
    # once its handlers were given back, before the traceback.
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [*data_args(tiny_model_dir, review_files), "--mixed_precision", "no", "--max_steps", "2"]
    ranks = start_ranks([*args, "--output_dir", out, "--logdir", runs], tmp_path, stderr=subprocess.STDOUT)
    watches = [LineWatch(rank) for rank in ranks]
    gone, survivor = ranks[killed], watches[1 - killed]
    try:
        watches[0].wait_for("backend: ")  # the main process claims the run's folders next, then everything loads
        if signalled:
            survivor.process.send_signal(signal.SIGTERM)  # as torchrun's agent does once a worker has died
        gone.kill()
        said = survivor.finish(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
    assert survivor.process.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert said.strip().splitlines()[-1] == (
        "stopped: another process of this run ended (killed or crashed) before training started, so this one stops "
        "too: nothing was trained or saved; run the same command again"
    ), said[-3000:]
    # The main process acknowledged the SIGTERM with a checkpoint that nothing trained could fill, and that the line
    # after it said could not be written.
    acknowledged = said.count(f"SIGTERM received: {ACKNOWLEDGED_WHILE_LOADING}\n")
    assert acknowledged == (signalled and killed == 1) and "checkpoint" not in said, said[-3000:]
    if killed == 1:  # the main process is left: the folders it created go, as after bad input
        assert not out.exists() and not runs.exists()
