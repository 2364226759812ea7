"""A classifier's last layer computes the first token alone (app/tasks/first_token.py): the same logits and gradients
as the model that computes every row, for each head that reads only that token; any other model is left as it is.

Tiny models built from configs, without dropout, so that both models draw nothing at random.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForSequenceClassification

from app.tasks.first_token import compute_the_first_token_alone, cut_layer
from app.telemetry.flops import training_flops

SIZES = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3,
)


def classifier(model_type: str, attention: str = "sdpa", **options) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SIZES, **options})
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attention).train()


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 99, (4, 20), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 12:] = 0  # padded rows: the first token must not attend to them
    attention_mask[3, 5:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.tensor([0, 2, 1, 2])}


def logits_and_gradients(model: torch.nn.Module, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = model(**batch())
    output.loss.backward()
    return output.logits.float().detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


DISTILBERT = {"hidden_dim": 48, "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0}


@pytest.mark.parametrize(
    "model_type, attention, options",
    [
        ("bert", "sdpa", {}),
        ("bert", "eager", {}),
        ("roberta", "sdpa", {}),
        ("xlm-roberta", "eager", {}),
        ("electra", "sdpa", {}),
        ("distilbert", "sdpa", DISTILBERT),
        ("distilbert", "eager", DISTILBERT),
    ],
)
def test_the_first_token_alone_gives_the_same_logits_and_gradients(model_type, attention, options):
    full = classifier(model_type, attention, **options)
    cut = classifier(model_type, attention, **options)
    assert compute_the_first_token_alone(cut) and cut_layer(cut) is not None
    expected_logits, expected = logits_and_gradients(full)
    logits, got = logits_and_gradients(cut)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    assert got.keys() == expected.keys(), "every weight still gets a gradient"
    for name in expected:
        scale = expected[name].abs().max()
        if scale < 1e-6:  # the keys' biases: zero but for rounding (softmax ignores a shift shared by all keys)
            continue
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_under_bf16_autocast_the_first_token_alone_stays_within_bf16s_rounding():
    full, cut = classifier("bert", "eager"), classifier("bert", "eager")  # eager: an additive float mask
    compute_the_first_token_alone(cut)
    expected, _ = logits_and_gradients(full, autocast=True)
    logits, _ = logits_and_gradients(cut, autocast=True)
    torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("distilbert", "its head reads the first token, but a config that returns every layer's states"),
        ("gpt2", "its head reads the last token"),
        ("deberta-v2", "its own attention"),
        ("bert", "relative positions, were a config to ask for them, act in the attention"),
        ("roberta", "a config that returns every layer's hidden states would get one row of the last"),
    ],
)
def test_other_models_are_left_as_they_are(model_type, why):
    options = {"n_embd": 32, "n_layer": 2, "n_head": 4} if model_type == "gpt2" else {}
    if model_type == "distilbert":
        options = {"hidden_dim": 48, "output_attentions": True}
    if model_type == "bert":
        options = {"position_embedding_type": "relative_key"}
    if model_type == "roberta":
        options = {"output_hidden_states": True}
    model = classifier(model_type, "eager", pad_token_id=0, **options).eval()  # their dropout has other names
    expected = model(**batch()).logits
    assert not compute_the_first_token_alone(model), why
    assert cut_layer(model) is None
    torch.testing.assert_close(model(**batch()).logits, expected, rtol=0, atol=0)


def test_the_flops_estimate_follows_what_the_cut_model_computes():
    # The MFU's numerator: its estimate for the cut model against the full one's, as torch's own counter counts the
    # matrix products of a training step of each.
    def counted(model) -> float:
        with FlopCounterMode(display=False) as counter:
            model(**{**batch(), "attention_mask": None}).loss.backward()
        return counter.get_total_flops()

    for model_type, options in (("bert", {}), ("distilbert", DISTILBERT)):
        full = classifier(model_type, num_hidden_layers=2, **options)
        cut = classifier(model_type, num_hidden_layers=2, **options)
        assert compute_the_first_token_alone(cut)
        estimated = training_flops(cut).per_token(20) / training_flops(full).per_token(20)
        measured = counted(cut) / counted(full)
        assert measured < 0.8, "the cut layer computes less"
        assert abs(estimated - measured) < 0.05, (model_type, estimated, measured)


def test_under_gradient_checkpointing_the_cut_layer_is_recomputed_too():
    # It replaces the layer's forward, which transformers wraps to checkpoint: it must checkpoint itself.
    full, cut = classifier("bert"), classifier("bert")
    compute_the_first_token_alone(cut)
    cut.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    cut_layer(cut).intermediate.register_forward_hook(lambda *_: calls.append(1))
    expected_logits, expected = logits_and_gradients(full)
    logits, got = logits_and_gradients(cut)
    assert len(calls) == 2, "run once forward, once more in the backward"
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    name = "bert.encoder.layer.2.intermediate.dense.weight"
    torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-7)
