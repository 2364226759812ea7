"""CPU dropout masks drawn faster than torch's serial loop (app/host/dropout.py): torch's dropout, from its generator.

The references here are written out by hand (a mask drawn after the same seed: SFC64 bits from numpy, or torch.rand;
attention computed in float64), so each test fails if the mode draws, keeps, scales or attends differently.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BertForSequenceClassification

import app.host.dropout
from app.config import TrainConfig
from app.host.dropout import (
    DropoutMasks,
    FastDropout,
    drops_out,
    masks_context,
    masks_of_run,
    serial_bernoulli,
)
from app.storage.checkpoints import STATE_FILE
from tests.conftest import run_app, tiny_bert_config
from tests.harness import build_training, train

P = 0.1


def sfc64_by_hand(shape, p: float) -> torch.Tensor:
    """The mask of a new run: a seed from torch's generator, then per element 32 bits of SFC64's 64-bit outputs, the
    low half first, kept where they are at least p * 2^32."""
    seed = torch.randint(0, 2**63 - 1, ()).item()
    count = math.prod(shape)
    words = np.random.Generator(np.random.SFC64(seed)).bit_generator.random_raw(math.ceil(count / 2))
    halves = np.stack([words & 0xFFFFFFFF, words >> 32], axis=1).reshape(-1)[:count]
    return torch.from_numpy(halves >= math.ceil(p * 2**32)).reshape(shape)


def uniform_by_hand(shape, p: float) -> torch.Tensor:
    """The mask of a run that started with float32 uniforms: one torch.rand each, kept where >= p."""
    return torch.rand(shape) >= p


# Each kind of the mode's masks with its reference: what masks_context gives a run that draws them.
KINDS = pytest.mark.parametrize(
    "masks, by_hand",
    [(DropoutMasks.SFC64, sfc64_by_hand), (DropoutMasks.UNIFORM, uniform_by_hand)],
    ids=["sfc64", "uniform"],
)


class AtenCalls(TorchDispatchMode):
    """Counts the aten operators that run while it is active, by name ("bernoulli_")."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@KINDS
def test_dropout_keeps_one_minus_p_of_the_elements_and_scales_them(masks, by_hand):
    x = torch.ones(1000, 1000)
    with masks_context(masks)():
        out = F.dropout(x, P, training=True)
    kept = out != 0
    assert torch.equal(out[kept], torch.full_like(out[kept], 1 / (1 - P)))
    # 10^6 Bernoulli(0.9) draws: the kept share is 0.9 to within 5 standard deviations (3e-4 each).
    assert abs(kept.float().mean().item() - (1 - P)) < 5 * (P * (1 - P) / x.numel()) ** 0.5
    # not one pattern repeated: rows and columns drop different elements
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[:, 0], kept[:, 1])


@KINDS
def test_the_mask_is_drawn_as_its_kind_says_from_torchs_default_generator(masks, by_hand):
    x = torch.randn(64, 47)  # an odd count: SFC64's last 64 bits give one element
    torch.manual_seed(7)
    with masks_context(masks)():
        out = F.dropout(x, p=0.3, training=True)
    torch.manual_seed(7)
    expected = x * by_hand((64, 47), 0.3) / 0.7
    torch.testing.assert_close(out, expected)

    state = torch.get_rng_state()  # what a checkpoint records, and a resume restores
    with masks_context(masks)():
        first = F.dropout(x, p=0.3, training=True)
        torch.set_rng_state(state)
        again = F.dropout(x, p=0.3, training=True)
        other = F.dropout(x, p=0.3, training=True)
    assert torch.equal(first, again) and not torch.equal(first, other)


@KINDS
def test_dropout_off_or_in_place_behaves_as_torchs(masks, by_hand):
    x = torch.randn(32, 32)
    with masks_context(masks)():
        assert torch.equal(F.dropout(x, P, training=False), x)
        assert torch.equal(F.dropout(x, 0.0, training=True), x)
        assert torch.equal(F.dropout(x, 1.0, training=True), torch.zeros_like(x))  # torch's own: all dropped
        y = x.clone()
        torch.manual_seed(1)
        returned = F.dropout(y, P, True, True)
    assert returned is y
    torch.manual_seed(1)
    torch.testing.assert_close(y, x * by_hand((32, 32), P) / (1 - P))


