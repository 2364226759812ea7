"""Causal-LM inputs at their edges, on the tiny decoders: empty prompts (in training data and on predict's stdin),
special tokens the model has no embedding for, and data errors that name the column and the row.

An empty prompt starts as transformers' generate() starts without input ids: from the chat template's user turn, or
else from the BOS token; a model with neither is refused before any weights load, naming the row.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.tasks.lm_data import IGNORE, Renderer
from tests import tb
from tests.conftest import run_app
from tests.test_predict import stdin_of

PROMPTS = ["--prompt_column", "prompt", "--response_column", "response"]


def edited_copy(source: Path, target: Path, **files: dict) -> Path:
    """A copy of a model folder with keys of its JSON files changed: `tokenizer_config={"bos_token": None}` sets
    tokenizer_config.json's bos_token to null."""
    shutil.copytree(source, target)
    for name, changes in files.items():
        path = target / f"{name}.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return target


def without_bos(source: Path, target: Path) -> Path:
    """The tiny GPT-2 (no chat template) with no BOS token anywhere: tokenizer, model config, generation config."""
    return edited_copy(
        source,
        target,
        tokenizer_config={"bos_token": None},
        config={"bos_token_id": None},
        generation_config={"bos_token_id": None},
    )


def write_pairs(folder: Path, kind: str, split: str, prompts: list[str], responses: list[str]) -> Path:
    """Prompt/response pairs as CSV (an empty prompt is an empty cell) or JSON lines (an empty string)."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame({"prompt": prompts, "response": responses})
    path = folder / f"{split}.{kind}"
    if kind == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True)
    return path


def train_args(tmp_path: Path, model_dir: Path, train: Path, validation: Path, *extra) -> list:
    return [
        *("--model_name_or_path", model_dir, "--train_file", train, "--validation_file", validation),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--run_name", "lm", "--disable_tqdm"),
        *("--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 2, "--max_length", 32),
        *("--max_steps", 1, "--mixed_precision", "no", *PROMPTS, *extra),
    ]


def predict_stdin(monkeypatch, model_dir: Path, lines: list[str], *extra) -> int:
    from app.predict import main as predict

    monkeypatch.setattr(sys, "stdin", stdin_of(("\n".join(lines) + "\n").encode()))
    args = ["--model_name_or_path", model_dir, "--max_new_tokens", 4, "--mixed_precision", "no", "--disable_tqdm"]
    return predict([str(a) for a in [*args, *extra]])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---- empty prompts ---------------------------------------------------------------------------------------------------
def test_without_a_chat_template_an_empty_prompt_is_the_bos_token_and_its_whole_response_is_learned(tiny_gpt2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    assert tokenizer("")["input_ids"] == [], "this tokenizer adds no BOS of its own"
    ids, labels, _, _ = Renderer(tokenizer, max_length=32).pair("", " great")
    response = tokenizer(" great", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == [tokenizer.bos_token_id] + response
    assert labels == [IGNORE] + response, "every response token is predicted, the first one from BOS"


def test_with_a_chat_template_an_empty_prompt_is_an_empty_user_turn(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    turn = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    assert Renderer(tokenizer, max_length=32).prompt_ids("") == tokenizer(turn, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def untied_gpt2_dir(tmp_path_factory, tiny_gpt2_dir) -> Path:
    """The tiny GPT-2 with its own LM head: with tied embeddings an untrained model answers BOS with BOS (its EOS
    too), which says nothing when compared."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path_factory.mktemp("untied-gpt2")
    config = GPT2Config.from_pretrained(tiny_gpt2_dir, tie_word_embeddings=False)
    torch.manual_seed(1)
    GPT2LMHeadModel(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(tiny_gpt2_dir).save_pretrained(target)
    return target


@pytest.mark.parametrize("lines, batch_size", [(["", ""], 64), ([""], 1), (["Fresh coffee.", "", "Stale tea.", ""], 2)])
def test_predict_generates_for_empty_stdin_lines_from_bos_in_their_rows(
    untied_gpt2_dir, capsys, monkeypatch, lines, batch_size
):
    """transformers' generate() given no input ids starts from the model's BOS: each empty line gets that answer, in
    its own row, whether its batch holds only empty prompts, one alone, or longer prompts too."""
    tokenizer = AutoTokenizer.from_pretrained(untied_gpt2_dir)
    model = AutoModelForCausalLM.from_pretrained(untied_gpt2_dir).eval()
    started = model.generate(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    from_nothing = tokenizer.decode(started[0, 1:], skip_special_tokens=True)
    assert from_nothing, "the untrained model says something to compare"

    assert predict_stdin(monkeypatch, untied_gpt2_dir, lines, "--per_device_eval_batch_size", batch_size) == 0
    rows = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert list(rows["text"]) == lines
    assert [answer for text, answer in zip(rows["text"], rows["generated_text"]) if not text] == [
        from_nothing
    ] * lines.count("")


def test_an_empty_cell_of_the_input_file_is_an_empty_prompt(tmp_path, untied_gpt2_dir, capsys, monkeypatch):
    assert predict_stdin(monkeypatch, untied_gpt2_dir, [""]) == 0
    from_nothing = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)["generated_text"][0]
    source = write_pairs(tmp_path, "csv", "prompts", ["Fresh coffee.", ""], ["great", "other"])
    assert predict_stdin(monkeypatch, untied_gpt2_dir, [], "--input_file", source, "--prompt_column", "prompt") == 0
    rows = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert list(rows["prompt"]) == ["Fresh coffee.", ""] and rows["generated_text"][1] == from_nothing


def test_predict_refuses_two_names_for_an_lms_prompt_column(tmp_path, tiny_gpt2_dir, capsys, monkeypatch):
    # --prompt_column won, and --text_column went unused without a word.
    source = write_pairs(tmp_path, "csv", "prompts", ["Fresh coffee."], ["great"])
    flags = ["--input_file", source, "--prompt_column", "prompt", "--text_column", "response"]
    assert predict_stdin(monkeypatch, tiny_gpt2_dir, [], *flags) == 2
    assert one_error_line(capsys) == (
        "error: --text_column and --prompt_column both name a causal LM's prompts; give one of them"
    )


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_empty_prompts_in_the_data_train_and_evaluate(tmp_path, tiny_gpt2_dir, kind):
    """Empty prompts in both splits (an empty string in JSON lines, an empty cell in a CSV): the final evaluation
    generates for them too, including a batch that holds only empty prompts."""
    prompts, responses = ["Fresh coffee.", "", "Stale tea.", ""], ["great", "other", "other", "great"]
    train = write_pairs(tmp_path / "data", kind, "train", prompts, responses)
    validation = write_pairs(tmp_path / "data", kind, "validation", prompts, responses)
    assert run_app(train_args(tmp_path, tiny_gpt2_dir, train, validation)) == 0
    scalars = tb.scalars(tmp_path / "runs" / "lm")
    assert "eval/exact_match" in scalars and 1 in scalars["eval/exact_match"]


def test_a_model_without_bos_or_chat_template_refuses_empty_prompts_naming_the_row(
    tmp_path, tiny_gpt2_dir, capsys, monkeypatch
):
    """Nothing to start from: transformers' generate() refuses the same case. Refused before any weights load."""
    model_dir = without_bos(tiny_gpt2_dir, tmp_path / "no-bos")
    train = write_pairs(tmp_path / "data", "csv", "train", ["Fresh coffee.", "Stale tea."], ["great", "other"])
    validation = write_pairs(tmp_path / "data", "csv", "validation", ["Tasty.", ""], ["great", "other"])
    assert run_app(train_args(tmp_path, model_dir, train, validation)) == 2
    assert one_error_line(capsys) == (
        "error: row 2 of the validation data (rows counted from 1, after the header): the prompt (column 'prompt') "
        "is empty, and this model has no chat template and no BOS token to start it from; fill in the prompt or "
        "drop the row"
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()

    assert predict_stdin(monkeypatch, model_dir, ["Fresh coffee.", "", "Stale tea."]) == 2
    assert one_error_line(capsys) == (
        "error: prompt 2 of the input (counted from 1) is empty, and this model has no chat template and no BOS "
        "token to start it from; give it a text or drop it"
    )
    assert predict_stdin(monkeypatch, model_dir, ["Fresh coffee."]) == 0, "prompts with text still generate"


# ---- special tokens --------------------------------------------------------------------------------------------------
def test_an_eos_token_beyond_the_models_vocabulary_is_refused_before_any_folder_is_written(
    tmp_path, tiny_gpt2_dir, capsys, monkeypatch
):
    """The tokenizer adds an unknown eos_token as a new token, one past the model's embeddings: training would stop
    at step 1 with an IndexError, after writing the run's folders."""
    model_dir = edited_copy(tiny_gpt2_dir, tmp_path / "bad-eos", tokenizer_config={"eos_token": "<|my_end|>"})
    vocabulary = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    train = write_pairs(tmp_path / "data", "csv", "train", ["Fresh coffee.", "Stale tea."], ["great", "other"])
    assert run_app(train_args(tmp_path, model_dir, train, train)) == 2
    expected = (
        f"error: the tokenizer's eos_token '<|my_end|>' is not in the model's vocabulary: its id is {vocabulary}, "
        f"and the model has {vocabulary} token embeddings (ids 0 to {vocabulary - 1}); set eos_token in "
        f"{model_dir / 'tokenizer_config.json'} to one of its tokens"
    )
    assert one_error_line(capsys) == expected
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    assert predict_stdin(monkeypatch, model_dir, ["Fresh coffee."]) == 2
    assert one_error_line(capsys) == expected


# ---- data errors name the column, and count rows from 1 ----------------------------------------------------------
@pytest.mark.parametrize(
    "case, expected",
    [
        ("train file without responses", "--response_column 'response' is not in the train data; its columns are: "),
        ("validation file without responses", "--response_column 'response' is not in the validation data; its "),
        (
            "an empty response cell",
            "column 'response' is empty in row 3 of the validation data (rows counted from 1, after the header); "
            "fill it in or drop the row",
        ),
        (
            "an empty string response in JSON lines",  # trained the end of the turn alone, where a CSV's was refused
            "column 'response' is empty in row 2 of the train data",
        ),
        (
            "a number where a prompt belongs",
            "column 'prompt' holds int 7 in row 2 of the train data (rows counted from 1, after the header); texts "
            "must be strings",
        ),
    ],
)
def test_data_errors_name_the_column_and_the_row_counted_from_1(tmp_path, tiny_gpt2_dir, capsys, case, expected):
    data = tmp_path / "data"
    data.mkdir()
    good = write_pairs(data, "csv", "good", ["Fresh coffee.", "Stale tea.", "Tasty."], ["great", "other", "great"])
    train, validation = good, good
    if case == "train file without responses":
        train = data / "prompts.csv"
        train.write_text("prompt\nFresh coffee.\nStale tea.\n")
    elif case == "validation file without responses":
        validation = data / "prompts.csv"
        validation.write_text("prompt\nFresh coffee.\nStale tea.\n")
    elif case == "an empty string response in JSON lines":
        train = data / "quiet.jsonl"
        train.write_text(
            '{"prompt": "Fresh coffee.", "response": "great"}\n{"prompt": "Stale tea.", "response": " "}\n'
        )
        validation = data / "fine.jsonl"
        validation.write_text('{"prompt": "Tasty.", "response": "great"}\n')
    elif case == "an empty response cell":
        validation = data / "gap.csv"
        validation.write_text("prompt,response\nFresh coffee.,great\nStale tea.,other\nTasty.,\n")
    else:
        train = data / "number.jsonl"
        train.write_text('{"prompt": "Fresh coffee.", "response": "great"}\n{"prompt": 7, "response": "other"}\n')
        validation = data / "fine.jsonl"
        validation.write_text('{"prompt": "Tasty.", "response": "great"}\n')
    assert run_app(train_args(tmp_path, tiny_gpt2_dir, train, validation)) == 2
    assert expected in one_error_line(capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "header, row, hint",
    [
        (
            "prompt,completion",
            "Fresh coffee.,great",
            "(prompt/response pairs: --prompt_column prompt --response_column completion)",
        ),
        (
            "prompt,response",
            "Fresh coffee.,great",
            "(prompt/response pairs: --prompt_column prompt --response_column response)",
        ),
        ("messages,source", '"[]",web', "(conversations: --messages_column messages)"),
        (
            "prompt;response",
            "Fresh coffee.;great",
            "(the header holds semicolons: a .csv file is read with commas between its columns; save it "
            "comma-separated, or as .jsonl)",
        ),
    ],
)
def test_a_file_in_trls_formats_without_its_flags_names_them(tmp_path, tiny_gpt2_dir, capsys, header, row, hint):
    # Without a format flag the app reads plain text from --text_column text; trl's files have other column names.
    data = tmp_path / "pairs.csv"
    data.write_text(f"{header}\n{row}\n")
    args = [arg for arg in train_args(tmp_path, tiny_gpt2_dir, data, data) if arg not in PROMPTS]
    assert run_app(args) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: --text_column 'text' is not in the train data") and line.endswith(hint), line


@pytest.mark.parametrize(
    "conversation, expected",
    [
        ("not a list", "a conversation must be a list of {role, content} turns with string values, got str"),
        (
            [{"from": "human", "value": "Fresh?"}, {"from": "gpt", "value": "great"}],
            "found {'from': 'human', 'value': 'Fresh?'} (ShareGPT's {from, value} turns: rename the keys, and human "
            "to user, gpt to assistant)",
        ),
        (  # "Assistant" or "model" for the model's turns
            [{"role": "user", "content": "Fresh?"}, {"role": "Assistant", "content": "great"}],
            "the conversation has no assistant turn (its roles: user, Assistant), so nothing in it would be learned; "
            "the model's turns take the role assistant",
        ),
        ([], "a conversation must be a list of {role, content} turns with string values, got an empty list"),
        (  # a traceback from the chat template's empty prompt before the first assistant turn, exit 1
            [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Fresh?"}],
            "the conversation opens with an assistant turn; start it with a user (or system) turn",
        ),
        (  # trained, without a word, as "answer with nothing"
            [{"role": "user", "content": "Fresh?"}, {"role": "assistant", "content": " "}],
            "assistant turn 2 of the conversation is empty; give it a text, or drop the turn",
        ),
        (  # OpenAI's tool call with a null content
            [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather"}}]},
            ],
            '(a tool call\'s turn: give it the content "" beside its tool_calls)',
        ),
    ],
    ids=["a string", "sharegpt", "no assistant", "empty", "assistant first", "empty answer", "null"],
)
def test_a_conversation_of_another_shape_is_one_line_naming_its_row(
    tmp_path, tiny_llama_dir, capsys, conversation, expected
):
    good = [{"role": "user", "content": "Tasty?"}, {"role": "assistant", "content": "great"}]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": chat}) for chat in (good, conversation)) + "\n")
    args = [arg for arg in train_args(tmp_path, tiny_llama_dir, data, data) if arg not in PROMPTS]
    assert run_app([*args, "--messages_column", "messages"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: row 2 of the train data (rows counted from 1, after the header), column 'messages'")
    assert expected in line, line


def test_a_chat_templates_own_refusal_is_one_line_naming_its_row(tmp_path, tiny_llama_dir, capsys):
    # Mistral's and Gemma's templates raise on roles they do not take: a jinja traceback and exit 1, folders left.
    model = tmp_path / "strict"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    strict = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System roles are not supported') }}{% endif %}"
    )
    config["chat_template"] = strict + config.get("chat_template", "")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)  # where a tokenizer may keep it instead
    good = [{"role": "user", "content": "Tasty?"}, {"role": "assistant", "content": "great"}]
    system = [{"role": "system", "content": "Be brief."}, *good]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": chat}) for chat in (good, good, system)) + "\n")
    args = [arg for arg in train_args(tmp_path, model, data, data) if arg not in PROMPTS]
    assert run_app([*args, "--messages_column", "messages"]) == 2
    assert one_error_line(capsys) == (
        "error: row 3 of the train data (rows counted from 1, after the header), column 'messages': the tokenizer's "
        "chat template refuses the conversation (System roles are not supported); change the conversation, or train "
        "with another template"
    )
    assert not (tmp_path / "out").exists()


def test_predict_says_how_many_prompts_it_cut_from_the_left(untied_gpt2_dir, capsys, monkeypatch):
    lines = ["Fresh coffee.", "word " * 40, "Stale."]
    assert predict_stdin(monkeypatch, untied_gpt2_dir, lines, "--max_length", 16) == 0
    assert (
        "note: 1 of 3 prompts were cut from the left to fit 16 tokens (--max_length 16, within the positions that "
        "--max_new_tokens leaves)"
    ) in capsys.readouterr().err.splitlines()


def test_a_chat_template_that_cannot_be_masked_says_what_to_do(tmp_path, tiny_llama_dir, capsys):
    model = tmp_path / "odd"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    # The prompt's generation header is not how its dialogue renders the answer's turn: no start to mask up to.
    config["chat_template"] = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "pairs.csv"
    pd.DataFrame({"prompt": ["Tasty?", "Fresh?"], "response": ["great", "other"]}).to_csv(data, index=False)
    assert run_app(train_args(tmp_path, model, data, data)) == 2
    assert one_error_line(capsys).endswith(
        "so the response's tokens cannot be told apart; train a model whose template does, or remove chat_template "
        "from its tokenizer_config.json to train on the plain prompt and response"
    )


@pytest.mark.parametrize("prompt", ["a", "s", "user", "assistant", "im_start", "Hello there"])
def test_a_prompt_whose_text_also_stands_in_the_template_is_split_where_the_template_puts_it(tiny_llama_dir, prompt):
    # The first match of the text was taken for the prompt: `a` inside `<|im_start|>`, so the special token was
    # spelled out in characters, in training and in predict.py; a system prompt holding the text did the same.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    system = "You are a helpful AI assistant; a user says hello there."
    tokenizer.chat_template = "<|im_start|>system\n" + system + "<|im_end|>\n" + tokenizer.chat_template
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert (
        Renderer(tokenizer, max_length=64).prompt_ids(prompt) == tokenizer(turn, add_special_tokens=False)["input_ids"]
    )


def test_a_response_that_fills_max_length_keeps_the_template_and_the_prompts_end(tiny_llama_dir):
    # The response took every place but one: the prompt and the whole template went, and the answer was learned from
    # a lone newline token.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    renderer = Renderer(tokenizer, max_length=20)
    prompt, response = "tell me a long story about coffee beans please", "a rather long answer " * 10
    ids, labels, prompt_cut, response_cut = renderer.pair(prompt, response)
    head, text, tail = renderer.prompt_parts(prompt)
    assert len(ids) == 20 and prompt_cut and response_cut
    assert ids[: len(head)] == head and ids[len(head) : len(head) + len(tail) + 1] == text[-1:] + tail
    assert labels[: len(head) + len(tail) + 1] == [IGNORE] * (len(head) + len(tail) + 1)


@pytest.mark.parametrize("prompt", ["", "hello\n", "Great coffee, would buy again. "])
def test_a_long_response_keeps_the_template_of_an_empty_or_trimmed_prompt(tiny_llama_dir, prompt):
    # An empty prompt, or one that a template trims (Llama 3's and Gemma's `content|trim`), was no match in its
    # rendering: the whole rendering was taken for the text, and a long response left a lone newline of it.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    renderer = Renderer(tokenizer, max_length=30)
    head, text, tail = renderer.prompt_parts(prompt)
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert head + text + tail == tokenizer(turn, add_special_tokens=False)["input_ids"]
    assert head and tail and text == tokenizer(prompt.strip(), add_special_tokens=False)["input_ids"]
    ids, labels, _, response_cut = renderer.pair(prompt, "a rather long answer " * 10)
    assert response_cut and ids[: len(head)] == head and ids[len(head) + min(len(text), 1) :][: len(tail)] == tail


def test_responses_cut_at_their_end_say_their_prompts_kept_one_token(tmp_path, tiny_llama_dir, capsys):
    # "prompts were cut from the left" and "ends were cut": it did not say that the prompts kept one token, that the
    # responses were learned with next to no context.
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": f"What is {i} plus {i}?", "response": "four " * 60} for i in range(4)]
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    assert run_app(train_args(tmp_path, tiny_llama_dir, data, data)) == 0
    assert (
        "note: 4 of 4 train examples: responses were cut at their end, their prompts to the template and one token, "
        "to fit --max_length 32"
    ) in capsys.readouterr().out


def test_a_jsonl_column_of_mixed_types_is_refused_not_read_as_json(tmp_path, tiny_llama_dir, capsys):
    # datasets typed the column Json and decoded its strings: "true" was True, "0042" 42, "null" None, and the error
    # named row 1 ("holds bool True"), whose value is the string "true"; the culprit, 7, is in row 4.
    data = tmp_path / "mixed.jsonl"
    rows = [("a", "true"), ("b", "0042"), ("c", "null"), ("f", 7)]
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in rows))
    assert run_app(train_args(tmp_path, tiny_llama_dir, data, data)) == 2
    assert one_error_line(capsys) == (
        f"error: {data}: column 'response' mixes strings and other values, and datasets reads its strings as JSON "
        "(row 1's 'true' as True); 7 in row 4 is int; write every value of it as a string"
    )


def test_a_column_of_mixed_types_that_the_run_does_not_read_is_left_alone(tmp_path, tiny_llama_dir):
    # Refused for every column: an id column of "0042" and 7 stopped a run, and predict.py, that never read it.
    data = tmp_path / "ids.jsonl"
    rows = [{"prompt": "a", "response": "b", "id": "0042"}, {"prompt": "c", "response": "d", "id": 7}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert run_app(train_args(tmp_path, tiny_llama_dir, data, data)) == 0


def test_a_tool_calls_turn_trains_where_the_template_renders_it_and_is_refused_where_it_does_not(
    tmp_path, tiny_llama_dir, capsys
):
    # A tool call's turn ("" beside its tool_calls) under a template that drops them was learned as an empty answer;
    # refused outright for a while, though Qwen2.5's and Llama 3.1's templates render the call and train it.
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(4)))
    renders = tmp_path / "renders-calls"
    shutil.copytree(tiny_llama_dir, renders)
    template = renders / "chat_template.jinja"  # where transformers 5 saves a tokenizer's template
    template.write_text(
        template.read_text().replace(
            "{{ message['content'] }}",
            "{{ message['content'] }}{% if message['tool_calls'] %}<tool_call>{{ message['tool_calls'][0]['function']"
            "['name'] }}</tool_call>{% endif %}",
        )
    )
    assert "<tool_call>" in template.read_text()
    for model, code in ((renders, 0), (tiny_llama_dir, 2)):  # the fixture's ChatML drops tool_calls
        args = [arg for arg in train_args(tmp_path / model.name, model, data, data) if arg not in PROMPTS]
        assert run_app([*args, "--messages_column", "messages"]) == code
    assert one_error_line(capsys).endswith(
        "column 'messages': assistant turn 2 is a tool call that the chat template does not render, so it would be "
        "learned as an empty answer; train with a template that renders tool_calls, or drop such turns and the "
        "tools' replies"
    )


def test_two_data_formats_at_once_are_refused_with_each_flag_named():
    # --text_column beside --messages_column was told "--messages_column alone, or --prompt_column with
    # --response_column", which named neither way to keep the plain text.
    from app.config import TrainConfig
    from app.errors import UsageError
    from app.tasks.lm_data import resolve_columns

    for extra in ({"text_column": "text"}, {"prompt_column": "q"}):
        with pytest.raises(UsageError) as refused:
            resolve_columns(TrainConfig(task="causal_lm", train_file="sft.jsonl", messages_column="messages", **extra))
        assert str(refused.value) == (
            "give --messages_column alone, or --prompt_column with --response_column, or --text_column: one format"
        )
