"""What a run prints besides its own lines (app/telemetry/console.py): the libraries' routine notices stay out of the
console unless --verbose asks for them, and what matters among them is said once in the app's words.

The notices: transformers' load report table (a new classification head), Accelerate's "Removed shared tensor" at
every checkpoint of a model with tied weights, and transformers' "`torch_dtype` is deprecated!", which came from the
app's own fp16 pre-flight. Read here as the console would show them: the process's stdout and stderr (capfd), and
every log record that reaches the root logger's handlers (caplog; in a plain process logging's last-resort handler
prints those on stderr), transformers' records included, which it sends to its own handler alone unless told to
propagate them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers.utils import logging as transformers_logging

from tests.conftest import run_app
from tests.test_lm_inputs import edited_copy, predict_stdin

LOAD_REPORT = "LOAD REPORT"
SHARED_TENSOR = "Removed shared tensor {'lm_head.weight'} while saving"
TORCH_DTYPE = "`torch_dtype` is deprecated!"


@pytest.fixture(autouse=True)
def library_records_reach_the_root_logger():
    transformers_logging.enable_propagation()
    transformers_logging.warning_once.cache_clear()  # a warning said once per process may have been said already
    yield
    transformers_logging.disable_propagation()


def console_of(capfd, caplog, args: list) -> str:
    code = run_app(args)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    return out + err + caplog.text


@pytest.mark.parametrize("verbose", [False, True])
def test_a_new_classification_head_is_said_in_one_line_and_the_load_report_only_with_verbose(
    quick_args, capfd, caplog, verbose
):
    args = [*quick_args, "--max_steps", "1", "--eval_steps", "0", *(["--verbose"] * verbose)]
    console = console_of(capfd, caplog, args)
    assert "new classification head: classifier.weight, classifier.bias (initialised at random)\n" in console
    assert (LOAD_REPORT in console) == verbose, console
    if not verbose:  # a resume loads the head from its checkpoint: the line said only "initialised at random"
        resumed = console_of(capfd, caplog, [*args, "--max_steps", "2", "--resume_from_checkpoint", "latest"])
        checkpoint = Path(quick_args[quick_args.index("--output_dir") + 1]) / "checkpoints" / "step-1"
        assert (
            "new classification head: classifier.weight, classifier.bias (initialised at random), then loaded from "
            f"{checkpoint}\n"
        ) in resumed, resumed


@pytest.mark.parametrize("verbose", [False, True])
def test_checkpoints_of_tied_weights_and_the_fp16_preflight_add_no_notices(
    tmp_path, tiny_llama_dir, review_files, capfd, caplog, verbose
):
    """A tied Llama (as SmolLM2) checkpointed at every step, in fp16, from a config that names no dtype (as many
    older checkpoints): the pre-flight reads the stored dtype, where it once asked for `torch_dtype`."""
    model_dir = edited_copy(tiny_llama_dir, tmp_path / "no-dtype", config={"dtype": None})
    args = [
        *("--model_name_or_path", model_dir, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--prompt_column", "text", "--response_column", "label"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--max_length", 48, "--disable_tqdm"),
        *("--max_steps", 2, "--save_steps", 1, "--eval_steps", 0, "--amp", *(["--verbose"] * verbose)),
    ]
    console = console_of(capfd, caplog, args)
    assert "amp pre-flight: clean" in console
    assert (SHARED_TENSOR in console) == verbose, console
    assert TORCH_DTYPE not in console, "the app's own call is gone: not even --verbose shows it"


@pytest.mark.parametrize("verbose", [False, True])
def test_predict_says_which_weights_the_checkpoint_lacked(
    tmp_path, tiny_llama_dir, capfd, caplog, monkeypatch, verbose
):
    model_dir = tmp_path / "lacking"
    shutil.copytree(tiny_llama_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    assert predict_stdin(monkeypatch, model_dir, ["Fresh coffee."], *(["--verbose"] * verbose)) == 0
    out, err = capfd.readouterr()
    assert "weights missing from the checkpoint: model.norm.weight (initialised at random)\n" in err
    assert (LOAD_REPORT in caplog.text) == verbose, caplog.text


def test_predict_refuses_a_model_whose_checkpoint_lacks_its_head(tmp_path, tiny_llama_dir, capfd, monkeypatch):
    # An LM head of its own (not tied to the embeddings) that the weight files lack: made at random, it generated
    # at random with exit 0, after the note above.
    model_dir = tmp_path / "headless"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors"), "saved tied: no head of its own"
    capfd.readouterr()
    assert predict_stdin(monkeypatch, model_dir, ["Fresh coffee."]) == 2
    assert capfd.readouterr().err.endswith(
        f"error: {model_dir} lacks the weights of its trained head (lm_head.weight): made at random, they would "
        "predict at random; copy the whole output folder again, or give a model saved with its head\n"
    )


@pytest.mark.parametrize("verbose", [False, True])
def test_adapters_go_on_without_a_deprecation_notice_unless_verbose(quick_args, capfd, caplog, recwarn, verbose):
    """peft probes `is_gradient_checkpointing` whenever it wraps a model, which transformers answers with a
    FutureWarning addressed to whoever wrote that call: not the user."""
    args = [*quick_args, "--use_peft", "--max_steps", "1", "--eval_steps", "0", *(["--verbose"] * verbose)]
    console_of(capfd, caplog, args)
    deprecated = [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]
    assert bool(deprecated) == verbose, [str(w.message) for w in recwarn]


def test_gradient_checkpointing_and_generation_add_no_notices(
    tmp_path, quick_args, tiny_gpt2_dir, review_files, capfd, caplog
):
    # transformers warned that BERT's use_cache was turned off for checkpointing, and, at every evaluation of a causal
    # LM with prompts, that a generation config came with generation arguments.
    console = console_of(
        capfd, caplog, [*quick_args, "--gradient_checkpointing", "--max_steps", "1", "--eval_steps", "0"]
    )
    assert "use_cache" not in console, console
    lm = [
        *("--model_name_or_path", tiny_gpt2_dir, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--prompt_column", "text", "--response_column", "label"),
        *("--output_dir", tmp_path / "lm", "--logdir", tmp_path / "runs", "--max_length", 48, "--disable_tqdm"),
        *("--max_steps", 1, "--max_eval_samples", 4, "--mixed_precision", "no"),
    ]
    console = console_of(capfd, caplog, lm)
    assert "eval/exact_match" in console or "exact match" in console, console
    assert "generation_config" not in console and "[transformers]" not in console, console


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_the_weight_loading_bar_follows_disable_tqdm(quick_args, capfd, caplog, disable_tqdm):
    # transformers' "Loading weights" bar came through --disable_tqdm, once per rank under a launch.
    args = [arg for arg in quick_args if arg != "--disable_tqdm"] + ["--disable_tqdm"] * disable_tqdm
    console = console_of(capfd, caplog, [*args, "--max_steps", "1", "--eval_steps", "0"])
    assert ("Loading weights" in console) != disable_tqdm, console
