"""--gguf_file: a model that ships as a GGUF file is converted once into the cache, through a staging folder, and
the conversion is the model that transformers reads from the file, without its quantized flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.inputs import gguf
from tests import forked
from tests.conftest import clean_env, run_app
from tests.lm_models import save_tiny_gguf


@pytest.fixture
def tiny_gguf(tmp_path, review_texts, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return save_tiny_gguf(tmp_path / "model", review_texts)


def test_the_conversion_is_the_files_model_and_is_made_once(tiny_gguf, tmp_path):
    folder, name = str(tiny_gguf.parent), tiny_gguf.name
    target = gguf.converted_folder(folder, name)
    assert target.parent == tmp_path / "cache" / "amp-trainer" / "gguf"
    said = []
    assert gguf.convert(folder, name, target, said.append) == target
    assert len(said) == 1 and said[0].startswith(f"converting {name} to a model folder in {target}")
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    assert (target / "model.safetensors").stat().st_mode & 0o777 == 0o644

    from_file = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(target).eval()
    assert getattr(from_file, "is_quantized", False) and not getattr(converted, "is_quantized", False)
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    with torch.no_grad():
        assert torch.equal(from_file(ids).logits, converted(ids).logits)

    assert gguf.convert(folder, name, target, said.append) == target
    assert len(said) == 1, "the second run loads the cache"
    changed = tiny_gguf.read_bytes() + b"\0"
    tiny_gguf.write_bytes(changed)
    assert gguf.converted_folder(folder, name) != target, "another file's bytes, another cache entry"


@pytest.mark.slow
def test_two_runs_converting_at_once_leave_one_complete_folder(tiny_gguf):
    folder, name = str(tiny_gguf.parent), tiny_gguf.name
    target = gguf.converted_folder(folder, name)
    script = tiny_gguf.parents[1] / "convert.py"
    script.write_text(
        "from pathlib import Path\nfrom app.inputs import gguf\n"
        f"print(gguf.convert({folder!r}, {name!r}, Path({str(target)!r}), print))\n"
    )
    env = clean_env(tiny_gguf.parent, XDG_CACHE_HOME=str(target.parents[2]))
    # Two processes of their own, forked from the suite's server (tests/forked.py): torch is imported already.
    racers = [forked.popen([sys.executable, script], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    outputs = [racer.communicate(timeout=240) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), [err[-2000:] for _, err in outputs]
    assert all(out.strip().endswith(str(target)) for out, _ in outputs)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], "no staging folder is left"
    assert AutoModelForCausalLM.from_pretrained(target) is not None


def test_a_missing_gguf_file_is_one_line_and_exit_2(tmp_path, tiny_gguf, capsys):
    args = ["--model_name_or_path", tiny_gguf.parent, "--gguf_file", "nope.gguf", "--output_dir", tmp_path / "out"]
    assert run_app([*args, "--logdir", tmp_path / "runs", "--task", "causal_lm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --gguf_file nope.gguf: no such file in {tiny_gguf.parent}"]
    assert run_app(["--gguf_file", "x.gguf"]) == 2
    assert "--gguf_file needs --model_name_or_path" in capsys.readouterr().err
    (tiny_gguf.parent / "fake.gguf").write_text("not a GGUF file")
    args[args.index("nope.gguf")] = "fake.gguf"
    assert run_app([*args, "--logdir", tmp_path / "runs", "--task", "causal_lm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gguf_file fake.gguf cannot be read:"), err


def gguf_run(tmp_path, tiny_gguf, review_files) -> list:
    """A causal-LM run of the GGUF file on the review files, writing under tmp_path."""
    return [
        *("--model_name_or_path", tiny_gguf.parent, "--gguf_file", tiny_gguf.name, "--task", "causal_lm"),
        *("--train_file", review_files["train"], "--validation_file", review_files["validation"]),
        *("--prompt_column", "text", "--response_column", "label", "--max_length", 48, "--max_steps", 1),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--disable_tqdm"),
    ]


def test_a_gguf_file_cut_inside_its_header_is_one_line_and_exit_2(tmp_path, tiny_gguf, review_files, capsys):
    data = tiny_gguf.read_bytes()
    for size in (4, 100, 3000):  # in the fixed header, in the metadata, in the tensor descriptions
        tiny_gguf.write_bytes(data[:size])
        assert run_app(gguf_run(tmp_path, tiny_gguf, review_files)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: --gguf_file {tiny_gguf.name} cannot be read: the file ends inside its header, at byte {size}: "
            "it was cut short; copy or download it again"
        ], err
        assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def cache_case(tmp_path, case: str):
    """A conversion cache that cannot be written: a file where its folder would go, or a read-only filesystem."""
    if case == "a file in the way":
        (tmp_path / "cache-file").write_text("not a folder")
        return tmp_path / "cache-file" / "cache", f"{tmp_path / 'cache-file'} is a file"
    mount = tmp_path / "read-only"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {made.stderr.decode().strip()}")
    return mount, f"{mount} is on a read-only filesystem"


@pytest.mark.parametrize("case", ["a file in the way", "a read-only filesystem"])
def test_a_cache_that_cannot_be_written_is_one_line_and_exit_2_before_the_conversion(
    tmp_path, tiny_gguf, review_files, capsys, monkeypatch, case
):
    cache, why = cache_case(tmp_path, case)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    try:
        code = run_app(gguf_run(tmp_path, tiny_gguf, review_files))
    finally:
        if case == "a read-only filesystem":
            subprocess.run(["umount", "-l", str(cache)], check=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"error: the cache for converted GGUF models, {cache / 'amp-trainer' / 'gguf'}, cannot be written: {why}; "
        "set XDG_CACHE_HOME to a folder you can write"
    ], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_predict_refuses_adapters_whose_gguf_file_changed_since_training(tiny_gguf, tmp_path, review_files, capsys):
    # A user's GGUF file replaced after training: predict.py converted the new file, merged the adapters into it and
    # generated garbage with exit 0 (the fingerprint is of the cache's conversion, compared for user folders only).
    from app.predict import main as predict

    folder = tiny_gguf.parent
    args = [
        *("--model_name_or_path", folder, "--gguf_file", tiny_gguf.name, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--prompt_column", "text", "--response_column", "label"),
        *("--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--max_length", 48, "--max_steps", 2),
        *("--use_peft", "--mixed_precision", "no", "--disable_tqdm", "--eval_steps", 0),
    ]
    assert run_app(args) == 0
    record = json.loads((tmp_path / "out" / "adapter_base.json").read_text())
    assert record["gguf_conversion"] == gguf.converted_folder(str(folder), tiny_gguf.name).name
    # The card's transformers-and-peft recipe would load the base without its GGUF file: predict.py's line alone
    card = (tmp_path / "out" / "README.md").read_text()
    assert "PeftModel" not in card
    assert (
        f"the GGUF file {tiny_gguf.name}, dequantized to float32, not the weights of the model's other copies" in card
    )
    flags = ["Fresh coffee.", "--model_name_or_path", str(tmp_path / "out"), "--mixed_precision", "no"]
    assert predict([*flags, "--max_new_tokens", "2"]) == 0
    tiny_gguf.write_bytes(tiny_gguf.read_bytes() + b"\0")
    capsys.readouterr()
    assert predict([*flags, "--max_new_tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        f"error: {tmp_path / 'out'} holds adapters trained on another version of their base's GGUF "
    ), err
    assert not gguf.converted_folder(str(folder), tiny_gguf.name).exists(), "refused before converting the new file"


def test_the_embedded_language_model_is_a_gguf_base_and_its_card_says_so():
    # Its card named the hub's SmolLM2 and gave peft's recipe for it: adapters trained on the Q4_1 file's dequantized
    # weights, put on other weights without a word.
    from app.config import TrainConfig
    from app.inputs.model import gguf_base
    from app.storage.model_card import base_source

    assert gguf_base(TrainConfig(task="causal_lm")) == gguf.EMBEDDED_LM_FILE == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert base_source(TrainConfig(task="causal_lm")) == (
        " (embedded, loaded offline: the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32, not the "
        "weights of the model's other copies)"
    )
    assert gguf_base(TrainConfig()) is None and base_source(TrainConfig()) == " (embedded, loaded offline)"
    assert gguf_base(TrainConfig(task="causal_lm", model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")) is None
