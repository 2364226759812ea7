"""Signals that land outside the training steps: before training starts, during the final evaluation and save.

Each test waits for a line the run prints (never a sleep), and every wait on the child's output has a deadline.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time

from transformers import AutoModelForSequenceClassification

from app.checkpoint import completed_checkpoints
from tests.conftest import ROOT, TRAIN_SCRIPT, clean_env, python_app

KILLER = ROOT / "tests" / "workers" / "kill_during_checkpoint.py"


class Child:
    """`python app/train.py ...` with its output read line by line on a thread, so every wait can time out."""

    def __init__(self, tmp_path, args: list):
        self.process = subprocess.Popen(
            [sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
            env=clean_env(tmp_path),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line starting {prefix!r} within {timeout} s:\n{''.join(self.seen)}") from None
            if line is None:
                raise AssertionError(f"the run ended before printing {prefix!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            if line.startswith(prefix):
                return

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        """The exit code and everything the run printed."""
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            self.process.kill()
        self._reader.join(timeout=30)
        while not self.lines.empty():
            line = self.lines.get_nowait()
            self.seen.append(line or "")
        return code, "".join(self.seen)


def test_a_signal_during_the_final_evaluation_lets_the_save_finish_and_exits_143(tmp_path, quick_args, review_files):
    # The training file as validation set, one example per batch: an evaluation long enough to land the signal in.
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0"]
    args += ["--validation_file", review_files["train"], "--per_device_eval_batch_size", "1"]
    child = Child(tmp_path, args)
    child.wait_for("evaluating the final model")
    child.process.send_signal(signal.SIGTERM)
    code, output = child.finish()
    out = tmp_path / "out"
    assert code == 143, output[-3000:]
    assert "stopped by signal 15 during the final evaluation or save; the model is complete" in output, output[-3000:]
    assert not (out / ".staging-model").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)  # complete: it loads, weights and all
    assert model.config.num_labels == 2


def test_a_signal_before_training_starts_checkpoints_step_0_and_exits_130(tmp_path, quick_args):
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "8"]
    child = Child(tmp_path, args)
    child.wait_for("precision: ")  # printed once the handler is installed, before loading and tokenizing
    child.process.send_signal(signal.SIGINT)
    code, output = child.finish()
    assert code == 130, output[-3000:]
    assert "stopped by signal 2 before training started" in output, output[-3000:]
    saved = completed_checkpoints(tmp_path / "out" / "checkpoints")
    assert [p.name for p in saved] == ["step-0"]
    assert not (tmp_path / "out" / "model.safetensors").exists()

    resumed = python_app(tmp_path, [*args, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {saved[0]}" in resumed.stdout


def test_a_kill_during_the_final_save_leaves_no_half_written_model(tmp_path, quick_args):
    args = [*quick_args, "--max_steps", "1", "--eval_steps", "0", "--save_steps", "0", "--max_eval_samples", "8"]
    cmd = [sys.executable, str(KILLER), "model", "1", *map(str, args)]
    killed = subprocess.run(cmd, env=clean_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "out"
    assert (out / ".staging-model" / "model.safetensors").is_file(), "the kill should land after the weights' write"
    assert not (out / "model.safetensors").exists(), "the weights reach the output folder only by an atomic rename"
