"""The causal-LM task on tiny decoders (a Llama with a chat template, a GPT-2 without): label masks, packing,
conversations, the loss where labels are, generation with left padding, and the task in whole runs."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from app.errors import UsageError
from app.tasks import generation, lm_data
from app.tasks.causal_lm import token_mean_loss
from app.tasks.lm_data import IGNORE, CausalLMCollator, Renderer
from app.telemetry import tags
from tests import harness, lm_models, tb
from tests.conftest import data_flags, run_app


def lm_args(tmp_path, model_dir, files, *extra) -> list:
    return [
        *data_flags(model_dir, files),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "lm"),
        *("--per_device_train_batch_size", 4, "--max_length", 48, "--disable_tqdm", "--logging_steps", 1),
        *extra,
    ]


PROMPTS = ["--prompt_column", "text", "--response_column", "label"]


# ---- rendering and label masks ---------------------------------------------------------------------------------------
def test_prompt_and_response_without_a_chat_template_mask_the_prompt_exactly(tiny_gpt2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    renderer = Renderer(tokenizer, max_length=64)
    assert not renderer.chat_template
    ids, labels, prompt_cut, response_cut = renderer.pair("Fresh coffee, review 3.", " great")
    prompt = tokenizer("Fresh coffee, review 3.")["input_ids"]
    response = tokenizer(" great", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt + response
    assert labels == [IGNORE] * len(prompt) + response
    assert not prompt_cut and not response_cut


def test_with_a_chat_template_the_labels_are_the_assistant_turn(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    renderer = Renderer(tokenizer, max_length=64)
    ids, labels, _, _ = renderer.pair("Fresh coffee.", "great")
    learned = [token for token, label in zip(ids, labels) if label != IGNORE]
    assert tokenizer.decode(learned) == "great<|im_end|>\n"
    assert (
        tokenizer.decode(ids) == "<|im_start|>user\nFresh coffee.<|im_end|>\n<|im_start|>assistant\ngreat<|im_end|>\n"
    )
    first = labels.index(next(label for label in labels if label != IGNORE))
    assert all(label == IGNORE for label in labels[:first]) and labels[first:] == ids[first:]


def test_a_long_prompt_is_cut_from_the_left_and_its_response_kept(tiny_gpt2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    renderer = Renderer(tokenizer, max_length=12)
    ids, labels, prompt_cut, response_cut = renderer.pair("word " * 40 + "the end", " great")
    response = tokenizer(" great", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert prompt_cut and not response_cut and len(ids) == 12
    assert ids[-len(response) :] == response and labels[-len(response) :] == response
    assert tokenizer.decode(ids[: -len(response)]).endswith("the end"), (
        "the end of the prompt, next to the answer, stays"
    )


def test_with_a_chat_template_a_long_prompt_loses_text_not_the_template(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids, labels, prompt_cut, _ = Renderer(tokenizer, max_length=24).pair("word " * 40 + "the end", "great")
    text = tokenizer.decode(ids)
    assert prompt_cut and len(ids) == 24
    assert text.startswith("<|im_start|>user\n") and "the end<|im_end|>\n<|im_start|>assistant\ngreat" in text


def dialogue(*contents: str) -> list[dict]:
    """A conversation whose turns alternate user, assistant, user, ..."""
    return [{"role": ("user", "assistant")[i % 2], "content": content} for i, content in enumerate(contents)]


def learned_spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of tokens that carry a label."""
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE and current:
            spans.append(tokenizer.decode(current))
            current = []
        elif label != IGNORE:
            current.append(token)
    return spans + ([tokenizer.decode(current)] if current else [])


def test_conversations_learn_the_assistant_turns_only(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = dialogue("Review: tasty.", "great", "Sure?", "Yes.")
    ids, labels, cut = Renderer(tokenizer, max_length=128).conversation(messages)
    assert not cut
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert learned_spans(tokenizer, ids, labels) == ["great<|im_end|>\n", "Yes.<|im_end|>\n"]


TEMPLATE_TEXTS = ["[INST] I rely on fast shipping [/INST] great coffee.", "Hello there, 2+2=4? user: assistant:"] * 20
PAIRS = [("on fast shipping", "great"), ("", "other"), ("Hello there  ", " great coffee"), ("2+2=", "4")]


@pytest.mark.parametrize("template", [*lm_models.TEMPLATES, "spaced"])
@pytest.mark.parametrize("prompt, response", PAIRS)
def test_training_ids_are_apply_chat_templates_and_the_labels_its_assistant_turn(template, prompt, response):
    # Tokenized piece by piece, a Mistral template's `[INST] ` and the prompt's first word came apart (`Ġ`, `on` where
    # the template gives `Ġon`). The prompt is the generation prompt's own tokens, as predict.py prompts with them; a
    # header ending in a space (`assistant: `) keeps its `Ġ` there, where the whole dialogue joins it to the answer.
    tokenizer = lm_models.templated_tokenizer(TEMPLATE_TEXTS, "chatml" if template == "spaced" else template)
    if template == "spaced":
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    renderer = Renderer(tokenizer, max_length=128)
    ids, labels, _, _ = renderer.pair(prompt, response)
    if template != "spaced":  # a conversation's header ending in a space joins the answer, as in the whole dialogue
        assert (ids, labels) == renderer.conversation(messages)[:2]
    prompt_alone = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=True)
    assert renderer.prompt_ids(prompt) == prompt_alone["input_ids"]
    first = next(i for i, label in enumerate(labels) if label != IGNORE)
    assert ids[:first] == prompt_alone["input_ids"], "training's prompt is the one predict.py gives"
    assert labels[first:] == ids[first:] and set(labels[:first]) == {IGNORE}
    learned = tokenizer.decode(ids[first:])
    assert learned.strip().startswith(response.strip()) and tokenizer.eos_token not in tokenizer.decode(ids[:first])
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    if template != "spaced":  # no token straddles the end of the prompt: the whole is the template's
        assert ids == whole, tokenizer.convert_ids_to_tokens(ids)
    else:  # the same text, then EOS (the template ends an answer with no token of its own); the space may be a token
        assert tokenizer.decode(ids) == tokenizer.decode(whole) + tokenizer.eos_token


