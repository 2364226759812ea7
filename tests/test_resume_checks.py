"""Checkpoints are checked before a resume: each records its files, a damaged `latest` falls back to the newest intact
one, a damaged checkpoint named by path is refused, older unrecorded ones and a missing random state are notes."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from app.storage.checkpoints import completed_checkpoints, find_resume_point
from app.storage.integrity import RECORD, write_record
from app.telemetry import tags
from tests import tb
from tests.conftest import data_flags, folder_state, run_app


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir, review_files):
    """A run with checkpoints step-2 and step-4, and the flags that made it."""
    folder = tmp_path_factory.mktemp("finished")
    flags = [
        *data_flags(tiny_model_dir, review_files),
        *("--output_dir", folder / "out", "--logdir", folder / "runs", "--run_name", "r", "--max_steps", 4),
        *("--save_steps", 2, "--per_device_train_batch_size", 8, "--max_length", 32, "--max_eval_samples", 8),
        *("--mixed_precision", "no", "--disable_tqdm"),
    ]
    assert run_app(flags) == 0
    return folder, flags


@pytest.fixture
def run_copy(finished, tmp_path):
    """A fresh copy of the finished run, its curves with it, and its flags pointed at the copy (a copy's resume into the
    original's curves is refused)."""
    folder, flags = finished
    moved = {folder / "out": tmp_path / "out", folder / "runs": tmp_path / "runs"}
    for original, copy in moved.items():
        shutil.copytree(original, copy)
    return tmp_path / "out", [moved.get(arg, arg) for arg in flags]


def test_every_checkpoint_records_each_of_its_files(run_copy):
    out, _ = run_copy
    for checkpoint in completed_checkpoints(out / "checkpoints"):
        recorded = json.loads((checkpoint / RECORD).read_text())["files"]
        on_disk = {str(p.relative_to(checkpoint)): p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}
        assert on_disk.pop(RECORD)
        assert {name: entry["bytes"] for name, entry in recorded.items()} == on_disk
        assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "trainer_state.json"} <= set(on_disk)
        assert all(len(entry["sha256"]) == 64 for entry in recorded.values())


