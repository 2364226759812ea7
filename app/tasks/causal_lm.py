"""Causal language modelling: fine-tune a decoder on prompt/response pairs, conversations, or plain text.

The task owns what is particular to it: the formats and their checks (lm_data.py), the model class, the loss at the
labelled positions only, and the metrics: eval/loss (the mean over every label token of the validation set, exact
across ranks), eval/perplexity, and for prompts eval/exact_match (greedy generation, generation.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from datasets import DatasetDict
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from app.adapters.trained import load_trained
from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig
from app.errors import UsageError, counted
from app.inputs.data import map_splits
from app.inputs.model import MISSING_WEIGHTS, load_weights, position_table
from app.inputs.reading import row_of
from app.tasks import generation, lm_data
from app.tasks.lm_data import IGNORE, CausalLMCollator, LMColumns, Renderer
from app.telemetry.tags import EVAL_EXACT_MATCH, EVAL_LOSS, EVAL_PERPLEXITY

NAME = "causal_lm"


def check_decoder(model_config: PretrainedConfig) -> None:
    """--task causal_lm on an encoder would train a head that sees the future: refuse it."""
    if getattr(model_config, "is_encoder_decoder", False):
        raise UsageError(
            f"--task causal_lm needs a decoder-only model; {model_config.model_type} is an encoder-decoder"
        )
    # transformers 5 configs of DistilBERT, ALBERT, DeBERTa, ModernBERT and more have no is_decoder at all
    encoder = model_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        model_config, "is_decoder", False
    )
    if encoder and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in model_config.architectures or []):
        raise UsageError(
            f"--task causal_lm needs a decoder model; {model_config.model_type} is an encoder (use --task "
            "sequence_classification, or a decoder such as a Llama or GPT-2 model)"
        )


def check_new_tokens(max_new_tokens: int | None, model_config: PretrainedConfig, origin: str = "") -> None:
    """The tokens generated per prompt leave room for a prompt in the model's positions. `origin` says where a value
    the user did not give on this command line came from."""
    positions = position_table(model_config)
    if max_new_tokens and positions is not None and max_new_tokens >= positions:
        raise UsageError(
            f"--max_new_tokens {max_new_tokens}{origin} leaves no room for a prompt in the model's {positions} "
            f"positions; use --max_new_tokens {positions - 1} or less"
        )


def labelled_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The LM head at the positions whose next token is a label, only: [batch, positions, vocabulary]. For
    prompt/response data that is a small share of the positions, and the head is a large matmul (vocabulary x
    hidden) whose fp32 logits would take the most memory of the step."""
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=batch["logit_positions"],
        use_cache=False,
    ).logits