@pytest.mark.parametrize("template", lm_models.TEMPLATES)
def test_a_conversation_of_several_turns_is_apply_chat_templates_ids(template):
    # Turn by turn, a SentencePiece tokenizer (Llama 2's template) began each later user turn with a "▁" ("▁[INST]"
    # where the whole dialogue gives "[", "INST]"): prompts that multi-turn inference never gives.
    tokenizer = lm_models.templated_tokenizer(TEMPLATE_TEXTS, template)
    messages = dialogue("I rely on fast shipping", "great", "fast shipping", "coffee.")
    ids, labels, _ = Renderer(tokenizer, max_length=256).conversation(messages)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    spans = [span.strip() for span in learned_spans(tokenizer, ids, labels)]
    assert len(spans) == 2 and spans[0].startswith("great") and spans[1].startswith("coffee."), spans


def eos_appending_tokenizer():
    """A SentencePiece tokenizer whose post-processor puts BOS before a text and EOS after it, as Llama's does when
    saved with add_eos_token=True."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    trained = lm_models.train_tokenizer(TEMPLATE_TEXTS, ["<s>", "</s>"], sentencepiece=True)
    bos, eos = trained.token_to_id("<s>"), trained.token_to_id("</s>")
    trained.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=trained, bos_token="<s>", eos_token="</s>")


def test_a_tokenizer_that_appends_eos_itself_ends_the_answer_and_each_document_with_one(tmp_path):
    # Its EOS stood between every prompt and its answer, a long prompt's cut kept it and lost BOS, and a document
    # ended in two.
    tokenizer = eos_appending_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    renderer = Renderer(tokenizer, max_length=12)
    text = tokenizer("on fast shipping", add_special_tokens=False)["input_ids"]
    answer = tokenizer("great", add_special_tokens=False)["input_ids"]
    ids, labels, _, _ = renderer.pair("on fast shipping", "great")
    assert ids == [bos, *text, *answer, eos] and labels == [IGNORE] * (1 + len(text)) + answer + [eos]
    assert renderer.prompt_ids("on fast shipping") == [bos, *text], "predict.py prompts as training did"
    ids, _, prompt_cut, _ = renderer.pair("I rely on fast shipping " * 5, "great")
    assert prompt_cut and len(ids) == 12 and ids[0] == bos and ids.count(eos) == 1
    assert renderer.prompt_ids("") == [bos]
    for document in ("great coffee.", "great coffee.</s>", ""):
        assert (
            renderer.document(document) == tokenizer(document)["input_ids"] and renderer.document(document)[-1] == eos
        )
    assert renderer.document("great coffee.").count(eos) == 1


NO_END = (  # a template that ends an answer with a newline: no special token after it
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
    "{% endif %}"
)


def test_a_template_that_ends_answers_with_no_token_of_its_own_learns_eos_after_each():
    # Nothing taught the model to stop: every greedy answer ran to --max_new_tokens, and exact match was 0 by design.
    tokenizer = lm_models.templated_tokenizer(TEMPLATE_TEXTS, "chatml")
    tokenizer.chat_template = NO_END
    renderer = Renderer(tokenizer, max_length=128)
    assert renderer.end_of_turn is None and renderer.answer_end == [tokenizer.eos_token_id]
    ids, labels, _, _ = renderer.pair("on fast shipping", "great")
    assert tokenizer.decode([label for label in labels if label != IGNORE]).endswith("great\n<|endoftext|>")
    ids, labels, _ = renderer.conversation(dialogue("on fast shipping", "great", "sure?", "yes"))
    assert [span.lstrip() for span in learned_spans(tokenizer, ids, labels)] == [
        "great\n<|endoftext|>",
        "yes\n<|endoftext|>",
    ]
    with_end = Renderer(lm_models.templated_tokenizer(TEMPLATE_TEXTS, "chatml"), max_length=128)
    assert with_end.answer_end == [] and with_end.end_of_turn is not None  # ChatML's <|im_end|> ends them


def test_a_template_that_wants_a_system_turn_is_probed_with_one_and_one_that_renders_nothing_adds_no_eos():
    # The probe's dialogue had no system turn: refused by the template, it read as "no end token", and EOS followed
    # the template's own <|im_end|> in every answer, with a note that said the template had none.
    tokenizer = lm_models.templated_tokenizer(TEMPLATE_TEXTS, "chatml")
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}"
        + lm_models.CHATML
    )
    renderer = Renderer(tokenizer, max_length=128)
    assert renderer.end_of_turn == tokenizer.convert_tokens_to_ids("<|im_end|>") and renderer.answer_end == []
    tokenizer.chat_template = "{{ raise_exception('no dialogue renders') }}"
    assert Renderer(tokenizer, max_length=128).answer_end == [], "nothing known of how it ends an answer: no EOS"


def test_a_max_length_of_two_without_a_template_trains(tmp_path, tiny_gpt2_dir, review_files):
    # The template's refusal measured a tokenizer without one: "the chat template ... takes 1 tokens".
    args = lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS, "--max_length", 2, "--max_steps", 1)
    assert run_app([*args, "--mixed_precision", "no", "--eval_steps", 0]) == 0


def test_a_max_length_that_the_template_fills_is_refused(tmp_path, tiny_llama_dir, review_files, capsys):
    # The prompt's text gave way to the template's system turn, and the note said the prompts kept one token.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    head, _, tail = Renderer(tokenizer, 64).prompt_parts("")
    around = len(head) + len(tail)
    args = lm_args(tmp_path, tiny_llama_dir, review_files, *PROMPTS, "--max_length", around + 1)
    assert run_app(args) == 2
    assert capsys.readouterr().err == (
        f"error: --max_length {around + 1} leaves no room for a prompt and its answer: the chat template around a "
        f"prompt takes {around} tokens; raise --max_length to at least {around + 2}\n"
    )
    assert not (tmp_path / "out").exists()


def test_packing_loses_and_repeats_no_token(tiny_gpt2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    renderer = Renderer(tokenizer, max_length=16)
    documents = [renderer.document(text) for text in ["short one", "a somewhat longer document " * 3, "x", "end"]]
    blocks = lm_data.pack(documents, 16)
    assert [token for block in blocks for token in block] == [token for doc in documents for token in doc]
    assert all(len(block) == 16 for block in blocks[:-1]) and 0 < len(blocks[-1]) <= 16
    assert sum(doc.count(tokenizer.eos_token_id) for doc in documents) == len(documents), "one EOS ends each document"


# ---- the loss where labels are ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_the_loss_at_labelled_positions_is_the_models_own_loss(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    renderer = Renderer(tokenizer, max_length=48)
    pairs = [("Stale and bitter, review 1.", " other"), ("Tasty!", " great"), ("Crushed box " * 5, " other")]
    features = [dict(zip(("input_ids", "labels"), renderer.pair(p, r)[:2])) for p, r in pairs]
    batch = CausalLMCollator(tokenizer.pad_token_id or tokenizer.eos_token_id, pad_to_multiple_of=8)(features)
    assert batch["logit_positions"].shape[1] < batch["input_ids"].shape[1] - 1, "the LM head skips the prompts"

    ours = token_mean_loss(model, batch)
    labels = torch.full_like(batch["input_ids"], IGNORE)
    for row, feature in enumerate(features):
        labels[row, : len(feature["labels"])] = torch.tensor(feature["labels"])
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
    assert batch["num_items"] == int((labels[:, 1:] != IGNORE).sum())
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


# ---- generation ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_batched_generation_with_left_padding_equals_one_by_one(request, model_fixture):
    from accelerate import Accelerator

    from app.amp.policy import PrecisionPolicy

    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    accelerator, fp32 = Accelerator(cpu=True), PrecisionPolicy("no", "cpu", "test", "test")
    renderer = Renderer(tokenizer, max_length=64)
    prompts = [renderer.prompt_ids(text) for text in ["a", "Stale coffee, bitter and old.", "Good tea, review 12"]]
    assert len({len(p) for p in prompts}) == 3, "prompts of different lengths, so that the batch pads"
    batched = generation.generate(accelerator, fp32, model, tokenizer, prompts, 12, batch_size=3)
    one_by_one = [generation.generate(accelerator, fp32, model, tokenizer, [p], 12, batch_size=1)[0] for p in prompts]
    batched, one_by_one = [g.text for g in batched], [g.text for g in one_by_one]
    assert batched == one_by_one
    assert any(text for text in batched), "the untrained model generates something to compare"


def test_generation_with_a_frozen_head_never_copies_the_head_per_row(tiny_llama_dir):
    """A frozen head (LoRA's base): torch's matmul would broadcast its weight over the rows of the prefill's
    last-position slice, [batch, hidden, vocab], for a batched product that copied it on SmolLM2's bfloat16 base
    (864 MiB at batch 16). No tensor of that size is made, not even a view."""
    from accelerate import Accelerator
    from torch.utils._python_dispatch import TorchDispatchMode

    from app.amp.policy import PrecisionPolicy

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return out

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).requires_grad_(False)
    head = model.get_output_embeddings().weight
    renderer = Renderer(tokenizer, max_length=64)
    prompts = [renderer.prompt_ids(text) for text in ["a", "Stale coffee, bitter and old.", "Good tea, review 12"]]
    accelerator, fp32 = Accelerator(cpu=True), PrecisionPolicy("no", "cpu", "test", "test")
    with LargestOutput() as watch:
        texts = generation.generate(accelerator, fp32, model, tokenizer, prompts, 4, batch_size=3)
    assert len(texts) == 3
    assert watch.largest < 2 * head.numel(), f"a tensor of {watch.largest} elements; the head has {head.numel()}"


ENDS = {"Ċ": "great", "great": "<|im_end|>", "<|im_end|>": "Ċ"}  # answers `great`, ends its turn, and would go on
RUNS_ON = {"Ċ": "great", "great": "Ċ"}  # `great` again and again, never an end token


@pytest.fixture(scope="module")
def qwen_base_layout(tmp_path_factory) -> dict[str, Path]:
    """Bigram Llamas with Qwen2.5's base layout: EOS `<|endoftext|>`, ChatML turns that end with `<|im_end|>`."""
    tokenizer = lm_models.templated_tokenizer(["great coffee, other tea"] * 20, "chatml")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.tokenize("great") == ["great"]
    folder = tmp_path_factory.mktemp("qwen-base-layout")
    return {
        name: lm_models.save_bigram_llama(folder / name, tokenizer, chain)
        for name, chain in [("ends", ENDS), ("runs_on", RUNS_ON)]
    }


def test_generation_stops_at_the_templates_end_of_turn(qwen_base_layout, capsys):
    # It stopped at EOS alone, which the template never puts after an answer: "great\ngreat\ngreat..." to the end.
    from app.predict import main as predict

    args = ["Tasty?", "--model_name_or_path", qwen_base_layout["ends"], "--max_new_tokens", 12, "--disable_tqdm"]
    assert predict([str(a) for a in [*args, "--mixed_precision", "no"]]) == 0
    out, err = capsys.readouterr()
    assert pd.read_csv(io.StringIO(out))["generated_text"].tolist() == ["great"]
    assert re.search(r"^generated for 1 prompt in [0-9.]+ s: [0-9.]+ prompts/s ", err, re.MULTILINE), err
    assert Renderer(AutoTokenizer.from_pretrained(qwen_base_layout["ends"]), 64).end_of_turn is not None


def test_an_end_of_turn_added_as_a_plain_token_is_a_stop_too(tmp_path):
    # ChatML's tokens added with add_tokens (not marked special), as community fine-tunes do: no end of turn was
    # found, and answers ran on past <|im_end|>.
    tokenizer = lm_models.templated_tokenizer(["great coffee, other tea"] * 20, "chatml")
    tokenizer.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        saved = json.loads((tmp_path / name).read_text())
        for token in [*saved.get("added_tokens", []), *saved.get("added_tokens_decoder", {}).values()]:
            token["special"] = token["content"] == "<|endoftext|>"
        (tmp_path / name).write_text(json.dumps(saved))
    plain = AutoTokenizer.from_pretrained(tmp_path)
    assert plain.convert_ids_to_tokens(plain.all_special_ids) == ["<|endoftext|>"], "the test's premise"
    assert Renderer(plain, 64).end_of_turn == plain.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("model, expected", [("ends", 1.0), ("runs_on", 0.0)])
def test_exact_match_counts_only_answers_that_end(qwen_base_layout, model, expected):
    # Cut at the longest reference plus one token, "great\ngreat" stripped was "great": 1.0 for a model whose answers
    # never end, and predict.py's ran on to --max_new_tokens.
    from accelerate import Accelerator
    from datasets import Dataset, DatasetDict
    from transformers import AutoConfig

    from app.amp.policy import PrecisionPolicy
    from app.config import TrainConfig
    from app.tasks.causal_lm import CausalLM

    folder = qwen_base_layout[model]
    pairs = Dataset.from_dict({"prompt": ["Tasty?", "Fresh coffee."], "response": ["great", "great"]})
    raw = DatasetDict({"train": pairs, "validation": pairs})
    cfg = TrainConfig(model_name_or_path=str(folder), prompt_column="prompt", response_column="response", max_length=64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    task = CausalLM.from_data(cfg, raw, tokenizer, AutoConfig.from_pretrained(folder))
    accelerator = Accelerator(cpu=True)
    task.tokenize(raw, accelerator)
    model = AutoModelForCausalLM.from_pretrained(folder)
    policy = PrecisionPolicy("no", "cpu", "test", "test")
    assert task.max_new_tokens() == 2, "great, then its end of turn"
    assert task.exact_match(accelerator, policy, model) == expected


# ---- whole runs ---------------------------------------------------------------------------------------------------
def charts_with_data(run_dir) -> set[str]:
    """The tags that the run's Custom Scalars charts draw; each chart has data in the run."""
    logged = tb.scalars(run_dir).keys()
    drawn = set()
    for charts in tb.layout(run_dir).values():
        for regexes in charts.values():
            for regex in regexes:
                matched = {tag for tag in logged if re.match(regex, tag)}
                assert matched, f"the chart {regex} has no data"
                drawn |= matched
    return drawn


def test_the_task_is_inferred_from_the_model_config_and_said_with_its_reason(
    tmp_path, tiny_gpt2_dir, review_files, capsys
):
    args = lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS, "--max_steps", 2, "--mixed_precision", "no")
    assert run_app(args) == 0
    out = capsys.readouterr().out
    assert "task: causal_lm (the model config's architecture is GPT2LMHeadModel)" in out
    scalars = tb.scalars(tmp_path / "runs" / "lm")
    for tag in (tags.EVAL_LOSS, tags.EVAL_PERPLEXITY, tags.EVAL_EXACT_MATCH):
        assert 2 in scalars[tag], tag
    loss, perplexity = scalars[tags.EVAL_LOSS][2], scalars[tags.EVAL_PERPLEXITY][2]
    assert perplexity == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)
    assert 0 <= scalars[tags.EVAL_EXACT_MATCH][2] <= 1
    assert tags.EVAL_ACCURACY not in scalars
    # Custom Scalars: a chart for each metric, and none without data (an accuracy chart was an empty box)
    assert charts_with_data(tmp_path / "runs" / "lm") >= {tags.EVAL_PERPLEXITY, tags.EVAL_EXACT_MATCH}


