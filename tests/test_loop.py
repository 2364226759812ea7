"""The one loop: with AMP off it is exactly a plain fp32 loop; with fp16 it really autocasts and scales."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import get_linear_schedule_with_warmup

from app.tasks.first_token import compute_the_first_token_alone
from tests.harness import build_training, train


def record_batches(model: torch.nn.Module) -> list[dict]:
    """Every batch the model is called with during training, as the loop passed it."""
    seen = []

    def hook(module, args, kwargs):
        if module.training:
            seen.append({k: v.clone() for k, v in kwargs.items()})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_amp_off_is_bitwise_a_plain_fp32_loop(tiny_model_dir, review_files):
    run = build_training(
        tiny_model_dir,
        review_files,
        mixed_precision="no",
        max_steps=6,
        warmup_ratio=0.5,
        weight_decay=0.0,
        max_grad_norm=0.05,
    )
    initial_weights = copy.deepcopy(run.model.state_dict())
    batches = record_batches(run.model)
    rng = torch.get_rng_state()  # dropout is on: both loops must draw the same masks
    train(run)

    plain = run.inputs.task.load_model(str(tiny_model_dir), torch.float32, lambda line: None)
    # The model as the app builds it, its last layer computing the first token alone (tests/test_first_token.py
    # checks that against transformers' own): the loop is the point here.
    assert compute_the_first_token_alone(plain)
    plain.load_state_dict(initial_weights)
    plain.train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=run.cfg.learning_rate, weight_decay=0.0, fused=True)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=6)
    torch.set_rng_state(rng)
    for batch in batches:
        with run.dropout_masks():  # the same dropout masks (app/host/dropout.py; tests/test_dropout.py checks them)
            loss = plain(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()

    assert len(batches) == 6
    app_weights = run.model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(app_weights[name], value), f"{name} differs from the plain fp32 loop"
    assert not torch.equal(app_weights["classifier.weight"], initial_weights["classifier.weight"]), "nothing trained"


@pytest.mark.parametrize("mode, expected", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("no", torch.float32)])
def test_linear_layers_compute_in_the_policy_dtype(tiny_model_dir, review_files, mode, expected):
    run = build_training(tiny_model_dir, review_files, mixed_precision=mode, max_steps=2)
    dtypes = set()
    for module in run.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, output: dtypes.add(output.dtype) if m.training else None)
    train(run)
    assert dtypes == {expected}
    assert all(p.dtype == torch.float32 for p in run.model.parameters()), "master weights must stay fp32"
    assert run.scaler.is_enabled() == (mode == "fp16")


def inject_inf_at(model: torch.nn.Module, micro_steps: set[int], optimizer) -> dict[int, dict]:
    """Make the loss infinite at the given (1-based) training forwards. Returns, per injected step, the optimizer
    state seen just before that step and just after it (at the next forward)."""
    calls = {"n": 0}
    snapshots: dict[int, dict] = {}

    def snapshot():
        return {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}

    def pre_hook(module, args, kwargs):
        if module.training:
            calls["n"] += 1
            if calls["n"] - 1 in micro_steps:
                snapshots[calls["n"] - 1]["after"] = snapshot()
            if calls["n"] in micro_steps:
                snapshots[calls["n"]] = {"before": snapshot()}

    def hook(module, args, kwargs, output):
        if module.training and calls["n"] in micro_steps:
            output.loss = output.loss * float("inf")
        return output

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(hook, with_kwargs=True)
    return snapshots


def test_loss_scale_follows_torch_schedule_and_skips_injected_infs(tiny_model_dir, review_files):
    # 10 steps, growth every 3 clean steps, inf at steps 2 and 7:
    # ok, SKIP, ok, ok, ok(grow), ok, SKIP, ok, ok, ok(grow) -> 2 growths, 2 skips.
    init = 2.0**10
    run = build_training(
        tiny_model_dir,
        review_files,
        amp=True,
        max_steps=10,
        init_loss_scale=init,
        loss_scale_growth_interval=3,
        warmup_ratio=0.3,
    )
    snapshots = inject_inf_at(run.model, {2, 7}, run.optimizer)
    train(run)

    state = run.state
    assert (state.opt_step, state.skipped_steps, state.applied_updates) == (10, 2, 8)
    assert run.scaler.get_scale() == init * 2**2 * 0.5**2
    assert run.schedule.last_epoch == state.applied_updates, "the LR schedule must follow applied updates only"
    for step, seen in snapshots.items():
        before, after = seen["before"], seen["after"]
        assert before.keys() == after.keys()
        for param in before:
            for key in before[param]:
                assert torch.equal(before[param][key], after[param][key]), (
                    f"optimizer state moved on skipped step {step}"
                )


def test_skipped_step_holds_the_learning_rate(tiny_model_dir, review_files):
    run = build_training(tiny_model_dir, review_files, amp=True, max_steps=4, warmup_ratio=0.5)
    # The LR each optimizer.step call sees; the fused optimizer is called on skipped steps too, and skips inside.
    lrs = []
    run.optimizer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    inject_inf_at(run.model, {2}, run.optimizer)
    train(run)
    assert len(lrs) == 4
    # LR of updates 1..4: warmup from 0; the skipped step 2 does not advance it, so steps 2 and 3 share one LR.
    assert lrs[0] == 0.0
    assert lrs[1] > 0 and lrs[2] == lrs[1] and lrs[3] > lrs[2]
