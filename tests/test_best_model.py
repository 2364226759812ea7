"""Best model at the end and early stopping: real runs on the tiny model, read back from TensorBoard and the files.

A high learning rate makes the tiny model's eval loss bounce: it peaks (is lowest) mid-run, then gets worse.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml
from safetensors.torch import load_file

from app.storage.checkpoints import completed_checkpoints
from tests import forked, tb
from tests.conftest import ROOT, clean_env, data_flags, folder_state, run_app

KILLER = ROOT / "tests" / "workers" / "kill_during_checkpoint.py"
BOUNCY = ["--learning_rate", "1e-2", "--warmup_ratio", "0", "--max_steps", "16", "--eval_steps", "2"]
# torch's own dropout masks, on which BOUNCY was chosen to stop early (app/host/dropout.py's draw other masks)
TORCH_MASKS = ["--fast_cpu_dropout", "false"]


def common_args(tiny_model_dir, review_files) -> list:
    return [
        *data_flags(tiny_model_dir, review_files),
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "64",
        "--disable_tqdm",
        "--mixed_precision",
        "no",
        "--run_name",
        "r",
        *BOUNCY,
        *TORCH_MASKS,
    ]


def best_step(eval_losses: dict[int, float]) -> int:
    """The step of the lowest eval loss; the earliest on a tie, since only a strict improvement replaces the best."""
    return min(sorted(eval_losses), key=lambda step: eval_losses[step])


def stop_step(eval_losses: dict[int, float], patience: int) -> int | None:
    """The evaluation at which `patience` evaluations in a row have not beaten the best (threshold 0)."""
    best, waited = None, 0
    for step in sorted(eval_losses):
        if best is None or eval_losses[step] < best:
            best, waited = eval_losses[step], 0
        else:
            waited += 1
            if waited == patience:
                return step
    return None


def assert_same_weights(expected_file, got_file) -> None:
    expected, got = load_file(expected_file), load_file(got_file)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} is not the best checkpoint's"


def test_the_saved_model_is_the_best_evaluations_even_with_save_total_limit_1(
    tmp_path, tiny_model_dir, review_files, capsys, monkeypatch
):
    args = [*common_args(tiny_model_dir, review_files), "--load_best_model_at_end", "--save_total_limit", "1"]
    args = [str(a) for a in [*args, "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]]
    monkeypatch.setattr(sys, "argv", ["app/train.py", *args])  # the command line that the model card records
    assert run_app(args) == 0
    events = [(e.step, e.value) for e in tb.load(tmp_path / "runs" / "r").Scalars("eval/loss")]
    *trained, (last_step, saved) = events
    losses = dict(trained)
    assert list(losses) == list(range(2, 17, 2)), "an evaluation every 2 steps, the last one at the end"
    best = best_step(losses)
    assert best < 16, f"the setup should make the eval loss peak mid-run: {losses}"
    # Then the saved model's evaluation at the last step, so that the last eval/* values (HPARAMS) are the best's.
    assert (last_step, saved) == (16, losses[best]), events

    out = capsys.readouterr().out
    assert f"loaded the best model, step {best} (eval/loss {losses[best]:.4f})" in out
    checkpoint = tmp_path / "out" / "checkpoints" / f"step-{best}"
    assert checkpoint.is_dir(), "save_total_limit pruned the best checkpoint"
    assert_same_weights(checkpoint / "model.safetensors", tmp_path / "out" / "model.safetensors")

    card = (tmp_path / "out" / "README.md").read_text()
    for fact in (
        f"| base model | {tiny_model_dir} |",
        f"| data | {review_files['train']}, validation {review_files['validation']} |",
        "| examples | 96 training, 48 validation |",
        "| labels | great, other |",
        "| precision | fp32, no autocast, on cpu, loss scaling off (from --mixed_precision",
        "| optimizer steps | 16 of 16 (loss scaling off) |",
        f"| weights saved from | step {best}, the best eval/loss; stored in float32 |",
        f"| eval/loss | {losses[best]:.4f} |",
        f"    app/train.py {' '.join(args)}",
    ):
        assert fact in card, f"the model card lacks {fact!r}"
    assert yaml.safe_load((tmp_path / "out" / "training_args.yaml").read_text())["learning_rate"] == 1e-2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def kill_run(tmp_path, nth: int, args: list) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(KILLER), "published", str(nth), *map(str, args)]
    return forked.run(cmd, env=clean_env(tmp_path), timeout=240)


@pytest.mark.slow
def test_early_stopping_and_the_best_model_survive_a_kill_9_and_resume(
    tmp_path, tiny_model_dir, review_files, capfd, one_thread
):
    """The killed runs are real processes; the uninterrupted run and the resumes run in this one."""
    args = [
        *common_args(tiny_model_dir, review_files),
        "--load_best_model_at_end",
        "--early_stopping_patience",
        "2",
        "--save_steps",
        "0",
    ]
    ref = run_app([*args, "--output_dir", tmp_path / "ref", "--logdir", tmp_path / "ref_runs"])
    said = capfd.readouterr()
    assert ref == 0, said.err[-2000:]
    curves = tb.scalars(tmp_path / "ref_runs" / "r")
    losses = curves["eval/loss"]
    in_loop = {step: loss for step, loss in losses.items() if step < 16}
    expected_stop = stop_step(in_loop, patience=2)
    assert expected_stop is not None and expected_stop < 16, f"the setup should stop early: {losses}"
    # The stop step's evaluation is the final model's (it was evaluated again: a second point, the same weights),
    # then the best model's, at the last step.
    steps = [event.step for event in tb.load(tmp_path / "ref_runs" / "r").Scalars("eval/loss")]
    assert steps == [*range(2, expected_stop + 1, 2), expected_stop], steps
    said_at_stop = [line for line in said.out.splitlines() if line.startswith(f"step {expected_stop}: eval/loss")]
    assert len(said_at_stop) == 2, said.out  # the loop's, and the best model's
    assert f"the trained model is step {expected_stop}'s, evaluated above (saved in {tmp_path / 'ref'})" in said.out
    assert curves["train/stopped_early"] == {expected_stop: 1.0}
    assert f"early stopping at optimizer step {expected_stop}: eval/loss has not improved" in said.out
    assert "optimizer steps  " + str(expected_stop) in said.out, "training went on after the stop"
    best = best_step(in_loop)
    assert_same_weights(
        tmp_path / "ref" / "checkpoints" / f"step-{best}" / "model.safetensors", tmp_path / "ref" / "model.safetensors"
    )

    # Two runs, killed side by side: (1) right after the checkpoint of the evaluation after the best, when the
    # patience count has started; (2) right after the checkpoint of the evaluation that stopped the run.
    here, here2 = (["--output_dir", tmp_path / out, "--logdir", tmp_path / f"runs_{out}"] for out in ("run", "run2"))
    with ThreadPoolExecutor(2) as pool:
        killed = pool.submit(kill_run, tmp_path, sorted(in_loop).index(best) + 2, [*args, *here])
        killed2 = pool.submit(kill_run, tmp_path, sorted(in_loop).index(expected_stop) + 1, [*args, *here2])
        killed, killed2 = killed.result(), killed2.result()
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert killed2.returncode == -signal.SIGKILL, killed2.stderr[-2000:]
    assert not (tmp_path / "run" / "model.safetensors").exists(), "the killed run must not have finished"

    resumed = run_app([*args, *here, "--resume_from_checkpoint", "latest"])
    said = capfd.readouterr()
    assert resumed == 0, said.err[-2000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / f'step-{best + 2}'}" in said.out
    assert f"early stopping at optimizer step {expected_stop}" in said.out
    assert f"loaded the best model, step {best} " in said.out
    assert_same_weights(tmp_path / "ref" / "model.safetensors", tmp_path / "run" / "model.safetensors")

    # The resume of the run killed after the stopping evaluation trains no further.
    resumed = run_app([*args, *here2, "--resume_from_checkpoint", "latest"])
    said = capfd.readouterr()
    assert resumed == 0, said.err[-2000:]
    assert "optimizer steps  " + str(expected_stop) in said.out, "the resumed run trained past the stop"
    assert_same_weights(tmp_path / "ref" / "model.safetensors", tmp_path / "run2" / "model.safetensors")


def test_best_model_flags_need_evaluations(tmp_path, quick_args, capsys):
    for flags in (["--load_best_model_at_end"], ["--early_stopping_patience", "3"]):
        assert run_app([*quick_args, "--eval_steps", "0", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {flags[0]} needs evaluations during training: pass --eval_steps N (N >= 1)"]
    assert run_app([*quick_args, "--metric_for_best_model", "precision"]) == 2
    assert "--metric_for_best_model 'precision' is not an evaluation metric" in capsys.readouterr().err
    for flags in (["--metric_for_best_model", "accuracy"], ["--greater_is_better", "true"]):  # ignored, silently
        assert run_app([*quick_args, *flags]) == 2
        assert capsys.readouterr().err == (
            f"error: {flags[0]} applies to --load_best_model_at_end and --early_stopping_patience; add one of them, "
            f"or drop {flags[0]}\n"
        )
    assert not (tmp_path / "out").exists()


def test_evaluations_that_never_come_before_the_last_step_are_named(tmp_path, quick_args, capsys):
    # --eval_steps past the run's length: no evaluation during training, so both flags did nothing, without a word.
    flags = ["--max_steps", "3", "--eval_steps", "10", "--load_best_model_at_end", "--early_stopping_patience", "1"]
    assert run_app([*quick_args, *flags]) == 0
    assert (
        "note: --eval_steps 10 leaves no evaluation before the run's last step (3): --load_best_model_at_end and "
        "--early_stopping_patience act on the final evaluation alone"
    ) in capsys.readouterr().out.splitlines()
    assert (
        run_app(
            [
                *quick_args,
                "--max_steps",
                "3",
                "--eval_steps",
                "2",
                "--load_best_model_at_end",
                "--run_name",
                "evaluated",
                "--output_dir",
                tmp_path / "evaluated",
            ]
        )
        == 0
    )
    assert "leaves no evaluation" not in capsys.readouterr().out


def test_a_resume_that_tracks_the_best_by_another_metric_is_one_line(tmp_path, tiny_model_dir, review_files, capfd):
    # The run's best eval/loss (0.69) was compared against eval/f1 values: a resume picked the step of the worst
    # loss as the best f1, and loaded and saved it.
    args = [*common_args(tiny_model_dir, review_files), "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]
    args += ["--load_best_model_at_end"]
    assert run_app([*args, "--max_steps", "4"]) == 0
    out = tmp_path / "out"
    before = folder_state(out)
    capfd.readouterr()
    for other, rule in (
        (["--metric_for_best_model", "f1"], "eval/f1 (higher is better)"),
        (["--greater_is_better", "true"], "eval/loss (higher is better)"),
    ):
        assert run_app([*args, "--max_steps", "8", *other, "--resume_from_checkpoint", "latest"]) == 2
        assert capfd.readouterr().err == (
            f"error: --resume_from_checkpoint {out / 'checkpoints' / 'step-4'} tracks the best model by eval/loss "
            f"(lower is better), this resume asks for {rule}: resume with --metric_for_best_model loss (and its "
            "--greater_is_better), or start a new run in another --output_dir\n"
        )
    assert folder_state(out) == before
    assert run_app([*args, "--max_steps", "8", "--resume_from_checkpoint", "latest"]) == 0, "the run's own metric"


def flip_weights(checkpoint) -> None:
    """Change the weights in place, same size: only the checkpoint's file record can tell."""
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))


