"""The run's folders on bad input: a folder that cannot be reached is one line and exit 2, an existing folder is left
as it was found, and what a failed start left behind does not block an identical rerun."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.tasks.classification import SequenceClassification
from app.telemetry import tags
from tests import forked, tb
from tests.conftest import ROOT, TRAIN_SCRIPT, clean_env, data_flags, folder_state, run_app


def without_root_powers() -> list[str]:
    """A prefix that runs a command without root's power to ignore file modes, so that a mode-000 folder is one."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root ignores file modes, and setpriv (util-linux) is not here to drop that power")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def train_without_root_powers(tmp_path, args: list) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*without_root_powers(), sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_an_output_dir_below_a_folder_that_cannot_be_entered_is_one_line_and_exit_2(tmp_path, quick_args):
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "team" / "out"
    args = [*quick_args, "--output_dir", out]
    locked.chmod(0)
    try:
        result = train_without_root_powers(tmp_path, args)
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
    from app.config import TrainConfig
    from app.storage.folders import write_config

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    write_config(TrainConfig(learning_rate=5e-5, run_name="test"), out)  # as a run writes it
    assert run_app([*quick_args, "--max_steps", "1", "--max_eval_samples", "8"]) == 0
    assert (out / "model.safetensors").is_file()

    (out.parent / "other").mkdir()
    (out.parent / "other" / "model.safetensors").write_text("a model, no checkpoints")
    capfd.readouterr()
    assert run_app([*quick_args, "--output_dir", out.parent / "other"]) == 2
    err = capfd.readouterr().err
    assert "is not empty (it holds model.safetensors); pass --overwrite_output_dir" in err
    assert "--resume_from_checkpoint" not in err, "no advice that would fail with 'no checkpoint'"


def test_a_named_output_dir_in_use_says_so_also_when_the_run_name_is_left_to_the_app(tmp_path, quick_args, capfd):
    # A default run name is tried with suffixes -2, -3, ... while a name is taken; no name frees an --output_dir that
    # holds a finished run, which was said as "no free default run name ...; pass --run_name".
    named = quick_args.index("--run_name")
    args = quick_args[:named] + quick_args[named + 2 :]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("a finished run's model")
    assert run_app(args) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: --output_dir {out} is not empty (it holds model.safetensors); pass --overwrite_output_dir "
        "to replace what is there, or another --output_dir"
    ], lines
    assert [p.name for p in out.iterdir()] == ["model.safetensors"] and not (tmp_path / "runs").exists()


def crashing_at_step(monkeypatch, step: int) -> None:
    """The task's own loss raises at training step `step` (its forward of that step): a crash of the run in this
    process, after its start texts, before any checkpoint."""
    calls, loss = [0], SequenceClassification.loss

    def crash(self, model, batch):
        calls[0] += 1
        if calls[0] == step:
            raise RuntimeError("the run crashed")
        return loss(self, model, batch)

    monkeypatch.setattr(SequenceClassification, "loss", crash)


def test_a_start_that_crashed_before_logging_a_step_does_not_block_its_rerun_under_the_same_name(
    tmp_path, quick_args, monkeypatch, capfd
):
    """A crash at the first step leaves event files with the start texts only (step 0): the rerun with the same
    --run_name takes their place, and TensorBoard shows the rerun's start, not the crashed one's."""
    args = [*quick_args, "--max_steps", "2", "--save_steps", "100", "--max_eval_samples", "8"]
    with monkeypatch.context() as patch:
        crashing_at_step(patch, 1)
        with pytest.raises(RuntimeError, match="the run crashed"):
            run_app([*args, "--learning_rate", "1e-4"])
    log_dir = tmp_path / "runs" / "test"
    assert "learning_rate: 0.0001" in tb.texts(log_dir)[tags.RUN_CONFIG], "the crash came after the start texts"
    assert not list((tmp_path / "out" / "checkpoints").glob("step-*"))

    capfd.readouterr()
    assert run_app([*args, "--learning_rate", "5e-5"]) == 0, capfd.readouterr().err[-2000:]
    assert "learning_rate: 5.0e-05" in tb.texts(log_dir)[tags.RUN_CONFIG], "the rerun's start, not the crashed one's"
    assert sorted(tb.scalars(log_dir)[tags.TRAIN_LOSS]) == [1, 2]