def test_conversations_and_packed_text_train_through_the_same_loop(
    tmp_path, tiny_llama_dir, conversation_files, review_files, capsys
):
    args = lm_args(tmp_path, tiny_llama_dir, conversation_files, "--messages_column", "messages", "--max_steps", 2)
    assert run_app([*args, "--mixed_precision", "no"]) == 0
    assert "left out" not in capsys.readouterr().out
    conversations = tb.scalars(tmp_path / "runs" / "lm")
    assert conversations[tags.EVAL_LOSS][2] > 1.0, "the assistant turns are learned and evaluated, not cut away"
    packed = lm_args(tmp_path / "packed", tiny_llama_dir, review_files, "--text_column", "text", "--max_steps", 2)
    assert run_app([*packed, "--mixed_precision", "no"]) == 0
    scalars = tb.scalars(tmp_path / "packed" / "runs" / "lm")
    assert scalars[tags.PERF_PADDING_FRACTION][2] == pytest.approx(0.0, abs=0.05), "packed blocks hardly pad"
    assert tags.EVAL_EXACT_MATCH not in scalars, "plain text has no reference answers"
    assert tags.EVAL_PERPLEXITY in charts_with_data(tmp_path / "packed" / "runs" / "lm")


def test_conversations_whose_answers_lie_past_max_length_are_left_out_or_refused(tmp_path, tiny_llama_dir, capsys):
    # Cut at --max_length, such a conversation keeps no assistant token: it trained on nothing, and a validation split
    # of them reported eval/loss 0.0000.
    def conversations(name: str, long_every: int) -> dict:
        user = [("word " * 200 if i % long_every == 0 else "Short review.") for i in range(12)]
        rows = [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "great"}]} for u in user]
        path = tmp_path / f"{name}.jsonl"
        pd.DataFrame(rows).to_json(path, orient="records", lines=True)
        return {"train": path, "validation": path}

    some = lm_args(tmp_path, tiny_llama_dir, conversations("some", 3), "--messages_column", "messages")
    assert run_app([*some, "--max_steps", 1, "--mixed_precision", "no"]) == 0
    out = capsys.readouterr().out
    for split in ("train", "validation"):
        assert (
            f"note: 4 of 12 {split} examples are left out: cut to fit --max_length 48, they keep no token to learn "
            "(their responses lie past the cut)"
        ) in out
    every = lm_args(tmp_path / "all", tiny_llama_dir, conversations("all", 1), "--messages_column", "messages")
    assert run_app(every) == 2
    assert capsys.readouterr().err == (  # one line: --disable_tqdm hides the tokenizing bars too
        "error: no train example keeps a token to learn within --max_length 48: the responses lie past the cut; "
        "raise --max_length, or shorten the texts before them\n"
    )


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_token_mean_loss_is_the_same_with_accumulation(tiny_llama_dir, uneven_responses, one_thread, strategy):
    """Batch 8 in one micro-batch and batch 4 x 2 micro-batches train on the same examples; their label-token counts
    differ between micro-batches, so only a mean over the step's tokens (not a mean of means) gives the same step.
    Length-grouped (the default), an optimizer step's examples are grouped, as HF does: grouped by micro-batch, 4 x 2
    trained on other examples per step than 8."""
    review_files = uneven_responses
    common = dict(
        mixed_precision="no",
        max_steps=3,
        train_sampling_strategy=strategy,
        task="causal_lm",
        prompt_column="text",
        response_column="label",
        text_column=None,
        label_column=None,
        max_length=48,
        learning_rate=1e-3,
    )
    runs = {}
    for accumulation, batch_size in ((1, 8), (2, 4)):
        run = harness.build_training(
            tiny_llama_dir,
            review_files,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            **common,
        )
        harness.train(run)
        runs[accumulation] = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    for name, value in runs[1].items():
        assert torch.allclose(runs[2][name], value, rtol=1e-4, atol=1e-6), name


