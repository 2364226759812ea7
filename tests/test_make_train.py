"""`make train` as a new user meets it: the command line the Makefile really runs, and what it prints first."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tests.conftest import ROOT, clean_env

BANNER = "were not passed to `accelerate launch`"


def make_train_command() -> list[str]:
    """The launch line of `make train`, as make expands it (`make -n` prints the commands and runs none)."""
    venv = Path(sys.executable).parents[1]
    shown = subprocess.run(
        ["make", "-n", "-s", "train", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    return shlex.split(next(line for line in shown.stdout.splitlines() if " launch " in line))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.slow
def test_make_train_opens_with_the_precision_decision_not_a_launcher_banner(tmp_path, quick_args):
    command = make_train_command()
    assert command[1] == "launch" and "app/train.py" in command, command
    quick = [*quick_args, "--max_steps", "1", "--eval_steps", "0", "--max_eval_samples", "8"]
    # The launcher forked (tests/forked.py): the same launch, without importing torch and transformers again.
    result = forked.run([*command, *map(str, quick)], cwd=ROOT, env=clean_env(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert BANNER not in result.stdout + result.stderr, result.stderr[:3000]
    assert result.stdout.splitlines()[0].startswith("precision: "), result.stdout[:1000]