def token_mean_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The mean cross-entropy over the batch's label tokens: the model's own loss, computed where labels are."""
    logits = labelled_logits(model, batch)
    summed = F.cross_entropy(
        logits.flatten(0, 1).float(), batch["logit_targets"].flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return summed / max(batch["num_items"], 1)


class CausalLM:
    """The task, once its data format is known (from `CausalLM.from_data`)."""

    name = NAME
    auto_model = AutoModelForCausalLM  # the model class for a config, the head transformers gives it
    pipeline_tag = "text-generation"
    summary = "A causal language model"

    def __init__(self, columns: LMColumns, tokenizer, cfg: TrainConfig, model_bos_token_id: int | None = None):
        self.columns, self.tokenizer, self.cfg = columns, tokenizer, cfg
        self.renderer = Renderer(tokenizer, cfg.max_length, model_bos_token_id)
        self.generates = columns.kind == "prompt_response"  # a reference to compare greedy answers with
        self.metrics = (EVAL_LOSS, EVAL_PERPLEXITY) + ((EVAL_EXACT_MATCH,) if self.generates else ())
        self.prompts: list[list[int]] = []  # the validation prompts and references, for exact match
        self.references: list[str] = []
        self.longest_answer = 0  # the most tokens a validation response is trained on, through its end token
        self.notes: list[str] = []  # what tokenizing had to cut, said once at start

    @classmethod
    def from_data(cls, cfg: TrainConfig, raw: DatasetDict, tokenizer, model_config: PretrainedConfig) -> CausalLM:
        """Check the model, tokenizer and columns (UsageError if they don't fit), before anything heavy."""
        check_decoder(model_config)
        check_new_tokens(cfg.max_new_tokens, model_config)  # predict.py takes it as its default: refused there too
        if cfg.max_length < 2:  # packed, it was "the data packs into a single token ...; add text"
            raise UsageError(
                f"--max_length {cfg.max_length} leaves a causal LM no token to learn: each is learned from the tokens "
                "before it; use --max_length 2 or more"
            )
        if tokenizer.eos_token_id is None:
            raise UsageError("the tokenizer has no EOS token, which ends responses and joins documents; add one")
        if tokenizer.pad_token_id is None:  # GPT-2 and Llama tokenizers come without one; padding is masked anyway
            tokenizer.pad_token = tokenizer.eos_token  # checked with EOS by load_tokenizer
        columns = lm_data.resolve_columns(cfg)
        if columns.kind == "messages" and not getattr(tokenizer, "chat_template", None):
            raise UsageError("--messages_column needs a tokenizer with a chat template; this one has none")
        lm_data.check_columns(raw, columns)
        task = cls(columns, tokenizer, cfg, getattr(model_config, "bos_token_id", None))
        if columns.kind == "messages":  # a template's own refusal, named with its row before anything heavy
            name = columns.names["messages"]
            for split in ("train", "validation"):
                for row, messages in enumerate(raw[split][name], start=1):
                    if refusal := task.renderer.template_refusal(messages):
                        raise UsageError(
                            f"{row_of(raw, split, row)}, column {name!r}: the tokenizer's chat template refuses the "
                            f"conversation ({refusal}); change the conversation, or train with another template"
                        )
                    if turn := task.renderer.dropped_tool_call(messages):
                        raise UsageError(
                            f"{row_of(raw, split, row)}, column {name!r}: assistant turn {turn} is a tool call that "
                            "the chat template does not render, so it would be learned as an empty answer; train "
                            "with a template that renders tool_calls, or drop such turns and the tools' replies"
                        )
        if columns.kind == "text":
            task._check_empty_documents(raw)
        if columns.kind != "text" and task.renderer.answer_end:
            task.notes.append(
                f"note: the chat template ends an answer with no special token: EOS ({tokenizer.eos_token}) is "
                "learned after each, so that generation stops there"
            )
        if columns.kind == "prompt_response":  # an empty prompt needs a token to generate from: refuse it now if none
            head, _, tail = task.renderer.prompt_parts("")
            if task.renderer.chat_template and len(head) + len(tail) + 2 > cfg.max_length:  # the text gives way
                raise UsageError(
                    f"--max_length {cfg.max_length} leaves no room for a prompt and its answer: the chat template "
                    f"around a prompt takes {counted(len(head) + len(tail), 'token')}; raise --max_length to at least "
                    f"{len(head) + len(tail) + 2}"
                )
            name = columns.names["prompt"]
            first = raw["train"][0]
            task.renderer.pair(first[name] or "", first[columns.names["response"]])  # the template masks, or says why
            for split in ("train", "validation"):
                row = lm_data.first_empty_prompt(task.renderer, raw[split][name])
                if row is not None:
                    raise UsageError(
                        f"{row_of(raw, split, row + 1)}: the prompt (column {name!r}) is empty, and "
                        f"{lm_data.NOTHING_TO_START_FROM}; fill in the prompt or drop the row"
                    )
        return task

    def _check_empty_documents(self, raw: DatasetDict) -> None:
        """Empty texts (lm_data.is_empty_document: a corpus's blank lines) are no documents: left out with a note,
        packed or not. Rendered, each was EOS alone (or after BOS), which packing joined into blocks of EOS that
        trained without a word. A split of nothing else is refused: the column of another field, or an export that
        lost the texts."""
        name = self.columns.names["text"]
        for split in ("train", "validation"):
            empty = sum(map(lm_data.is_empty_document, raw[split][name]))
            if empty == len(raw[split]):
                raise UsageError(
                    f"every {split} text (column {name!r}) is empty: nothing to learn; name the column of texts with "
                    "--text_column, or check the file"
                )
            if empty:
                self.notes.append(f"note: {empty} of {len(raw[split])} {split} texts are empty and left out")

    # ---- data ---------------------------------------------------------------------------------------------------
    def tokenize(self, raw: DatasetDict, accelerator: Accelerator) -> DatasetDict:
        """Token ids and labels (-100 where the loss skips); the main process tokenizes first, the others read its
        cache."""
        encode = {"prompt_response": self._encode_pairs, "messages": self._encode_conversations}.get(
            self.columns.kind, self._encode_documents
        )
        with accelerator.main_process_first():
            tokenized = map_splits(raw, encode, batched=True, desc="Tokenizing")
        ends = (  # a pair's response cut: its prompt kept the template and its last token alone
            "responses were cut at their end, their prompts to the template and one token,"
            if self.columns.kind == "prompt_response"
            else "ends were cut"
        )
        for split in ("train", "validation"):
            for column, what in (("prompt_cut", "prompts were cut from the left"), ("end_cut", ends)):
                if column in tokenized[split].column_names:
                    cut = sum(tokenized[split][column])
                    if cut:
                        self.notes.append(
                            f"note: {cut} of {counted(len(tokenized[split]), f'{split} example')}: {what} to fit "
                            f"--max_length {self.cfg.max_length}"
                        )
        for split in ("train", "validation"):
            tokenized[split] = self._without_unlearnable(tokenized[split], split)
        if self.generates:
            validation = tokenized["validation"]
            self.prompts = [ids[:n] for ids, n in zip(validation["input_ids"], validation["prompt_length"])]
            self.references = list(validation["reference"])
            self.longest_answer = max(map(self._answer_length, validation["input_ids"], validation["prompt_length"]))
        extra = [
            c for c in ("prompt_cut", "end_cut", "prompt_length", "reference") if c in tokenized["train"].column_names
        ]
        return tokenized.remove_columns(extra)

    def _without_unlearnable(self, split_data, split: str):
        """The examples that keep a token to learn after the cut: a conversation whose assistant turns lie past
        --max_length keeps none, and would train on nothing and count nothing in eval/loss (0.0000: a metric that
        lies). Dropped with a note; UsageError if none is left. A label at position 0 has no token before it."""
        learnable = [any(label != IGNORE for label in labels[1:]) for labels in split_data["labels"]]
        if all(learnable):
            return split_data
        cut = split_data["end_cut"] if "end_cut" in split_data.column_names else [False] * len(learnable)
        dropped = [row for row, keep in enumerate(learnable) if not keep]
        length = self.cfg.max_length
        packed = self.columns.kind == "text" and self.cfg.packing
        if packed:  # the stream's last block, of one token: nothing before it to predict it from
            reason = "the last block of the packed text holds a single token, with none before it to predict it from"
            refusal = f"the {split} data packs into a single token, with none before it to predict it from; add text"
        elif all(cut[row] for row in dropped):
            reason = f"cut to fit --max_length {length}, they keep no token to learn (their responses lie past the cut)"
            refusal = (
                f"no {split} example keeps a token to learn within --max_length {length}: the responses lie past the "
                "cut; raise --max_length, or shorten the texts before them"
            )
        else:  # rows of no token to learn, and perhaps some cut
            reason = f"they hold no token to learn (empty texts, or responses past the cut at --max_length {length})"
            refusal = (
                f"no {split} example holds a token to learn: the texts are empty, or the responses lie past "
                f"--max_length {length}; check the {split} data"
            )
        if not any(learnable):
            raise UsageError(refusal)
        self.notes.append(
            f"note: {len(dropped)} of {counted(len(learnable), f'{split} example')} are left out: {reason}"
        )
        return split_data.select([row for row, keep in enumerate(learnable) if keep])

    def _encode_pairs(self, batch: dict) -> dict:
        names = self.columns.names
        out = {"input_ids": [], "labels": [], "prompt_cut": [], "end_cut": [], "prompt_length": [], "reference": []}
        for prompt, response in zip(batch[names["prompt"]], batch[names["response"]]):
            ids, labels, prompt_cut, end_cut = self.renderer.pair(prompt or "", response)  # None: an empty CSV cell
            for key, value in zip(out, (ids, labels, prompt_cut, end_cut, labels.count(IGNORE), response.strip())):
                out[key].append(value)
        return out

    def _encode_conversations(self, batch: dict) -> dict:
        out = {"input_ids": [], "labels": [], "end_cut": []}
        for messages in batch[self.columns.names["messages"]]:
            for key, value in zip(out, self.renderer.conversation(messages)):
                out[key].append(value)
        return out

    def _encode_documents(self, batch: dict) -> dict:
        texts = batch[self.columns.names["text"]]
        documents = [self.renderer.document(text) for text in texts if not lm_data.is_empty_document(text)]
        if self.cfg.packing:
            blocks = lm_data.pack(documents, self.cfg.max_length)
            return {"input_ids": blocks, "labels": blocks}
        rows = [document[: self.cfg.max_length] for document in documents]
        return {"input_ids": rows, "labels": rows, "end_cut": [len(d) > self.cfg.max_length for d in documents]}

    def collator(self, pad_to_multiple_of: int | None) -> CausalLMCollator:
        return CausalLMCollator(self.tokenizer.pad_token_id, pad_to_multiple_of)

    # ---- model and loss -----------------------------------------------------------------------------------------
    def empty_model(self, model_config: PretrainedConfig) -> torch.nn.Module:
        """The causal LM on the meta device: its layers and sizes, no memory (for the estimate and the adapters)."""
        with torch.device("meta"):
            return self.auto_model.from_config(model_config)

    def load_model(self, model_path: str, dtype: torch.dtype, say: Callable[[str], None]) -> torch.nn.Module:
        """The causal LM with its weights in `dtype` (float32 master weights unless a frozen base asks for less);
        weights it lacked are said."""
        model = load_weights(AutoModelForCausalLM, model_path, say, MISSING_WEIGHTS, dtype=dtype)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return token_mean_loss(model, batch)

    def items(self, batch: dict) -> int:
        """What the loss is a mean over: label tokens, counted on the host by the collator."""
        return batch["num_items"]

    # ---- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self, accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module, loader
    ) -> dict[str, float]:
        """eval/loss over every label token of the validation set, its perplexity, and exact match for prompts."""
        model.eval()
        sums, counts = [], []
        for batch in loader:
            with policy.autocast():
                logits = labelled_logits(model, batch)
            targets = batch["logit_targets"]
            per_token = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none"
            ).view_as(targets)
            # Per example, so that gather_for_metrics can drop the examples that even batches repeated.
            gathered = accelerator.gather_for_metrics((per_token.double().sum(1), (targets != IGNORE).sum(1)))
            sums.append(gathered[0])
            counts.append(gathered[1])
        model.train()
        loss = (torch.cat(sums).sum() / torch.cat(counts).sum().clamp(min=1)).item()
        metrics = {EVAL_LOSS: loss, EVAL_PERPLEXITY: perplexity(loss)}
        if self.generates:
            metrics[EVAL_EXACT_MATCH] = self.exact_match(accelerator, policy, model)
        return metrics

    def _answer_length(self, ids: list[int], prompt_length: int) -> int:
        """The tokens of an answer as trained, through the first of its end tokens (what generation stops at): the
        response tokenized alone can be shorter than in its template (`▁great ▁ </s>` after `[/INST]`)."""
        answer = ids[prompt_length:]
        stops = {self.tokenizer.eos_token_id, self.renderer.end_of_turn}
        return next((i + 1 for i, token in enumerate(answer) if token in stops), len(answer))

    def max_new_tokens(self) -> int:
        """--max_new_tokens, or enough for the longest validation response and its end token."""
        return self.cfg.max_new_tokens or self.longest_answer

    def exact_match(self, accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module) -> float:
        """The share of validation prompts whose greedy answer ends (at an end token) and, stripped, equals the
        reference response."""
        answers = generation.generate(
            accelerator,
            policy,
            model,
            self.tokenizer,
            self.prompts,
            self.max_new_tokens(),
            self.cfg.per_device_eval_batch_size,
            end_of_turn=self.renderer.end_of_turn,
        )
        # An answer cut at the most new tokens, not ended, is no match: the reference ends, and stripped, a cut
        # "great\ngreat" of two tokens was "great".
        hits = sum(a.ended and a.finite and a.text.strip() == ref for a, ref in zip(answers, self.references))
        return hits / max(len(self.references), 1)

    def card(self) -> dict[str, str]:
        """What the model card says of the task."""
        formats = {
            "prompt_response": "prompt/response pairs; loss on the responses",
            "messages": "conversations; loss on the assistant turns",
            "text": "plain text" + (", packed into blocks" if self.cfg.packing else ", one document per row"),
        }
        template = "the tokenizer's chat template" if self.renderer.chat_template else "no chat template"
        return {"task": f"causal language modelling: {formats[self.columns.kind]}", "rendering": template}


