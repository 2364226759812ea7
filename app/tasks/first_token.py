"""The last encoder layer of a classifier computes the first token alone, the one its head reads.

BERT's pooler, and the classification heads of RoBERTa, ELECTRA and DistilBERT, read the last layer's output at the
first position ([CLS] or <s>) and nothing else: the last layer's other rows never reach the loss. So that layer takes
its keys and values from every token, as before, but its query, attention output and feed-forward block from the
first token alone: about 15% less work in a six-layer model's step (forward, backward and evaluation), for the same
loss and gradients up to float rounding. Its dropout then draws masks for that row alone, so a run's random stream
differs from a model that computes every row (docs/benchmarks.md).

Applied where the head is one of those and the layer is BERT's or DistilBERT's (self-attention alone, no chunked
feed-forward, sdpa or eager attention, absolute positions, no hidden states or attentions asked for); any other model
runs as transformers builds it. A run resumed from a checkpoint that records every row computed (one written before
this) computes them all to its end, so that it continues exactly.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

# Heads that read the encoder's output at the first position only (transformers' modeling code).
READ_THE_FIRST_TOKEN = frozenset(
    {
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "CamembertForSequenceClassification",
        "ElectraForSequenceClassification",
        "DistilBertForSequenceClassification",
    }
)


def compute_the_first_token_alone(model: torch.nn.Module) -> bool:
    """Make the last encoder layer of `model` (a classifier, before any adapters) compute the first token alone.
    Returns whether it applies (see the module docstring); a model it does not apply to is left as it is."""
    config = model.config
    if (
        type(model).__name__ not in READ_THE_FIRST_TOKEN
        or config._attn_implementation not in ("sdpa", "eager")  # flex attention's masks are not tensors
        or getattr(config, "position_embedding_type", "absolute") != "absolute"  # relative ones act in attention
        or config.output_hidden_states  # the last layer's would be one row
        or config.output_attentions
    ):
        return False
    found = _last_layer(model.base_model)
    if found is None:
        return False
    last, first_row = found
    last.forward = types.MethodType(functools.partial(_forward, first_row=first_row), last)
    last.computes_the_first_token_alone = True
    return True


def cut_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer that computes the first token alone in `model` (adapters and wrappers included), else None."""
    return next((m for m in model.modules() if getattr(m, "computes_the_first_token_alone", False)), None)


def weights_once_per_sequence(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The cut layer's weights that now compute one row per sequence, not one per token (telemetry/flops.py)."""
    parts = (
        (layer.attention.self.query, layer.attention.output.dense, layer.intermediate, layer.output.dense)
        if hasattr(layer.attention, "self")
        else (layer.attention.q_lin, layer.attention.out_lin, layer.ffn)
    )
    return [p for part in parts for p in part.parameters()]


def _last_layer(base: torch.nn.Module):
    """The last layer and the forward of its first row, where the layer is one this module knows; else None."""
    bert = getattr(getattr(base, "encoder", None), "layer", None)
    if bert:
        last = bert[-1]
        attention = getattr(getattr(last, "attention", None), "self", None)
        known = (
            not getattr(last, "is_decoder", True)
            and not getattr(last, "add_cross_attention", True)
            and getattr(last, "chunk_size_feed_forward", 1) == 0
            and not getattr(attention, "is_causal", True)
            and all(hasattr(attention, name) for name in ("query", "key", "value", "attention_head_size", "scaling"))
        )
        return (last, _bert_row) if known else None
    distilbert = getattr(getattr(base, "transformer", None), "layer", None)
    if distilbert:
        last = distilbert[-1]
        attention = getattr(last, "attention", None)
        known = (
            getattr(getattr(last, "ffn", None), "chunk_size_feed_forward", 1) == 0
            and not getattr(attention, "is_causal", True)
            and all(hasattr(attention, name) for name in ("q_lin", "k_lin", "v_lin", "out_lin", "scaling"))
            and all(hasattr(last, name) for name in ("sa_layer_norm", "output_layer_norm"))
        )
        return (last, _distilbert_row) if known else None
    return None


def _forward(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, first_row, **kw):
    """The layer's forward for the first position's row: [batch, 1, hidden] out. Checkpointed as transformers
    checkpoints the layer's own forward (which this replaces) under --gradient_checkpointing."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(functools.partial(first_row, layer), hidden_states, attention_mask)
    return first_row(layer, hidden_states, attention_mask)


def _bert_row(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """BertLayer (RoBERTa's, ELECTRA's) for the first row."""
    attention = layer.attention.self
    first = hidden_states[:, :1]
    attended = _first_query(
        attention.query, attention.key, attention.value, attention, hidden_states, attention_mask, layer.training
    )
    attention_output = layer.attention.output(attended, first)
    return layer.output(layer.intermediate(attention_output), attention_output)


def _distilbert_row(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """DistilBERT's TransformerBlock for the first row."""
    attention = layer.attention
    first = hidden_states[:, :1]
    attended = _first_query(
        attention.q_lin, attention.k_lin, attention.v_lin, attention, hidden_states, attention_mask, layer.training
    )
    attention_output = layer.sa_layer_norm(attention.out_lin(attended) + first)
    return layer.output_layer_norm(layer.ffn(attention_output) + attention_output)


def _first_query(query, key, value, attention, hidden_states, attention_mask, training: bool) -> torch.Tensor:
    """Self-attention of the first token over every token: [batch, 1, heads x head size], before the output
    projection. `attention` holds the head size, the scaling and the dropout."""
    batch, length, _ = hidden_states.shape
    size = attention.attention_head_size
    q = query(hidden_states[:, :1]).view(batch, 1, -1, size).transpose(1, 2)
    k = key(hidden_states).view(batch, length, -1, size).transpose(1, 2)
    v = value(hidden_states).view(batch, length, -1, size).transpose(1, 2)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :1]  # [batch, 1, queries or 1, keys]: the first query's row
    attended = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask, dropout_p=attention.dropout.p if training else 0.0, scale=attention.scaling
    )
    return attended.transpose(1, 2).reshape(batch, 1, -1)