def attention_by_hand(q, k, v, keep, p, attn_mask=None, is_causal=False, scale=None):
    """Softmax attention in float64 with a given keep mask: the reference for the mode's attention dropout."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves several query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    # A row that may attend to no key gives zeros (torch's safe softmax), not the NaN of a softmax over -inf alone.
    attends_to_none = scores.isneginf().all(-1, keepdim=True)
    weights = torch.where(attends_to_none, 0.0, scores.masked_fill(attends_to_none, 0).softmax(-1))
    return (weights * keep / (1 - p)) @ v


@KINDS
@pytest.mark.parametrize(
    "case",
    ["no mask", "boolean mask", "additive mask", "causal", "scale", "grouped query", "a row attends to no key"],
)
def test_attention_dropout_is_softmax_attention_with_the_drawn_mask(case, masks, by_hand):
    torch.manual_seed(0)
    heads, kv_heads = (4, 2) if case == "grouped query" else (3, 3)
    q = torch.randn(2, heads, 5, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, 6 if case != "causal" else 5, 8, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    options = {
        "no mask": {},
        "boolean mask": {"attn_mask": torch.tensor([True] * 4 + [False] * 2).expand(2, 1, 5, 6)},
        "additive mask": {"attn_mask": torch.randn(2, 1, 5, 6)},
        "causal": {"is_causal": True},
        "scale": {"scale": 0.05},
        "grouped query": {"enable_gqa": True},
        "a row attends to no key": {"attn_mask": torch.tensor([[True] * 6] * 2 + [[False] * 6] + [[True] * 6] * 2)},
    }[case]
    p = 0.4
    torch.manual_seed(3)
    with masks_context(masks)():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **options)
    torch.manual_seed(3)
    keep = by_hand((2, heads, 5, k.shape[-2]), p)
    options.pop("enable_gqa", None)
    expected = attention_by_hand(q, k, v, keep, p, **options)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)

    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=1e-5, atol=1e-5)
    if case == "a row attends to no key":
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2])) and torch.equal(
            grads[0][:, :, 2], 0 * q[:, :, 2]
        )


def test_attention_in_bf16_keeps_torchs_precision():
    """As torch's math path: computed in float32, rounded to bf16 once. Computed in bf16, fewer than half of these
    elements come out as the float64 reference rounded to bf16; computed in float32, all or nearly all do."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16() for _ in range(3))
    torch.manual_seed(5)
    with FastDropout():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=P)
    torch.manual_seed(5)
    expected = attention_by_hand(q, k, v, sfc64_by_hand((2, 3, 16, 16), P), P)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the output
    assert (out == expected.bfloat16()).float().mean() > 0.99


def kept_everywhere(shape, p: float) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


# Calls of F.scaled_dot_product_attention: (query, key, value shapes), dtype, options, autocast's dtype or None.
BOOL_MASK = torch.tensor([True] * 4 + [False] * 2).expand(2, 1, 5, 6)
NO_KEY_ROW = torch.tensor([[True] * 6] * 2 + [[False] * 6] + [[True] * 6] * 2)
FLOAT32_MIN_ROW = torch.zeros(5, 6).index_fill_(0, torch.tensor([1]), torch.finfo(torch.float32).min)
CALLS = {
    "float32": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {}, None),
    "boolean mask": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"attn_mask": BOOL_MASK}, None),
    "additive mask": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"attn_mask": torch.randn(2, 1, 5, 6)}, None),
    "float32's min as the mask": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"attn_mask": FLOAT32_MIN_ROW}, None),
    "a row attends to no key": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"attn_mask": NO_KEY_ROW}, None),
    "causal, more queries than keys": (((2, 3, 7, 8), (2, 3, 5, 8)), torch.float32, {"is_causal": True}, None),
    "causal, fewer queries than keys": (((2, 3, 5, 8), (2, 3, 7, 8)), torch.float32, {"is_causal": True}, None),
    "scale": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"scale": 0.05}, None),
    "negative scale": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {"scale": -0.3}, None),
    "grouped query": (((2, 4, 5, 8), (2, 2, 6, 8)), torch.float32, {"enable_gqa": True}, None),
    "grouped query, equal heads": (((2, 4, 5, 8), (2, 4, 6, 8)), torch.float32, {"enable_gqa": True}, None),
    "no head dimension": (((3, 5, 8), (3, 6, 8)), torch.float32, {}, None),
    "float64": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float64, {"attn_mask": BOOL_MASK}, None),
    "bfloat16": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.bfloat16, {"attn_mask": BOOL_MASK}, None),
    "float16": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float16, {}, None),
    "float32 under bf16 autocast": (((2, 3, 5, 8), (2, 3, 6, 8)), torch.float32, {}, torch.bfloat16),
    "float64 under bf16 autocast": (
        ((2, 3, 5, 8), (2, 3, 6, 8)),
        torch.float64,
        {"attn_mask": BOOL_MASK},
        torch.bfloat16,
    ),
    "bfloat16 under bf16 autocast, float32's min as the mask": (
        ((2, 3, 5, 8), (2, 3, 6, 8)),
        torch.bfloat16,
        {"attn_mask": FLOAT32_MIN_ROW},
        torch.bfloat16,
    ),
    "float32 under fp16 autocast, causal": (
        ((2, 3, 5, 8), (2, 3, 5, 8)),
        torch.float32,
        {"is_causal": True},
        torch.float16,
    ),
}


