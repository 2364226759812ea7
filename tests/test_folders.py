"""The run's folders on bad input: a folder that cannot be reached is one line and exit 2, an existing folder is left
as it was found, and what a failed start left behind does not block an identical rerun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import TRAIN_SCRIPT, clean_env, run_app


def without_root_powers() -> list[str]:
    """A prefix that runs a command without root's power to ignore file modes, so that a mode-000 folder is one."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root ignores file modes, and setpriv (util-linux) is not here to drop that power")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_an_output_dir_below_a_folder_that_cannot_be_entered_is_one_line_and_exit_2(tmp_path, quick_args):
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "team" / "out"
    args = [*quick_args, "--output_dir", out]
    locked.chmod(0)
    try:
        result = subprocess.run(
            [*without_root_powers(), sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
            env=clean_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: --output_dir {out} cannot be created: Permission denied"), result.stderr
    assert list(locked.iterdir()) == [] and not (tmp_path / "runs").exists()


def test_bad_input_leaves_an_existing_output_dir_as_it_was(tmp_path, quick_args, capfd):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code = run_app([*quick_args, "--overwrite_output_dir", "--label_column", "stars"])
    assert code == 2
    assert "error: --label_column 'stars' is not in the train data" in capfd.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"], "no claim, no config left behind"
    assert not (tmp_path / "runs").exists(), "the TensorBoard folder it created is gone"


def test_what_a_failed_start_left_does_not_block_the_same_command_again(tmp_path, quick_args, capfd):
    """A start that died before its first checkpoint (a crash, an OOM kill) leaves its config and an empty
    checkpoints folder; the same command again must run, not advise a resume that has nothing to resume."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "training_args.yaml").write_text("learning_rate: 5.0e-05\n")
    assert run_app([*quick_args, "--max_steps", "1", "--max_eval_samples", "8"]) == 0
    assert (out / "model.safetensors").is_file()

    (out.parent / "other").mkdir()
    (out.parent / "other" / "model.safetensors").write_text("a model, no checkpoints")
    capfd.readouterr()
    assert run_app([*quick_args, "--output_dir", out.parent / "other"]) == 2
    err = capfd.readouterr().err
    assert "is not empty (it holds model.safetensors); pass --overwrite_output_dir" in err
    assert "--resume_from_checkpoint" not in err, "no advice that would fail with 'no checkpoint'"
