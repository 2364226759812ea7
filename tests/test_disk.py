"""The disk: a full one is one line and exit code 4 with the previous checkpoint intact, on a real small filesystem;
what the run writes is as readable as the umask allows."""

from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from app.storage.checkpoints import completed_checkpoints
from app.storage.disk import write_atomically
from app.storage.integrity import damage
from tests import tb
from tests.conftest import data_flags, run_app, start_ranks

# The tiny model's checkpoint is 12.0 MB: 4.0 MB of weights, 8.0 MB of AdamW state.


def fill(disk: Path, pages_left: int = 0) -> None:
    """Fill a small disk with a file named filler, then give back `pages_left` pages of 4 KB."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as file:
        with pytest.raises(OSError):
            while True:
                file.write(b"\0" * 4096)
    os.truncate(filler, filler.stat().st_size - 4096 * pages_left)


def last_line(stderr: str) -> str:
    """The line the run ended with; before it, only the libraries' progress bars and reports, never a traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return stderr.strip().splitlines()[-1]


def run_flags(tiny_model_dir, review_files, out, logdir) -> list:
    return [
        *data_flags(tiny_model_dir, review_files),
        *("--output_dir", out, "--logdir", logdir, "--run_name", "r", "--max_steps", 4, "--save_steps", 1),
        *("--per_device_train_batch_size", 8, "--max_length", 32, "--mixed_precision", "no", "--disable_tqdm"),
    ]


def test_a_full_disk_at_a_checkpoint_is_one_line_exit_4_and_the_previous_one_is_intact(
    tmp_path, small_disk, tiny_model_dir, review_files, capfd
):
    out = small_disk / "out"
    code = run_app(run_flags(tiny_model_dir, review_files, out, tmp_path / "runs"))
    result = capfd.readouterr()
    assert code == 4, result.err[-3000:]
    root, error = out / "checkpoints", last_line(result.err)
    assert error.startswith(f"error: no space left on device for checkpoint step-2 in {root}: it needs about 12.0"), (
        error
    )
    assert error.endswith(f" MB are free; {root / 'step-1'} is intact")
    warning = rf"warning: \d+\.\d MB free in {re.escape(str(root))}, and the last checkpoint took 12\.0 MB: this one "
    warning += "may not fit"
    assert [line for line in result.out.splitlines() if re.fullmatch(warning, line)], result.out[-2000:]
    assert [p.name for p in completed_checkpoints(root)] == ["step-1"]
    assert damage(root / "step-1") is None, "the previous checkpoint is whole"
    assert not list(root.glob(".staging-*")), "the partial checkpoint is removed, which frees its space"
    assert not list(out.glob(".claim-*")), "the claim is given back"
    assert [row["precision"] for row in tb.hparams_rows(tmp_path / "runs" / "r")] == ["no"], "its HPARAMS row"


def test_a_run_that_a_full_disk_stops_at_its_final_save_keeps_its_hparams_row(
    tmp_path, small_disk, tiny_model_dir, review_files, capfd
):
    # A halt after training (the final save, its evaluation) wrote no row; one inside the training loop did.
    fill(small_disk, pages_left=64)  # 256 kB: the run's config fits, the model's 4 MB do not
    flags = run_flags(tiny_model_dir, review_files, small_disk / "out", tmp_path / "runs")
    flags[flags.index("--save_steps") + 1] = 0
    assert run_app(flags) == 4, capfd.readouterr().err[-3000:]
    assert "the final model" in last_line(capfd.readouterr().err)
    assert [row["precision"] for row in tb.hparams_rows(tmp_path / "runs" / "r")] == ["no"]


def test_a_full_disk_at_the_first_checkpoint_says_what_was_written(tmp_path, tiny_model_dir, review_files, capfd):
    mount = tmp_path / "tiny_disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        code = run_app(run_flags(tiny_model_dir, review_files, mount / "out", tmp_path / "runs"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    result = capfd.readouterr()
    assert code == 4, result.err[-3000:]
    error = last_line(result.err)
    assert error.startswith("error: no space left on device for checkpoint step-1 in "), error
    assert "it needs more than the " in error and error.endswith("this run has no earlier checkpoint")


@pytest.mark.slow
def test_both_ranks_stop_with_exit_4_when_the_disk_fills(tmp_path, small_disk, tiny_model_dir, review_files):
    """Two gloo ranks, started as torchrun starts them: the main process's write fails, neither rank hangs."""
    args = run_flags(tiny_model_dir, review_files, small_disk / "out", tmp_path / "runs")
    ranks = start_ranks(args, tmp_path)
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [4, 4], errors
    assert last_line(errors[0]).startswith("error: no space left on device for checkpoint step-2 in "), errors[0]
    assert "error: " not in errors[1], "one rank says why"


