"""The causal-LM task through everything else the app does: the plain-loop equivalence, two ranks, kill -9 and an
exact resume, the fp16 doctor on a decoder, best model and the model card. Gradient checkpointing on a decoder:
tests/test_gradient_checkpointing.py."""

from __future__ import annotations

import copy
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

import app.amp.policy
import app.host.dropout
from app.storage.checkpoints import completed_checkpoints
from app.tasks.causal_lm import token_mean_loss
from app.telemetry import tags
from tests import harness, tb
from tests.conftest import ROOT, assert_trained_alike, free_port, launch, run_app
from tests.test_causal_lm import PROMPTS, lm_args
from tests.test_checkpoint import kill_run

CPU_MULTI = ROOT / "accelerate_configs" / "cpu_multi.yaml"
HOT = "model.layers.1.mlp.down_proj"  # the Linear whose fp16 output overflows in the hot decoder


def lm_run_options(**extra) -> dict:
    return (
        dict(task="causal_lm", prompt_column="text", response_column="label", text_column=None, label_column=None)
        | extra
    )


def test_amp_off_is_bitwise_a_plain_fp32_loop_with_the_same_loss(tiny_llama_dir, uneven_responses):
    run = harness.build_training(
        tiny_llama_dir,
        uneven_responses,
        mixed_precision="no",
        max_steps=4,
        warmup_ratio=0.5,
        weight_decay=0.0,
        max_grad_norm=0.5,
        max_length=48,
        per_device_train_batch_size=4,
        **lm_run_options(),
    )
    initial = copy.deepcopy(run.model.state_dict())
    loader = run.train_loader.base_dataloader  # Accelerate's loader wraps the DataLoader that collates
    batches, collate = [], loader.collate_fn
    loader.collate_fn = lambda rows: batches.append(collate(rows)) or batches[-1]
    harness.train(run)

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    plain.load_state_dict(initial)
    plain.train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=run.cfg.learning_rate, weight_decay=0.0, fused=True)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=4)
    batches = batches[:4]  # Accelerate's loader collates one batch ahead, to know which batch is the last
    for batch in batches:
        token_mean_loss(plain, batch).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    assert len(batches) == 4 and len({b["num_items"] for b in batches}) > 1, "batches of unequal label counts"
    for name, value in plain.state_dict().items():
        assert torch.equal(run.model.state_dict()[name], value), f"{name} differs from the plain fp32 loop"
    assert not torch.equal(run.model.state_dict()["lm_head.weight"], initial["lm_head.weight"]), "nothing trained"


@pytest.mark.slow
def test_two_ranks_train_as_one_process_on_the_global_batch(tmp_path, tiny_llama_dir, uneven_responses, one_thread):
    """The token-mean loss is over every rank's label tokens: 2 ranks x 4 examples step as 1 x 8 would."""
    common = [
        *lm_args(tmp_path, tiny_llama_dir, uneven_responses, *PROMPTS),
        *("--mixed_precision", "no", "--max_steps", 4, "--eval_steps", 0, "--train_sampling_strategy", "random"),
        *("--learning_rate", "1e-3"),
    ]
    common = common[: common.index("--output_dir")] + common[common.index("--output_dir") + 4 :]  # placed per run
    common[common.index("--per_device_train_batch_size") + 1] = "4"
    two = launch(
        tmp_path,
        ["--config_file", CPU_MULTI, "--main_process_port", free_port(), "--num_cpu_threads_per_process", 1],
        [*common, "--output_dir", tmp_path / "two", "--logdir", tmp_path / "two_runs"],
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = [*common, "--output_dir", tmp_path / "one", "--logdir", tmp_path / "one_runs"]
    one[one.index("--per_device_train_batch_size") + 1] = "8"
    assert run_app(one) == 0
    assert_trained_alike(tmp_path, "lm", {1, 2, 3, 4}, loss_tolerance=1e-5)


@pytest.mark.slow
def test_kill_9_then_resume_is_bitwise_for_a_decoder_in_fp16(tmp_path, tiny_gpt2_dir, review_files, one_thread):
    """The killed run is a real process; the uninterrupted run and the resume run in this one."""
    common = [
        *lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS),
        *("--amp", "--max_steps", 10, "--save_steps", 4, "--eval_steps", 0, "--loss_scale_growth_interval", 3),
        *("--seed", 3),
    ]
    common = common[: common.index("--output_dir")] + common[common.index("--output_dir") + 4 :]
    here = ["--output_dir", tmp_path / "run", "--logdir", tmp_path / "runs"]
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_run, tmp_path, "published", 1, [*common, *here])
        # Signal handlers can only be installed from the main thread: the in-process run stays on it.
        assert run_app([*common, "--output_dir", tmp_path / "ref", "--logdir", tmp_path / "ref_runs"]) == 0
        killed = killed.result()
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [p.name for p in completed_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-4"]
    assert run_app([*common, *here, "--resume_from_checkpoint", "latest"]) == 0
    expected, got = load_file(tmp_path / "ref" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs from the uninterrupted run"
    scales = tb.scalars(tmp_path / "runs" / "lm")[tags.AMP_LOSS_SCALE]
    assert scales == tb.scalars(tmp_path / "ref_runs" / "lm")[tags.AMP_LOSS_SCALE]
    assert len(set(scales.values())) > 1, "the scale moved (growth every 3 steps), so its state had to be restored"


@pytest.fixture(scope="module")
def hot_llama_dir(tmp_path_factory, review_texts):
    """A tiny Llama whose layer-1 MLP output goes beyond fp16's range: harmless in fp32 and bf16."""
    from tests.lm_models import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("hot-llama"), review_texts)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule(HOT).weight.mul_(1e6)
    model.save_pretrained(path)
    return path


def test_the_fp16_doctor_names_the_overflowing_module_of_a_decoder(
    tmp_path, hot_llama_dir, review_files, capsys, monkeypatch
):
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: False)
    args = lm_args(tmp_path, hot_llama_dir, review_files, *PROMPTS, "--amp", "--max_steps", 6)
    assert run_app([*args, "--max_consecutive_skips", 2, "--eval_steps", 0]) == 3
    out, err = capsys.readouterr()
    preflight = next(line for line in out.splitlines() if "amp pre-flight" in line)
    assert f"first in execution order: {HOT} (max |x| = inf)" in preflight
    assert f"first overflow: {HOT} (forward output, max |x| = inf in float16)" in err


