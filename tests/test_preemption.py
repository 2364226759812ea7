"""Signals that land outside the training steps: before training starts, during the final evaluation and save; and
a reader of the run's output that goes away.

Each test waits for a line the run prints (never a sleep), and every wait on the child's output has a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.host.preemption import ACKNOWLEDGED, ACKNOWLEDGED_AFTER_TRAINING, ACKNOWLEDGED_WHILE_LOADING, StopRequest
from app.host.runtime import HostCollective
from app.storage.checkpoints import completed_checkpoints
from app.storage.integrity import damage
from app.tasks.classification import SequenceClassification
from tests import forked
from tests.conftest import ROOT, TRAIN_SCRIPT, LineWatch, clean_env, folder_state, run_app

KILLER = ROOT / "tests" / "workers" / "kill_during_checkpoint.py"


def start_run(tmp_path, args: list) -> LineWatch:
    """`python app/train.py ...` with its output read line by line on a thread, so every wait can time out."""
    process = forked.popen(
        [sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return LineWatch(process)


@pytest.mark.slow
def test_a_signal_during_the_final_evaluation_lets_the_save_finish_and_exits_143(tmp_path, quick_args, review_files):
    # The training file as validation set, one example per batch: an evaluation long enough to land the signal in.
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0"]
    args += ["--validation_file", review_files["train"], "--per_device_eval_batch_size", "1"]
    child = start_run(tmp_path, args)
    child.wait_for("evaluating the final model")
    child.process.send_signal(signal.SIGTERM)
    output = child.finish()
    code = child.process.returncode
    out = tmp_path / "out"
    assert code == 143, output[-3000:]
    assert "stopped by signal 15 during the final evaluation or save; the model is complete" in output, output[-3000:]
    # What the acknowledgement promises is what happens: no step to stop after, no checkpoint (it said "checkpointing").
    assert f"SIGTERM received: {ACKNOWLEDGED_AFTER_TRAINING}\n" in output and ACKNOWLEDGED not in output, output[-3000:]
    assert not (out / ".staging-model").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)  # complete: it loads, weights and all
    assert model.config.num_labels == 2


@pytest.mark.slow
def test_a_signal_before_training_starts_checkpoints_step_0_and_exits_130(tmp_path, quick_args, capfd):
    """The signalled run is a real process; the resume runs in this one."""
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "8"]
    child = start_run(tmp_path, args)
    child.wait_for("precision: ")  # printed once the handler is installed, before loading and tokenizing
    child.process.send_signal(signal.SIGINT)
    output = child.finish()
    code = child.process.returncode
    assert code == 130, output[-3000:]
    assert "stopped by signal 2 before training started" in output, output[-3000:]
    assert f"SIGINT received: {ACKNOWLEDGED_WHILE_LOADING}\n" in output, output[-3000:]  # no step to stop after
    saved = completed_checkpoints(tmp_path / "out" / "checkpoints")
    assert [p.name for p in saved] == ["step-0"]
    assert not (tmp_path / "out" / "model.safetensors").exists()

    capfd.readouterr()
    code, said = run_app([*args, "--resume_from_checkpoint", "latest"]), capfd.readouterr()
    assert code == 0, said.err[-2000:]
    assert f"resumed from {saved[0]}" in said.out


@pytest.mark.slow
def test_ctrl_c_pressed_again_and_again_leaves_one_line_and_a_complete_checkpoint(tmp_path, quick_args):
    # Once the stop's line was said, a Ctrl-C more landed in the process's teardown: Python's "Exception ignored in
    # atexit callback" (or in tqdm's __del__) with a KeyboardInterrupt traceback came after the line.
    args = [*quick_args, "--max_steps", "100000", "--eval_steps", "0", "--save_steps", "0"]
    child = start_run(tmp_path, args)
    child.wait_for("training: ")
    child.process.send_signal(signal.SIGINT)
    child.wait_for("SIGINT received: ")
    while child.process.poll() is None:  # through the step, the checkpoint's write and the teardown, to the exit
        child.process.send_signal(signal.SIGINT)
        time.sleep(0.002)
    output = child.finish()
    assert child.process.returncode == 130, output[-3000:]
    saved = completed_checkpoints(tmp_path / "out" / "checkpoints")
    assert len(saved) == 1 and damage(saved[0]) is None, saved
    assert not list((tmp_path / "out" / "checkpoints").glob(".staging-*"))
    step = saved[0].name.removeprefix("step-")
    after_the_acknowledgement = output[output.index("SIGINT received: ") :].splitlines()[1:]
    assert after_the_acknowledgement == [f"stopped by signal 2 at optimizer step {step}; resume from {saved[0]}"]


def test_a_kill_during_the_final_save_leaves_no_half_written_model(tmp_path, quick_args):
    args = [*quick_args, "--max_steps", "1", "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "8"]
    cmd = [sys.executable, str(KILLER), "model", "1", *map(str, args)]
    killed = forked.run(cmd, env=clean_env(tmp_path), timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "out"
    assert (out / ".staging-model" / "model.safetensors").is_file(), "the kill should land after the weights' write"
    assert not (out / "model.safetensors").exists(), "the weights reach the output folder only by an atomic rename"


@pytest.mark.slow
def test_a_kill_during_the_final_evaluation_loses_no_step(tmp_path, quick_args, review_files, capfd):
    """A signal during the final evaluation lets it finish; a scheduler's SIGKILL after its grace period does not.
    The last step is checkpointed before that evaluation, so the resume has nothing to train again. The killed run
    is a real process; the resume runs in this one."""
    args = [*quick_args, "--max_steps", "3", "--eval_steps", "0", "--save_steps", "100"]
    long_evaluation = ["--validation_file", review_files["train"], "--per_device_eval_batch_size", "1"]
    child = start_run(tmp_path, [*args, *long_evaluation])
    child.wait_for("evaluating the final model")
    child.process.kill()
    child.finish()
    saved = completed_checkpoints(tmp_path / "out" / "checkpoints")
    assert [p.name for p in saved] == ["step-3"], "the last step, though --save_steps is beyond it"

    capfd.readouterr()
    code, said = run_app([*args, "--max_eval_samples", "8", "--resume_from_checkpoint", "latest"]), capfd.readouterr()
    assert code == 0, said.err[-2000:]
    assert f"resumed from {saved[0]} at optimizer step 3" in said.out


def test_a_final_evaluation_that_fails_leaves_the_trained_model_complete(tmp_path, quick_args, monkeypatch):
    """Whatever fails after training (here the task's own evaluation, in this process) cannot lose the training: the
    model of the last step is in the output folder, whole, before the final evaluation starts."""

    def failing_evaluation(*args, **kwargs):
        raise RuntimeError("the final evaluation failed")

    monkeypatch.setattr(SequenceClassification, "evaluate", failing_evaluation)
    args = [*quick_args, "--max_steps", "3", "--eval_steps", "0", "--save_steps", "100", "--max_eval_samples", "8"]
    with pytest.raises(RuntimeError, match="the final evaluation failed"):
        run_app(args)
    out = tmp_path / "out"
    assert not (out / ".staging-model").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)  # complete: it loads, weights and all
    AutoTokenizer.from_pretrained(out)
    trained = load_file(out / "checkpoints" / "step-3" / "model.safetensors")  # the last step's weights
    assert trained.keys() == model.state_dict().keys()
    assert all(torch.equal(model.state_dict()[name], weights) for name, weights in trained.items())


def test_without_checkpoints_asked_for_the_run_ends_without_one(tmp_path, quick_args):
    assert run_app([*quick_args, "--max_steps", "2", "--save_steps", "0", "--max_eval_samples", "8"]) == 0
    assert not completed_checkpoints(tmp_path / "out" / "checkpoints")


def test_a_reader_that_goes_away_neither_stops_the_run_nor_changes_its_exit_code(tmp_path, quick_args):
    """`python app/train.py ... 2>&1 | head -1`: the run trains to its end, saves its model and exits 0."""
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "8"]
    process = forked.popen(
        [sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        first = process.stdout.readline()
        process.stdout.close()  # the reader leaves after one line, as head -1 does
        code = process.wait(timeout=240)
    finally:
        process.kill()
    assert first.startswith("precision: "), first
    assert code == 0, "the run died when its reader left"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_run_ends_while_a_thread_pool_of_its_libraries_waits_for_work(tmp_path):
    # torch.compile builds its kernels in a ThreadPoolExecutor whose idle workers only stop when threading's shutdown
    # tells them to: a `python app/train.py --torch_compile` run trained, saved, then waited on them for ever.
    script = tmp_path / "entry.py"
    script.write_text(
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from app.cli import exit_process\n"
        "pool = ThreadPoolExecutor(2)\n"
        "assert pool.submit(sum, [1, 2]).result() == 3\n"
        "print('done', flush=True)\n"
        "exit_process(7)\n"
    )
    result = forked.run([sys.executable, script], env=clean_env(tmp_path, PYTHONPATH=str(ROOT)), timeout=30)
    assert (result.returncode, result.stdout) == (7, "done\n"), result.stderr[-2000:]


def test_a_user_s_own_accelerate_use_cpu_is_not_taken_for_the_launcher(monkeypatch):
    """Users export ACCELERATE_USE_CPU to keep a GPU host on its CPU and then run `python app/train.py`: no launcher
    kills that process, so its lines must not say one does (the launched case is in test_precision.py)."""
    for name in [name for name in os.environ if name.startswith("ACCELERATE_") or name == "LOCAL_RANK"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    stop = StopRequest(HostCollective(1))
    try:
        assert stop.training_line() == "training: SIGTERM or Ctrl-C saves a checkpoint, then stops"
    finally:
        stop.restore()


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler of its own for SIGTERM (Python installs none by itself)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.parametrize(
    "script, rank", [("train.py", None), ("predict.py", None), ("train.py", "1")], ids=["train", "predict", "rank-1"]
)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_libraries_import_is_one_line(tmp_path, script, rank, signum):
    # A Ctrl-C in the first seconds, as torch and transformers import, was a KeyboardInterrupt traceback from
    # importlib, and a SIGTERM ended the process without a word (-15). Of a launch's processes, rank 0 says it.
    child = subprocess.Popen(
        [sys.executable, ROOT / "app" / script, "--model_name_or_path", tmp_path / "none"],
        env=clean_env(tmp_path, **({"RANK": rank} if rank else {})),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not catches_sigterm(child.pid) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    name = signal.Signals(signum).name
    said = f"{name} received while starting: stopped before anything was read or written\n"
    assert (child.returncode, err) == (128 + signum, "" if rank else said)


def test_the_acknowledgement_under_accelerate_launch_says_a_second_ctrl_c_kills_at_once(monkeypatch, capfd):
    """accelerate launch's own handler kills its one process at a second Ctrl-C, without its 5 s: pressed again, as
    the app lets a user do, it lost the checkpoint in the making (no stop line, no checkpoint, exit -2)."""
    for name in [name for name in os.environ if name.startswith("ACCELERATE_") or name == "LOCAL_RANK"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")  # as that launcher sets them, and no rank
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False")
    stop = StopRequest(HostCollective(1))
    try:
        if not stop.killed_after_grace:
            pytest.skip("accelerate before 1.16 does not kill its process after a grace period")
        capfd.readouterr()
        stop._handle(signal.SIGINT, None)
    finally:
        stop.restore()
    assert capfd.readouterr().err == (
        f"SIGINT received: {ACKNOWLEDGED}; if it came through accelerate launch, that kills this process 5 s after it, "
        "or at once on a second Ctrl-C\n"
    )


@pytest.mark.slow
def test_a_signal_before_an_overwrite_removes_anything_keeps_the_earlier_run(tmp_path, quick_args, capfd, monkeypatch):
    # The earlier model and checkpoints were removed, then a step-0 checkpoint saved, and exit 130: a Ctrl-C on
    # seeing the wrong --output_dir lost the run it meant to keep.
    import app.train

    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--max_eval_samples", "8", "--save_steps", "2"]
    assert run_app(args) == 0
    before = folder_state(tmp_path / "out")
    load_inputs = app.train.load_inputs

    def ctrl_c_while_tokenizing(*args, **kwargs):  # the signal lands in the same place every time: a real one
        inputs = load_inputs(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return inputs

    monkeypatch.setattr(app.train, "load_inputs", ctrl_c_while_tokenizing)
    capfd.readouterr()
    assert run_app([*args, "--overwrite_output_dir", "--run_name", "again"]) == 130
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by signal 2 before --overwrite_output_dir removed anything: {tmp_path / 'out'} is as it was"
    )
    assert folder_state(tmp_path / "out") == before
    assert not (tmp_path / "runs" / "again").exists()