@pytest.mark.parametrize("call", CALLS, ids=list(CALLS))
def test_attention_dropout_computes_what_torchs_attention_computes(call):
    """With every element kept and p = 0.5, the mode's attention is exactly twice torch's own without dropout, on the
    path torch takes with dropout on a CPU (its math path): the same casts under autocast, the same float32 for half
    inputs, the same output dtype, the same answer for a mask torch would round to -inf, the same gradients. Up to
    float rounding (one rounding of a half output)."""
    (q_shape, kv_shape), dtype, options, autocast = CALLS[call]
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for shape in (q_shape, kv_shape, kv_shape))
    along = torch.randn(q_shape[:-1] + kv_shape[-1:])
    outputs = []
    for mode, p in ((FastDropout(kept_everywhere), 0.5), (contextlib.nullcontext(), 0.0)):
        with mode, torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **options)
        grads = torch.autograd.grad((out.double() * along).sum(), (q, k, v))
        outputs.append((out, grads))
    (out, grads), (torchs, torchs_grads) = outputs
    assert out.dtype == torchs.dtype
    half = torch.float16 in (out.dtype, dtype) or torch.bfloat16 in (out.dtype, dtype)
    tolerance = {"rtol": 8e-3, "atol": 1e-5} if half else {"rtol": 1e-5, "atol": 1e-6}
    if dtype == torch.float64:
        tolerance = {"rtol": 1e-12, "atol": 1e-12}  # computed in float64, as torch does: not float32's 1e-7
    torch.testing.assert_close(out, 2 * torchs, **tolerance)
    for grad, torchs_grad in zip(grads, torchs_grads):
        torch.testing.assert_close(grad, 2 * torchs_grad, **tolerance)


# Calls torch refuses: the mode passes them on, so that torch's own error says what is wrong.
REFUSED = {
    "an integer mask": lambda q: {"attn_mask": torch.ones(4, 4, dtype=torch.long)},
    "keys in another dtype": lambda q: {"key": q.bfloat16()},
    "key heads that do not divide the query's": lambda q: {"key": q[:, :1].expand(1, 3, 4, 8), "enable_gqa": True},
    "a causal call with a mask": lambda q: {"attn_mask": torch.ones(4, 4, dtype=torch.bool), "is_causal": True},
    "a mask in another float dtype": lambda q: {"attn_mask": torch.zeros(4, 4, dtype=torch.float16)},
    "a mask that does not broadcast": lambda q: {"attn_mask": torch.zeros(3, 4, 4)},
    "a key of one dimension": lambda q: {"key": torch.randn(8), "value": torch.randn(8)},
    "grouped queries without a head dimension": lambda q: (
        {"query": q[0, 0], "key": q[0, 0], "value": q[0, 0]} | {"enable_gqa": True}
    ),
}


@pytest.mark.parametrize("bad", REFUSED, ids=list(REFUSED))
def test_attention_dropout_refuses_what_torchs_refuses(bad):
    q = torch.randn(1, 2, 4, 8)
    arguments = {"query": q, "key": q, "value": q, "dropout_p": P, **REFUSED[bad](q)}
    errors = []
    for mode in (contextlib.nullcontext(), FastDropout()):
        with pytest.raises(Exception) as error, mode:
            F.scaled_dot_product_attention(**arguments)
        errors.append(f"{type(error.value).__name__}: {error.value}")
    assert errors[1] == errors[0]


def tiny_bert(hidden_dropout: float, attention_dropout: float) -> torch.nn.Module:
    config = tiny_bert_config(100, hidden_dropout, attention_dropout, attn_implementation="sdpa")
    torch.manual_seed(0)
    return BertForSequenceClassification(config).train()


