"""TensorBoard telemetry: the tags read back from real event files, the loss-scale story, the alarm and the server."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from app.telemetry import tags
from app.telemetry.meters import gpu_memory_tags
from tests import tb
from tests.conftest import ROOT, data_flags, run_app

TRAIN_TAGS = {tags.TRAIN_LOSS, tags.TRAIN_LR, tags.TRAIN_GRAD_NORM, tags.TRAIN_EPOCH}
AMP_TAGS = {
    tags.AMP_LOSS_SCALE,
    tags.AMP_SKIPPED_STEPS,
    tags.AMP_SKIP_RATE,
    tags.AMP_CONSECUTIVE_SKIPS,
    tags.AMP_APPLIED_UPDATES,
}
PERF_TAGS = {
    tags.PERF_SAMPLES_PER_SEC,
    tags.PERF_TOKENS_PER_SEC,
    tags.PERF_TOKENS_PER_SEC_PER_DEVICE,
    tags.PERF_PADDING_FRACTION,
    tags.PERF_STEP_TIME_MS,
}
EVAL_TAGS = {tags.EVAL_LOSS, tags.EVAL_ACCURACY, tags.EVAL_F1}
GPU_ONLY = {
    tags.PERF_MFU_PCT,
    tags.MEMORY_ALLOCATED_GIB,
    tags.MEMORY_RESERVED_GIB,
    tags.MEMORY_PEAK_ALLOCATED_GIB,
    tags.MEMORY_PEAK_ALLOCATED_PCT,
    tags.MEMORY_PEAK_RESERVED_PCT,
    tags.MEMORY_ALLOC_RETRIES,
    tags.MEMORY_OOMS,
}


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory, tiny_model_dir, review_files):
    """A short fp16 run on the CPU, logged every 2 optimizer steps."""
    root = tmp_path_factory.mktemp("amp_run")
    args = [
        *data_flags(tiny_model_dir, review_files),
        "--output_dir",
        root / "out",
        "--logdir",
        root / "runs",
        "--run_name",
        "amp",
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "64",
        "--disable_tqdm",
        "--amp",
        "--max_steps",
        "6",
        "--logging_steps",
        "2",
        "--eval_steps",
        "4",
    ]
    assert run_app(args) == 0
    return root / "runs" / "amp"


def test_every_tag_is_logged_with_sane_values(amp_run):
    values = tb.scalars(amp_run)
    expected = TRAIN_TAGS | AMP_TAGS | PERF_TAGS | EVAL_TAGS | {tags.MEMORY_RSS_GIB, tags.AMP_HEADROOM_BITS}
    assert expected <= values.keys(), f"missing: {expected - values.keys()}"
    assert not values.keys() & GPU_ONLY, "GPU-only tags on a CPU run"
    assert sorted(values[tags.TRAIN_LOSS]) == [2, 4, 6], "logged every --logging_steps optimizer steps"
    for tag in TRAIN_TAGS | PERF_TAGS | EVAL_TAGS | {tags.MEMORY_RSS_GIB, tags.AMP_LOSS_SCALE}:
        assert all(math.isfinite(v) for v in values[tag].values()), tag
    assert all(v > 1 for v in values[tags.AMP_LOSS_SCALE].values()), "fp16 runs with a loss scale above 1"
    assert values[tags.AMP_APPLIED_UPDATES][6] + values[tags.AMP_SKIPPED_STEPS][6] == 6
    assert 0 < values[tags.PERF_PADDING_FRACTION][6] < 1 and values[tags.MEMORY_RSS_GIB][6] > 0.1
    # One process: per device is the total.
    assert values[tags.PERF_TOKENS_PER_SEC_PER_DEVICE] == values[tags.PERF_TOKENS_PER_SEC]
    # A healthy tiny model: the largest fp16 activation is far below 65504, measured at every log step.
    assert sorted(values[tags.AMP_HEADROOM_BITS]) == [2, 4, 6]
    assert all(4 < bits < 24 for bits in values[tags.AMP_HEADROOM_BITS].values()), values[tags.AMP_HEADROOM_BITS]
    assert set(values[tags.EVAL_ACCURACY]) == {4, 6}, "evaluated at --eval_steps and at the end"


def test_run_info_texts_and_hparams(amp_run):
    texts = tb.texts(amp_run)
    assert {"run/config", "run/environment", "run/precision", "run/tf32"} <= texts.keys()
    assert "fp16 autocast on cpu" in texts["run/precision"] and "warning:" in texts["run/precision"]
    assert "learning_rate: 5.0e-05" in texts["run/config"] and "| torch |" in texts["run/environment"]
    assert (
        "| CUDA fp32 matmuls (torch.backends.cuda.matmul.fp32_precision, allow_tf32) | full fp32 |" in texts["run/tf32"]
    )
    plugins = tb.load(amp_run).PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugins, "no HPARAMS entry"
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(plugins["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["loss_scaling"].string_value == "true", start.hparams["loss_scaling"]  # was the number 1
    assert len(list(amp_run.glob("events.out.tfevents.*"))) == 1, "one event file per run"


def test_the_runs_throughput_pools_its_intervals_and_fills_the_hparams_cell(amp_run):
    # HPARAMS' throughput cell showed the last interval's perf/samples_per_sec, and compare_amp.py averaged the
    # intervals' values: an interval of one step weighed as much as a long one.
    from tensorboard.plugins.hparams import plugin_data_pb2

    values = tb.scalars(amp_run)
    assert list(values[tags.RUN_SAMPLES_PER_SEC]) == [6], "once, at the last step"
    # Steps of 8 samples; the intervals end at steps 2, 4 and 6, and step 1 (warm-up) is not timed.
    timed_steps = {2: 1, 4: 2, 6: 2}
    rates = values[tags.PERF_SAMPLES_PER_SEC]
    seconds = sum(8 * n / rates[step] for step, n in timed_steps.items())
    assert values[tags.RUN_SAMPLES_PER_SEC][6] == pytest.approx(8 * 5 / seconds, rel=1e-5)
    content = tb.load(amp_run).PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    columns = [info.name.tag for info in experiment.metric_infos]
    assert tags.RUN_SAMPLES_PER_SEC in columns and tags.PERF_SAMPLES_PER_SEC not in columns, columns


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_no_scaler_tags_without_a_scaler(tmp_path, quick_args, capfd, precision):
    """A constant loss scale of 1 and no skips tell nothing: without a scaler the tags are absent; the run says so."""
    assert run_app([*quick_args, "--mixed_precision", precision, "--max_steps", "2", "--eval_steps", "0"]) == 0
    run_dir = tmp_path / "runs" / "test"
    values = tb.scalars(run_dir)
    assert sorted(values[tags.TRAIN_LOSS]) == [1, 2], "the run logged"
    assert not values.keys() & {*tags.SCALER_TAGS, tags.AMP_HEADROOM_BITS}, "scaler or fp16 tags without a scaler"
    assert "AMP off: no loss scaler" in tb.texts(run_dir)["run/precision"]
    amp_health = tb.layout(run_dir)["AMP health"]
    assert [regex for chart in amp_health.values() for regex in chart] == ["^train/grad_norm$"]
    assert "optimizer steps  2 (loss scaling off)" in capfd.readouterr().out


def card_rows(output_dir) -> dict[str, str]:
    """The model card's table of facts, by name."""
    rows = (line.split(" | ") for line in (output_dir / "README.md").read_text().splitlines() if line.startswith("| "))
    return {row[0].removeprefix("| "): row[1].removesuffix(" |") for row in rows if len(row) == 2}


def summary_of(out: str) -> str:
    return out[out.index("run summary") :]


def test_resumes_in_other_precisions_report_the_runs_steps_by_precision(tmp_path, quick_args, capfd):
    # The summary read loss scaling from this process's log steps, the model card from the last command's precision:
    # a resume with nothing left said "loss scaling off" for fp16 steps, and n/a for measures of steps it never took;
    # a resume in fp32 said all the run's steps were fp32's, without loss scaling.
    args = [*quick_args, "--eval_steps", "0", "--save_steps", "2", "--max_steps", "2"]
    assert run_app([*args, "--amp"]) == 0
    capfd.readouterr()
    assert run_app([*args, "--amp", "--resume_from_checkpoint", "latest"]) == 0
    summary = summary_of(capfd.readouterr().out)
    assert "optimizer steps  2 (2 applied, 0 skipped)\n" in summary, summary
    assert "samples/s        n/a: no step trained in this run (it resumed at step 2, where training ends)" in summary
    assert "peak memory      n/a: no step trained in this run;" in summary, summary
    fp32 = [*args, "--max_steps", "4", "--mixed_precision", "no", "--resume_from_checkpoint", "latest"]
    assert run_app(fp32) == 0
    summary = summary_of(capfd.readouterr().out)
    assert (
        "optimizer steps  4 (4 applied, 0 skipped); fp16 with loss scaling for steps 1-2, then fp32 for steps 3-4"
        in (summary)
    )
    card = card_rows(tmp_path / "out")
    assert card["optimizer steps"] == "4 of 4 (4 applied, 0 skipped for fp16 overflow)"
    assert card["precision"] == (
        "fp16 with loss scaling for steps 1-2, then fp32 for steps 3-4; evaluated in fp32, no autocast, on cpu (from "
        "--mixed_precision: no was asked for)"
    )
    saved = json.loads((tmp_path / "out" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert saved["state"]["precisions"] == [[1, "fp16"], [3, "no"]]
    # HPARAMS showed the last command's precision alone: "no", loss scaling false.
    row = tb.hparams_rows(tmp_path / "runs" / "test")[0]
    assert (row["precision"], row["loss_scaling"]) == ("fp16 then no", "true")


def test_steps_of_a_checkpoint_that_recorded_no_precision_are_said_unrecorded(tmp_path):
    from app.state import TrainState
    from app.storage.checkpoints import STATE_FILE, CheckpointRecord

    # A checkpoint written before precisions were recorded: its state has no such key.
    CheckpointRecord("r", "no", 1, TrainState(opt_step=4, applied_updates=4)).write(tmp_path)
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    del saved["state"]["precisions"]
    (tmp_path / STATE_FILE).write_text(json.dumps(saved))
    older = CheckpointRecord.read(tmp_path).state
    assert older.precision_runs() == [(1, 4, None)] and older.may_have_skipped()
    older.take_step("no")
    assert (
        older.said_precisions() == "a precision not recorded (an earlier version) for steps 1-4, then fp32 for step 5"
    )
    fresh = TrainState()
    fresh.take_step("no")
    assert fresh.precision_runs() == [(1, 1, "no")] and not fresh.may_have_skipped()


def test_forced_overflow_skips_every_step(tmp_path, quick_args):
    code = run_app(
        [
            *quick_args,
            "--amp",
            "--init_loss_scale",
            "1e30",
            "--max_steps",
            "6",
            "--warmup_ratio",
            "0",
            "--eval_steps",
            "0",
        ]
    )
    assert code == 0
    values = tb.scalars(tmp_path / "runs" / "test")
    assert values[tags.AMP_SKIPPED_STEPS][6] == 6 and values[tags.AMP_APPLIED_UPDATES][6] == 0
    assert values[tags.AMP_SKIP_RATE][6] == 1.0 and values[tags.AMP_CONSECUTIVE_SKIPS][6] == 6
    assert values[tags.AMP_LOSS_SCALE][6] == np.float32(1e30) * np.float32(0.5**6)
    assert set(values[tags.TRAIN_LR].values()) == {np.float32(5e-5)}, "the LR moved without an applied update"
    assert all(not math.isfinite(v) for v in values[tags.TRAIN_GRAD_NORM].values()), "inf norms are shown as they are"


def test_scale_collapse_alarm_stops_with_exit_3_and_a_checkpoint(tmp_path, quick_args, capfd):
    code = run_app(
        [
            *quick_args,
            "--amp",
            "--init_loss_scale",
            "1e30",
            "--max_consecutive_skips",
            "3",
            "--max_steps",
            "50",
            "--logging_steps",
            "10",
            "--eval_steps",
            "0",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 3
    assert "loss-scale alarm at optimizer step 4: 4 steps in a row were skipped" in out
    assert (
        "loss scale after each recent skipped step (step: scale): 1: 5e+29, 2: 2.5e+29" in out and "what to try" in out
    )
    # Step 4's overflow flag reaches the host during step 5 (no sync per step), so the run stops after step 5.
    assert (tmp_path / "out" / "checkpoints" / "step-5" / "trainer_state.json").is_file()
    assert "stopped by the loss-scale alarm; checkpoint for inspection:" in err and "step-5" in err
    assert "(after step 5: step 4's overflow is read during the next step, which ran too)" in err, err[-1000:]
    assert tb.scalars(tmp_path / "runs" / "test")[tags.AMP_CONSECUTIVE_SKIPS] == {5: 5.0}, "logged when it stopped"
    # The run that fp16 failed had no row in HPARAMS to compare it with the runs that did not fail.
    assert [row["precision"] for row in tb.hparams_rows(tmp_path / "runs" / "test")] == ["fp16"]


def test_scale_alarm_can_warn_and_go_on(tmp_path, quick_args, capfd):
    code = run_app(
        [
            *quick_args,
            "--amp",
            "--min_loss_scale",
            "1e29",
            "--init_loss_scale",
            "1e30",
            "--on_scale_collapse",
            "warn",
            "--max_steps",
            "6",
            "--eval_steps",
            "0",
        ]
    )
    out, _ = capfd.readouterr()
    assert code == 0
    assert out.count("loss-scale alarm") == 1 and "the loss scale fell to 6.25e+28, below --min_loss_scale 1e+29" in out
    assert "what to try:" in out and "--on_scale_collapse warn" not in out, "the advice offered what the run does"


def test_a_run_shorter_than_logging_steps_logs_its_last_step(tmp_path, quick_args, capfd):
    """6 steps with the default --logging_steps 10: the last step is logged anyway, with the scaler's story."""
    args = [*quick_args, "--amp", "--max_steps", "6", "--logging_steps", "10", "--eval_steps", "0"]
    assert run_app(args) == 0
    logged = tb.scalars(tmp_path / "runs" / "test")
    for tag in (tags.TRAIN_LOSS, tags.AMP_LOSS_SCALE, tags.AMP_SKIPPED_STEPS, tags.PERF_SAMPLES_PER_SEC):
        assert list(logged.get(tag, {})) == [6], f"{tag}: {logged.get(tag)}"
    assert logged[tags.AMP_LOSS_SCALE][6] > 1, "fp16 ran with the scaler on"
    summary = capfd.readouterr().out
    assert "nan" not in summary and "n/a" not in summary and "0.00 GiB" not in summary, summary


def test_a_one_step_run_says_what_it_could_not_measure(tmp_path, quick_args, capfd):
    assert run_app([*quick_args, "--max_steps", "1", "--eval_steps", "0"]) == 0
    out = capfd.readouterr().out
    summary = out[out.index("run summary") :]
    assert "n/a (fewer than 2 steps)" in summary and "nan" not in summary, summary
    assert "0.00 GiB" not in summary and "GiB (CPU RSS" in summary, summary
    # The RSS read at a log step can only be at or under the process's high-water mark, read at the end, in GiB.
    sampled = float(re.search(r"peak memory +([\d.]+) GiB \(CPU RSS", summary)[1])
    high_water = float(re.search(r"high-water mark ([\d.]+) GiB \(the main process", summary)[1])
    assert sampled <= high_water < 64, summary


def test_the_high_water_mark_keeps_a_peak_that_has_passed():
    """Memory held for a moment and freed, as by a generation batch, stays in the high-water mark after the RSS
    fell. A process of its own, so that no earlier test's peak is in the mark."""
    code = (
        "import psutil\n"
        "from app.telemetry.meters import high_water_mark_gib\n"
        "resident = lambda: psutil.Process().memory_info().rss / 2**30\n"
        "before = resident()\n"
        "block = b'x' * (768 * 2**20)\n"  # written, so resident: 0.75 GiB on top of what the process holds
        "del block\n"
        "print(before, high_water_mark_gib(), resident())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after, rss = map(float, result.stdout.split())
    assert after - before >= 0.7, (before, after)
    assert rss < after - 0.5, "the block left the RSS, and only the mark kept it"


def cuda_memory_stats(gib: dict[str, float], retries: int, ooms: int) -> dict[str, int]:
    """A dict with every key that torch.cuda.memory_stats() returns (its docstring's list, flattened as it flattens),
    with `gib` giving "allocated_bytes.all.peak"-style entries in GiB and the rest made up."""
    stats = {}
    core = ("allocated", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes")
    for stat in (*core, "inactive_split", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for metric in ("current", "peak", "allocated", "freed"):
                stats[f"{stat}.{pool}.{metric}"] = 7
    for metric in ("current", "peak", "allocated", "freed"):
        stats[f"oversize_allocations.{metric}"] = stats[f"oversize_segments.{metric}"] = 0
    stats |= {"num_sync_all_streams": 3, "num_device_alloc": 40, "num_device_free": 2, "max_split_size": -1}
    stats |= {"num_alloc_retries": retries, "num_ooms": ooms, "num_oom_rejections": 0}
    return stats | {key: int(value * 2**30) for key, value in gib.items()}


def test_gpu_memory_tags_from_the_allocators_stats():
    gib = {
        "allocated_bytes.all.current": 10.0,
        "allocated_bytes.all.peak": 35.0,
        "reserved_bytes.all.current": 40.0,
        "reserved_bytes.all.peak": 70.0,
    }
    values = gpu_memory_tags(cuda_memory_stats(gib, retries=3, ooms=1), device_bytes=140 * 2**30)
    assert values == {
        tags.MEMORY_ALLOCATED_GIB: 10.0,
        tags.MEMORY_RESERVED_GIB: 40.0,
        tags.MEMORY_PEAK_ALLOCATED_GIB: 35.0,
        tags.MEMORY_PEAK_ALLOCATED_PCT: 25.0,
        tags.MEMORY_PEAK_RESERVED_PCT: 50.0,
        tags.MEMORY_ALLOC_RETRIES: 3,
        tags.MEMORY_OOMS: 1,
    }


def test_train_lr_is_the_rate_each_logged_step_updated_with(tmp_path, quick_args):
    # It was the next step's rate, and then, where the step before a log step was not one, the rate of the step
    # before (the schedule moves when a step's outcome is settled, at the next update): 0, 3.3e-5, 3.3e-5 here.
    args = [*quick_args, "--mixed_precision", "no", "--max_steps", "6", "--warmup_ratio", "0.5", "--logging_steps", "2"]
    assert run_app([*args, "--learning_rate", "6e-5", "--eval_steps", "0"]) == 0
    logged = tb.scalars(tmp_path / "runs" / "test")[tags.TRAIN_LR]
    # HF's linear schedule, 3 warmup steps of 6: step k updates at the rate after k - 1 updates.
    used = {k: 6e-5 * ((k - 1) / 3 if k - 1 < 3 else (6 - (k - 1)) / 3) for k in range(1, 7)}
    assert logged == {step: pytest.approx(used[step], rel=1e-6) for step in (2, 4, 6)}, logged


def test_the_time_a_log_step_spends_logging_counts_in_the_throughput(tmp_path, quick_args, monkeypatch):
    # The clock restarted at the end of each log step: what logging cost (the memory probe, the reads, ~20 scalars,
    # tqdm) was in no interval, and with --logging_steps 1 the throughput read 12% above the wall clock's.
    from app.telemetry.writer import TensorBoardWriter

    write = TensorBoardWriter.log

    def slow_log(self, scalars, step):  # a logging step that takes 0.2 s, as a slow disk or a busy host might
        time.sleep(0.2)
        write(self, scalars, step)

    monkeypatch.setattr(TensorBoardWriter, "log", slow_log)
    args = [*quick_args, "--mixed_precision", "no", "--max_steps", "5", "--eval_steps", "0"]
    assert run_app(args) == 0
    step_ms = tb.scalars(tmp_path / "runs" / "test")[tags.PERF_STEP_TIME_MS]
    # Each one-step interval from step 3 on follows a log step's 0.2 s (step 2's follows the warm-up, untimed).
    assert all(step_ms[step] >= 200 for step in (3, 4, 5)), step_ms