def test_a_residual_stream_beyond_fp16_kept_in_fp32_is_a_note_not_a_warning(
    tmp_path, review_texts, review_files, capsys, monkeypatch
):
    """Scaled-up embeddings put the residual stream near 1e6 in fp32; RMSNorm brings it back before every fp16
    matmul, so nothing in fp16 overflows and the run trains without a skip. (The model has no dropout: no line about
    its masks, even where torch draws them serially.)"""
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)
    from tests.lm_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "wide", review_texts)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e7)
    model.config.tie_word_embeddings = False  # keep the LM head as it was
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() / 1e7)
    model.save_pretrained(path)
    args = lm_args(tmp_path, path, review_files, *PROMPTS, "--amp", "--max_steps", 3, "--eval_steps", 0)
    assert run_app(args) == 0
    out = capsys.readouterr().out
    assert "amp pre-flight: clean" in out and "warning: amp pre-flight" not in out
    assert "kept in fp32 by autocast, cannot overflow it" in out
    assert "dropout: masks" not in out
    assert tb.scalars(tmp_path / "runs" / "lm")[tags.AMP_SKIPPED_STEPS][3] == 0


def test_the_best_checkpoint_of_a_model_with_tied_embeddings_loads_at_the_end(tmp_path, tiny_gpt2_dir, review_files):
    # Its checkpoints hold the tied LM head once, under the embeddings' name: a strict load_state_dict of an earlier
    # best failed ("Missing key(s) in state_dict: lm_head.weight"), a traceback after the final evaluation.
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_gpt2_dir).tie_word_embeddings
    args = lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS, "--mixed_precision", "no", "--max_steps", 4)
    flags = ["--eval_steps", 2, "--save_steps", 2, "--load_best_model_at_end", "--metric_for_best_model", "perplexity"]
    assert run_app([*args, *flags, "--greater_is_better", "true"]) == 0  # the worse perplexity: an earlier step
    best = json.loads((tmp_path / "out" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    step = best["state"]["best_step"]
    assert step == 2, "perplexity falls as it trains: the highest is the first"
    saved = load_file(tmp_path / "out" / "model.safetensors")
    stored = load_file(tmp_path / "out" / "checkpoints" / f"step-{step}" / "model.safetensors")
    assert all(torch.equal(saved[name], stored[name]) for name in stored), "the saved model is the best checkpoint's"


def test_best_model_and_early_stopping_take_the_lm_metrics(tmp_path, tiny_gpt2_dir, review_files, capsys):
    args = lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS, "--mixed_precision", "no", "--max_steps", 6)
    flags = ["--eval_steps", 2, "--load_best_model_at_end", "--metric_for_best_model", "perplexity"]
    assert run_app([*args, *flags, "--early_stopping_patience", 5]) == 0
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    perplexities = tb.scalars(tmp_path / "runs" / "lm")[tags.EVAL_PERPLEXITY]
    assert set(perplexities) == {2, 4, 6}
    assert state["state"]["best_step"] == min(perplexities, key=perplexities.get), "lower perplexity is better"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "causal language modelling: prompt/response pairs" in card
    again = [*args, *flags[:3], "--metric_for_best_model", "accuracy", "--output_dir", tmp_path / "o2", "--run_name"]
    again += ["again"]
    assert run_app(again) == 2
    assert "is not computed for --task causal_lm" in capsys.readouterr().err
