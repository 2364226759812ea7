"""fp16 diagnostics (app/amp/diagnose.py, app/amp/fallback.py) on real tiny models: one whose fp16 output overflows
in a named Linear, one healthy, one whose config says bf16. Every test forces the bf16 probe it depends on, never
reads it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import app.amp.policy
import app.host.dropout
from app import loop
from app.amp import diagnose, fallback
from app.errors import TrainingHalted
from app.host.dropout import DropoutMasks
from app.telemetry import tags
from tests import harness, tb
from tests.conftest import OVERFLOWING, run_app, save_tiny_bert
from tests.test_dropout import AtenCalls


@pytest.fixture(scope="session")
def warming_model_dir(tmp_path_factory) -> Path:
    """A tiny BERT whose same Linear starts at ~5300 (3.6 bits below 65504) and grows as it trains at a high LR: its
    input LayerNorm is scaled up, so Adam's steps on the Linear's small weights move its output by a lot."""
    from transformers import BertModel

    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-warming"), dropout=0.1)
    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule("encoder.layer.1.attention.output.LayerNorm").weight.mul_(12000)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bf16_config_model_dir(tmp_path_factory) -> Path:
    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-bf16-config"), dropout=0.1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    return path


def with_model(quick_args: list[str], model_dir: Path) -> list[str]:
    args = list(quick_args)
    args[args.index("--model_name_or_path") + 1] = str(model_dir)
    return args


def all_texts(run_dir: Path, tag: str) -> list[str]:
    events = tb.load(run_dir)
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")]


@pytest.mark.parametrize(
    "has_bf16, advice",
    [
        (False, "--mixed_precision no (fp32: this device has no native bf16)"),  # bf16, emulated there, offered
        (True, "--mixed_precision bf16 (no loss scaling needed)"),
    ],
)
def test_preflight_and_overflow_report_name_the_overflowing_linear(
    quick_args, overflow_model_dir, tmp_path, capsys, monkeypatch, has_bf16, advice
):
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: has_bf16)
    args = with_model(quick_args, overflow_model_dir)
    code = run_app([*args, "--amp", "--max_steps", "6", "--max_consecutive_skips", "2", "--eval_steps", "0"])
    out, err = capsys.readouterr()
    assert code == 3
    preflight = next(line for line in out.splitlines() if "amp pre-flight" in line)
    assert f"first in execution order: bert.{OVERFLOWING} (max |x| = inf)" in preflight
    assert f"Expect loss-scale skips; consider {advice} (" in preflight, "what a fallback would pick on this CPU"
    assert f"what to try: a lower --learning_rate; {advice}; check the data" in out
    report = f"first overflow: bert.{OVERFLOWING} (forward output, max |x| = inf in float16)"
    assert report in err
    run_dir = tmp_path / "runs" / "test"
    assert f"bert.{OVERFLOWING}" in all_texts(run_dir, tags.AMP_PREFLIGHT)[0]
    assert all_texts(run_dir, tags.AMP_OVERFLOW_REPORT) == [report]
    # Overflowing from step 1 on: no headroom at any logged step (-1 bit, finite, so that TensorBoard draws it), and
    # the module that sets it is the one that overflows.
    assert set(tb.scalars(run_dir)[tags.AMP_HEADROOM_BITS].values()) == {-1.0}
    assert all_texts(run_dir, tags.AMP_HEADROOM_MODULE)[0] == (
        f"`bert.{OVERFLOWING}` sets the fp16 headroom: none, its output holds inf (logged as -1 bit)"
    )


def test_nan_activations_from_the_first_step_draw_a_headroom_curve(quick_args, tmp_path):
    """NaN activations at every step, while the scaler skips and halves its scale: the chart shows -1 bit at every
    log step (TensorBoard draws no point for NaN) and names the module."""
    from transformers import BertModel

    path = save_tiny_bert(tmp_path / "nan-bert", dropout=0.1)
    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule(OVERFLOWING).weight[0, 0] = float("nan")
    model.save_pretrained(path)
    args = [*with_model(quick_args, path), "--amp", "--on_scale_collapse", "warn", "--max_steps", "8"]
    assert run_app([*args, "--eval_steps", "0", "--save_steps", "0"]) == 0
    run_dir = tmp_path / "runs" / "test"
    logged = tb.scalars(run_dir)
    assert logged[tags.AMP_HEADROOM_BITS] == {step: -1.0 for step in range(1, 9)}
    assert logged[tags.AMP_SKIPPED_STEPS][8] == 8, "every step skipped"
    assert all_texts(run_dir, tags.AMP_HEADROOM_MODULE) == [
        f"`bert.{OVERFLOWING}` sets the fp16 headroom: none, its output holds nan (logged as -1 bit)"
    ]


def test_headroom_falls_to_zero_before_the_loss_scale_alarm(quick_args, warming_model_dir, tmp_path, capsys):
    """Activations that grow as the model trains: the headroom curve shows it steps before the scaler reacts."""
    args = [*with_model(quick_args, warming_model_dir), "--amp", "--learning_rate", "3e-2", "--warmup_ratio", "0"]
    args += ["--weight_decay", "0", "--max_consecutive_skips", "3", "--max_steps", "30", "--eval_steps", "0"]
    assert run_app(args) == 3
    alarm = int(re.search(r"loss-scale alarm at optimizer step (\d+)", capsys.readouterr().out).group(1))
    run_dir = tmp_path / "runs" / "test"
    logged = tb.scalars(run_dir)
    headroom, skipped = logged[tags.AMP_HEADROOM_BITS], logged[tags.AMP_SKIPPED_STEPS]
    first_skip = min(step for step, count in skipped.items() if count > 0)
    gone = min(step for step, bits in headroom.items() if bits <= 0)
    assert gone <= first_skip < alarm, (headroom, skipped, alarm)
    assert headroom[1] > 2 and headroom[first_skip - 1] < headroom[1] - 2, "it fell by 2 bits before any skip"
    assert f"`bert.{OVERFLOWING}` sets the fp16 headroom" in all_texts(run_dir, tags.AMP_HEADROOM_MODULE)[0]


def test_healthy_preflight_says_one_clean_line_and_leaves_no_trace(tiny_model_dir, review_files, capsys):
    final = {}
    for skip in (False, True):
        run = harness.build_training(tiny_model_dir, review_files, amp=True, max_steps=3, skip_amp_preflight=skip)
        harness.train(run)
        final[skip] = {k: v.clone() for k, v in run.model.state_dict().items()}
        lines = [line for line in capsys.readouterr().out.splitlines() if "pre-flight" in line]
        if skip:
            assert lines == []
        else:
            assert len(lines) == 1 and lines[0].startswith("amp pre-flight: clean, largest fp16 module output"), lines
    assert final[False].keys() == final[True].keys()
    for name in final[False]:
        assert torch.equal(final[False][name], final[True][name]), name


@pytest.mark.parametrize("has_bf16", [True, False])
def test_preflight_warns_about_a_model_stored_in_bf16(quick_args, bf16_config_model_dir, capsys, monkeypatch, has_bf16):
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: has_bf16)
    assert run_app([*with_model(quick_args, bf16_config_model_dir), "--amp", "--max_steps", "1"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "stored in bfloat16" in line]
    assert len(warnings) == 1
    offer = "--mixed_precision bf16 (no loss scaling needed)" if has_bf16 else "--mixed_precision no (fp32: this device"
    assert f"exceed fp16's range (max 65504); try {offer}" in warnings[0], warnings[0]


def test_overflow_replay_leaves_weights_grads_and_rng_unchanged(overflow_model_dir, review_files):
    run = harness.build_training(overflow_model_dir, review_files, amp=True, max_steps=2, skip_amp_preflight=True)
    loop.train(run)
    model = run.model
    model.train()  # replayed as in training: dropout draws from the global RNG
    batch = diagnose.first_training_batch(run.train_loader, run.accelerator.device)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)  # gradients of a step in progress must survive the replay
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    optimizer_state = {k: {n: t.clone() for n, t in s.items()} for k, s in run.optimizer.optimizer.state.items()}

    line = run.overflow_report(batch, run.scaler.get_scale())
    run.close()

    assert line == f"first overflow: bert.{OVERFLOWING} (forward output, max |x| = inf in float16)"
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for p, grad in zip(model.parameters(), grads):
        assert torch.equal(p.grad, grad)
    for key, saved in optimizer_state.items():
        for name, value in saved.items():
            assert torch.equal(run.optimizer.optimizer.state[key][name], value)


def test_overflow_replay_draws_the_runs_dropout_masks_also_when_checkpointing_recomputes(
    overflow_model_dir, review_files, monkeypatch
):
    """The replay is the training forward's: under the run's masks (host/dropout.py), drawn again as gradient
    checkpointing recomputes a layer in the backward pass."""
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # where the flag picks the SFC64 masks
    run = harness.build_training(
        overflow_model_dir, review_files, amp=True, max_steps=1, skip_amp_preflight=True, gradient_checkpointing=True
    )
    assert run.masks == DropoutMasks.SFC64
    run.model.train()
    batch = diagnose.first_training_batch(run.train_loader, run.accelerator.device)
    with AtenCalls() as seen:
        line = run.overflow_report(batch, run.scaler.get_scale())
    run.close()
    assert line == f"first overflow: bert.{OVERFLOWING} (forward output, max |x| = inf in float16)"
    assert seen.calls["bernoulli_"] == 0 and seen.calls["randint"] > 0, seen.calls  # a seed per SFC64 mask


@pytest.mark.slow
def test_under_torch_compile_the_diagnostic_passes_run_eagerly(overflow_model_dir, review_files, capsys):
    """Their hooks would have torch.compile trace a hooked graph of its own for each pass (minutes for SmolLM2 on a
    CPU: docs/benchmarks.md#fp16-pre-flight), and the pre-flight comes before the training graph is compiled."""
    from torch._dynamo.utils import counters

    run = harness.build_training(
        overflow_model_dir, review_files, amp=True, max_steps=1, torch_compile=True, skip_amp_preflight=True
    )
    run.model.train()
    batch = diagnose.first_training_batch(run.train_loader, run.accelerator.device)
    counters.clear()
    try:
        run.preflight()
        line = run.overflow_report(batch, run.scaler.get_scale())
        compiled = counters["stats"]["unique_graphs"]
        run.model(**batch)  # the model itself is still compiled: this call traces it
        assert counters["stats"]["unique_graphs"] > compiled
    finally:
        run.close()
    assert compiled == 0, "a diagnostic pass compiled a graph"
    assert f"first in execution order: bert.{OVERFLOWING} (max |x| = inf)" in capsys.readouterr().out
    assert line == f"first overflow: bert.{OVERFLOWING} (forward output, max |x| = inf in float16)"


@pytest.mark.parametrize("has_bf16, target", [(True, "bf16"), (False, "no")])
def test_fallback_finishes_in_the_new_precision_and_a_resume_stays_in_it(
    quick_args, overflow_model_dir, tmp_path, capsys, monkeypatch, has_bf16, target
):
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: has_bf16)
    label = "fp32" if target == "no" else target
    args = [*with_model(quick_args, overflow_model_dir), "--amp", "--max_consecutive_skips", "2", "--eval_steps", "0"]
    args += ["--on_scale_collapse", "fallback", "--save_steps", "5"]
    assert run_app([*args, "--max_steps", "6"]) == 0
    out = capsys.readouterr().out
    assert (
        "fallback at optimizer step 3, on the loss-scale alarm: going back to step-0 (optimizer step 0) and "
        f"carrying on in {label}"
    ) in out
    # The summary said "6 (6 applied, 0 skipped)": loss scaling on, for a run that ended without it
    assert "  optimizer steps  6 (loss scaling off)" in out
    run_dir = tmp_path / "runs" / "test"
    logged = tb.scalars(run_dir)
    losses = logged[tags.TRAIN_LOSS]  # steps 1-3 were logged twice: the later, fallback values win
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values()), losses
    for tag in (*tags.SCALER_TAGS, tags.AMP_HEADROOM_BITS):  # fp16's tags stop where fp16 stopped
        assert sorted(logged[tag]) == [1, 2, 3], f"{tag}: {logged[tag]}"
    precision = all_texts(run_dir, tags.RUN_PRECISION)
    assert len(precision) == 2 and precision[0].startswith("precision: fp16 autocast")
    assert "until step 3; then" in precision[1] and "from --on_scale_collapse fallback" in precision[1]
    assert f"carrying on in {label}" in all_texts(run_dir, tags.AMP_FALLBACK)[0]
    saved = json.loads((tmp_path / "out" / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    assert saved["precision"] == target and saved["fallback"] == {"from": "fp16", "at_step": 3}

    # Asked for fp16 again, the resume continues in the fallback precision and says so.
    assert run_app([*args, "--max_steps", "6", "--resume_from_checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    assert (
        f"note: resuming in {label}, not fp16: this run fell back from fp16 at optimizer step 3 (--on_scale_collapse "
        "fallback), and a resume does not go back to fp16: pass another precision with --mixed_precision, or start a "
        "new run in fp16"
    ) in out
    assert out.startswith(f"precision: {target + ' autocast' if target == 'bf16' else 'fp32, no autocast,'} on cpu")
    assert "loss-scale alarm" not in out and "loss scaling toggled" not in out  # saved with the disabled scaler
    assert "has nothing to do" not in out  # the flag did its work in this run: the note above says so
    assert json.loads((tmp_path / "out" / "checkpoints" / "step-5" / "trainer_state.json").read_text())["fallback"]


def test_a_fallback_to_a_checkpoint_after_skipped_steps_counts_them_in_the_summary(
    quick_args, overflow_model_dir, capsys, monkeypatch, tmp_path
):
    # Back to step-2, whose fp16 steps were both skipped: the summary said "(loss scaling off)", the model card
    # "2 skipped".
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: True)
    args = [*with_model(quick_args, overflow_model_dir), "--amp", "--max_consecutive_skips", "2", "--eval_steps", "0"]
    assert run_app([*args, "--on_scale_collapse", "fallback", "--save_steps", "1", "--max_steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "going back to step-2 (optimizer step 2)" in out, out
    steps = (
        "  optimizer steps  6 (4 applied, 2 skipped); fp16 with loss scaling for steps 1-2, then bf16 for steps 3-6\n"
    )
    assert steps in out, out
    # The model card said bf16 alone: its "fell back from" line compared the last precision with itself.
    card = (tmp_path / "out" / "README.md").read_text()
    assert (
        "| precision | fp16 with loss scaling for steps 1-2, then bf16 for steps 3-6; evaluated in bf16 autocast on "
        "cpu (from --on_scale_collapse fallback: the loss-scale alarm, handled at optimizer step 3"
    ) in card


def test_fallback_without_a_loss_scale_says_it_has_nothing_to_do_and_saves_no_start(tmp_path, quick_args, capsys):
    # In bf16 or fp32 no loss scale can collapse: the flag was ignored without a word, and a step-0 checkpoint written.
    assert run_app([*quick_args, "--max_steps", 2, "--mixed_precision", "no", "--on_scale_collapse", "fallback"]) == 0
    assert (
        "note: --on_scale_collapse fallback acts on fp16's loss scale; this run computes in fp32, with no loss scale, "
        "so it has nothing to do"
    ) in capsys.readouterr().out.splitlines()
    assert not (tmp_path / "out" / "checkpoints" / "step-0").exists()


def test_loss_scaler_flags_without_a_loss_scale_say_they_have_nothing_to_do(tmp_path, quick_args, capsys, monkeypatch):
    # They were ignored without a word; and under a launcher's bf16 a start below the alarm's scale was refused as
    # if an fp16 run were coming.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    path = tmp_path / "scaler.yaml"
    path.write_text("loss_scale_growth_interval: 1000000\n")  # an int, as typed: not 1e+06
    assert run_app([*quick_args, "--max_steps", 1, "--eval_steps", 0, "--init_loss_scale", 0.5, "--config", path]) == 0
    assert (
        "note: --init_loss_scale 0.5, --loss_scale_growth_interval 1000000 act on fp16's loss scale; this run "
        "computes in bf16, with no loss scale, so they have nothing to do (--loss_scale_growth_interval: from --config "
        f"{path}; a flag on the command line overrides it)"
    ) in capsys.readouterr().out.splitlines()


def test_a_second_alarm_after_the_fallback_stops_with_exit_3(overflow_model_dir, review_files):
    run = harness.build_training(overflow_model_dir, review_files, amp=True, max_steps=1, skip_amp_preflight=True)
    run.policy = replace(run.policy, mode="bf16", source=fallback.SOURCE)
    with pytest.raises(TrainingHalted) as halted:
        fallback.fall_back(run.policy, run.checkpoints.last_saved, 7)
    run.close()
    assert halted.value.exit_code == 3 and "after the fallback to bf16" in str(halted.value)


def test_overflow_report_names_the_first_gradient_to_overflow(tiny_model_dir, review_files):
    # A healthy forward pass, but a loss scale no fp16 gradient survives: the backward pass overflows first at the end.
    run = harness.build_training(tiny_model_dir, review_files, amp=True, init_loss_scale=1e30, max_steps=1)
    line = run.overflow_report(
        diagnose.first_training_batch(run.train_loader, run.accelerator.device), run.scaler.get_scale()
    )
    run.close()
    assert line == "first overflow: classifier (gradient, max |x| = inf in float16)"


@pytest.mark.parametrize("logging_steps", [1, 10])
def test_the_alarms_report_replays_the_failing_step_at_its_own_scale_and_checks_parameter_gradients(
    quick_args, capfd, tmp_path, logging_steps
):
    # One batch, the same at every step. The sums over the batch that make the classifier's parameter gradients
    # overflow fp16 from a loss scale of about 2**18 * 65504 / 62656 on; no module output or its gradient does below
    # 2**21. Step 1 ran at 1.5 * 2**19, step 2 at 1.5 * 2**18: the alarm. The report replayed the batch at the scale
    # after step 2's skip (0.75 * 2**18, clean) and watched module outputs and their gradients alone: "the overflow
    # came from another batch", in a run that never saw another batch. Between log steps a step is settled one step
    # late: the alarm of step 2 comes during step 3, whose batch and scale are not step 2's.
    args = [*quick_args, "--amp", "--init_loss_scale", str(1.5 * 2**19), "--max_consecutive_skips", "1"]
    args += ["--max_train_samples", "16", "--per_device_train_batch_size", "16", "--max_steps", "4"]
    assert run_app([*args, "--eval_steps", "0", "--logging_steps", str(logging_steps)]) == 3
    err = capfd.readouterr().err
    report = next(line for line in err.splitlines() if "overflow" in line and "alarm" not in line)
    expected = r"first overflow: classifier\.(weight|bias) \(parameter gradient, max \|x\| = inf in float32\)"
    assert re.fullmatch(expected, report), err
    assert all_texts(tmp_path / "runs" / "test", tags.AMP_OVERFLOW_REPORT) == [report]


def test_the_preflight_checks_the_loops_first_batch(tiny_model_dir, review_files):
    run = harness.build_training(tiny_model_dir, review_files, amp=True, max_steps=1)
    checked = diagnose.first_training_batch(run.train_loader, run.accelerator.device)
    run.train_loader.set_epoch(0)  # as the loop starts its first epoch
    trained = next(iter(run.train_loader))
    run.close()
    assert checked.keys() == trained.keys()
    for key in checked:
        assert torch.equal(checked[key], trained[key]), key


def test_preflight_flags_a_nan_output(tmp_path, review_files, capsys):
    # NaN compares False with everything: a check written as `value > limit` would let it through.
    from transformers import BertModel

    path = save_tiny_bert(tmp_path / "nan-bert", dropout=0.1)
    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule(OVERFLOWING).weight[0, 0] = float("nan")
    model.save_pretrained(path)
    run = harness.build_training(path, review_files, amp=True, max_steps=1)
    capsys.readouterr()
    run.preflight()
    run.close()
    line = capsys.readouterr().out.strip()
    assert f"first in execution order: bert.{OVERFLOWING} (max |x| = nan)" in line, line


def test_the_overflow_report_of_several_processes_names_the_first_that_found_one():
    hit = "first overflow: classifier (gradient, max |x| = inf in float16)"
    assert diagnose.overflow_said([hit], True) == hit
    assert diagnose.overflow_said([None, hit, "first overflow: other"], True) == f"{hit}, in the batch of process 1"
    assert diagnose.overflow_said([None, None], True) == (
        "overflow report: the replayed batches of all 2 processes stay within fp16's range (the overflow came from "
        "another batch)"
    )
    assert diagnose.overflow_said([None], False) == "overflow report: no batch to replay"


def test_an_evaluation_whose_logits_overflow_predicts_nothing(quick_args, overflow_model_dir, tmp_path, capsys):
    # Every fp16 logit NaN: argmax read each as class 0 and reported its share of the labels (0.6875) as the accuracy.
    args = with_model(quick_args, overflow_model_dir)
    assert run_app([*args, "--amp", "--max_steps", "2", "--on_scale_collapse", "warn", "--eval_steps", "0"]) == 0
    scalars = tb.scalars(tmp_path / "runs" / "test")
    assert math.isnan(scalars[tags.EVAL_LOSS][2]), "the logits of this evaluation do not overflow"
    assert scalars[tags.EVAL_ACCURACY][2] == 0.0 and scalars[tags.EVAL_F1][2] == 0.0
    assert "  eval/accuracy    0.0000\n" in capsys.readouterr().out
