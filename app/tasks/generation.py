"""Greedy generation for many prompts at once: evaluation's exact match and predict.py's causal-LM output.

Each process generates a share of the prompts, longest first (prompts of similar length share a batch, so little
padding), padded on the left so that every row's next token is at the same position; the results come back in the
prompts' order. Generation stops at the model's end tokens and at the end of turn that the chat template puts after an
assistant's message, where that is another token (ChatML's `<|im_end|>` on a model whose EOS is `<|endoftext|>`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from app.amp.policy import PrecisionPolicy
from app.inputs.model import position_table
from app.storage.final_model import is_sharded


class Generated(NamedTuple):
    text: str  # decoded without special tokens
    ended: bool  # at an end token; else cut at the most new tokens, which no reference answer is
    finite: bool  # every step's logits were finite: else the tokens came from NaN (fp16 overflow), garbage


def greedy_config(
    model: torch.nn.Module, tokenizer, max_new_tokens: int, end_of_turn: int | None = None
) -> GenerationConfig:
    """Greedy decoding that stops at the model's end tokens and at `end_of_turn`: the same answer every time,
    whatever the model's own sampling defaults."""
    eos = model.generation_config.eos_token_id  # a chat model's may list its end-of-turn token as well
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    # A template whose turns end with a token other than EOS (a base model's ChatML) trains that token: without it
    # among the stops, an answer ran on to max_new_tokens ("great\ngreat\n..."). The tokenizer's EOS ends what the
    # app trains without a template's end (lm_data.Renderer), whatever the model's generation config lists.
    stops = list(dict.fromkeys([*eos, tokenizer.eos_token_id, end_of_turn]))
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[stop for stop in stops if stop is not None],
    )


class NonFiniteWatch(LogitsProcessor):
    """Marks the rows whose logits held a NaN or a +inf (or were all -inf) at a step where they were still
    generating: greedy search takes a token from them all the same (NaN's argmax is token 0), so fp16 overflow came out
    as text. A -inf among finite scores is a token banned by the model's own generation settings (no_repeat_ngram_size,
    suppress_tokens, ...), which the processors before this one apply. Kept on the device, read once per batch."""

    def __init__(self, width: int, stops: torch.Tensor, rows: int, device: torch.device):
        self.width, self.stops = width, stops.to(device)
        self.seen = torch.zeros(rows, dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        going = ~torch.isin(input_ids[:, self.width :], self.stops).any(-1)  # a finished row's steps are padding
        broken = torch.isnan(scores).any(-1) | torch.isposinf(scores).any(-1) | torch.isneginf(scores).all(-1)
        self.seen |= going & broken
        return scores


@torch.no_grad()
def generate(
    accelerator: Accelerator,
    policy: PrecisionPolicy,
    model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    on_batch=None,
    end_of_turn: int | None = None,
) -> list[Generated]:
    """The greedy continuation of each token-id prompt, in the prompts' order.

    Args:
        on_batch: called with the number of prompts done after each batch (a progress bar), on every process.
        end_of_turn: the token the chat template ends an assistant's message with (Renderer.end_of_turn), a stop.
    """
    raw = accelerator.unwrap_model(model)  # generate() is the model's own, not the DDP wrapper's
    was_training = raw.training
    raw.eval()
    config = greedy_config(raw, tokenizer, max_new_tokens, end_of_turn)
    stops = torch.tensor(config.eos_token_id)
    positions = position_table(raw.config)
    pad = tokenizer.pad_token_id
    found = []
    # A sharded model's every forward is a collective (FSDP gathers each layer's weights): every rank must make as
    # many as the others, so the shares are padded to one length (the last rank repeats a prompt, dropped below) and
    # generate() steps on until every rank's batch has ended (synced_gpus). Unsharded, a rank needs no other.
    sharded = is_sharded(raw)
    shares = accelerator.split_between_processes(list(range(len(prompts))), apply_padding=sharded)
    with shares as mine, contiguous_head_input(raw):
        order = sorted(mine, key=lambda i: len(prompts[i]), reverse=True)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
            # A prompt and its continuation fit in the position table: past it, learned positions (GPT-2's) fail with
            # an IndexError. A validation prompt leaves room for its own response, not for the longest one.
            config.max_new_tokens = max_new_tokens if positions is None else min(max_new_tokens, positions - width)
            watch = NonFiniteWatch(width, stops, len(chunk), accelerator.device)
            with policy.autocast():  # the config alone: transformers warns of one given with generation arguments
                out = raw.generate(
                    input_ids=ids.to(accelerator.device),
                    attention_mask=mask.to(accelerator.device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([watch]),
                    synced_gpus=sharded,
                )
            new, finite = out[:, width:].cpu(), (~watch.seen).tolist()  # host syncs, once per batch
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            ended = torch.isin(new, stops).any(-1).tolist()
            found.extend((i, Generated(*row)) for i, *row in zip(chunk, texts, ended, finite))
            if on_batch:
                on_batch(len(chunk))
    raw.train(was_training)
    done = {i: Generated(*generated) for i, generated in gather_object(found)}  # a prompt the padding repeated: once
    return [done[i] for i in range(len(prompts))]


@contextlib.contextmanager
def contiguous_head_input(model: torch.nn.Module):
    """The output head's input made contiguous while inside.

    The prefill gives the head each prompt's last position, a [batch, 1, hidden] slice of the hidden states. torch's
    matmul folds that into one product only if the slice is contiguous or the weight needs a gradient; for a frozen
    head (LoRA's base) it broadcasts the weight over the rows for a batched product instead, which copied it once per
    row on SmolLM2's bfloat16 base: 864 MiB at its evaluation batch of 16, on every call.
    """
    head = model.get_output_embeddings()
    hook = None if head is None else head.register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