def test_a_models_training_forward_draws_no_bernoulli_mask_under_the_mode():
    model = tiny_bert(P, P)
    batch = {"input_ids": torch.randint(1, 100, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    batch["attention_mask"][0, 8:] = 0
    for mode, bernoullis in ((contextlib.nullcontext, 8), (FastDropout, 0)):
        # 8 of torch's: embeddings, 2 layers x (attention probabilities, attention output, feed-forward output), head
        with AtenCalls() as seen, mode():
            model(**batch).logits.sum().backward()
        assert seen.calls["bernoulli_"] == bernoullis, mode


def test_attention_dropout_reaches_the_models_attention():
    """Only attention dropout on: the training forward under the mode still differs from the evaluation one."""
    model = tiny_bert(0.0, 0.5)
    batch = {"input_ids": torch.randint(1, 100, (4, 12))}
    with torch.no_grad():
        evaluated = model.eval()(**batch).logits
        with FastDropout(), AtenCalls() as seen:
            trained = model.train()(**batch).logits
    assert seen.calls["bernoulli_"] == 0
    assert not torch.allclose(trained, evaluated)


def test_torch_draws_its_cpu_masks_serially_except_with_mkl_on_intel():
    assert not serial_bernoulli(mkl=True, intel=True)
    assert serial_bernoulli(mkl=True, intel=False)
    assert serial_bernoulli(mkl=False, intel=True)


def test_which_runs_use_the_mode(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)
    assert masks_of_run(TrainConfig(), cpu) == DropoutMasks.SFC64
    assert masks_of_run(TrainConfig(fast_cpu_dropout=False), cpu) == DropoutMasks.TORCH
    assert masks_of_run(TrainConfig(torch_compile=True), cpu) == DropoutMasks.TORCH
    assert masks_of_run(TrainConfig(), cuda) == DropoutMasks.TORCH
    # a resume keeps the run's own, whatever the flag says now
    assert masks_of_run(TrainConfig(), cpu, started_with=DropoutMasks.TORCH) == DropoutMasks.TORCH
    for started_with in (DropoutMasks.UNIFORM, DropoutMasks.SFC64):
        assert masks_of_run(TrainConfig(fast_cpu_dropout=False), cpu, started_with=started_with) == started_with
    assert masks_of_run(TrainConfig(), cpu, started_with=DropoutMasks.UNIFORM) == DropoutMasks.UNIFORM
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: True)
    assert masks_of_run(TrainConfig(), cpu) == (
        DropoutMasks.TORCH if torch.backends.mkl.is_available() else DropoutMasks.SFC64
    )


def test_the_flag_reaches_the_training_loop(monkeypatch, tiny_model_dir, review_files):
    """Two runs that differ only in --fast_cpu_dropout train on other masks (and so end with other weights); each
    forward of the first ran under the mode."""
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # the serial-Bernoulli case, on any host
    weights = {}
    for fast in (True, False):
        run = build_training(tiny_model_dir, review_files, mixed_precision="no", max_steps=2, fast_cpu_dropout=fast)
        with AtenCalls() as seen:
            train(run)
        assert (seen.calls["bernoulli_"] == 0) == fast
        weights[fast] = run.accelerator.unwrap_model(run.model).classifier.weight.detach().clone()
    assert not torch.equal(weights[True], weights[False])


def test_a_resume_keeps_the_masks_the_run_started_with(tmp_path, monkeypatch, tiny_model_dir, review_files, capsys):
    """A run started on torch's masks, resumed with the flag on (its default), still ends bitwise where it would have
    ended uninterrupted: the checkpoint records the masks, and the resume says it keeps them."""
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # where the flag would pick the uniform masks
    common = [
        *("--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--per_device_train_batch_size", 8, "--max_length", 32),
        *("--max_steps", 4, "--save_steps", 2, "--mixed_precision", "no", "--disable_tqdm", "--run_name", "r"),
    ]
    for name, extra in (("torch", ["--fast_cpu_dropout", "false"]), ("sfc64", [])):
        assert run_app([*common, *extra, "--output_dir", tmp_path / name, "--logdir", tmp_path / f"runs_{name}"]) == 0
        assert ("dropout: masks from 32 bits of SFC64 per element" in capsys.readouterr().out) == (
            name == DropoutMasks.SFC64
        )
        recorded = json.loads((tmp_path / name / "checkpoints" / "step-2" / STATE_FILE).read_text())
        assert recorded["dropout_masks"] == name
    uninterrupted = load_file(tmp_path / "torch" / "model.safetensors")
    assert not torch.equal(
        uninterrupted["classifier.weight"], load_file(tmp_path / "sfc64" / "model.safetensors")["classifier.weight"]
    )

    shutil.rmtree(tmp_path / "torch" / "checkpoints" / "step-4")
    (tmp_path / "torch" / "model.safetensors").unlink()
    capsys.readouterr()
    resumed = [*common, "--output_dir", tmp_path / "torch", "--logdir", tmp_path / "runs_again"]
    assert run_app([*resumed, "--resume_from_checkpoint", "latest", "--overwrite_output_dir"]) == 0
    assert "dropout masks drawn as when the run started (torch's own)" in capsys.readouterr().out
    again = load_file(tmp_path / "torch" / "model.safetensors")
    for name, value in uninterrupted.items():
        assert torch.equal(again[name], value), name


def test_the_backward_pass_keeps_a_byte_of_mask_per_element_not_a_float_copy():
    # torch's own dropout keeps a boolean mask for backward; a float32 one would take four times the memory.
    x = torch.randn(64, 128, requires_grad=True)
    kept = []

    def pack(tensor):
        kept.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), FastDropout():
        y = torch.nn.functional.dropout(x, p=0.1, training=True)
    assert kept == [(torch.bool, x.numel())]
    y.sum().backward()
    keep = y.detach() != 0
    torch.testing.assert_close(x.grad, keep.float() / 0.9, rtol=0, atol=0)