def test_a_run_that_crashed_after_logging_steps_keeps_its_curves_and_its_name(tmp_path, quick_args, monkeypatch, capfd):
    """Curves are another run's work, checkpoint or not: the same --run_name again is refused, the folder untouched."""
    args = [*quick_args, "--max_steps", "4", "--save_steps", "100", "--max_eval_samples", "8"]
    with monkeypatch.context() as patch:
        crashing_at_step(patch, 3)
        with pytest.raises(RuntimeError, match="the run crashed"):
            run_app(args)
    log_dir = tmp_path / "runs" / "test"
    assert sorted(tb.scalars(log_dir)[tags.TRAIN_LOSS]) == [1, 2]
    before = sorted((p.name, p.read_bytes()) for p in log_dir.iterdir())

    capfd.readouterr()
    assert run_app(args) == 2
    err = capfd.readouterr().err
    assert err == (
        f"error: TensorBoard run {log_dir} already exists and would mix two runs: it holds an earlier run's curves; "
        "pass another --run_name, leave it unset for a unique one, or delete that folder to use the name again\n"
    )
    assert sorted((p.name, p.read_bytes()) for p in log_dir.iterdir()) == before
    # The run saved no checkpoint: asked to overwrite it, the answer says what that flag does not replace.
    assert run_app([*args, "--overwrite_output_dir"]) == 2
    assert "curves (--overwrite_output_dir replaces the model folder, not TensorBoard runs); pass another" in (
        capfd.readouterr().err
    )
    assert sorted((p.name, p.read_bytes()) for p in log_dir.iterdir()) == before


def test_a_kill_during_the_first_checkpoint_write_does_not_block_the_rerun(tmp_path, quick_args):
    """SIGKILL with the first checkpoint half-written leaves only its staging folder: nothing to resume, so the same
    command again starts afresh (the staging folder is cleaned up at start). No step logged: no curves to keep."""
    args = [*quick_args, "--max_steps", "2", "--save_steps", "1", "--max_eval_samples", "8", "--logging_steps", "100"]
    killer = [sys.executable, str(ROOT / "tests" / "workers" / "kill_during_checkpoint.py"), "staged", "1"]
    killed = forked.run([*killer, *args], env=clean_env(tmp_path), timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    checkpoints = tmp_path / "out" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [".staging-step-1"]

    assert run_app(args) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2"]


def test_overwrite_output_dir_removes_the_earlier_model_when_it_starts(tmp_path, quick_args, monkeypatch, capfd):
    """An earlier model stayed until the new run's final save, beside the new run's training_args.yaml: a run that
    crashed or was stopped before that save left a folder that predict.py read as a model trained with the new run's
    flags (another text column, another --max_length). Now the earlier run goes when the new one starts; files that
    are not a model's stay."""
    out = tmp_path / "out"
    args = [*quick_args, "--max_steps", "2", "--save_steps", "1", "--max_eval_samples", "8"]
    assert run_app([*args, "--max_length", "32"]) == 0
    (out / "notes.txt").write_text("mine")
    assert {"model.safetensors", "config.json", "README.md", "checkpoints"} <= {p.name for p in out.iterdir()}

    capfd.readouterr()
    with monkeypatch.context() as patch:
        crashing_at_step(patch, 1)
        with pytest.raises(RuntimeError, match="the run crashed"):
            run_app([*args, "--run_name", "second", "--overwrite_output_dir"])
    assert (
        f"note: --overwrite_output_dir: the earlier model and checkpoints in {out} are removed"
        in capfd.readouterr().out
    )
    left = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "checkpoints")
    assert left == ["notes.txt", "training_args.yaml"] and not list(out.glob("checkpoints/step-*")), left
    assert "max_length: 64" in (out / "training_args.yaml").read_text()
    from app.predict import main as predict

    assert predict(["A text.", "--model_name_or_path", str(out), "--mixed_precision", "no"]) == 2