def test_a_text_written_atomically_is_the_old_or_the_new_even_on_a_full_disk(small_disk):
    # What checkpoints' records and the benchmarks' per-round JSON are written with.
    record = small_disk / "record.json"
    write_atomically(record, "old")
    write_atomically(record, "new")
    assert record.read_text() == "new"
    with pytest.raises(OSError) as error:
        write_atomically(record, "x" * (30 << 20))  # more than the 20 MB filesystem holds
    assert error.value.errno == errno.ENOSPC
    assert record.read_text() == "new" and [path.name for path in small_disk.iterdir()] == ["record.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_what_the_run_writes_is_as_readable_as_the_umask_allows(
    tmp_path, tiny_model_dir, review_files, umask, mode, capfd
):
    flags = run_flags(tiny_model_dir, review_files, tmp_path / "out", tmp_path / "runs")
    flags[flags.index("--max_steps") + 1] = 1
    before = os.umask(umask)  # the umask is the process's: this test's run is the only one in it
    try:
        code = run_app([*flags, "--max_eval_samples", "8"])
    finally:
        os.umask(before)
    assert code == 0, capfd.readouterr().err[-2000:]
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert tmp_path / "out" / "model.safetensors" in written
    assert tmp_path / "out" / "checkpoints" / "step-1" / "model.safetensors" in written
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(mode)}, modes


def test_a_full_disk_under_the_logdir_ends_the_curves_with_a_warning_not_the_run(
    tmp_path, tiny_disk, tiny_model_dir, review_files, capfd
):
    # Two tracebacks (the event file's thread, then the next add_scalar) and exit 1: the steps since the last
    # checkpoint were lost, though the model's own disk had room.
    args = [*data_flags(tiny_model_dir, review_files), "--output_dir", tmp_path / "out", "--logdir", tiny_disk]
    args += ["--per_device_train_batch_size", "8", "--max_length", "32", "--max_steps", "40", "--logging_steps", "1"]
    assert run_app([*args, "--eval_steps", "0", "--max_eval_samples", "8", "--mixed_precision", "no"]) == 0
    err = capfd.readouterr().err  # the progress bar's too: the warning stands on a line of its own
    assert "Traceback" not in err, err[-3000:]
    warned = [line for line in err.splitlines() if line.startswith("warning: the disk under")]
    assert len(warned) == 1 and "training goes on" in warned[0], err[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_an_output_dir_on_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path, tiny_disk, tiny_model_dir, review_files, capfd
):
    # The folder and an empty draft of its lease (.claim-new-<token>.json) were left behind.
    fill(tiny_disk)
    args = [*data_flags(tiny_model_dir, review_files), "--output_dir", tiny_disk / "out", "--logdir", tmp_path / "runs"]
    assert run_app([*args, "--max_steps", "1"]) == 2
    assert capfd.readouterr().err.strip().startswith("error: ")
    assert [p.name for p in tiny_disk.iterdir()] == ["filler"] and not (tmp_path / "runs").exists()


def test_a_disk_that_fills_as_the_run_ends_says_where_the_curves_end(tiny_disk, capfd):
    # "TensorBoard's curves stop at step 0; training goes on", said by the hparams or the close after training.
    from app.telemetry.writer import TensorBoardWriter

    writer = TensorBoardWriter(tiny_disk / "run")
    for step in range(1, 6):
        writer.log({"train/loss": 1.0 / step}, step)
    fill(tiny_disk)
    writer.hparams({"note": "x" * 20000}, ["eval/loss"])
    writer.close()
    warned = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: the disk under")]
    assert len(warned) == 1 and warned[0].endswith("TensorBoard's curves end after step 5"), warned


def test_a_logdir_full_before_the_run_starts_is_warned_and_the_run_trains(
    tmp_path, tiny_disk, tiny_model_dir, review_files, capfd
):
    # A traceback writing the TensorBoard folder's training_args.yaml (exit 1); on a resume, opening the event file
    # raised, and the writer's cleanup an AttributeError.
    fill(tiny_disk, pages_left=1)  # the run's lease fits, not its config
    args = [*data_flags(tiny_model_dir, review_files), "--output_dir", tmp_path / "out", "--logdir", tiny_disk]
    args += ["--max_steps", "2", "--max_length", "32", "--eval_steps", "0", "--max_eval_samples", "8", "--disable_tqdm"]
    assert run_app(args) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("warning: the disk under")], err[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