def test_a_quantized_model_is_refused_before_training(tmp_path, tiny_gpt2_dir, review_files, capsys):
    config = json.loads((tiny_gpt2_dir / "config.json").read_text())
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    for file in tiny_gpt2_dir.iterdir():
        (quantized / file.name).write_bytes(file.read_bytes())
    (quantized / "config.json").write_text(
        json.dumps(config | {"quantization_config": {"quant_method": "bitsandbytes"}})
    )
    assert run_app(lm_args(tmp_path, quantized, review_files, *PROMPTS)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is quantized (bitsandbytes)" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("data", ["packed text", "prompts"])
def test_a_max_length_of_one_token_is_refused_for_what_it_is(tmp_path, tiny_gpt2_dir, review_files, capsys, data):
    # Packed, it was "the train data packs into a single token, with none before it to predict it from; add text".
    columns = ["--text_column", "text"] if data == "packed text" else PROMPTS
    assert run_app([*lm_args(tmp_path, tiny_gpt2_dir, review_files, *columns), "--max_length", 1]) == 2
    assert capsys.readouterr().err == (
        "error: --max_length 1 leaves a causal LM no token to learn: each is learned from the tokens before it; use "
        "--max_length 2 or more\n"
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_flags_of_the_other_task_are_refused(
    tmp_path, tiny_gpt2_dir, tiny_model_dir, review_files, conversation_files, capsys
):
    assert run_app(lm_args(tmp_path, tiny_gpt2_dir, review_files, *PROMPTS, "--label_column", "label")) == 2
    assert "--label_column does not apply to --task causal_lm" in capsys.readouterr().err
    assert run_app(lm_args(tmp_path, tiny_model_dir, review_files, *PROMPTS)) == 2
    assert "--prompt_column does not apply to --task sequence_classification" in capsys.readouterr().err
    assert run_app(lm_args(tmp_path, tiny_model_dir, review_files, "--task", "causal_lm")) == 2
    assert "is an encoder" in capsys.readouterr().err
    conversations = lm_args(tmp_path, tiny_gpt2_dir, conversation_files, "--messages_column", "messages")
    assert run_app(conversations) == 2
    assert "--messages_column needs a tokenizer with a chat template" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists(), "bad input leaves nothing"


def test_generation_stays_within_learned_positions_in_evaluation_and_predict(
    tmp_path, review_texts, uneven_responses, capsys
):
    # GPT-2's positions are a table: a prompt of --max_length positions plus new tokens past it was an IndexError, at
    # the final evaluation (the longest response's room after a short response's long prompt) and in predict.py.
    from app.predict import main as predict
    from tests.lm_models import save_tiny_gpt2

    model = save_tiny_gpt2(tmp_path / "gpt2-64", review_texts, positions=64)
    args = lm_args(tmp_path, model, uneven_responses, *PROMPTS, "--max_length", 64, "--max_steps", 1)
    assert run_app([*args, "--mixed_precision", "no"]) == 0

    long_prompt = " ".join(review_texts[:20])  # hundreds of tokens: cut from the left to leave room for the answer
    out = str(tmp_path / "out")
    assert predict([long_prompt, "--model_name_or_path", out, "--max_new_tokens", "16", "--disable_tqdm"]) == 0
    capsys.readouterr()
    # The model card's command, with predict.py's default: 128 new tokens were refused in 64 positions; half of them.
    assert predict(["a text", "--model_name_or_path", out, "--disable_tqdm"]) == 0, capsys.readouterr().err
    assert predict([long_prompt, "--model_name_or_path", out, "--max_new_tokens", "64"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: --max_new_tokens 64 leaves no room for a prompt in the model's 64 positions; use --max_new_tokens 63 "
        "or less\n"
    )


def test_max_new_tokens_past_the_positions_is_refused_by_train_and_named_by_predict(
    tmp_path, tiny_llama_dir, review_files, capsys
):
    # train.py took --max_new_tokens 300 on a model of 256 positions; predict.py then refused the folder naming a flag
    # that it was never given.
    from app.predict import main as predict

    args = lm_args(tmp_path, tiny_llama_dir, review_files, *PROMPTS, "--max_steps", 1, "--mixed_precision", "no")
    assert run_app([*args, "--max_new_tokens", 300]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --max_new_tokens 300 leaves no room for a prompt in the model's 256 positions; use --max_new_tokens "
        "255 or less"
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists(), "refused before anything was written"

    folder = tmp_path / "trained-before"  # a folder from a run that took it, as training_args.yaml records it
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "training_args.yaml").write_text("max_length: 48\nmax_new_tokens: 300\n")
    assert predict(["Tasty?", "--model_name_or_path", str(folder)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --max_new_tokens 300 (the training run's, from {folder / 'training_args.yaml'}; predict.py's flag "
        "overrides it) leaves no room for a prompt in the model's 256 positions; use --max_new_tokens 255 or less"
    ]
    assert predict(["Tasty?", "--model_name_or_path", str(folder), "--max_new_tokens", "4", "--disable_tqdm"]) == 0


def test_predict_generates_for_each_prompt_in_order(tmp_path, tiny_llama_dir, review_files, capsys):
    from app.predict import main as predict

    args = lm_args(tmp_path, tiny_llama_dir, review_files, *PROMPTS, "--max_steps", 2, "--mixed_precision", "no")
    assert run_app(args) == 0
    prompts = pd.read_csv(review_files["validation"]).head(5).rename(columns={"text": "prompt"})
    source = tmp_path / "prompts.csv"
    prompts.to_csv(source, index=False)
    out = tmp_path / "generated.jsonl"
    code = predict(
        ["--model_name_or_path", str(tmp_path / "out"), "--input_file", str(source), "--prompt_column", "prompt"]
        + ["--output_file", str(out), "--max_new_tokens", "4", "--compare_fp32", "--disable_tqdm"]
        + ["--mixed_precision", "bf16"]
    )
    assert code == 0
    written = pd.read_json(out, lines=True)
    assert list(written.columns) == ["prompt", "label", "generated_text"]
    assert list(written["prompt"]) == list(prompts["prompt"])
    assert "compare_fp32: bf16 vs fp32 on 5 prompts:" in capsys.readouterr().err
    # In fp32, the first row is what transformers' own generate() gives for the prompt rendered with the template.
    code = predict(
        ["--model_name_or_path", str(tmp_path / "out"), "--input_file", str(source), "--prompt_column", "prompt"]
        + ["--output_file", str(out), "--max_new_tokens", "4", "--disable_tqdm", "--mixed_precision", "no"]
        + ["--overwrite_output_file"]
    )
    assert code == 0
    fp32 = pd.read_json(out, lines=True)["generated_text"].fillna("")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    first = torch.tensor([Renderer(tokenizer, 48).prompt_ids(prompts["prompt"][0])])
    one = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=4, do_sample=False)
    assert fp32[0] == tokenizer.decode(one[0, first.shape[1] :], skip_special_tokens=True)
    paired = ["--model_name_or_path", str(tmp_path / "out"), "--input_file", str(source), "--text_pair_column", "label"]
    assert predict(paired) == 2
    assert "--text_pair_column is for sentence-pair classifiers" in capsys.readouterr().err

    # Without --max_new_tokens, as many as the run was trained with (what `--max_new_tokens 4` records).
    recorded = tmp_path / "out" / "training_args.yaml"
    recorded.write_text(recorded.read_text().replace("max_new_tokens: null", "max_new_tokens: 4"))
    again = ["--model_name_or_path", str(tmp_path / "out"), "--input_file", str(source), "--prompt_column", "prompt"]
    code = predict(
        again + ["--output_file", str(out), "--overwrite_output_file", "--disable_tqdm", "--mixed_precision", "no"]
    )
    assert code == 0
    assert pd.read_json(out, lines=True)["generated_text"].fillna("").tolist() == fp32.tolist()


@pytest.mark.parametrize("trained_on", ["plain text", "prompts"])
def test_predict_renders_and_reads_prompts_as_the_model_was_trained(
    tmp_path, tiny_llama_dir, review_files, capsys, trained_on
):
    # A model trained on plain text had its prompts wrapped in the chat template, which it never saw: the fox that
    # learned "the quick brown fox jumps" went on with ",&&&&". And the prompts were read from a text column, not the
    # trained --prompt_column: another column silently, or a StopIteration traceback where the file had no text.
    from app.predict import main as predict

    columns = ["--text_column", "text", "--no_packing"] if trained_on == "plain text" else ["--prompt_column", "prompt"]
    frames = {split: pd.read_csv(path).head(16) for split, path in review_files.items()}
    files = {}
    for split, frame in frames.items():
        files[split] = tmp_path / f"{split}.csv"
        frame.assign(prompt=frame["text"].str[:40]).rename(columns={"label": "completion"}).to_csv(files[split])
    response = [] if trained_on == "plain text" else ["--response_column", "completion"]
    args = lm_args(tmp_path, tiny_llama_dir, files, *columns, *response, "--max_steps", 1, "--mixed_precision", "no")
    assert run_app(args) == 0
    source = tmp_path / "prompts.csv"
    pd.DataFrame({"prompt": ["Fresh coffee with", "The tea was"], "text": ["Not the", "prompts"]}).to_csv(source)
    out = tmp_path / "generated.jsonl"
    flags = ["--model_name_or_path", str(tmp_path / "out"), "--max_new_tokens", "4", "--mixed_precision", "no"]
    assert predict([*flags, "--input_file", str(source), "--output_file", str(out), "--disable_tqdm"]) == 0
    read = "text" if trained_on == "plain text" else "prompt"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for prompt, generated in zip(pd.read_csv(source)[read], pd.read_json(out, lines=True)["generated_text"].fillna("")):
        if trained_on == "plain text":  # a document's start, as training tokenized documents
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        else:
            ids = torch.tensor([Renderer(tokenizer, 48).prompt_ids(prompt)])
            assert tokenizer.decode(ids[0]).startswith("<|im_start|>"), "the chat template, as in training"
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert generated == tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    without = tmp_path / "without.csv"
    pd.DataFrame({"other": ["a"]}).to_csv(without, index=False)
    capsys.readouterr()
    assert predict([*flags, "--input_file", str(without)]) == 2
    assert capsys.readouterr().err == (  # no flag named the column: it named --prompt_column, which was not given
        f"error: the input has no column {read!r}, where the prompts are looked for by default; its columns are: "
        "other; give --prompt_column with the column of prompts, one plain text per row (a conversation's turns are "
        "not read)\n"
    )


@pytest.mark.parametrize("packing", ["--packing", "--no_packing"])
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_empty_documents_are_left_out_packed_or_not_and_a_split_of_them_is_refused(
    tmp_path, tiny_gpt2_dir, capsys, packing, suffix
):
    # GPT-2 adds no BOS: an empty text was EOS alone. Unpacked, the note said they were cut at --max_length; packed,
    # a file of empty texts trained on blocks of EOS without a word. A csv's empty cell was refused, "" left out.
    def documents(name: str, empty_every: int) -> dict:
        empty = " " if suffix == ".jsonl" else ""  # a csv's empty cell, read as None
        rows = [{"text": empty if i % empty_every == 0 else "Fresh coffee, great taste.", "id": i} for i in range(12)]
        path = tmp_path / f"{name}{suffix}"
        if suffix == ".csv":
            pd.DataFrame(rows).to_csv(path, index=False)
        else:
            pd.DataFrame(rows).to_json(path, orient="records", lines=True)
        return {"train": path, "validation": path}

    some = lm_args(tmp_path, tiny_gpt2_dir, documents("some", 4), "--text_column", "text", packing)
    assert run_app([*some, "--max_steps", 1, "--mixed_precision", "no"]) == 0
    out = capsys.readouterr().out
    assert "note: 3 of 12 train texts are empty and left out" in out.splitlines()
    assert "examples are left out" not in out
    every = lm_args(tmp_path / "all", tiny_gpt2_dir, documents("all", 1), "--text_column", "text", packing)
    assert run_app(every) == 2
    assert capsys.readouterr().err == (
        "error: every train text (column 'text') is empty: nothing to learn; name the column of texts with "
        "--text_column, or check the file\n"
    )
    assert not (tmp_path / "all" / "out").exists()


def test_a_packed_last_block_of_one_token_is_left_out_for_what_it_is(tmp_path, tiny_gpt2_dir, capsys):
    # The note blamed empty texts or responses past the cut: packed text has neither; its last block held one token.
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    texts = ["Fresh coffee, great taste.", "Stale, and the box was crushed.", "Would buy again."]
    total = sum(len(Renderer(tokenizer, 64).document(text)) for text in texts)
    path = tmp_path / "docs.jsonl"
    pd.DataFrame({"text": texts}).to_json(path, orient="records", lines=True)
    args = lm_args(tmp_path, tiny_gpt2_dir, {"train": path, "validation": path}, "--text_column", "text")
    assert run_app([*args, "--max_length", total - 1, "--max_steps", 1, "--mixed_precision", "no"]) == 0
    assert (
        "note: 1 of 2 train examples are left out: the last block of the packed text holds a single token, with none "
        "before it to predict it from"
    ) in capsys.readouterr().out


def test_perplexity_is_exp_of_the_loss_and_nan_for_a_nan_loss():
    from app.tasks.causal_lm import perplexity

    assert perplexity(1.0) == pytest.approx(math.e) and perplexity(800.0) == math.inf
    assert math.isnan(perplexity(math.nan)), "a NaN loss was reported as an infinite perplexity"


@pytest.mark.parametrize("model_type", ["bert", "distilbert", "albert", "deberta-v2", "modernbert"])
def test_an_encoder_is_refused_as_a_causal_lm_whether_its_config_knows_is_decoder_or_not(model_type):
    # transformers 5 took is_decoder out of most encoders' configs: reading it was an AttributeError and a traceback.
    from app.tasks.causal_lm import check_decoder

    with pytest.raises(UsageError, match=f"--task causal_lm needs a decoder model; {model_type} is an encoder"):
        check_decoder(AutoConfig.for_model(model_type))
    check_decoder(AutoConfig.for_model("gpt2"))