def test_dropout_is_found_in_modules_and_in_attention_rates():
    """The dropout line is said for a model that draws masks: BERT's dropout modules, Llama's attention rate and OPT's
    dropout (numbers passed to attention and F.dropout, no module), LoRA's dropout on a base without any; not for a
    model whose rates are all 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    assert drops_out(BertForSequenceClassification(tiny_bert_config(64, 0.1, 0.0)))
    assert drops_out(BertForSequenceClassification(tiny_bert_config(64, 0.0, 0.1)))
    assert not drops_out(BertForSequenceClassification(tiny_bert_config(64, 0.0, 0.0)))
    llama = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    assert drops_out(LlamaForCausalLM(LlamaConfig(**llama, attention_dropout=0.1)))
    assert not drops_out(LlamaForCausalLM(LlamaConfig(**llama, attention_dropout=0.0)))
    for rate in (0.05, 0.0):
        lora = LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=rate)
        adapted = get_peft_model(LlamaForCausalLM(LlamaConfig(**llama, attention_dropout=0.0)), lora)
        assert drops_out(adapted) == (rate > 0)
    opt = dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2)
    opt |= dict(word_embed_proj_dim=32, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.2)
    assert drops_out(OPTForCausalLM(OPTConfig(**opt, dropout=0.1)))  # F.dropout with its config's rate, no module
    assert not drops_out(OPTForCausalLM(OPTConfig(**opt, dropout=0.0)))  # LayerDrop skips layers, draws no mask


def test_a_compiled_resume_of_a_run_on_fast_masks_says_it_draws_torchs(
    tmp_path, monkeypatch, tiny_model_dir, review_files, capsys
):
    # Compiled, the masks are torch's own whatever the run started with: the resume went on without a word.
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # where the run draws SFC64 masks
    common = [
        *("--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"], "--max_eval_samples", 8),
        *("--validation_file", review_files["validation"], "--per_device_train_batch_size", 8, "--max_length", 32),
        *("--max_steps", 2, "--save_steps", 2, "--mixed_precision", "no", "--disable_tqdm", "--run_name", "r"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs"),
    ]
    assert run_app(common) == 0
    capsys.readouterr()
    assert run_app([*common, "--torch_compile", "--resume_from_checkpoint", "latest"]) == 0  # nothing left to train
    assert (
        "note: the run started with dropout masks from 32 bits of SFC64 per element; this resume draws torch's own "
        "(compiled), so it does not continue exactly as the run would have"
    ) in capsys.readouterr().out.splitlines()


def test_a_resume_of_a_model_without_dropout_says_nothing_of_masks(
    tmp_path, monkeypatch, tiny_model_no_dropout, review_files, capsys
):
    # It said the masks were drawn as when the run started, for a model that draws none.
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # where the run draws SFC64 masks
    common = [
        *("--model_name_or_path", tiny_model_no_dropout, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--per_device_train_batch_size", 8, "--max_length", 32),
        *("--max_steps", 2, "--save_steps", 2, "--mixed_precision", "no", "--disable_tqdm", "--run_name", "r"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--max_eval_samples", 8),
    ]
    assert run_app(common) == 0
    assert run_app([*common, "--fast_cpu_dropout", "false", "--resume_from_checkpoint", "latest"]) == 0
    assert "dropout" not in capsys.readouterr().out