def test_the_best_checkpoint_is_checked_at_a_resume_found_beside_a_branch_and_never_loaded_damaged(
    tmp_path, tiny_model_dir, review_files, capfd, monkeypatch
):
    # A resume checked only the checkpoint it resumed from: a damaged best was loaded at the end and saved as the
    # model; a deleted or truncated one was a traceback after the training; and a resume into another --output_dir
    # looked for the best (a step before the branch) in its own folder, where it is not.
    args = [*common_args(tiny_model_dir, review_files), "--logdir", tmp_path / "runs", "--load_best_model_at_end"]
    run = tmp_path / "run"
    assert run_app([*args, "--output_dir", run]) == 0
    loaded = re.search(r"loaded the best model, step (\d+) ", capfd.readouterr().out)
    assert loaded, "the setup should make the eval loss peak before the last step"
    best, last = int(loaded.group(1)), run / "checkpoints" / "step-16"
    best_weights = run / "checkpoints" / f"step-{best}" / "model.safetensors"
    assert_same_weights(best_weights, run / "model.safetensors")

    # A branch at the last step: nothing to train, the best is loaded from the run it branched from.
    capfd.readouterr()
    branch = ["--output_dir", tmp_path / "branch", "--run_name", "branch"]
    assert run_app([*args, *branch, "--resume_from_checkpoint", last]) == 0, capfd.readouterr().err[-2000:]
    assert f"loaded the best model, step {best} " in capfd.readouterr().out
    assert_same_weights(best_weights, tmp_path / "branch" / "model.safetensors")
    # The branch resumed in turn (a preemption): the best is still in the run it branched from.
    assert (tmp_path / "branch" / "checkpoints" / "step-16").is_dir()
    more = [*branch, "--max_steps", "18", "--resume_from_checkpoint", "latest"]
    assert run_app([*args, *more]) == 0, capfd.readouterr().err[-2000:]
    assert "cannot be loaded" not in capfd.readouterr().out

    # Damaged before a resume: one line, before anything loads; nothing changed.
    shutil.copytree(best_weights.parent, tmp_path / "intact")
    flip_weights(best_weights.parent)
    before = folder_state(run, files_only=True)
    resume = [*args, "--output_dir", run, "--resume_from_checkpoint", "latest"]
    assert run_app([*resume, "--max_steps", "18"]) == 2
    err = capfd.readouterr().err
    assert err == (
        f"error: --load_best_model_at_end: the run's best checkpoint so far, step {best}, cannot be loaded: "
        f"{best_weights} does not match its checksum: it changed after it was written; restore it, or resume with "
        "--load_best_model_at_end false (the model saved is then the last step's)\n"
    ), err
    assert folder_state(run, files_only=True) == before

    # Gone after the resume's check (deleted by hand during the training): a warning, not a traceback; the model saved
    # is the last step's, and the model card says so.
    shutil.rmtree(best_weights.parent)
    shutil.copytree(tmp_path / "intact", best_weights.parent)
    from app.storage.checkpoints import Checkpoints

    save = Checkpoints.save

    def save_then_lose_the_best(self, state):
        saved = save(self, state)
        shutil.rmtree(best_weights.parent, ignore_errors=True)
        return saved

    monkeypatch.setattr(Checkpoints, "save", save_then_lose_the_best)
    assert run_app(resume) == 0, capfd.readouterr().err[-2000:]
    said = capfd.readouterr().out
    assert (
        f"warning: the best checkpoint, step {best}, cannot be loaded ({best_weights.parent} is missing): the model "
        "saved is the last step's, step 16"
    ) in said, said
    assert_same_weights(last / "model.safetensors", run / "model.safetensors")
    assert "| weights saved from | the last step; stored in float32 |" in (run / "README.md").read_text()


