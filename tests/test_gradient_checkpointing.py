"""--gradient_checkpointing changes memory, not the training: a model with dropout trains to the same weights, bit for
bit, with either kind of CPU dropout masks (app/host/dropout.py), one rank or two.

The references are the same runs without checkpointing; each pair differs in that flag alone.
"""

from __future__ import annotations

import json

import pytest
import torch

import app.host.dropout
from app.host.dropout import DropoutMasks
from tests import forked, harness
from tests.conftest import ACCELERATE, ROOT, clean_env, free_port, save_tiny_bert
from tests.lm_models import save_tiny_llama
from tests.test_causal_lm_runs import lm_run_options

MASKS = {True: DropoutMasks.SFC64, False: DropoutMasks.TORCH}  # --fast_cpu_dropout -> the masks a run draws


@pytest.fixture(scope="module")
def bert_hidden_dropout_only(tmp_path_factory) -> object:
    """Dropout on hidden states only: no attention dropout, so no path through SDPA's math kernel."""
    from transformers import AutoConfig

    path = save_tiny_bert(tmp_path_factory.mktemp("bert-hidden-dropout"), dropout=0.1)
    config = AutoConfig.from_pretrained(path)
    config.attention_probs_dropout_prob = 0.0
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_attention_dropout(tmp_path_factory, review_texts) -> object:
    """A decoder whose only dropout is attention dropout, inside SDPA."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama-attention-dropout"), review_texts, dropout=0.1)


CASES = {  # the model's fixture and what the runs train with besides the defaults
    "bert, hidden and attention dropout": ("tiny_model_dir", {}),
    "bert, hidden dropout only": ("bert_hidden_dropout_only", {}),
    "bert in fp16 autocast": ("tiny_model_dir", {"mixed_precision": "fp16"}),
    "llama, attention dropout": ("llama_attention_dropout", lm_run_options(max_length=48)),
}


def checkpointing_on(model) -> bool:
    on = getattr(model, "is_activation_checkpointing", None)  # transformers' newer name; older 5.x: the old one
    return model.is_gradient_checkpointing if on is None else on


@pytest.mark.parametrize("fast_cpu_dropout", [True, False], ids=["sfc64 masks", "torch masks"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_checkpointing_trains_bitwise_the_weights_of_a_run_without_it(
    case, fast_cpu_dropout, request, review_files, monkeypatch
):
    monkeypatch.setattr(app.host.dropout, "intel_cpu", lambda: False)  # where the flag picks the SFC64 masks
    fixture, options = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    final = {}
    for checkpointing in (False, True):
        run = harness.build_training(
            model_dir,
            review_files,
            **{"mixed_precision": "no"} | options,
            max_steps=3,
            gradient_checkpointing=checkpointing,
            fast_cpu_dropout=fast_cpu_dropout,
        )
        assert run.masks == MASKS[fast_cpu_dropout]
        assert checkpointing_on(run.model) == checkpointing
        harness.train(run)
        final[checkpointing] = {k: v.clone() for k, v in run.model.state_dict().items()}
    for name, value in final[False].items():
        off = (final[True][name] - value).abs().max().item()
        assert torch.equal(final[True][name], value), f"{name}: {off:.3g} off"


@pytest.mark.slow
def test_two_ranks_train_bitwise_the_weights_of_two_ranks_without_it(
    tmp_path, tiny_model_dir, llama_attention_dropout, review_files
):
    """One real launch of two processes: the classifier and the decoder, each mask kind, with and without."""
    models = {"bert": (tiny_model_dir, {}), "llama": (llama_attention_dropout, lm_run_options(max_length=48))}
    runs = {
        f"{model}-{MASKS[fast].value}-{checkpointing}": {
            "model_dir": str(model_dir),
            "options": options
            | dict(mixed_precision="no", max_steps=3, gradient_checkpointing=checkpointing, fast_cpu_dropout=fast),
        }
        for model, (model_dir, options) in models.items()
        for fast in (True, False)
        for checkpointing in (False, True)
    }
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps({"files": {k: str(v) for k, v in review_files.items()}, "runs": runs}))
    launcher = [ACCELERATE, "launch", "--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml"]
    cmd = [*launcher, "--main_process_port", free_port(), ROOT / "tests" / "workers" / "train_runs.py", spec, tmp_path]
    result = forked.run(cmd, env=clean_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in (0, 1)]
    assert [saved["world"] for saved in ranks] == [2, 2]
    for saved in ranks:
        for name, run in saved["runs"].items():
            assert run["masks"] == name.split("-")[1] and run["model_flag"] == name.endswith("True"), name
        for name, run in saved["runs"].items():
            if name.endswith("True"):
                plain = saved["runs"][name.removesuffix("True") + "False"]["params"]
                for param, value in run["params"].items():
                    assert torch.equal(value, plain[param]), f"{name}, {param}"
    for name, run in ranks[0]["runs"].items():  # data parallel: both ranks hold the same weights
        for param, value in run["params"].items():
            assert torch.equal(value, ranks[1]["runs"][name]["params"][param]), f"{name}, {param}"
