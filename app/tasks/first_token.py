"""The last encoder layer of a classifier computes the first token alone, the one its head reads.

BERT's pooler, and RoBERTa's and ELECTRA's classification heads, read the last layer's output at the first position
([CLS] or <s>) and nothing else: the last layer's other rows never reach the loss. So that layer takes its keys and
values from every token, as before, but its query, attention output and feed-forward block from the first token
alone: about 15% less work in a six-layer model's step (forward, backward and evaluation), for the same loss and
gradients up to float rounding. Its dropout then draws masks for that row alone, so a run's random stream differs
from a model that computes every row (docs/benchmarks.md).

Applied where the head is one of those and the layer is BERT's (self-attention alone, no chunked feed-forward, sdpa
or eager attention); any other model runs as transformers builds it. A run resumed from a checkpoint that records
every row computed (one written before this) computes them all to its end, so that it continues exactly.
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
    }
)
_ATTENTION = ("query", "key", "value", "dropout", "num_attention_heads", "attention_head_size", "scaling")


def compute_the_first_token_alone(model: torch.nn.Module) -> bool:
    """Make the last encoder layer of `model` (a classifier, before any adapters) compute the first token alone.
    Returns whether it applies (see the module docstring); a model it does not apply to is left as it is."""
    if type(model).__name__ not in READ_THE_FIRST_TOKEN:
        return False
    if model.config._attn_implementation not in ("sdpa", "eager"):  # flex attention's masks are not tensors
        return False
    if getattr(model.config, "position_embedding_type", "absolute") != "absolute":  # relative ones act in attention
        return False
    if model.config.output_hidden_states or model.config.output_attentions:  # the last layer's would be one row
        return False
    layers = getattr(getattr(model.base_model, "encoder", None), "layer", None)
    if not layers:
        return False
    last = layers[-1]
    if (
        getattr(last, "is_decoder", True)
        or getattr(last, "add_cross_attention", True)
        or getattr(last, "chunk_size_feed_forward", 1) != 0
        or not all(hasattr(last.attention.self, name) for name in _ATTENTION)
        or getattr(last.attention.self, "is_causal", True)
    ):
        return False
    last.forward = types.MethodType(_first_token_forward, last)
    last.computes_the_first_token_alone = True
    return True


def cut_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer that computes the first token alone in `model` (adapters and wrappers included), else None."""
    return next((m for m in model.modules() if getattr(m, "computes_the_first_token_alone", False)), None)


def _first_token_forward(
    layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs
) -> torch.Tensor:
    """BertLayer.forward for the first position's row: [batch, 1, hidden] out. Checkpointed as transformers
    checkpoints the layer's own forward (which this replaces) under --gradient_checkpointing."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(functools.partial(_first_row, layer), hidden_states, attention_mask)
    return _first_row(layer, hidden_states, attention_mask)


def _first_row(layer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    attention = layer.attention.self
    batch, length, _ = hidden_states.shape
    heads, size = attention.num_attention_heads, attention.attention_head_size
    first = hidden_states[:, :1]
    query = attention.query(first).view(batch, 1, heads, size).transpose(1, 2)
    key = attention.key(hidden_states).view(batch, length, heads, size).transpose(1, 2)
    value = attention.value(hidden_states).view(batch, length, heads, size).transpose(1, 2)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :1]  # [batch, 1, queries or 1, keys]: the first query's row
    attended = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=attention.dropout.p if layer.training else 0.0,
        scale=attention.scaling,
    )
    attention_output = layer.attention.output(attended.transpose(1, 2).reshape(batch, 1, heads * size), first)
    return layer.output(layer.intermediate(attention_output), attention_output)