def test_a_branch_from_a_set_aside_line_loads_that_line_s_best_not_the_checkpoint_that_replaced_it(
    tmp_path, tiny_model_dir, review_files, capfd
):
    # A resume from a step before the best wrote a new line over the best's folder name (the first line set aside).
    # A branch from the set-aside line's last checkpoint loaded the new line's checkpoint of that name as its best.
    args = [*common_args(tiny_model_dir, review_files), "--logdir", tmp_path / "runs", "--load_best_model_at_end"]
    args += ["--save_total_limit", "10"]  # every evaluation's checkpoint kept
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert run_app([*args, "--output_dir", run]) == 0
    loaded = re.search(r"loaded the best model, step (\d+) ", capfd.readouterr().out)
    assert loaded and int(loaded.group(1)) >= 4, "the setup should make the eval loss peak after step 2"
    best = int(loaded.group(1))
    # Another line from two steps before the best: a longer schedule, other weights at the best's step.
    replaced = [*args, "--output_dir", run, "--max_steps", "18"]
    assert run_app([*replaced, "--resume_from_checkpoint", root / f"step-{best - 2}"]) == 0
    aside = root / f"replaced-after-step-{best - 2}"
    assert (aside / f"step-{best}").is_dir() and (root / f"step-{best}").is_dir()
    capfd.readouterr()
    branch = ["--output_dir", tmp_path / "branch", "--run_name", "branch"]
    assert run_app([*args, *branch, "--resume_from_checkpoint", aside / "step-16"]) == 0, capfd.readouterr().err
    assert f"loaded the best model, step {best} (" in (said := capfd.readouterr().out), said
    assert f"from {aside / f'step-{best}'}" in said, said
    assert_same_weights(aside / f"step-{best}" / "model.safetensors", tmp_path / "branch" / "model.safetensors")