class TextGenerator:
    """predict.py's output for a causal LM: each prompt's greedy continuation, rendered as in training: with the chat
    template when the tokenizer has one, unless the model was trained on plain text (`chat` False)."""

    columns = ("generated_text",)
    unit, done = "prompt", "generated for"  # as predict.py counts its inputs: "generated for 2 prompts"

    def __init__(
        self,
        model_path: str,
        tokenizer,
        max_length: int,
        batch_size: int,
        device: torch.device,
        say: Callable[[str], None],
        max_new_tokens: int,
        chat: bool | None = None,
    ):
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = load_trained(model_path, AutoModelForCausalLM, say)  # full, or a base with adapters
        self.model.to(device).eval()
        self.tokenizer = tokenizer
        self.renderer = Renderer(tokenizer, max_length, getattr(self.model.config, "bos_token_id", None), chat)
        self.max_length, self.batch_size, self.max_new_tokens = max_length, batch_size, max_new_tokens
        self.cut_note: str | None = None  # how many prompts the last predict() cut to fit
        self.non_finite = 0  # how many of the last predict()'s generations came from NaN or inf logits

    @staticmethod
    def check_inputs(
        tokenizer,
        model_config: PretrainedConfig,
        max_length: int,
        max_new_tokens: int,
        prompts: list[str],
        chat: bool | None = None,
        new_tokens_origin: str = "",
    ) -> None:
        """Before the weights load (load_tokenizer has checked the special tokens): the new tokens leave room for a
        prompt in the model's positions, and every prompt has a token to follow."""
        check_new_tokens(max_new_tokens, model_config, new_tokens_origin)
        renderer = Renderer(tokenizer, max_length, getattr(model_config, "bos_token_id", None), chat)
        empty = lm_data.first_empty_prompt(renderer, prompts)
        if empty is not None:
            raise UsageError(
                f"prompt {empty + 1} of the input (counted from 1) is empty, and {lm_data.NOTHING_TO_START_FROM}; give "
                "it a text or drop it"
            )

    def predict(self, accelerator: Accelerator, policy: PrecisionPolicy, texts: list[list[str]], progress) -> list[str]:
        # A prompt longer than the model was trained with keeps its end, the part the answer follows; and it leaves
        # room in the model's positions for --max_new_tokens.
        positions = position_table(self.model.config)
        room = self.max_length if positions is None else min(self.max_length, positions - self.max_new_tokens)
        fitted = [self.renderer.fit_prompt(prompt, room) for prompt in texts[0]]
        prompts = [ids for ids, _ in fitted]
        cut = sum(was_cut for _, was_cut in fitted)
        self.cut_note = (
            f"{cut} of {counted(len(prompts), 'prompt')} were cut from the left to fit {counted(room, 'token')} "
            f"(--max_length {self.max_length}, within the positions that --max_new_tokens leaves)"
            if cut
            else None
        )
        generated = generation.generate(
            accelerator,
            policy,
            self.model,
            self.tokenizer,
            prompts,
            self.max_new_tokens,
            self.batch_size,
            progress,
            end_of_turn=self.renderer.end_of_turn,
        )
        self.non_finite = sum(not g.finite for g in generated)
        return [g.text for g in generated]

    def columns_of(self, generated: list[str]) -> dict[str, list]:
        return {"generated_text": generated}

    def compare(self, label: str, generated: list[str], reference: list[str]) -> str:
        """How generations in another precision agree with fp32's, in one line."""
        same = sum(ours == theirs for ours, theirs in zip(generated, reference))
        rows = len(generated)
        return (
            f"compare_fp32: {label} vs fp32 on {counted(rows, 'prompt')}: {same} of {counted(rows, 'generation')} "
            "identical"
        )


def perplexity(loss: float) -> float:
    """exp(loss): inf past what a float holds, and NaN for a NaN loss (fp16 overflowing), which `loss < 700` took for
    an infinite perplexity."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf
