"""Causal-LM data: which format the columns hold, rendering with the chat template, label masks, packing, batching.

Three formats, one result per example: `input_ids`, and `labels` that are the token where the loss counts and -100
where it does not (prompts, padding, user turns):
- prompt/response (`--prompt_column`, `--response_column`): the loss covers the response only. With a chat template
  the pair is rendered as a user turn and an assistant turn; without one it is prompt + response + EOS.
- conversations (`--messages_column`): lists of {role, content}, rendered with the chat template; the loss covers
  the assistant turns.
- plain text (`--text_column` alone): every token counts. Packed by default: documents joined by EOS and cut into
  blocks of --max_length, so no compute goes to padding; attention then crosses document boundaries (as HF's run_clm
  and most pretraining do). `--packing false` keeps one document per row.

With a chat template, a prompt's ids are those of its rendering with the generation prompt, tokenized once, as
`tokenizer.apply_chat_template(..., add_generation_prompt=True)` gives them and predict.py prompts with them; the
answer is tokenized from where the prompt ends, so the model learns to continue the very tokens it is prompted with.
Where no token straddles that point (ChatML, Llama 3, Mistral), the whole is `apply_chat_template`'s. A conversation's
ids are `apply_chat_template`'s, its assistant turns told apart by the tokens' offsets (a fast tokenizer's).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from datasets import DatasetDict

from app.config import TrainConfig, refuse_flags_of_other_tasks
from app.errors import UsageError, first_line
from app.inputs.data import EMBEDDED_LABEL_COLUMN, EMBEDDED_TEXT_COLUMN, is_embedded
from app.inputs.reading import check_text_cells, header_hint, row_of

IGNORE = -100  # the label of a position that the loss skips (PyTorch's and HF's convention)


@dataclass(frozen=True)
class LMColumns:
    """Which format the data holds, and its column names."""

    kind: str  # "prompt_response", "messages" or "text"
    names: dict[str, str]  # role -> column: prompt and response, messages, or text


def resolve_columns(cfg: TrainConfig) -> LMColumns:
    refuse_flags_of_other_tasks(cfg, "causal_lm", ("label_column", "text_pair_column"))
    if cfg.messages_column:
        if cfg.prompt_column or cfg.response_column or cfg.text_column:
            raise UsageError(
                "give --messages_column alone, or --prompt_column with --response_column, or --text_column: one format"
            )
        return LMColumns("messages", {"messages": cfg.messages_column})
    if cfg.prompt_column or cfg.response_column:
        if not (cfg.prompt_column and cfg.response_column):
            raise UsageError("--prompt_column and --response_column go together: give both")
        if cfg.text_column:
            raise UsageError("--text_column is for plain text; with --prompt_column the prompts are the text")
        return LMColumns("prompt_response", {"prompt": cfg.prompt_column, "response": cfg.response_column})
    if is_embedded(cfg) and not cfg.text_column:  # the reviews as prompts, their labels as responses
        return LMColumns("prompt_response", {"prompt": EMBEDDED_TEXT_COLUMN, "response": EMBEDDED_LABEL_COLUMN})
    return LMColumns("text", {"text": cfg.text_column or "text"})


def check_columns(raw: DatasetDict, columns: LMColumns) -> None:
    flags = {"prompt": "--prompt_column", "response": "--response_column", "messages": "--messages_column"}
    for split in ("train", "validation"):
        present = raw[split].column_names
        for role, name in columns.names.items():
            if name not in present:
                option = flags.get(role, "--text_column")
                hint = (_format_hint(present) if role == "text" else "") or header_hint(present, option, name)
                raise UsageError(
                    f"{option} {name!r} is not in the {split} data; its columns are: {', '.join(present)}{hint}"
                )
            if role != "messages":  # an empty prompt is a prompt (an empty CSV cell is read as None)
                # An empty document ("", spaces, an empty cell) is left out with a note (a corpus's blank lines, as in
                # wikitext: causal_lm.CausalLM._check_empty_documents); an empty response is refused.
                check_text_cells(raw, split, name, may_be_empty=role != "response", blank_is_empty=role != "text")
                continue
            for row, value in enumerate(raw[split][name], start=1):
                problem = _conversation_problem(value)
                if problem:
                    raise UsageError(f"{row_of(raw, split, row)}, column {name!r}: {problem}")


def _format_hint(present: list[str]) -> str:
    """The flags for a file in one of trl's dataset formats, named by its columns (the text format is the default)."""
    if "messages" in present:
        return " (conversations: --messages_column messages)"
    answer = next((name for name in ("completion", "response") if name in present), None)
    if "prompt" in present and answer:
        return f" (prompt/response pairs: --prompt_column prompt --response_column {answer})"
    return ""


def _conversation_problem(value) -> str | None:
    shape = "a conversation must be a list of {role, content} turns with string values"
    if not isinstance(value, list) or not value:
        return f"{shape}, got {'an empty list' if isinstance(value, list) else type(value).__name__}"
    for turn in value:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("role"), str)
            or not isinstance(turn.get("content"), str)
        ):
            fix = ""
            if isinstance(turn, dict) and {"from", "value"} <= turn.keys():
                fix = " (ShareGPT's {from, value} turns: rename the keys, and human to user, gpt to assistant)"
            elif isinstance(turn, dict) and turn.get("tool_calls"):  # arrow gives every turn every key: None if unset
                fix = ' (a tool call\'s turn: give it the content "" beside its tool_calls)'
            return f"{shape}; found {turn!r}{fix}"
    if not any(turn["role"] == "assistant" for turn in value):
        roles = ", ".join(dict.fromkeys(turn["role"] for turn in value))
        return (
            f"the conversation has no assistant turn (its roles: {roles}), so nothing in it would be learned; the "
            "model's turns take the role assistant"
        )
    for number, turn in enumerate(value, start=1):
        # Learned as "answer with nothing"; a tool call's turn is its tool_calls, which chat templates that know them
        # render (one that does not renders an empty turn, as before).
        if turn["role"] == "assistant" and not turn["content"].strip() and not turn.get("tool_calls"):
            return f"assistant turn {number} of the conversation is empty; give it a text, or drop the turn"
    if value[0]["role"] == "assistant":  # nothing before it to answer, and no prompt to render it after
        return "the conversation opens with an assistant turn; start it with a user (or system) turn"
    return None


# A user turn's content that no real prompt holds: where the template puts the text, and what follows it.
PROMPT_MARKER = "\x00amp-trainer prompt\x00"