def damage(checkpoint, kind: str) -> str:
    """Damage one file of the checkpoint as a crash, a full disk or a stray edit would; return its name."""
    files = {"weights": "model.safetensors", "optimizer": "optimizer.bin", "state": "trainer_state.json"}
    name = files.get(kind.split()[-1], RECORD)
    path = checkpoint / name
    if kind.startswith("truncated"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind.startswith("deleted"):
        path.unlink()
    elif kind.startswith("garbage"):
        path.write_text("{not json")
    elif kind.startswith("reshaped"):  # valid JSON, not a record's shape
        path.write_text('{"files": []}')
    else:  # one byte changed, the size the same
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return name


KINDS = [
    "truncated weights",
    "truncated optimizer",
    "garbage state",
    "deleted weights",
    "flipped weights",
    "deleted state",
    "deleted record",  # this version records every checkpoint's files: without its record, it is not vouched for
    "reshaped record",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_latest_falls_back_to_the_newest_intact_checkpoint(run_copy, kind, capfd):
    out, flags = run_copy
    step_2, step_4 = out / "checkpoints" / "step-2", out / "checkpoints" / "step-4"
    name = damage(step_4, kind)
    capfd.readouterr()
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0
    lines = capfd.readouterr().out.splitlines()
    notes = [line for line in lines if line.startswith(f"note: {step_4} is damaged ({step_4 / name} ")]
    assert notes == [line for line in lines if " is damaged (" in line], lines
    assert notes[0].endswith(f"); resuming from {step_2}, the newest intact one")
    loaded = next(i for i, line in enumerate(lines) if line.startswith("run r: "))  # printed once the model loaded
    assert lines.index(notes[0]) < loaded, "said before anything loads"
    assert f"resumed from {step_2} at optimizer step 2" in lines


def test_a_damaged_checkpoint_named_by_path_is_refused_naming_the_file(run_copy, capfd):
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    damage(step_4, "truncated optimizer")
    before = sorted((p, p.stat().st_size) for p in out.rglob("*"))
    capfd.readouterr()
    assert run_app([*flags, "--resume_from_checkpoint", step_4]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: --resume_from_checkpoint {step_4} is damaged: {step_4 / 'optimizer.bin'} has ")
    assert sorted((p, p.stat().st_size) for p in out.rglob("*")) == before, "nothing written, no claim left"


def test_latest_with_every_checkpoint_damaged_is_refused_naming_the_newest(run_copy, capfd):
    out, flags = run_copy
    for checkpoint in completed_checkpoints(out / "checkpoints"):
        damage(checkpoint, "deleted weights")
    capfd.readouterr()
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: --resume_from_checkpoint latest: no intact checkpoint in {out / 'checkpoints'}")
    assert f"{out / 'checkpoints' / 'step-4' / 'model.safetensors'} is missing" in err
    # Each checkpoint was tried: it said "the newest is damaged" as if the others had not been.
    count = len(completed_checkpoints(out / "checkpoints"))
    assert count > 1 and f", all {count} are damaged, the newest: " in err, err
    assert err.rstrip().endswith("start fresh with --overwrite_output_dir, which deletes them and the run's model"), err


@pytest.mark.parametrize("missing", ["random state", "record"])
def test_a_checkpoint_without_its_random_state_or_an_older_one_without_a_record_resumes_with_a_note(
    run_copy, missing, capfd
):
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    (step_4 / ("random_states_0.pkl" if missing == "random state" else RECORD)).unlink()
    if missing == "record":  # as versions before records wrote it: no data position either
        saved = json.loads((step_4 / "trainer_state.json").read_text())
        (step_4 / "trainer_state.json").write_text(json.dumps({**saved, "data": None}))
    capfd.readouterr()
    assert run_app([*flags, "--max_steps", 5, "--resume_from_checkpoint", "latest"]) == 0
    out_lines = capfd.readouterr().out.splitlines()
    expected = {
        "random state": f"note: {step_4} has no random state for process 0: their dropout and other random draws "
        "start afresh, so the resume is not exact",
        "record": f"note: {step_4} has no record of its files (an older checkpoint): resuming from it unchecked",
    }[missing]
    assert expected in out_lines
    assert f"resumed from {step_4} at optimizer step 4" in out_lines


def test_a_latest_without_its_state_file_or_record_is_named_as_damaged(run_copy, capfd):
    """An unrecorded checkpoint (as older versions wrote) that lost its trainer_state.json is not passed over."""
    out, flags = run_copy
    step_2, step_4 = out / "checkpoints" / "step-2", out / "checkpoints" / "step-4"
    (step_4 / RECORD).unlink()
    (step_4 / "trainer_state.json").unlink()
    capfd.readouterr()
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert (
        f"note: {step_4} is damaged ({step_4 / 'trainer_state.json'} is missing); resuming from {step_2}, the newest "
        "intact one"
    ) in lines, lines
    assert f"resumed from {step_2} at optimizer step 2" in lines


def test_a_resume_with_another_label_count_is_one_line_before_anything_is_written(run_copy, review_files, capfd):
    # Accelerate's load would fail on the head's shape after the run's folders were written, with a long traceback.
    out, flags = run_copy
    three = {}
    for split, path in review_files.items():
        frame = pd.read_csv(path)
        frame.loc[::3, "label"] = "meh"
        three[split] = out.parent / f"three-{split}.csv"
        frame.to_csv(three[split], index=False)
    before = folder_state(out)
    capfd.readouterr()
    resumed = [*flags, "--train_file", three["train"], "--validation_file", three["validation"]]
    assert run_app([*resumed, "--resume_from_checkpoint", "latest"]) == 2
    err = capfd.readouterr().err
    assert err == (
        f"error: --resume_from_checkpoint {out / 'checkpoints' / 'step-4'} holds the weights of another model "
        "(classifier.bias is [2] there, [3] in this run's model): resume with the model and labels it was trained "
        "with, or start the new model in another --output_dir\n"
    )
    assert folder_state(out) == before


def test_a_resume_on_renamed_labels_is_one_line_before_anything_is_written(run_copy, review_files, capfd):
    # "great" renamed "z-great" sorts after "other": class 0 would have changed meaning, silently, at the same shape.
    out, flags = run_copy
    renamed = {}
    for split, path in review_files.items():
        frame = pd.read_csv(path)
        frame["label"] = frame["label"].replace({"great": "z-great"})
        renamed[split] = out.parent / f"renamed-{split}.csv"
        frame.to_csv(renamed[split], index=False)
    before = folder_state(out)
    capfd.readouterr()
    resumed = [*flags, "--train_file", renamed["train"], "--validation_file", renamed["validation"]]
    assert run_app([*resumed, "--max_steps", 6, "--resume_from_checkpoint", "latest"]) == 2
    assert capfd.readouterr().err == (
        f"error: --resume_from_checkpoint {out / 'checkpoints' / 'step-4'} was trained on the labels 0: great, "
        "1: other; this data's are 0: other, 1: z-great, so class ids would change meaning: resume on data with the "
        "run's labels, or start a new run in another --output_dir\n"
    )
    assert folder_state(out) == before


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside_and_latest_continues_it(run_copy, capfd):
    # Else `latest` would pick the abandoned step-4 over this resume's own checkpoints, and pruning would count it.
    out, flags = run_copy
    root = out / "checkpoints"
    capfd.readouterr()
    resumed = [*flags, "--max_steps", 3, "--save_steps", 1, "--save_total_limit", 2]
    assert run_app([*resumed, "--resume_from_checkpoint", root / "step-2"]) == 0
    aside = root / "replaced-after-step-2"
    assert (
        f"note: the run had gone on past step-2: its later checkpoints (step-4) are moved to {aside}, so that "
        "--resume_from_checkpoint latest continues this run; delete that folder when you no longer need them"
    ) in capfd.readouterr().out.splitlines()
    assert [p.name for p in completed_checkpoints(root)] == ["step-2", "step-3"]
    assert completed_checkpoints(aside) == [aside / "step-4"]
    assert find_resume_point("latest", str(out)).path == root / "step-3"


def test_a_resume_says_which_flags_the_checkpoint_overrides_and_records_what_ran(run_copy, capfd):
    # The optimizer's state holds the run's learning rate and weight decay: new values did not apply, without a word,
    # while training_args.yaml claimed them.
    out, flags = run_copy
    capfd.readouterr()
    changed = [*flags, "--learning_rate", "1e-3", "--weight_decay", "0.1", "--max_steps", 5]
    assert run_app([*changed, "--resume_from_checkpoint", "latest"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert (
        "note: a resume continues the run's training as it was set: learning_rate 5e-05 and weight_decay 0.01 as the "
        "run had them, not --learning_rate 0.001, --weight_decay 0.1; a new run can change them"
    ) in lines
    assert (
        "note: the run was set to 4 optimizer steps, this resume to 5 optimizer steps: the learning-rate schedule is "
        "recomputed for the new length, so the learning rate changes from the checkpoint's"
    ) in lines
    recorded = yaml.safe_load((out / "training_args.yaml").read_text())
    assert (recorded["learning_rate"], recorded["weight_decay"], recorded["max_steps"]) == (5e-5, 0.01, 5)


def test_a_new_length_gives_the_first_resumed_update_the_new_schedule_s_learning_rate(run_copy, tmp_path):
    # The optimizer's state holds the LR of the checkpoint's schedule: at the 4-step run's end, 0. The first update of
    # the 5-step resume took it, and left the weights as they were.
    out, flags = run_copy
    assert run_app([*flags, "--max_steps", 5, "--logging_steps", 1, "--resume_from_checkpoint", "latest"]) == 0
    # warmup ceil(0.1 * 5) = 1 step, then linear decay: after 4 applied updates, (5 - 4) / (5 - 1) of the peak
    assert tb.scalars(tmp_path / "runs" / "r")[tags.TRAIN_LR][5] == pytest.approx(5e-5 * 0.25, rel=1e-6)
    before, after = (
        load_file(out / "checkpoints" / "step-4" / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert any(not torch.equal(before[name], after[name]) for name in before), "step 5 left the weights as they were"


def test_a_checkpoint_copied_under_another_name_resumes_and_sets_the_later_line_aside(run_copy, capfd):
    # Its step is the one it records: the name is the user's (a copy, a link). It crashed on the name (exit 1).
    out, flags = run_copy
    root = out / "checkpoints"
    shutil.copytree(root / "step-2", root / "good-step-2")
    capfd.readouterr()
    assert run_app([*flags, "--max_steps", 3, "--resume_from_checkpoint", root / "good-step-2"]) == 0, (
        capfd.readouterr().err[-2000:]
    )
    assert f"resumed from {root / 'good-step-2'} at optimizer step 2" in capfd.readouterr().out
    assert [p.name for p in completed_checkpoints(root)] == ["step-2", "step-3"]
    assert completed_checkpoints(root / "replaced-after-step-2") == [root / "replaced-after-step-2" / "step-4"]


def test_a_resume_that_fails_before_it_writes_a_curve_hides_none_of_the_run_s_points(finished, tmp_path, monkeypatch):
    # A resume from step-2 hides what the run logged after step 2 (purge_step 3), the moment its event file opens.
    # When that resume failed before training, step 4's points stayed hidden under the next resume, from step-4.
    from app.storage.checkpoints import Checkpoints

    folder, flags = finished
    out, runs = tmp_path / "out", tmp_path / "runs"
    flags = [{folder / "out": out, folder / "runs": runs}.get(arg, arg) for arg in flags]
    assert run_app(flags) == 0  # the run in folders of its own: the module's are resumed into by other tests

    def broken(*_):
        raise RuntimeError("a failure while resuming")

    with monkeypatch.context() as patch:
        patch.setattr(Checkpoints, "set_aside_later", broken)
        with pytest.raises(RuntimeError, match="a failure while resuming"):
            run_app([*flags, "--resume_from_checkpoint", out / "checkpoints" / "step-2"])
    assert run_app([*flags, "--max_steps", 6, "--logging_steps", 1, "--resume_from_checkpoint", "latest"]) == 0
    assert sorted(tb.scalars(runs / "r")[tags.TRAIN_LOSS]) == [4, 5, 6]


def test_a_resume_under_another_run_name_says_where_its_curves_go(run_copy, capfd):
    # The curves of steps 3 and 4 went to runs/other, those before stayed in runs/r, without a word.
    out, flags = run_copy
    flags = [arg for i, arg in enumerate(flags) if "--run_name" not in flags[max(i - 1, 0) : i + 1]]
    runs = flags[flags.index("--logdir") + 1]
    capfd.readouterr()
    assert run_app([*flags, "--run_name", "other", "--resume_from_checkpoint", out / "checkpoints" / "step-2"]) == 0
    assert (
        f"note: --run_name other continues run r: its curves go on in {runs / 'other'}, apart from its earlier steps' "
        "(in run r); leave --run_name out to keep them in one TensorBoard run"
    ) in capfd.readouterr().out.splitlines()


def test_what_users_pass_to_resume_from_checkpoint_gets_a_line_that_says_what_to_pass(run_copy, tmp_path, capfd):
    out, flags = run_copy
    expected = {
        tmp_path / "no-such": f"error: --resume_from_checkpoint {tmp_path / 'no-such'}: no such folder; give a "
        "checkpoint folder (<output_dir>/checkpoints/step-N), or latest with the run's --output_dir\n",
        out / "training_args.yaml": f"error: --resume_from_checkpoint {out / 'training_args.yaml'}: a file, not a "
        "folder; give a checkpoint folder (<output_dir>/checkpoints/step-N), or latest with the run's --output_dir\n",
        out: f"error: --resume_from_checkpoint {out} is a run's output folder; pass --resume_from_checkpoint latest "
        f"--output_dir {out}, or one of its checkpoints ({out / 'checkpoints' / 'step-N'})\n",
    }
    capfd.readouterr()
    for spec, line in expected.items():
        assert run_app([*flags, "--resume_from_checkpoint", spec]) == 2
        assert capfd.readouterr().err == line
    elsewhere = [*flags, "--output_dir", tmp_path / "elsewhere", "--resume_from_checkpoint", "latest"]
    assert run_app(elsewhere) == 2
    assert capfd.readouterr().err == (
        f"error: --resume_from_checkpoint latest: no checkpoint in {tmp_path / 'elsewhere'}/checkpoints; pass the "
        "--output_dir of the run to continue, or drop the flag to start fresh\n"
    )
    # HF Trainer's resume_from_checkpoint=True is the newest checkpoint of the output folder.
    assert run_app([*flags, "--resume_from_checkpoint", "true"]) == 0
    assert f"resumed from {out / 'checkpoints' / 'step-4'} at optimizer step 4" in capfd.readouterr().out


def test_latest_finds_a_run_in_outputs_by_its_name_and_a_branch_into_another_folder_is_a_new_run(
    run_copy, tmp_path, monkeypatch, capfd
):
    out, flags = run_copy
    shutil.copytree(out, tmp_path / "outputs" / "r")
    monkeypatch.chdir(tmp_path)
    without_output_dir = [arg for i, arg in enumerate(flags) if "--output_dir" not in flags[i - 1 : i + 1]]
    capfd.readouterr()
    assert run_app([*without_output_dir, "--resume_from_checkpoint", "latest"]) == 0  # --run_name r in the flags
    assert "resumed from outputs/r/checkpoints/step-4 at optimizer step 4" in capfd.readouterr().out

    # From another run's checkpoint into a new output folder: the run's TensorBoard folder is left to it.
    branch = [*without_output_dir[: without_output_dir.index("--run_name")], "--output_dir", tmp_path / "branch"]
    branch += ["--max_steps", 5, "--resume_from_checkpoint", out / "checkpoints" / "step-2"]
    assert run_app(branch) == 0
    said = capfd.readouterr().out
    assert "run r:" not in said and f"model: {tmp_path / 'branch'}" in said


def test_a_branch_gets_the_checks_of_a_new_run_in_folders_that_hold_another_run(run_copy, tmp_path, capfd):
    # A resume into another --output_dir is a new run: it replaced another run's model and checkpoints without
    # --overwrite_output_dir, and under that run's --run_name it wrote into its TensorBoard folder.
    out, flags = run_copy
    other = tmp_path / "other"
    shutil.copytree(out, other)
    before = folder_state(tmp_path, files_only=True)
    branch = [*flags, "--output_dir", other, "--resume_from_checkpoint", out / "checkpoints" / "step-2"]
    capfd.readouterr()
    assert run_app(branch) == 2
    assert capfd.readouterr().err == (
        f"error: --output_dir {other} is not empty; pass --resume_from_checkpoint latest to continue that run, "
        "--overwrite_output_dir to replace it, or another --output_dir\n"
    )
    runs = flags[flags.index("--logdir") + 1]
    assert (
        run_app([*flags, "--output_dir", tmp_path / "new", "--resume_from_checkpoint", out / "checkpoints" / "step-2"])
        == 2
    )
    assert capfd.readouterr().err == (
        f"error: TensorBoard run {runs / 'r'} already exists and would mix two runs: it holds an earlier run's "
        "curves; pass another --run_name, leave it unset for a unique one, or delete that folder to use the name "
        "again\n"
    )
    assert folder_state(tmp_path, files_only=True) == before


def test_a_set_aside_checkpoint_resumes_in_its_run_and_sets_the_line_that_replaced_it_aside(run_copy, capfd):
    out, flags = run_copy
    root = out / "checkpoints"
    assert run_app([*flags, "--max_steps", 3, "--resume_from_checkpoint", root / "step-2"]) == 0
    replaced = root / "replaced-after-step-2"
    capfd.readouterr()
    resumed = [arg for i, arg in enumerate(flags) if "--output_dir" not in flags[i - 1 : i + 1]]  # found from the path
    assert run_app([*resumed, "--max_steps", 5, "--resume_from_checkpoint", replaced / "step-4"]) == 0
    said = capfd.readouterr().out.splitlines()
    assert f"resumed from {replaced / 'step-4'} at optimizer step 4" in said
    assert (
        f"note: the run had gone on past step-2: its later checkpoints (step-3) are moved to {root}/"
        "replaced-after-step-2-2, so that --resume_from_checkpoint latest continues this run; delete that folder when "
        "you no longer need them"
    ) in said
    assert [p.name for p in completed_checkpoints(root)] == ["step-2", "step-5"]
    assert completed_checkpoints(root / "replaced-after-step-2-2") == [root / "replaced-after-step-2-2" / "step-3"]
    assert (out / "model.safetensors").is_file() and not (root / "model.safetensors").exists()


@pytest.mark.parametrize("where", [".", "merged", "models/base"], ids=["the-model-folder", "its-merged", "elsewhere"])
def test_an_output_dir_that_is_or_holds_the_model_being_fine_tuned_is_refused(
    tmp_path, tiny_model_dir, review_files, where, capfd
):
    # With --overwrite_output_dir the final save replaced the model's files there: an adapters run lost its base. A
    # model in a folder the run does not write (models/base) is left alone, as the run leaves it.
    out = tmp_path / "model"
    model = out / where if where != "." else out
    shutil.copytree(tiny_model_dir, model)
    before = folder_state(model, files_only=True)
    flags = [
        *data_flags(model, review_files),
        "--output_dir",
        out,
        "--logdir",
        tmp_path / "runs",
        "--overwrite_output_dir",
    ]
    capfd.readouterr()
    code = run_app([*flags, "--max_steps", 1, "--use_peft", "--max_eval_samples", 8, "--disable_tqdm"])
    if where == "models/base":
        assert code == 0 and (out / "adapter_config.json").is_file()
    else:
        assert code == 2
        assert capfd.readouterr().err == (
            f"error: --output_dir {out} {'is' if where == '.' else 'holds'} the model being fine-tuned "
            f"(--model_name_or_path {model}): the run's model would replace it; pass another --output_dir\n"
        )
    assert folder_state(model, files_only=True) == before


def test_a_plain_resume_of_a_run_with_its_own_settings_has_nothing_to_say():
    # The run's command without --learning_rate resumes at the run's 1e-4: no flag asked for 5e-5 (the default). Its
    # --max_steps decides the length, whatever --num_train_epochs says.
    from app.config import TrainConfig
    from app.optim import resumed_settings

    recorded = {"learning_rate": 1e-4, "weight_decay": 0.0, "warmup_ratio": 0.0, "max_steps": 4, "num_train_epochs": 2}
    cfg, notes = resumed_settings(TrainConfig(max_steps=4), recorded)
    assert notes == []
    assert (cfg.learning_rate, cfg.weight_decay, cfg.warmup_ratio) == (1e-4, 0.0, 0.0)
    # A new warmup rewrote the schedule mid-run (the LR climbed again), without a word.
    changed = TrainConfig(max_steps=0, num_train_epochs=2, learning_rate=3e-4, warmup_ratio=0.9)
    cfg, notes = resumed_settings(changed, recorded)
    assert cfg.warmup_ratio == 0.0
    assert notes == [
        "note: a resume continues the run's training as it was set: learning_rate 0.0001 and warmup_ratio 0 as the run "
        "had them, not --learning_rate 0.0003, --warmup_ratio 0.9; a new run can change them",
        "note: the run was set to 4 optimizer steps, this resume to 2 epochs: the learning-rate schedule is "
        "recomputed for the new length, so the learning rate changes from the checkpoint's",
    ]
    # Another adapter dropout trained on under the run's model card and adapter_config.json, without a word.
    cfg, notes = resumed_settings(TrainConfig(max_steps=4, lora_dropout=0.3), {**recorded, "lora_dropout": 0.05})
    assert cfg.lora_dropout == 0.05
    assert notes == [
        "note: a resume continues the run's training as it was set: lora_dropout 0.05 as the run had it, not "
        "--lora_dropout 0.3; a new run can change it"
    ]


def test_the_weights_check_of_a_resume_leaves_sharded_layouts_to_accelerate(tmp_path):
    # Under FSDP's SHARDED_STATE_DICT a checkpoint holds pytorch_model_fsdp_0/, no model.safetensors: the check raised
    # FileNotFoundError where the resume had worked.
    import torch
    from safetensors.torch import save_file

    from app.storage.checkpoints import stored_shapes, weights_mismatch

    model = torch.nn.Linear(3, 2)
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    assert stored_shapes(tmp_path / "model.safetensors") is None  # adapters/plan.check_full_weights: nothing to check
    save_file({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, tmp_path / "model.safetensors")
    stored = stored_shapes(tmp_path / "model.safetensors")
    assert weights_mismatch(stored, model) == "weight is [2, 4] there, [2, 3] in this run's model"


def test_the_model_card_shows_the_command_that_started_the_run_then_each_resumes(run_copy, monkeypatch):
    # It showed the last resume's command alone: run again, that resumes; it does not say how the run began.
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    [started] = json.loads((step_4 / "trainer_state.json").read_text())["commands"]
    resumes = []
    for steps in (6, 8):
        argv = ["app/train.py", *map(str, flags), "--max_steps", str(steps), "--resume_from_checkpoint", "latest"]
        monkeypatch.setattr("sys.argv", argv)  # the command line that the card and the checkpoints record
        assert run_app(argv[1:]) == 0
        resumes.append(" ".join(argv))
    card = (out / "README.md").read_text()
    shown = card[card.index("## How it was trained") :]
    assert shown.index(f"Started with:\n\n    {started}\n") < shown.index(f"Resumed with:\n\n    {resumes[0]}\n")
    assert shown.index(f"Resumed with:\n\n    {resumes[0]}\n") < shown.index(f"Resumed with:\n\n    {resumes[1]}\n")

    # A checkpoint of an earlier version records no commands: the first is said to be unknown.
    step_8 = out / "checkpoints" / "step-8"
    saved = json.loads((step_8 / "trainer_state.json").read_text())
    del saved["commands"]
    (step_8 / "trainer_state.json").write_text(json.dumps(saved))
    write_record(step_8)  # as that version recorded its files
    argv = ["app/train.py", *map(str, flags), "--max_steps", "10", "--resume_from_checkpoint", str(step_8)]
    monkeypatch.setattr("sys.argv", argv)
    assert run_app(argv[1:]) == 0
    card = (out / "README.md").read_text()
    assert "Started with:\n\n    (not recorded: its checkpoint was written by an earlier version)\n" in card, card
    assert f"Resumed with:\n\n    {' '.join(argv)}\n" in card


def test_a_run_that_began_computing_every_row_resumes_so_and_a_new_one_with_the_first_token_alone(run_copy):
    # tasks/first_token.py: a resume continues as its run began, so that it continues exactly (its masks' shapes).
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    saved = json.loads((step_4 / "trainer_state.json").read_text())
    assert saved["first_token_alone"] is True, "a new run of the tiny BERT classifier computes the first token alone"
    del saved["first_token_alone"]  # as checkpoints written before it was recorded
    (step_4 / "trainer_state.json").write_text(json.dumps(saved))
    write_record(step_4)
    assert run_app([*flags, "--max_steps", 6, "--resume_from_checkpoint", "latest"]) == 0
    assert json.loads((out / "checkpoints" / "step-6" / "trainer_state.json").read_text())["first_token_alone"] is False


def test_a_max_steps_before_the_checkpoints_step_is_one_line_before_anything_is_written(run_copy, capfd):
    # It trained nothing and saved step 4's model as the 3-step run's, under a note that the schedule was recomputed.
    out, flags = run_copy
    before = folder_state(out)
    capfd.readouterr()
    assert run_app([*flags, "--max_steps", 3, "--resume_from_checkpoint", "latest"]) == 2
    out_text, err = capfd.readouterr()
    assert "schedule is recomputed" not in out_text  # a note of the resume that is refused
    assert err == (
        f"error: --max_steps 3 ends before --resume_from_checkpoint {out / 'checkpoints' / 'step-4'} (optimizer step "
        "4): nothing would train, and the model saved would be step 4's; give --max_steps 4 or more, or resume from a "
        "checkpoint at step 3 or before\n"
    )
    assert folder_state(out) == before


@pytest.mark.parametrize(
    "length, said",
    [
        (
            [],
            "note: the checkpoint is at step 4, the run's last: nothing is left to train; the model is saved and "
            "evaluated again",
        ),
        (
            ["--max_steps", -1, "--num_train_epochs", 0.1],
            "note: the checkpoint is at step 4, past this run's 2 "
            "optimizer steps: nothing trains, and the model saved is step 4's",
        ),
    ],
    ids=["the run's last step", "past a length in epochs"],
)
def test_a_resume_with_nothing_left_to_train_says_so(run_copy, capfd, length, said):
    out, flags = run_copy
    capfd.readouterr()
    assert run_app([*flags, *length, "--resume_from_checkpoint", "latest"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert said in lines
    assert f"evaluating the final model (step 4's, saved in {out})" in lines


def test_a_resume_with_nothing_left_to_train_replaces_the_evaluation_of_its_step(finished, tmp_path):
    # What a scheduler that always resumes does after a run that ended (or was stopped during its final evaluation):
    # the final evaluation of step 4 was drawn twice, at the same step.
    folder, flags = finished
    moved = {folder / "out": tmp_path / "out", folder / "runs": tmp_path / "runs"}  # a run of this test's own
    flags = [moved.get(arg, arg) for arg in flags]
    assert run_app(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    before = {tag: tb.raw_points(run_dir, tag) for tag in (tags.EVAL_LOSS, tags.TRAIN_LOSS)}
    assert [step for step, _ in before[tags.EVAL_LOSS]].count(4) == 1
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0
    after = {tag: tb.raw_points(run_dir, tag) for tag in (tags.EVAL_LOSS, tags.TRAIN_LOSS)}
    assert after == before, "one point per step, of the same weights; the other tags at that step kept"


def test_a_resume_in_another_precision_replaces_the_runs_hparams_row(finished, tmp_path):
    # TensorBoard shows the first row a run holds: the run's fp32 row stood beside the bf16 resume's final metrics.
    folder, flags = finished
    moved = {folder / "out": tmp_path / "out", folder / "runs": tmp_path / "runs"}
    flags = [moved.get(arg, arg) for arg in flags]
    assert run_app(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    assert [row["precision"] for row in tb.hparams_rows(run_dir)] == ["no"]
    resumed = [*flags, "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoints" / "step-2")]
    resumed[resumed.index("--mixed_precision") + 1] = "bf16"
    assert run_app(resumed) == 0
    rows = tb.hparams_rows(run_dir)
    # One row, the run's: steps 1-2 ran in fp32, the rest in bf16.
    assert [(row["precision"], row["loss_scaling"]) for row in rows] == [("no then bf16", "false")]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2, "the earlier run's file kept, less its row"


def test_a_resume_with_another_seed_keeps_the_runs_held_out_rows_and_records_its_seed(
    tmp_path, tiny_model_dir, review_files, capfd
):
    # The held-out validation split was drawn with the resume's --seed: other rows held out, so some of the run's
    # validation rows were trained on and some training rows never seen again, without a note (the same row count).
    flags = [
        *("--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"]),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "r", "--save_steps", 2),
        *("--per_device_train_batch_size", 8, "--max_length", 32, "--mixed_precision", "no", "--disable_tqdm"),
    ]
    assert run_app([*flags, "--max_steps", 2]) == 0
    capfd.readouterr()
    assert run_app([*flags, "--max_steps", 4, "--seed", 7, "--resume_from_checkpoint", "latest"]) == 0
    out = capfd.readouterr().out
    assert (
        "note: a resume keeps its run's seed (42): the same held-out validation rows and order of the examples, so "
        "that it continues exactly; --seed 7 applies to new runs"
    ) in out.splitlines()
    assert "held out from the training data at random with --seed 42;" in out
    assert yaml.safe_load((tmp_path / "out" / "training_args.yaml").read_text())["seed"] == 42


@pytest.fixture
def five_steps(finished, tmp_path):
    """A run of 5 steps logged and saved at each (checkpoints step-3 to step-5 kept), in folders of its own."""
    folder, flags = finished
    out, runs = tmp_path / "out", tmp_path / "runs"
    flags = [{folder / "out": out, folder / "runs": runs}.get(arg, arg) for arg in flags]
    flags = [*flags, "--max_steps", 5, "--logging_steps", 1, "--save_steps", 1, "--save_total_limit", 3]
    assert run_app(flags) == 0
    return out, runs / "r", flags


def test_a_resume_takes_what_the_killed_run_logged_past_its_checkpoint_out_of_the_event_files(five_steps):
    # SummaryWriter's purge step hid step 5's first points from EventAccumulator, but TensorBoard's server ignores
    # it: it drew both step 5s, the killed run's and the resumed run's.
    out, run_dir, flags = five_steps
    shutil.rmtree(out / "checkpoints" / "step-5")  # killed after step 5 logged, before its checkpoint was written
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0
    assert [step for step, _ in tb.raw_points(run_dir, tags.TRAIN_LOSS)] == [1, 2, 3, 4, 5]
    assert not list(run_dir.glob(".*")), "no file left half-written"


def test_a_resume_from_an_older_checkpoint_moves_the_replaced_lines_points_beside_its_checkpoints(five_steps):
    out, run_dir, flags = five_steps
    replaced = tb.raw_points(run_dir, tags.TRAIN_LOSS)[3:]
    assert run_app([*flags, "--resume_from_checkpoint", out / "checkpoints" / "step-3"]) == 0
    assert (out / "checkpoints" / "replaced-after-step-3").is_dir()
    assert [step for step, _ in tb.raw_points(run_dir, tags.TRAIN_LOSS)] == [1, 2, 3, 4, 5]
    # The line it replaced: a TensorBoard run of its own, its points as they were logged.
    assert tb.raw_points(run_dir / "replaced-after-step-3", tags.TRAIN_LOSS) == replaced
    assert sorted(tb.scalars(run_dir / "replaced-after-step-3")[tags.TRAIN_LOSS]) == [4, 5]


def test_a_resume_from_a_set_aside_checkpoint_moves_the_replacing_lines_points_from_where_the_lines_part(five_steps):
    # Resumed from replaced-after-step-3/step-4, the line that had replaced it was set aside from step 3, but its
    # curves from step 5 only: its step 4 stayed in the resumed line's curves.
    out, run_dir, flags = five_steps
    root = out / "checkpoints"
    assert run_app([*flags, "--resume_from_checkpoint", root / "step-3"]) == 0  # line B replaces A after step 3
    line_b = tb.raw_points(run_dir, tags.TRAIN_LOSS)[3:]
    assert run_app([*flags, "--resume_from_checkpoint", root / "replaced-after-step-3" / "step-4"]) == 0  # A again
    assert (root / "replaced-after-step-3-2").is_dir(), "B's checkpoints, set aside in turn"
    assert tb.raw_points(run_dir / "replaced-after-step-3-2", tags.TRAIN_LOSS) == line_b
    assert [step for step, _ in tb.raw_points(run_dir, tags.TRAIN_LOSS)] == [1, 2, 3, 5]  # A's 4: in its own folder
    assert [step for step, _ in tb.raw_points(run_dir / "replaced-after-step-3", tags.TRAIN_LOSS)] == [4, 5]


def test_a_kill_right_after_a_resume_sets_a_line_aside_keeps_its_points(five_steps, monkeypatch):
    # The checkpoints moved at once, the curves at the first write: a kill between them left step-3 as latest, and
    # the next resume took the replaced line's points for a killed run's and removed them.
    import app.wiring

    out, run_dir, flags = five_steps
    replaced = tb.raw_points(run_dir, tags.TRAIN_LOSS)[3:]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill would stop it: nothing after this line runs

    with monkeypatch.context() as patch:
        patch.setattr(app.wiring, "Telemetry", killed)
        with pytest.raises(KeyboardInterrupt):
            run_app([*flags, "--resume_from_checkpoint", out / "checkpoints" / "step-3"])
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0
    assert tb.raw_points(run_dir / "replaced-after-step-3", tags.TRAIN_LOSS) == replaced
    assert [step for step, _ in tb.raw_points(run_dir, tags.TRAIN_LOSS)] == [1, 2, 3, 4, 5]


def test_the_replaced_lines_curves_move_before_its_checkpoints(five_steps, monkeypatch):
    # Moved after them, a kill in between left the points to the next resume, which removed them as a killed run's.
    from pathlib import Path

    out, run_dir, flags = five_steps
    replaced = tb.raw_points(run_dir, tags.TRAIN_LOSS)[3:]
    mkdir = Path.mkdir

    def killed_before_the_checkpoints_move(self, *args, **kwargs):
        if self.parent.name == "checkpoints" and self.name.startswith("replaced-after-step-"):
            raise KeyboardInterrupt  # as a kill would stop it here
        return mkdir(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", killed_before_the_checkpoints_move)
        with pytest.raises(KeyboardInterrupt):
            run_app([*flags, "--resume_from_checkpoint", out / "checkpoints" / "step-3"])
    assert run_app([*flags, "--resume_from_checkpoint", "latest"]) == 0  # the old line's step-5: nothing left
    assert tb.raw_points(run_dir / "replaced-after-step-3", tags.TRAIN_LOSS) == replaced, "aside, not lost"


def test_a_resume_that_names_another_model_says_whose_config_and_tokenizer_go_on(run_copy, tiny_model_dir, capfd):
    # The checkpoint's weights went on under another folder's config and tokenizer without a word; the same folder
    # by another path (a relative one) is the run's.
    out, flags = run_copy
    other = out.parent / "copy-of-the-model"
    shutil.copytree(tiny_model_dir, other)
    model_at = flags.index("--model_name_or_path") + 1
    for model in (os.path.relpath(tiny_model_dir), other):
        resumed = [*flags[:model_at], model, *flags[model_at + 1 :], "--resume_from_checkpoint", "latest"]
        capfd.readouterr()
        assert run_app(resumed) == 0  # at the run's last step: saved and evaluated again
        said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("note: the run was trained")]
        expected = (
            f"note: the run was trained from {tiny_model_dir}, this resume names {other}: the checkpoint's weights "
            "go on under its config and tokenizer, which the output folder will hold; resume with the run's "
            "--model_name_or_path to keep the run's"
        )
        assert said == ([expected] if model == other else [])


LM_FLAGS = ["--task", "causal_lm", "--prompt_column", "text", "--response_column", "label"]
CLASSIFIER_FLAGS = ["--task", "sequence_classification", "--text_column", "text", "--label_column", "label"]


@pytest.mark.parametrize(
    "trained, resumed, lacking",
    [
        (LM_FLAGS, CLASSIFIER_FLAGS, "score.weight is not in the checkpoint"),
        (CLASSIFIER_FLAGS, LM_FLAGS, "score.weight is not in this run's model"),
    ],
    ids=["causal_lm as a classifier", "classifier as a causal_lm"],
)
def test_a_checkpoint_resumed_as_another_task_is_one_line_before_anything_is_written(
    tmp_path, tiny_llama_dir, review_files, capfd, trained, resumed, lacking
):
    # The tied LM head is stored once, so an LM's checkpoint held no weight the classifier lacks: the check passed,
    # the run rewrote training_args.yaml with the new task and columns, and Accelerate's load failed (exit 1).
    flags = [
        *data_flags(tiny_llama_dir, review_files),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "r", "--max_steps", 2),
        *("--save_steps", 2, "--per_device_train_batch_size", 8, "--max_length", 48, "--max_eval_samples", 8),
        *("--mixed_precision", "no", "--disable_tqdm"),
    ]
    assert run_app([*flags, *trained]) == 0
    before = folder_state(tmp_path, files_only=True)
    step_2 = tmp_path / "out" / "checkpoints" / "step-2"
    capfd.readouterr()
    assert run_app([*flags, *resumed, "--max_steps", 4, "--resume_from_checkpoint", "latest"]) == 2
    was, now = trained[1], resumed[1]
    assert capfd.readouterr().err == (
        f"error: --resume_from_checkpoint {step_2} holds a {was} model, not one for this run's --task {now} "
        f"({lacking}): resume with --task {was}, or start the new task in another --output_dir\n"
    )
    assert folder_state(tmp_path, files_only=True) == before


def test_a_resume_that_fails_while_loading_the_checkpoint_leaves_the_run_s_folders_as_they_were(run_copy, capfd):
    # training_args.yaml was written before the checkpoint loaded: the crash left the run's folders recording a
    # resume that never ran (predict.py then read its flags).
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    (step_4 / RECORD).unlink()  # an older checkpoint, unrecorded, whose optimizer state is damaged: nothing checks it
    saved = json.loads((step_4 / "trainer_state.json").read_text())
    (step_4 / "trainer_state.json").write_text(json.dumps({**saved, "data": None}))
    (step_4 / "optimizer.bin").write_bytes(b"not a pickle")
    runs = flags[flags.index("--logdir") + 1] / "r"
    before = folder_state(out, files_only=True), folder_state(runs, files_only=True)
    with pytest.raises(pickle.UnpicklingError):  # a crash, not bad input: its traceback stays
        run_app([*flags, "--max_steps", 6, "--learning_rate", 1e-3, "--resume_from_checkpoint", "latest"])
    assert (folder_state(out, files_only=True), folder_state(runs, files_only=True)) == before


@pytest.fixture(scope="module")
def hf_trainer_output(tmp_path_factory, tiny_model_dir, review_files):
    """HF Trainer's output folder with its checkpoint-2: the tiny BERT classifier trained 2 steps on the reviews."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    folder = tmp_path_factory.mktemp("hf-trainer") / "hf"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    frame = pd.read_csv(review_files["train"]).head(16)
    frame["label"] = (frame["label"] == "other").astype(int)
    data = Dataset.from_pandas(frame).map(
        lambda rows: tokenizer(rows["text"], truncation=True, max_length=32), batched=True
    )
    names = {0: "great", 1: "other"}  # the labels named, so that a run on the reviews can start from its weights
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, id2label=names, label2id={name: i for i, name in names.items()}
    )
    args = TrainingArguments(
        folder, max_steps=2, save_steps=2, per_device_train_batch_size=8, report_to=[], use_cpu=True
    )
    Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
    assert (folder / "checkpoint-2" / "trainer_state.json").is_file()
    return folder


def test_hf_trainer_s_checkpoint_is_one_line_that_says_how_to_start_from_its_weights(
    run_copy, hf_trainer_output, tmp_path, capfd
):
    # It was called damaged: "trainer_state.json cannot be read (KeyError); resume from another checkpoint".
    _, flags = run_copy
    checkpoint = hf_trainer_output / "checkpoint-2"
    start = f"this app cannot resume HF Trainer's checkpoints; --model_name_or_path {checkpoint} starts a new run from "
    before = folder_state(hf_trainer_output.parent, files_only=True)
    capfd.readouterr()
    expected = {
        ("--resume_from_checkpoint", checkpoint): f"--resume_from_checkpoint {checkpoint} is HF Trainer's checkpoint: ",
        ("--resume_from_checkpoint", "latest", "--output_dir", hf_trainer_output): (
            f"--resume_from_checkpoint latest: no checkpoint in {hf_trainer_output}/checkpoints; {hf_trainer_output} "
            "holds HF Trainer's checkpoint-N folders (the newest: checkpoint-2): "
        ),
        ("--resume_from_checkpoint", hf_trainer_output): (
            f"--resume_from_checkpoint {hf_trainer_output} holds HF Trainer's checkpoint-N folders (the newest: "
            "checkpoint-2): "
        ),
    }
    for resume, said in expected.items():
        assert run_app([*flags, *resume]) == 2
        assert capfd.readouterr().err == f"error: {said}{start}its weights\n"
    assert folder_state(hf_trainer_output.parent, files_only=True) == before
    # A checkpoint of peft adapters holds no model to start from: the advice led to a refusal that sent the user back.
    adapters = tmp_path / "lora" / "checkpoint-2"
    shutil.copytree(checkpoint, adapters)
    (adapters / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    assert run_app([*flags, "--resume_from_checkpoint", adapters]) == 2
    assert "holds peft adapters, not a model: merge them into their base with peft" in capfd.readouterr().err
    # What the line advises: a new run from the checkpoint's weights.
    new_run = ["--model_name_or_path", checkpoint, "--output_dir", tmp_path / "new", "--run_name", "new"]
    assert run_app([*flags, *new_run, "--max_steps", 1, "--save_steps", 0]) == 0


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"state": {"opt_step": "4"}}, 'state.opt_step "4", not a whole number of 0 or more'),
        ({"num_processes": 0}, "num_processes 0, not a whole number of 1 or more"),
        ({"state": []}, "state [], not a mapping"),
        ({"batch_flags": [4]}, "batch_flags [4], not two whole numbers of 1 or more or null"),
    ],
    ids=["a count as text", "no processes", "no state", "one batch flag"],
)
def test_an_older_checkpoint_with_a_hand_edited_record_is_named_as_damaged(run_copy, capfd, edit, said):
    # No file record vouches for an older checkpoint: "opt_step": "4" was a TypeError in optim.check_resume_length,
    # "num_processes": 0 a ValueError in batch_shape.resumed_shape, each a traceback.
    out, flags = run_copy
    step_4 = out / "checkpoints" / "step-4"
    (step_4 / RECORD).unlink()
    saved = json.loads((step_4 / "trainer_state.json").read_text())
    saved["data"] = None  # as versions before file records wrote it
    for key, value in edit.items():
        saved[key] = {**saved[key], **value} if isinstance(value, dict) else value
    (step_4 / "trainer_state.json").write_text(json.dumps(saved))
    before = folder_state(out, files_only=True)
    capfd.readouterr()
    assert run_app([*flags, "--max_steps", 6, "--resume_from_checkpoint", step_4]) == 2
    assert capfd.readouterr().err == (
        f"error: --resume_from_checkpoint {step_4} is damaged: {step_4 / 'trainer_state.json'} records {said}; "
        "resume from another checkpoint\n"
    )
    assert folder_state(out, files_only=True) == before


def test_the_same_model_named_otherwise_is_the_runs(tiny_model_dir, tmp_path, monkeypatch):
    # False notes: a relative folder recorded from another working directory, the embedded default by its folder or
    # hub name, the embedded LM by its hub name with the task left to be inferred.
    from app.config import TrainConfig
    from app.inputs.model import EMBEDDED_LM_NAME, EMBEDDED_MODEL_NAME, another_model_note, embedded_model_dir

    monkeypatch.chdir(tmp_path)
    now = TrainConfig(model_name_or_path=str(tiny_model_dir))
    assert another_model_note(now, {"model_name_or_path": "models/tiny-bert"}) == []  # relative, from elsewhere
    assert another_model_note(now, {"model_name_or_path": os.path.relpath(tiny_model_dir)}) == []
    for named in (str(embedded_model_dir()), EMBEDDED_MODEL_NAME):
        assert another_model_note(TrainConfig(model_name_or_path=named), {"model_name_or_path": None}) == []
    lm = {"model_name_or_path": None, "task": "causal_lm"}
    assert another_model_note(TrainConfig(model_name_or_path=EMBEDDED_LM_NAME), lm) == []
    assert another_model_note(now, {"model_name_or_path": None}) == [  # the default, then a folder: another model
        f"note: the run was trained from {EMBEDDED_MODEL_NAME}, this resume names {tiny_model_dir}: the checkpoint's "
        "weights go on under its config and tokenizer, which the output folder will hold; resume with the run's "
        "--model_name_or_path to keep the run's"
    ]


def test_every_counter_of_the_training_state_has_its_record_check():
    # A field added to TrainState without a kind in _RECORD_VALUES would go unchecked in an older checkpoint.
    import dataclasses

    from app.state import TrainState
    from app.storage.checkpoints import _RECORD_VALUES

    assert set(_RECORD_VALUES["state."]) == {field.name for field in dataclasses.fields(TrainState)}
