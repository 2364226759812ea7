"""scripts/compare_amp.py: the verdict's branches on synthetic runs, and a comparison that differs in precision only
(same batch shapes, same dropout masks). The end-to-end run of the script is in test_scripts.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from app.telemetry import tags
from tests import harness
from tests.conftest import ROOT, run_app

spec = importlib.util.spec_from_file_location("compare_amp", ROOT / "scripts" / "compare_amp.py")
compare_amp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_amp)

NO_NATIVE = {"fp16": None, "bf16": None}
NATIVE_BF16 = {"fp16": None, "bf16": "AVX512-BF16"}
TENSOR_CORES = {"fp16": "tensor cores (sm_80)", "bf16": "tensor cores (sm_80)"}


def synthetic(samples_per_sec: float, timed: int = 3, skipped: float = 0, accuracy: float = 0.8, steps: int = 20):
    return {
        "curves": {tags.TRAIN_LOSS: {s: 0.5 for s in range(1, steps + 1)}},
        "device": "cpu",
        "gpu": False,
        "timed_intervals": timed,
        "samples_per_sec": samples_per_sec if timed else float("nan"),
        "padding_fraction": 0.3,
        "preflight": None,
        "peak_memory_gib": 1.0,
        "memory_kind": "CPU RSS",
        "metrics": {tags.EVAL_ACCURACY: accuracy, tags.EVAL_F1: 0.7},
        "eval_loss": 0.5,
        "loss_scaling": True,
        "skipped_steps": skipped,
        "loss_scale": 65536.0,
    }


def test_verdict_fp16_faster_says_use_amp():
    said = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(20)}, TENSOR_CORES)
    assert "fp16 is 2.00x the speed of fp32" in said and "use --amp here" in said and "Likely cause" not in said
    assert said[0].isupper(), said  # a sentence; it read "on this cpu fp16 is ..."


def test_verdict_fp16_slower_without_native_fp16_names_the_emulation():
    said = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(5)}, NO_NATIVE)
    assert "fp16 is 0.50x the speed of fp32: use --mixed_precision no here." in said
    assert "Likely cause: this device has no native fp16 matmuls" in said
    assert "bf16" not in said  # neither measured nor native here: not offered


def test_verdict_offers_bf16_measured_or_native():
    measured = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(5), "bf16": synthetic(13)}, NATIVE_BF16)
    assert "use --mixed_precision no or bf16 (1.30x fp32) here" in measured
    slower_bf16 = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(5), "bf16": synthetic(9)}, NATIVE_BF16)
    assert "use --mixed_precision no here" in slower_bf16
    native = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(5)}, NATIVE_BF16)
    assert "or try bf16 (this device has AVX512-BF16: --with_bf16 measures it)" in native


@pytest.mark.parametrize(
    "native, cause", [(NO_NATIVE, "this device has no native fp16 matmuls"), (TENSOR_CORES, "the model or batch")]
)
def test_verdict_says_skipped_steps_cost_updates_not_speed(native, cause):
    # It blamed fp16's speed on the skips, on a CPU that emulates fp16: samples/s counts a skipped step's batches too.
    said = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(5, skipped=6)}, native)
    assert f"Likely cause: {cause}" in said and "Likely cause: the loss scaler" not in said, said
    assert (
        "Note: the scaler skipped 6 of 20 steps, so fp16 trained with fewer updates (a matter of quality, not speed); "
        "watch amp/loss_scale."
    ) in said


def test_verdict_same_speed_on_native_fp16_names_the_small_model():
    said = compare_amp.verdict({"no": synthetic(10), "fp16": synthetic(10.5)}, TENSOR_CORES)
    assert said[0].isupper(), said
    assert "about the speed of fp32 (1.05x)" in said and "Likely cause: the model or batch is too small" in said


@pytest.mark.parametrize(
    "metrics, said",
    [
        ({tags.EVAL_PERPLEXITY: 3.0, tags.EVAL_EXACT_MATCH: 0.5}, "and an exact-match change of +0.0 points"),
        ({tags.EVAL_PERPLEXITY: 3.0}, "and an eval/loss change of +0.0000"),  # plain text: no reference answers
    ],
    ids=["prompts", "plain text"],
)
def test_a_causal_lms_comparison_speaks_of_its_own_metrics_never_nan(tmp_path, metrics, said):
    # It reported "final eval/accuracy nan" and "an accuracy change of +nan points" for a causal LM.
    runs = {mode: {**synthetic(speed), "metrics": metrics} for mode, speed in (("no", 10), ("fp16", 20))}
    verdict = compare_amp.write_report(runs, ["python", "app/train.py"], tmp_path / "report.md", "8")
    report = (tmp_path / "report.md").read_text()
    assert said in verdict and "accuracy" not in report and "nan" not in report.lower(), report
    assert "| final eval/perplexity | 3.0000 | 3.0000 |" in report


@pytest.mark.parametrize("short", ["no", "fp16"])
def test_a_short_run_is_reported_in_words_never_nan(tmp_path, short):
    runs = {"no": synthetic(10), "fp16": synthetic(5)}
    runs[short] = synthetic(0, timed=0)
    said = compare_amp.write_report(runs, ["python", "app/train.py"], tmp_path / "report.md", "8")
    report = (tmp_path / "report.md").read_text()
    assert said.startswith("Not enough steps to judge on this cpu") and "nan" not in said
    assert "nan" not in report.lower() and "| samples/s |" in report and "not enough steps" in report


def test_every_precision_sees_the_same_batch_shapes(tiny_model_dir, review_files):
    # 24, not 8: the harness truncates to 64 tokens, a multiple of 8, so padding to 8 would change no shape here.
    shapes = {}
    for precision in ("no", "fp16", "bf16"):
        run = harness.build_training(tiny_model_dir, review_files, mixed_precision=precision, pad_to_multiple_of=24)
        shapes[precision] = [tuple(batch["input_ids"].shape) for batch in run.train_loader]
        run.close()
    assert shapes["no"] == shapes["fp16"] == shapes["bf16"]
    assert all(length % 24 == 0 for _, length in shapes["no"])
    unpadded = harness.build_training(tiny_model_dir, review_files, mixed_precision="no")
    assert [tuple(batch["input_ids"].shape) for batch in unpadded.train_loader] != shapes["no"]  # the flag acts
    unpadded.close()


def test_two_fp32_runs_of_a_comparison_deviate_by_zero(quick_args, tmp_path):
    curves = []
    for name in ("a", "b"):
        args = list(quick_args)
        args[args.index("--run_name") + 1] = name
        args[args.index("--output_dir") + 1] = str(tmp_path / name)
        assert run_app([*args, "--mixed_precision", "no", "--pad_to_multiple_of", "8", "--max_steps", "4"]) == 0
        curves.append(compare_amp.read_run(tmp_path / "runs" / name)["curves"][tags.TRAIN_LOSS])
    assert sorted(curves[0]) == [1, 2, 3, 4] and all(math.isfinite(v) for v in curves[0].values())
    assert compare_amp.largest_deviation(*curves) == 0.0
    assert torch.tensor(list(curves[0].values())).std() > 0  # real, changing losses, not a constant


def test_an_fp16_run_that_fell_back_is_reported_as_such(quick_args, overflow_model_dir, tmp_path):
    # Its column showed fp16's last loss scale and skipped steps beside the fallback precision's speed, and the verdict
    # blamed the skipped steps for a speed that was bf16's or fp32's.
    args = list(quick_args)
    args[args.index("--model_name_or_path") + 1] = str(overflow_model_dir)
    args += ["--amp", "--max_consecutive_skips", "2", "--eval_steps", "0", "--on_scale_collapse", "fallback"]
    assert run_app([*args, "--max_steps", "6"]) == 0
    fp16 = compare_amp.read_run(tmp_path / "runs" / "test")
    assert fp16["fallback"].startswith("fallback at optimizer step 3") and not fp16["loss_scaling"]
    said = compare_amp.write_report({"no": synthetic(10), "fp16": fp16}, ["app/train.py"], tmp_path / "r.md", "1")
    # No advice from the fallback precision's speed: it blamed fp16's emulation, or said "use --amp" where bf16 ran
    # fast.
    assert said.startswith("fp16 did not train this job on this cpu: its loss scale collapsed, and the run fell back (")
    assert "so its column is mostly the other precision's. Use --mixed_precision " in said
    faster = {"no": synthetic(10), "fp16": {**fp16, "samples_per_sec": 15}}
    for native, advice in ((NATIVE_BF16, "bf16"), (NO_NATIVE, "no")):
        fell_back = compare_amp.verdict(faster, native)
        assert "--amp" not in fell_back and f"Use --mixed_precision {advice} here, or fix what overflows" in fell_back
    rows = {
        row.split("|")[1].strip(): row.split("|")[3].strip()
        for row in (tmp_path / "r.md").read_text().splitlines()
        if row.startswith("| ")
    }
    assert rows["skipped steps"] == rows["final loss scale"] == "off", rows


def test_a_loss_that_is_not_finite_and_steps_all_skipped_are_said_so():
    # "no common logged steps" where both runs logged the same steps and fp16's losses were nan; "fewer updates"
    # where fp16 made none.
    base, fp16 = synthetic(10), synthetic(5, skipped=10)
    base["curves"] = {tags.TRAIN_LOSS: {5: 0.7, 10: 0.6}}
    fp16["curves"] = {tags.TRAIN_LOSS: {5: float("nan"), 10: float("nan")}}
    assert compare_amp._deviation(base, fp16) == "not finite (a loss was inf or nan)"
    fp16["curves"] = {tags.TRAIN_LOSS: {5: float("nan"), 10: 0.6}}  # one nan among finite losses: max() skipped it
    assert compare_amp._deviation(base, fp16) == "not finite (a loss was inf or nan)"
    assert compare_amp._deviation(base, {"curves": {tags.TRAIN_LOSS: {7: 0.5}}}) == "no common logged steps"
    said = compare_amp.verdict({"no": base, "fp16": fp16}, NO_NATIVE)
    assert "the scaler skipped 10 of 10 steps, so fp16 trained with no update at all" in said, said