class Renderer:
    """Turns one example into token ids and labels, within --max_length.

    Args:
        model_bos_token_id: the model config's BOS, for a tokenizer that names none (an empty prompt starts from it).
        chat: render prompts with the tokenizer's chat template; default: when it has one. A model trained on plain
            text continues plain text (predict.py).
    """

    def __init__(self, tokenizer, max_length: int, model_bos_token_id: int | None = None, chat: bool | None = None):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.chat_template = bool(getattr(tokenizer, "chat_template", None)) and chat is not False
        # Without a chat template an empty prompt starts from BOS, as generate() does when given no input ids.
        bos = tokenizer.bos_token_id
        self.bos = bos if bos is not None else model_bos_token_id

    def _ids(self, text: str) -> list[int]:
        # As apply_chat_template tokenizes a rendering: no special tokens added, the template's own are parsed.
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # cut later, not here

    def _pieces(self, text: str, bounds: list[int]) -> list[list[int]]:
        """`text` tokenized once, in pieces cut at the character positions `bounds` (ascending).

        Tokenized piece by piece, the text split inside a turn where a template's space met a prompt's first word
        (`[INST] on`: `Ġ`, `on` where the whole gives `Ġon`), and a SentencePiece tokenizer began each piece with a
        `▁`: ids that no rendering tokenizes to. A token that straddles a bound goes to the piece after it."""
        if self.tokenizer.is_fast:  # one pass: a token ending past a bound is after it (linear in the text)
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            ids, ends = encoded["input_ids"], [end for _, end in encoded["offset_mapping"]]
            cuts = [next((i for i, end in enumerate(ends) if end > bound), len(ids)) for bound in bounds]
        else:  # a slow tokenizer has no offsets: the tokens of the text up to each bound (one tokenization each)
            ids, cuts = self._ids(text), []
            for bound in bounds:
                upto = self._ids(text[:bound]) if bound else []
                cuts.append(next((i for i, (a, b) in enumerate(zip(upto, ids)) if a != b), min(len(upto), len(ids))))
        cuts = [max(cuts[: i + 1]) for i in range(len(cuts))]  # never backwards
        return [ids[start:end] for start, end in zip([0, *cuts], [*cuts, len(ids)])]

    def prompt_parts(self, prompt: str, rendered: str | None = None) -> tuple[list[int], list[int], list[int]]:
        """The tokens a response follows, in three parts: what comes before the prompt's text (the template's system
        turn and user header, or the tokenizer's BOS), the text, and what comes after it (the assistant's header).
        With a chat template the three make up the tokens of its rendering (`rendered`, if done already).

        An empty prompt renders as an empty user turn, or else as BOS alone; with neither, as no token at all, which
        `first_empty_prompt` finds before any weights load."""
        if self.chat_template:
            rendered = self._render_prompt(prompt) if rendered is None else rendered
            before, text, _ = self._split_prompt(rendered, prompt)
            head, text_ids, tail = self._pieces(rendered, [len(before), len(before) + len(text)])
            return head, text_ids, tail
        # The tokenizer's own special tokens around a text: BOS goes before the prompt; an EOS its post-processor
        # appends does not (it would stand between every prompt and its answer).
        prefix, suffix = self._special_affixes
        text, whole = self._ids(prompt), self.tokenizer(prompt, verbose=False)["input_ids"]
        if not text:  # an empty prompt: the tokenizer's BOS, else the model's
            return prefix or ([self.bos] if self.bos is not None else []), [], []
        if whole == prefix + text + suffix:
            return prefix, text, []
        if whole[-len(text) :] == text:
            return whole[: len(whole) - len(text)], text, []
        return [], whole[: len(whole) - len(suffix)] if suffix and whole[-len(suffix) :] == suffix else whole, []

    @functools.cached_property
    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text of its own accord (its post-processor's: BOS,
        and the EOS that Llama's add_eos_token appends), found around a one-letter text."""
        plain, whole = self._ids("a"), self.tokenizer("a", verbose=False)["input_ids"]
        at = next((i for i in range(len(whole) - len(plain) + 1) if whole[i : i + len(plain)] == plain), None)
        return ([], []) if at is None else (whole[:at], whole[at + len(plain) :])

    @functools.cached_property
    def answer_end(self) -> list[int]:
        """What the app puts after an answer that the chat template ends with no special token of its own (`Bot:
        {answer}\n`): EOS, so that the model learns to stop where generation stops. Empty where the template ends it,
        and where it renders no dialogue that shows how it ends one."""
        known = self._after_answer is not None
        return [self.tokenizer.eos_token_id] if known and self.end_of_turn is None else []

    def _render_prompt(self, prompt: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    def _split_prompt(self, rendered: str, prompt: str) -> tuple[str, str, str]:
        """A prompt's rendering in three: what the template puts before any prompt's text (system turn, user header),
        the text as the template wrote it (trimmed, by some), and what it puts after (the turn's end, the assistant's
        header), found by rendering a marker. The first match of the text was a wrong split where the text also
        stands earlier: `a` inside `<|im_start|>`, `AI` in a default system prompt."""
        around = self._around_prompt
        if around is not None:
            before, after = around
            if rendered.startswith(before) and rendered.endswith(after) and len(before) + len(after) <= len(rendered):
                return before, rendered[len(before) : len(rendered) - len(after)], after
        at = rendered.find(prompt) if prompt else -1  # a template that changes around the text: its first match
        if at < 0:  # a template that rewrites the text: no parts to tell apart
            return "", rendered, ""
        return rendered[:at], prompt, rendered[at + len(prompt) :]

    @functools.cached_property
    def _around_prompt(self) -> tuple[str, str] | None:
        """What the template puts before and after a prompt's text; None if it does not render a marker as written."""
        marked = self._render_prompt(PROMPT_MARKER)
        at = marked.find(PROMPT_MARKER)
        return (marked[:at], marked[at + len(PROMPT_MARKER) :]) if at >= 0 else None

    @functools.cached_property
    def end_of_turn(self) -> int | None:
        """The special token the chat template puts after an assistant's message (ChatML's `<|im_end|>`, Llama 3's
        `<|eot_id|>`), which training teaches and generation stops at; None without a template, or if none follows."""
        marks = self._special_ids
        return next((token for token in self._after_answer or [] if token in marks), None)

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        # Added tokens count whether marked special or not: ChatML's added with add_tokens, as community fine-tunes
        # do, are not, and the answers ran on past them.
        return set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)

    @functools.cached_property
    def _after_answer(self) -> list[int] | None:
        """The tokens the chat template puts after an assistant's answer, from a dialogue it renders (a user turn, or
        a system turn first where the template requires one); None without a template, where it renders neither (the
        data's own refusal is said with its row), or where it does not write the answer as given."""
        if not self.chat_template:
            return None
        answer = {"role": "assistant", "content": PROMPT_MARKER}
        for opening in ([], [{"role": "system", "content": "?"}]):
            try:
                rendered = self.tokenizer.apply_chat_template(
                    [*opening, {"role": "user", "content": "?"}, answer], tokenize=False
                )
            except Exception:  # a template's own refusal of this dialogue
                continue
            at = rendered.find(PROMPT_MARKER)
            return self._ids(rendered[at + len(PROMPT_MARKER) :]) if at >= 0 else None  # an answer it rewrites
        return None

    def prompt_ids(self, prompt: str, room: int | None = None) -> list[int]:
        """The prompt's tokens; when `room` is given and they don't fit, the text is cut from the left (its end, next
        to the answer, stays), and then, if need be, the template around it."""
        return self.fit_prompt(prompt, room)[0]

    def fit_prompt(self, prompt: str, room: int | None) -> tuple[list[int], bool]:
        """prompt_ids, and whether they were cut to fit."""
        return self._fit(*self.prompt_parts(prompt), room)

    @staticmethod
    def _fit(head: list[int], text: list[int], tail: list[int], room: int | None) -> tuple[list[int], bool]:
        if room is None or len(head) + len(text) + len(tail) <= room:
            return head + text + tail, False
        keep = max(room - len(head) - len(tail), 0)
        ids = head + text[len(text) - keep :] + tail
        return ids[len(ids) - room :], True

    def pair(self, prompt: str, response: str) -> tuple[list[int], list[int], bool, bool]:
        """ids, labels, whether the prompt was cut from the left, whether the response was cut."""
        if self.chat_template:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            rendered = self._render_prompt(prompt)
            whole = self.tokenizer.apply_chat_template(turns, tokenize=False)
            if not whole.startswith(rendered):
                raise UsageError(
                    "the tokenizer's chat template does not render a prompt as the start of its dialogue, so the "
                    "response's tokens cannot be told apart; train a model whose template does, or remove "
                    "chat_template from its tokenizer_config.json to train on the plain prompt and response"
                )
            # From where the prompt ends: a header ending in a space (`assistant: `) keeps its own token, as predict.py
            # prompts with it, where apply_chat_template's whole dialogue joins it to the answer's first word.
            head, text, tail = self.prompt_parts(prompt, rendered)
            response_ids = self._ids(whole[len(rendered) :]) + self.answer_end
        else:
            # Prompt and response meet with no template between them: tokenized apart, so that the model learns the
            # response after the prompt's own tokens, the ones predict.py gives it.
            response_ids = self._ids(response) + [self.tokenizer.eos_token_id]
            head, text, tail = self.prompt_parts(prompt)
        # The response is cut at its end so that the template around the prompt and the prompt's last token stay, as
        # the model will be prompted; where even they do not fit, one prompt token stays to predict from.
        around = len(head) + len(tail) + min(len(text), 1)
        most = self.max_length - around if around < self.max_length else self.max_length - 1
        response_cut = len(response_ids) > most
        response_ids = response_ids[:most]
        room = self.max_length - len(response_ids)
        prompt_ids, prompt_cut = self._fit(head, text, tail, room)
        return prompt_ids + response_ids, [IGNORE] * len(prompt_ids) + response_ids, prompt_cut, response_cut

    def template_refusal(self, messages: list[dict]) -> str | None:
        """Why the chat template will not render this conversation (its own check, such as roles that must
        alternate, or no system turn), or None if it renders."""
        try:
            self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja's raise_exception, or what the template's code trips on: it cannot render
            return first_line(e)
        return None

    def dropped_tool_call(self, messages: list[dict]) -> int | None:
        """The number of the first assistant turn that is a tool call alone (no text beside its tool_calls) and that
        the chat template renders as if it had none: it would be learned as an empty answer. None if there is none
        (a template that renders tool calls, Qwen2.5's or Llama 3.1's, trains them)."""
        render = self.tokenizer.apply_chat_template
        for number, turn in enumerate(messages, start=1):
            if turn["role"] != "assistant" or not turn.get("tool_calls") or turn["content"].strip():
                continue
            without = {key: value for key, value in turn.items() if key != "tool_calls"}
            before = messages[: number - 1]
            if render([*before, turn], tokenize=False) == render([*before, without], tokenize=False):
                return number
        return None

    def conversation(self, messages: list[dict]) -> tuple[list[int], list[int], bool]:
        """ids, labels (the assistant turns), whether the end was cut at --max_length."""
        if not self.chat_template:
            raise UsageError("--messages_column needs a tokenizer with a chat template; this one has none")
        render = self.tokenizer.apply_chat_template
        whole = render(messages, tokenize=False)
        bounds, done = [], 0  # where each assistant turn begins and ends in the rendering
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            head, through = (
                render(messages[:i], tokenize=False, add_generation_prompt=True),
                render(messages[: i + 1], tokenize=False),
            )
            if not (whole.startswith(through) and through.startswith(head) and len(head) >= done):
                raise UsageError(
                    "the tokenizer's chat template does not render a dialogue turn by turn, so the assistant's "
                    "turns cannot be told apart; train a model whose template does, or give the data as "
                    "--prompt_column and --response_column"
                )
            bounds += [len(head), len(through)]
            done = len(through)
        # The dialogue's own tokens, apply_chat_template's, cut where each assistant turn begins and ends (tokenized
        # turn by turn, a SentencePiece tokenizer put a "▁" before every later user turn).
        ids, labels = [], []
        for index, piece in enumerate(self._pieces(whole, bounds)):  # odd pieces: the assistant's turns
            if index % 2:  # an assistant's turn
                piece = piece + self.answer_end
            ids += piece
            labels += piece if index % 2 else [IGNORE] * len(piece)
        cut = len(ids) > self.max_length
        return ids[: self.max_length], labels[: self.max_length], cut

    def document(self, text: str) -> list[int]:
        """A document's tokens, ended by EOS: one, where the tokenizer appends it itself (Llama's add_eos_token) or the
        text ends with it, as HF's run_clm leaves them."""
        ids, eos = self.tokenizer(text, verbose=False)["input_ids"], self.tokenizer.eos_token_id
        return ids if ids and ids[-1] == eos else ids + [eos]


def is_empty_document(text: str | None) -> bool:
    """A plain-text corpus's empty text ("", spaces alone, or None: an empty csv cell), which is no document."""
    return not (text or "").strip()


def first_empty_prompt(renderer: Renderer, prompts: list) -> int | None:
    """The index of the first prompt that renders as no token at all, so that nothing could follow it: an empty one
    (or None, an empty CSV cell), where the model has no chat template and no BOS. None if every prompt renders."""
    if renderer.prompt_ids(""):  # a template's user turn, or BOS: every prompt has a token to follow
        return None
    return next((i for i, prompt in enumerate(prompts) if not renderer.prompt_ids(prompt or "")), None)


NOTHING_TO_START_FROM = "this model has no chat template and no BOS token to start it from"


def pack(documents: list[list[int]], block: int) -> list[list[int]]:
    """Documents joined end to end and cut into blocks of `block` tokens; the last block keeps the rest (no token is
    lost or repeated)."""
    stream = [token for document in documents for token in document]
    return [stream[start : start + block] for start in range(0, len(stream), block)]


class CausalLMCollator:
    """Pads a batch on the right and marks the positions the loss is computed at, all on the host.

    `logit_positions[b]` holds the positions whose next token is a label, `logit_targets[b]` those labels; rows with
    fewer are filled with position 0 and target -100. The model computes its LM head at these positions only (its
    `logits_to_keep`), which for prompt/response data is a small share of the sequence. `num_items` is the number of
    label tokens: a Python int, so that the loop weighs micro-batches without reading the device.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None):
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids, mask, positions, targets = [], [], [], []
        for f in features:
            padding = length - len(f["input_ids"])
            ids.append(list(f["input_ids"]) + [self.pad_token_id] * padding)
            mask.append([1] * len(f["input_ids"]) + [0] * padding)
            labels = list(f["labels"])
            kept = [p for p in range(len(labels) - 1) if labels[p + 1] != IGNORE]
            positions.append(kept)
            targets.append([labels[p + 1] for p in kept])
        width = max(1, max(len(kept) for kept in positions))
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "logit_positions": torch.tensor([p + [0] * (width - len(p)) for p in positions]),
            "logit_targets": torch.tensor([t + [IGNORE] * (width - len(t)) for t in targets]),
            "num_items": sum(len(t) for t in targets),
        }