def test_a_resume_that_leaves_out_the_best_model_flags_says_what_changes(tmp_path, tiny_model_dir, review_files, capfd):
    # The run early-stopped and kept its best; a resume without the flags trained on and saved the last step's
    # weights, without a word (a new learning rate gets a note).
    args = [*common_args(tiny_model_dir, review_files), "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]
    tracking = ["--load_best_model_at_end", "--early_stopping_patience", "5"]
    assert run_app([*args, *tracking, "--max_steps", "4"]) == 0
    note = (
        "note: the run was started with --load_best_model_at_end and --early_stopping_patience 5, this resume "
        "without: the model saved is the last step's, not the best, and it does not stop early; pass them again to "
        "keep them"
    )
    capfd.readouterr()
    assert run_app([*args, *tracking, "--max_steps", "6", "--resume_from_checkpoint", "latest"]) == 0
    assert "note: the run was started with" not in capfd.readouterr().out
    assert run_app([*args, "--max_steps", "8", "--resume_from_checkpoint", "latest"]) == 0
    assert note in capfd.readouterr().out.splitlines()


def test_save_total_limit_counts_the_best_and_the_newest_as_hf_does(tmp_path, tiny_model_dir, review_files, capfd):
    # A limit of 2 kept three checkpoints: the best and the newest were spared outside the count.
    args = [*common_args(tiny_model_dir, review_files), "--load_best_model_at_end", "--save_total_limit", "2"]
    assert run_app([*args, "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]) == 0
    loaded = re.search(r"loaded the best model, step (\d+) ", capfd.readouterr().out)
    assert loaded, "the setup should make the eval loss peak before the last step"
    kept = [p.name for p in completed_checkpoints(tmp_path / "out" / "checkpoints")]
    assert kept == [f"step-{loaded.group(1)}", "step-16"], kept


def test_a_new_best_without_a_checkpoint_of_its_own_is_never_taken_for_the_older_bests(tmp_path):
    # Early stopping alone evaluates without saving: the recorded place of the older best stayed, and a resume with
    # --load_best_model_at_end loaded step 8's weights as "the best model, step 10".
    from app.best import BestModel
    from app.config import TrainConfig
    from app.state import TrainState
    from app.storage.checkpoints import best_checkpoint

    root = tmp_path / "run" / "checkpoints"
    for step in (8, 10, 12):
        (root / f"step-{step}").mkdir(parents=True)
    state = TrainState(opt_step=10, best_step=8, best_metric=0.7, best_checkpoint=str(root / "step-8"))
    BestModel(TrainConfig(early_stopping_patience=100, eval_steps=2), state).after_eval(10, {"eval/loss": 0.6})
    assert (state.best_step, state.best_checkpoint) == (10, None)
    assert best_checkpoint(state, root / "step-12") == root / "step-10"
    state.best_checkpoint = str(root / "step-8")  # as a checkpoint written before it was cleared records it
    assert best_checkpoint(state, root / "step-12") == root / "step-10"


def test_a_run_that_stops_early_logs_its_last_step(tmp_path, tiny_model_dir, review_files):
    # The step that stopped the run was no log step (--logging_steps 10): a run stopped at step 6 had no train/*,
    # perf/* or memory curve at all, and its summary said "no step was logged".
    args = [*common_args(tiny_model_dir, review_files), "--early_stopping_patience", "2"]
    assert run_app([*args, "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]) == 0
    curves = tb.scalars(tmp_path / "runs" / "r")
    (stopped,) = curves["train/stopped_early"]
    assert stopped < 16 and stopped % 10, f"the setup should stop early, at no log step: {stopped}"
    for tag in ("train/loss", "train/lr", "perf/samples_per_sec", "memory/rss_gib"):
        assert stopped in curves[tag], (tag, curves[tag])


def test_a_resume_of_a_run_that_stopped_early_draws_its_last_evaluation_once(tmp_path, tiny_model_dir, review_files):
    # Nothing is left to train, so the resume evaluates the stop step again: a second point at that step.
    args = [*common_args(tiny_model_dir, review_files), "--early_stopping_patience", "2", "--save_steps", "2"]
    args += ["--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]
    assert run_app(args) == 0
    run_dir = tmp_path / "runs" / "r"
    (stopped,) = tb.scalars(run_dir)["train/stopped_early"]
    before = tb.raw_points(run_dir, "eval/loss")
    assert stopped < 16 and [step for step, _ in before].count(stopped) == 1
    assert run_app([*args, "--resume_from_checkpoint", "latest"]) == 0
    assert tb.raw_points(run_dir, "eval/loss") == before


def test_a_nan_evaluation_is_never_the_best_and_never_an_improvement():
    # The fp16 evaluations before a fallback gave eval/loss nan: the first seeded the best, no number is below a NaN,
    # and the run loaded its untrained step as "the best" (or stopped early while the loss fell).
    from app.best import BestModel
    from app.config import TrainConfig
    from app.state import TrainState

    state = TrainState()
    best = BestModel(TrainConfig(load_best_model_at_end=True, early_stopping_patience=2, eval_steps=2), state)
    assert best.after_eval(0, {"eval/loss": float("nan")}) is None
    assert (state.best_step, state.best_metric, state.evals_without_improvement) == (None, None, 0)
    assert best.after_eval(2, {"eval/loss": 5.5}) is None
    assert (state.best_step, state.best_metric, state.evals_without_improvement) == (2, 5.5, 0)
    assert best.after_eval(4, {"eval/loss": float("nan")}) is None and state.best_step == 2
    assert best.after_eval(5, {"eval/loss": float("nan")}) is None, "patience 2 is not spent on NaN evaluations"
    assert best.after_eval(6, {"eval/loss": 5.4}) is None and (state.best_step, state.best_metric) == (6, 5.4)
    # Tracked by accuracy: NaN logits still give one (argmax 0), the NaN loss marks the evaluation.
    by_accuracy = BestModel(TrainConfig(load_best_model_at_end=True, metric_for_best_model="accuracy"), TrainState())
    assert by_accuracy.after_eval(1, {"eval/loss": float("nan"), "eval/accuracy": 0.69}) is None
    assert by_accuracy.state.best_step is None
    # A NaN best recorded by an earlier version's checkpoint gives way to the first number.
    state.best_metric = float("nan")
    assert best.after_eval(8, {"eval/loss": 7.0}) is None and (state.best_step, state.best_metric) == (8, 7.0)


def test_a_best_of_another_line_with_the_same_step_and_metric_is_told_apart_by_its_commands(tmp_path):
    # By accuracy on a small validation set, the line that replaced the best's folder scored the same at that step:
    # (best_step, best_metric) matched, and a branch from the set-aside line loaded the other line's weights.
    from app.state import TrainState
    from app.storage.checkpoints import CheckpointRecord, best_checkpoint

    root = tmp_path / "run" / "checkpoints"
    aside = root / "replaced-after-step-1"
    started, replaced = "app/train.py --max_steps 8", "app/train.py --max_steps 12 --resume_from_checkpoint step-1"
    best = TrainState(opt_step=2, best_step=2, best_metric=0.6875, best_checkpoint=str(root / "step-2"))
    for folder, commands in [(aside / "step-2", [started]), (root / "step-2", [started, replaced])]:
        folder.mkdir(parents=True)
        CheckpointRecord("r", "no", 1, best, commands=commands).write(folder)
    later = TrainState(opt_step=6, best_step=2, best_metric=0.6875, best_checkpoint=str(root / "step-2"))
    assert best_checkpoint(later, aside / "step-6", commands=[started]) == aside / "step-2"
    branch = [started, "app/train.py --output_dir branch --resume_from_checkpoint replaced-after-step-1/step-6"]
    assert best_checkpoint(later, aside / "step-6", tmp_path / "branch", branch) == aside / "step-2"
    assert best_checkpoint(later, root / "step-6", commands=[started, replaced]) == root / "step-2"


def test_the_last_steps_checkpoint_records_its_evaluation_for_a_resume_that_trains_on(
    tmp_path, tiny_model_dir, review_files
):
    # The last step's evaluation came after its checkpoint: step-8 recorded the best and the patience of step 6, so a
    # resume to 12 steps compared its evaluations with those, and a later tie of step 8's best took its place.
    args = common_args(tiny_model_dir, review_files)
    args[args.index("--max_steps") + 1] = "8"
    args += ["--save_steps", "4", "--load_best_model_at_end", "--early_stopping_patience", "9"]
    args += ["--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"]
    assert run_app(args) == 0
    losses = tb.scalars(tmp_path / "runs" / "r")["eval/loss"]
    assert set(losses) == {2, 4, 6, 8}, "evaluated once at each step, the last one too"
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-8" / "trainer_state.json").read_text())["state"]
    best = best_step(losses)
    assert (state["best_step"], state["best_metric"]) == (best, pytest.approx(losses[best]))
    assert state["evals_without_improvement"] == sum(step > best for step in losses)