@contextlib.contextmanager
def immutable(path: Path):
    """`path` cannot be deleted, renamed or changed, by root too (chattr +i)."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr cannot set the immutable flag here (it needs root and a file system that has it)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_overwrite_output_dir_moves_the_earlier_run_aside_whole_before_deleting_it(tmp_path, quick_args, capfd):
    # A folder's permissions were checked, not its files': a file that cannot be deleted stopped the deleting half-way
    # (checkpoints gone, the model kept, exit 2), or, deep in a checkpoint, after the other checkpoints were gone.
    out = tmp_path / "out"
    args = [*quick_args, "--max_steps", "2", "--save_steps", "1", "--max_eval_samples", "8"]
    assert run_app(args) == 0
    before = folder_state(out, files_only=True)
    again = [*args, "--run_name", "second", "--overwrite_output_dir"]
    with immutable(out / "model.safetensors"):
        assert run_app(again) == 2
    assert (
        "cannot be moved aside to be deleted (Operation not permitted); nothing was deleted" in capfd.readouterr().err
    )
    assert folder_state(out, files_only=True) == before
    stuck = out / "checkpoints" / "step-2" / "trainer_state.json"
    try:
        with immutable(stuck):  # it moves with its folder, but cannot be deleted: the rest goes, and the run trains
            assert run_app(again) == 0
        [aside] = (out / "checkpoints").glob(".overwritten-*")
        assert [p.relative_to(aside) for p in aside.rglob("*")] == [Path("step-2"), Path("step-2/trainer_state.json")]
        assert sorted(p.name for p in (out / "checkpoints").iterdir() if p != aside) == ["step-1", "step-2"]
        warned = f"warning: --overwrite_output_dir: what is left of the earlier run in {aside} cannot be deleted"
        assert warned in capfd.readouterr().out
    finally:
        for left in out.rglob(".overwritten-*/step-2/trainer_state.json"):
            subprocess.run(["chattr", "-i", str(left)], capture_output=True)
    # Deletable now (or left by a run killed before it deleted them): the next overwrite takes them along.
    assert run_app([*again, "--run_name", "third"]) == 0
    assert not list(out.rglob(".overwritten-*"))


def test_overwrite_output_dir_removes_a_models_files_by_their_names_and_a_runs_checkpoints_alone(
    tmp_path, quick_args, capfd
):
    # Matched by patterns (tokenizer*, vocab.*), a user's tokenizer.py and vocab.md went, and checkpoints/ and merged/
    # went whole, notes and all.
    out = tmp_path / "out"
    args = [*quick_args, "--max_steps", "1", "--save_steps", "1", "--max_eval_samples", "8"]
    assert run_app(args) == 0
    mine = {
        "tokenizer.py": "import x",
        "vocab.md": "# words",
        "checkpoints/notes.txt": "lr 3e-3",
        "merged/keep.txt": ".",
    }
    for name, text in mine.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    capfd.readouterr()
    assert run_app([*args, "--run_name", "second", "--max_steps", "2", "--overwrite_output_dir"]) == 0
    assert (
        f"note: --overwrite_output_dir: the earlier model and checkpoints in {out} are removed"
        in capfd.readouterr().out
    )
    assert {name: (out / name).read_text() for name in mine} == mine
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["notes.txt", "step-1", "step-2"]
    assert "second" in (out / "checkpoints" / "step-2" / "trainer_state.json").read_text()


def test_overwrite_output_dir_keeps_a_readme_this_app_did_not_write(tmp_path, quick_args, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    mine = "---\ntags: [mine]\n---\n# My notes on this folder\n"
    (out / "README.md").write_text(mine)
    (out / "config.json").write_text("{}")  # an earlier model's file
    with monkeypatch.context() as patch:
        crashing_at_step(patch, 1)
        with pytest.raises(RuntimeError, match="the run crashed"):
            run_app([*quick_args, "--max_steps", "1", "--max_eval_samples", "8", "--overwrite_output_dir"])
    assert (out / "README.md").read_text() == mine and not (out / "config.json").exists()


def test_overwrite_output_dir_deletes_nothing_when_a_folder_of_the_earlier_run_cannot_be_emptied(tmp_path, quick_args):
    # The checkpoints went one by one until the locked one stopped the deleting: exit 2 with the earlier run's newest
    # checkpoint (or its model) lost, and nothing trained to replace it.
    out = tmp_path / "out"
    assert run_app([*quick_args, "--max_steps", "2", "--save_steps", "1", "--max_eval_samples", "8"]) == 0
    locked = out / "checkpoints" / "step-2"
    before = folder_state(out, files_only=True)
    args = [*quick_args, "--run_name", "second", "--max_steps", "1", "--overwrite_output_dir"]
    locked.chmod(0o555)
    try:
        result = train_without_root_powers(tmp_path, args)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (  # after the tokenizing bars of datasets
        f"error: --overwrite_output_dir: the earlier run's files in {locked} cannot be deleted (no permission to "
        "change that folder); "
        "nothing was deleted: make it writable, or choose another --output_dir"
    )
    assert folder_state(out, files_only=True) == before


@pytest.mark.parametrize(
    "inside, what",
    [
        ("checkpoints/step-2", "is a checkpoint"),
        ("checkpoints/step-2/new", "is inside a checkpoint"),
        ("checkpoints", "is a run's checkpoints folder"),
    ],
    ids=["a-checkpoint", "below-one", "the-checkpoints-folder"],
)
def test_an_output_dir_in_a_runs_checkpoints_is_refused_with_or_without_overwrite(
    tmp_path, quick_args, capfd, inside, what
):
    # The "not empty" refusal advised --overwrite_output_dir, which wrote the new run's model over step-2's weights:
    # `latest` then found step-2 damaged and fell back to step-1.
    out = tmp_path / "out"
    assert run_app([*quick_args, "--max_steps", "2", "--save_steps", "1", "--max_eval_samples", "8"]) == 0
    before, entries = folder_state(tmp_path, files_only=True), sorted(tmp_path.rglob("*"))
    capfd.readouterr()
    target = out / inside
    args = [*quick_args, "--output_dir", target, "--run_name", "other", "--max_steps", "1", "--overwrite_output_dir"]
    assert run_app(args) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: --output_dir {target} {what} (") and err.count("\n") == 1, err
    assert "pass an --output_dir outside it" in err and "--overwrite_output_dir" not in err
    # Files as they were, no entry added or left behind (a folder's own time changes with the claim it let go).
    assert folder_state(tmp_path, files_only=True) == before and sorted(tmp_path.rglob("*")) == entries


def test_overwrite_output_dir_follows_no_link_to_a_model_and_empties_linked_checkpoints(
    tmp_path, quick_args, monkeypatch
):
    # A `merged` link (to another disk) was rmtree'd: OSError, a traceback after every input check. A `checkpoints`
    # link was left as it was (rmtree's errors ignored): the new run's checkpoints mixed with the earlier run's.
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (elsewhere / "merged").mkdir(parents=True)
    (elsewhere / "merged" / "config.json").write_text("{}")
    (elsewhere / "checkpoints" / "step-7").mkdir(parents=True)
    (elsewhere / "checkpoints" / "step-7" / "trainer_state.json").write_text("{}")
    out.mkdir()
    (out / "merged").symlink_to(elsewhere / "merged")
    (out / "checkpoints").symlink_to(elsewhere / "checkpoints")
    with monkeypatch.context() as patch:
        crashing_at_step(patch, 1)
        with pytest.raises(RuntimeError, match="the run crashed"):
            run_app([*quick_args, "--max_steps", "1", "--max_eval_samples", "8", "--overwrite_output_dir"])
    assert not (out / "merged").exists() and (elsewhere / "merged" / "config.json").is_file(), "the link alone goes"
    assert (out / "checkpoints").is_symlink() and list((elsewhere / "checkpoints").iterdir()) == []


def test_a_copy_of_training_args_yaml_runs_the_same_again_as_a_new_run(tmp_path, quick_args, monkeypatch):
    # As the README says: it recorded the run's --output_dir and --run_name, and a copy was refused twice (the output
    # folder not empty, then the TensorBoard run taken), both "from --config".
    monkeypatch.chdir(tmp_path)  # the new run's default folders: outputs/<run_name> and runs/<run_name> here
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--max_eval_samples", "8", "--learning_rate", "1e-4"]
    assert run_app(args) == 0
    copy = tmp_path / "again.yaml"
    copy.write_text((tmp_path / "out" / "training_args.yaml").read_text())
    before = folder_state(tmp_path / "out")
    assert run_app(["--config", copy]) == 0
    (again,) = (tmp_path / "outputs").iterdir()
    assert yaml.safe_load((again / "training_args.yaml").read_text())["learning_rate"] == 1e-4
    assert (tmp_path / "runs" / again.name).is_dir() and folder_state(tmp_path / "out") == before


def test_a_copy_of_training_args_yaml_reads_the_runs_model_and_data_from_another_working_directory(
    tmp_path, tiny_model_dir, review_files, monkeypatch
):
    # Trained on `base` and `train.csv` relative to the project, the file recorded them as typed: from another working
    # directory its copy found no model, or, where that directory held a train.csv of its own, trained on it without
    # a word.
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    for folder in (project, elsewhere):
        shutil.copytree(tiny_model_dir, folder / "base")
        shutil.copy(review_files["validation"], folder / "validation.csv")
    shutil.copy(review_files["train"], project / "train.csv")
    shutil.copy(review_files["validation"], elsewhere / "train.csv")  # other data, under the same name
    monkeypatch.chdir(project)
    flags = ["--model_name_or_path", "base", "--train_file", "train.csv", "--validation_file", "validation.csv"]
    flags += ["--max_length", "64", "--max_steps", "2", "--eval_steps", "0", "--disable_tqdm"]
    assert run_app([*flags, "--output_dir", "out", "--run_name", "first"]) == 0
    recorded = yaml.safe_load((project / "out" / "training_args.yaml").read_text())
    names = ("model_name_or_path", "train_file", "validation_file", "logdir")
    assert [recorded[name] for name in names] == [
        str(project / "base"),
        str(project / "train.csv"),
        str(project / "validation.csv"),
        "runs",  # where a run writes is its working directory's, as its output folder is
    ]
    monkeypatch.chdir(elsewhere)
    assert run_app(["--config", project / "out" / "training_args.yaml", "--run_name", "again"]) == 0
    card = (elsewhere / "outputs" / "again" / "README.md").read_text()
    assert "96 training, 48 validation" in card, card  # the project's 96 examples, not the 48 of elsewhere's file
    assert (elsewhere / "runs" / "again").is_dir() and not (project / "runs" / "again").exists()


def test_training_args_yaml_keeps_hub_names_as_typed(tmp_path, monkeypatch):
    from app.config import TrainConfig
    from app.storage.folders import write_config

    monkeypatch.chdir(tmp_path)
    written = TrainConfig(model_name_or_path="owner/model", dataset_name="imdb", train_file="gone.csv")
    write_config(written, tmp_path)
    recorded = yaml.safe_load((tmp_path / "training_args.yaml").read_text())
    assert (recorded["model_name_or_path"], recorded["dataset_name"]) == ("owner/model", "imdb")
    assert recorded["train_file"] == "gone.csv"  # no file here to name: as typed


def test_a_training_args_yaml_of_the_users_own_is_no_failed_start_and_is_kept(tmp_path, quick_args, capfd):
    # `--config exp1/training_args.yaml --output_dir exp1`: taken for what a failed start leaves, the folder was
    # reused and the user's file, comments and all, replaced by the resolved config.
    from app.config import TrainConfig
    from app.storage.folders import write_config

    folder, written = tmp_path / "exp1", tmp_path / "written"
    folder.mkdir()
    written.mkdir()
    write_config(TrainConfig(run_name="earlier"), written)  # a run's own, copied and given a comment: the user's
    commented = (written / "training_args.yaml").read_text().replace("\nseed:", "\n# my seed\nseed:")
    for mine in (
        "# my settings\nlearning_rate: 3.0e-4\nmax_steps: 1\n",
        (ROOT / "configs" / "default.yaml").read_text(),  # every key, as a run writes them
        commented,
    ):
        (folder / "training_args.yaml").write_text(mine)  # a few keys, or a copy of the shipped config (every key)
        before = folder_state(folder)
        assert run_app([*quick_args, "--config", folder / "training_args.yaml", "--output_dir", folder]) == 2
        assert capfd.readouterr().err.startswith(
            f"error: --output_dir {folder} is not empty (it holds training_args.yaml); pass --overwrite_output_dir to "
            "replace what is there, or another --output_dir"
        )
        assert folder_state(folder) == before


def test_the_recorded_config_holds_no_action_on_the_folders_and_a_resume_says_it_keeps_them(
    tmp_path, quick_args, capfd
):
    # training_args.yaml recorded overwrite_output_dir: true: a copy of it passed to --config, to run the same again
    # with another learning rate, deleted the run. Under a resume the flag did nothing, without a word.
    args = [*quick_args, "--max_steps", "2", "--eval_steps", "0", "--max_eval_samples", "8", "--save_steps", "1"]
    assert run_app(args) == 0
    assert run_app([*args, "--overwrite_output_dir", "--run_name", "again"]) == 0
    recorded = yaml.safe_load((tmp_path / "out" / "training_args.yaml").read_text())
    assert (recorded["overwrite_output_dir"], recorded["resume_from_checkpoint"]) == (False, None)
    assert (recorded["output_dir"], recorded["run_name"]) == (None, None), "a copy run again is refused as this run"
    capfd.readouterr()
    resumed = [*args, "--run_name", "again", "--max_steps", "3", "--resume_from_checkpoint", "latest"]
    assert run_app([*resumed, "--overwrite_output_dir"]) == 0
    assert (
        f"note: --overwrite_output_dir is not applied: --resume_from_checkpoint continues the run in "
        f"{tmp_path / 'out'}, and keeps its files\n"
    ) in capfd.readouterr().out
    recorded = yaml.safe_load((tmp_path / "out" / "training_args.yaml").read_text())
    assert (recorded["overwrite_output_dir"], recorded["resume_from_checkpoint"], recorded["max_steps"]) == (
        False,
        None,
        3,
    )


def test_a_resume_from_another_working_directory_keeps_the_runs_curves_in_its_logdir(
    tmp_path, tiny_model_dir, review_files, monkeypatch, capsys
):
    # The default --logdir `runs` is relative: resumed from another directory, the curves' second part went to that
    # directory's runs/, apart from their first, without a word.
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    flags = [*map(str, data_flags(tiny_model_dir, review_files)), "--max_length", "64", "--eval_steps", "0"]
    flags += ["--save_steps", "1", "--run_name", "r", "--disable_tqdm", "--mixed_precision", "no"]
    monkeypatch.chdir(project)
    assert run_app([*flags, "--output_dir", "out", "--max_steps", "1"]) == 0
    monkeypatch.chdir(elsewhere)
    resume = [*flags, "--output_dir", project / "out", "--resume_from_checkpoint", "latest"]
    capsys.readouterr()
    assert run_app([*resume, "--max_steps", "2"]) == 0
    assert "note: --logdir" not in capsys.readouterr().out
    assert not (elsewhere / "runs").exists()
    assert sorted(tb.scalars(project / "runs" / "r")[tags.TRAIN_LOSS]) == [1, 2]
    # A project copied whole, resumed from its own folder, goes on in its own runs/; the original's are untouched.
    shutil.copytree(project, tmp_path / "copy")
    before = sorted(path.name for path in (project / "runs" / "r").iterdir())
    monkeypatch.chdir(tmp_path / "copy")
    assert run_app([*flags, "--output_dir", "out", "--resume_from_checkpoint", "latest", "--max_steps", "3"]) == 0
    assert sorted(path.name for path in (project / "runs" / "r").iterdir()) == before
    assert sorted(tb.scalars(tmp_path / "copy" / "runs" / "r")[tags.TRAIN_LOSS]) == [1, 2, 3]
    monkeypatch.chdir(elsewhere)
    # A --logdir given that is not the run's: kept, and said.
    assert run_app([*resume, "--max_steps", "3", "--logdir", "apart"]) == 0
    assert (
        f"note: --logdir apart is not the run's ({project / 'runs'}): the curves of this resume go there, apart from "
        "the run's earlier steps; leave --logdir out to keep them in one TensorBoard run"
    ) in capsys.readouterr().out
    assert sorted(tb.scalars(elsewhere / "apart" / "r")[tags.TRAIN_LOSS]) == [3]


def test_a_copy_s_resume_never_writes_in_the_original_s_curves_outside_the_project(
    tmp_path, tiny_model_dir, review_files, monkeypatch, capsys
):
    # With --logdir outside the project, a copy's resume found the run's curves there, the original's, wrote its
    # steps into them and moved the original's later points aside as a replaced line; at another depth, or beside
    # another project's --logdir, it found and took over other runs' curves.
    project, outside = tmp_path / "project", tmp_path / "tb"
    project.mkdir()
    flags = [*map(str, data_flags(tiny_model_dir, review_files)), "--max_length", "64", "--eval_steps", "0"]
    flags += ["--save_steps", "1", "--run_name", "r", "--disable_tqdm", "--mixed_precision", "no"]
    monkeypatch.chdir(project)
    assert run_app([*flags, "--output_dir", "out", "--max_steps", "2", "--logdir", outside]) == 0
    copy = tmp_path / "deeper" / "copy"
    shutil.copytree(project, copy)
    before = folder_state(outside / "r")
    monkeypatch.chdir(copy)
    resume = [*flags, "--output_dir", "out", "--resume_from_checkpoint", "out/checkpoints/step-1", "--max_steps", "2"]
    capsys.readouterr()
    assert run_app([*resume, "--logdir", outside]) == 2
    assert capsys.readouterr().err == (
        f"error: TensorBoard run {outside / 'r'} holds the curves of the run in {project / 'out'}, not of this one in "
        "out; pass another --logdir or --run_name for this run's\n"
    )
    assert run_app([*resume, "--logdir", outside, "--run_name", "r2"]) == 0  # as it says
    assert run_app(resume) == 0
    assert (
        f"note: the curves of this run's earlier steps are in {outside / 'r'} (saved from {project / 'out'}); this "
        f"resume's go in {copy / 'runs' / 'r'}"
    ) in capsys.readouterr().out
    assert folder_state(outside / "r") == before  # the original's curves, untouched
    assert sorted(tb.scalars(copy / "runs" / "r")[tags.TRAIN_LOSS]) == [2]
    # Moved, not copied (no checkpoint of the run left where it was saved): its curves outside go on, if asked.
    shutil.rmtree(tmp_path / "deeper")
    project.rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    moved = [*flags, "--output_dir", "out", "--resume_from_checkpoint", "latest", "--logdir", outside]
    assert run_app([*moved, "--max_steps", "3"]) == 0
    assert sorted(tb.scalars(outside / "r")[tags.TRAIN_LOSS]) == [2, 3]  # logged at each run's end
    assert not (tmp_path / "moved" / "runs").exists()
    # Another project's run of the same name where this resume is told to write: its curves are its own.
    (tmp_path / "q").mkdir()
    monkeypatch.chdir(tmp_path / "q")
    assert run_app([*flags, "--output_dir", "out", "--max_steps", "2"]) == 0
    into_q = [*flags, "--output_dir", tmp_path / "moved" / "out", "--resume_from_checkpoint", "latest"]
    capsys.readouterr()
    assert run_app([*into_q, "--logdir", "./runs", "--max_steps", "4"]) == 2
    assert capsys.readouterr().err == (
        f"error: TensorBoard run runs/r holds the curves of the run in {tmp_path / 'q' / 'out'}, not of this one in "
        f"{tmp_path / 'moved' / 'out'}; pass another --logdir or --run_name for this run's\n"
    )


@pytest.mark.parametrize("damage", ["empty", "a folder"])
def test_a_damaged_owner_stamp_of_a_tensorboard_run_is_one_line_not_taken_as_absent(
    tmp_path, quick_args, capsys, damage
):
    # Read as absent, an empty stamp let a copy's resume take the run's curves over (and restamp them its own); a
    # folder of that name gave a traceback once the model had loaded.
    assert run_app([*quick_args, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0"]) == 0
    stamp = tmp_path / "runs" / "test" / "written_for.json"
    stamp.unlink()
    stamp.write_text("") if damage == "empty" else stamp.mkdir()
    before = sorted(path.name for path in stamp.parent.iterdir())
    capsys.readouterr()
    resume = [*quick_args, "--max_steps", "3", "--eval_steps", "0", "--resume_from_checkpoint", "latest"]
    assert run_app(resume) == 2
    assert capsys.readouterr().err == (
        f"error: {stamp} cannot be read (damaged, or not a file): it names the output folder whose run writes these "
        f"curves; delete it if they are this run's ({tmp_path / 'out'}), or pass another --logdir or --run_name\n"
    )
    assert sorted(path.name for path in stamp.parent.iterdir()) == before  # nothing written there
    assert stamp.is_dir() if damage == "a folder" else stamp.read_text() == ""  # the stamp not rewritten
