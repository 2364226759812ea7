"""LoRA adapters on a frozen half-precision base (app/adapters/): the classic fp16 failure made impossible, what trains
in which dtype, checkpoints that hold the adapters, resumes that must fit, and the output folder that predict.py and
peft load.

Tiny models built from configs (tests/conftest.py, tests/lm_models.py); the app's real main() in this process.
"""

from __future__ import annotations

import io
import json
import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from app.storage.checkpoints import STATE_FILE
from app.telemetry import tags
from tests import harness, tb
from tests.conftest import OVERFLOWING, data_flags, run_app, save_tiny_bert

RUN = ["--max_steps", "6", "--save_steps", "3", "--eval_steps", "0", "--logging_steps", "3"]


def lora_args(tmp_path: Path, model: Path, files: dict, name: str = "out", *extra) -> list:
    return [
        *data_flags(model, files),
        "--output_dir",
        tmp_path / name,
        "--logdir",
        tmp_path / "runs",
        "--run_name",
        name,
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "64",
        "--disable_tqdm",
        "--use_peft",
        *extra,
    ]


def trained_on_a_relative_base(tiny_model_dir: Path, review_files: dict, tmp_path: Path, monkeypatch) -> Path:
    """The output folder of a LoRA run given its base as `base`, a folder in tmp_path, the working directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, "base")
    assert run_app([*lora_args(tmp_path, Path("base"), review_files), *RUN, "--mixed_precision", "no"]) == 0
    return tmp_path / "out"


def stored(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)


def test_the_classic_fp16_failure_and_the_app_on_the_same_fp16_base(tiny_model_dir, review_files, tmp_path, capsys):
    # The plain way, as peft users meet it: an fp16 base, peft's copy of the new head to train in full, a GradScaler.
    from peft import LoraConfig, get_peft_model

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2, dtype=torch.float16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(1000, 2000, (2, 8))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1])).loss
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(optimizer)

    # The app, on the same base stored in float16 (--dtype auto under --amp): it trains, its head in float32.
    run = harness.build_training(tiny_model_dir, review_files, amp=True, use_peft=True, max_steps=4)
    frozen = {p.dtype for p in run.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in run.model.parameters() if p.requires_grad}
    harness.train(run)
    assert frozen == {torch.float16} and trained == {torch.float32}
    assert run.state.opt_step == 4 and run.state.applied_updates >= 1
    head = [n for n, p in run.model.named_parameters() if p.requires_grad and "classifier" in n]
    assert head, "the new head trains in full"


def test_the_first_lines_say_what_is_frozen_and_what_trains_and_tensorboard_gets_the_counts(
    tiny_model_dir, review_files, tmp_path, capsys
):
    assert run_app([*lora_args(tmp_path, tiny_model_dir, review_files), "--amp", *RUN]) == 0
    out = capsys.readouterr().out
    estimate = next(line for line in out.splitlines() if line.startswith("memory, estimated before loading"))
    adapters = next(line for line in out.splitlines() if line.startswith("adapters: LoRA r=16"))
    frozen = next(line for line in out.splitlines() if line.startswith("frozen base"))
    assert out.index(estimate) < out.index(adapters) < out.index("training: SIGTERM")
    assert "on 13 layers (all-linear:" in adapters and "trained in full: classifier" in adapters
    assert "in float16" in frozen and "trained in float32" in frozen
    # The counts against the model itself, built as the app builds it.
    run = harness.build_training(tiny_model_dir, review_files, amp=True, use_peft=True, max_steps=1)
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    base_bytes = sum(p.numel() * p.element_size() for p in run.model.parameters() if not p.requires_grad)
    run.close()
    # r x (in + out) on 12 encoder layers of 32 -> 32/64 and the pooler, plus the new head trained in full (2 x 32 + 2)
    expected = 16 * (8 * (32 + 32) + 2 * (32 + 64) + 2 * (64 + 32)) + 16 * (32 + 32) + (2 * 32 + 2)
    assert trainable == expected
    logged = tb.scalars(tmp_path / "runs" / "out")
    assert logged[tags.MODEL_TRAINABLE_PARAMS] == {0: trainable}
    estimate_gib = logged[tags.MEMORY_ESTIMATE_GIB][0]
    # the estimate: the frozen weights as stored, and 16 bytes for each trained parameter (weight, gradient, AdamW)
    assert estimate_gib * 2**30 == pytest.approx(base_bytes + 16 * trainable, rel=1e-6)
    assert "estimated at start:" in out.split("run summary")[1]


def test_checkpoints_hold_the_adapters_and_a_resume_is_bitwise(tiny_model_dir, review_files, tmp_path, capsys):
    whole = lora_args(tmp_path, tiny_model_dir, review_files, "whole", "--amp")
    assert run_app([*whole, *RUN]) == 0
    step_3 = tmp_path / "whole" / "checkpoints" / "step-3"
    resumed = lora_args(tmp_path, tiny_model_dir, review_files, "resumed", "--amp")
    assert run_app([*resumed, *RUN, "--resume_from_checkpoint", step_3]) == 0

    with safe_open(step_3 / "model.safetensors", "pt") as saved:
        names = list(saved.keys())
    assert names and all("lora_" in n or "modules_to_save" in n for n in names), names  # no frozen base weight
    record = json.loads((step_3 / STATE_FILE).read_text())["adapters"]
    assert record["r"] == 16 and len(record["target_modules"]) == 13 and record["modules_to_save"] == ["classifier"]
    a = stored(tmp_path / "whole" / "adapter_model.safetensors")
    b = stored(tmp_path / "resumed" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "change, expected",
    [
        (["--lora_r", "8"], "holds adapters of another shape (--lora_r 16): resume with the same --lora_r"),
        (
            ["--lora_target_modules", "query"],
            "(--lora_target_modules on 13 modules, bert.encoder.layer.0.attention.self.key among them)",
        ),
        ([], "holds LoRA adapters: resume with --use_peft"),
    ],
)
def test_a_resume_that_does_not_fit_the_adapters_is_one_line(
    tiny_model_dir, review_files, tmp_path, capsys, change, expected
):
    args = lora_args(tmp_path, tiny_model_dir, review_files)
    assert run_app([*args, *RUN[:1], "3", *RUN[2:]]) == 0
    if not change:  # the same run without --use_peft
        args = [a for a in args if a != "--use_peft"]
    capsys.readouterr()
    assert run_app([*args, *change, *RUN, "--resume_from_checkpoint", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_a_resume_naming_the_same_targets_in_another_order_fits(tiny_model_dir):
    # `--lora_target_modules value query` was refused for adapters saved with `query value`: "another shape (on 4
    # modules)", though both adapt the same 4 layers.
    from transformers import AutoConfig

    from app.adapters.lora import plan_adapters
    from app.adapters.plan import ModelPlan, check_resume
    from app.config import TrainConfig
    from app.errors import UsageError

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model_dir))

    def plan(*targets: str) -> ModelPlan:
        adapters = plan_adapters(TrainConfig(use_peft=True, lora_target_modules=list(targets)), model, [], True)
        return ModelPlan(torch.float32, "", adapters, "base", None, "sequence_classification")

    saved = plan("query", "value").record()
    check_resume(saved, plan("value", "query"), Path("step-3"), model)
    with pytest.raises(UsageError, match=r"\(--lora_target_modules on 4 modules, not bert.encoder.layer.0.attention"):
        check_resume(saved, plan("query", "value", "key"), Path("step-3"), model)


def test_a_full_model_checkpoint_or_another_base_is_refused(tiny_model_dir, review_files, tmp_path, capsys):
    full = [a for a in lora_args(tmp_path, tiny_model_dir, review_files, "full") if a != "--use_peft"]
    assert run_app([*full, *RUN[:1], "3", *RUN[2:]]) == 0
    capsys.readouterr()
    assert run_app([*full, "--use_peft", *RUN, "--resume_from_checkpoint", "latest"]) == 2
    assert "holds a full fine-tune, not adapters" in capsys.readouterr().err

    args = lora_args(tmp_path, tiny_model_dir, review_files)
    assert run_app([*args, *RUN[:1], "3", *RUN[2:]]) == 0
    other = tmp_path / "other-base"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).bert
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.mul_(1.01)  # the same shapes, other weights
    model.save_pretrained(other)
    for file in tiny_model_dir.glob("tokenizer*"):
        (other / file.name).write_bytes(file.read_bytes())
    capsys.readouterr()
    moved = [other if a == tiny_model_dir else a for a in args]
    assert run_app([*moved, *RUN, "--resume_from_checkpoint", "latest"]) == 2
    assert "holds adapters of another base model" in capsys.readouterr().err


def test_the_output_folder_loads_in_peft_and_predicts_with_the_trained_adapters(
    tiny_model_dir, review_files, tmp_path, capsys
):
    from peft import PeftModel

    from app.predict import main as predict

    assert run_app([*lora_args(tmp_path, tiny_model_dir, review_files), "--amp", *RUN, "--save_merged_model"]) == 0
    out = tmp_path / "out"
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir) and adapter["task_type"] == "SEQ_CLS"
    assert "base_model:" in (out / "README.md").read_text()

    # Loaded as any peft user would: the base, then the adapters on it.
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged").eval()
    assert merged.dtype == torch.float32
    # The run's config beside it: what predict.py takes --max_length from.
    assert (out / "merged" / "training_args.yaml").read_text() == (out / "training_args.yaml").read_text()
    text = "Great coffee, fresh and strong. Will buy again."
    ids = AutoTokenizer.from_pretrained(out)(text, return_tensors="pt")
    with torch.no_grad():
        expected = peft_model(**ids).logits.softmax(-1)[0]
        torch.testing.assert_close(merged(**ids).logits.softmax(-1)[0], expected, rtol=0, atol=1e-5)
    capsys.readouterr()
    assert predict([text, "--model_name_or_path", str(out), "--mixed_precision", "no"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    label, probability = row.rsplit(",", 2)[-2:]
    assert label == merged.config.id2label[int(expected.argmax())]
    assert float(probability) == pytest.approx(float(expected.max()), abs=1e-5)

    # As a model to fine-tune, the folder is one line that names the merged model and the base.
    again = lora_args(tmp_path, out, review_files, "again")[:-1]  # without --use_peft
    assert run_app([*again, *RUN]) == 2
    assert capsys.readouterr().err == (
        f"error: --model_name_or_path {out} holds LoRA adapters, not a model: fine-tune {out / 'merged'}, or the base "
        f"{tiny_model_dir} (with --use_peft for new adapters); to train these adapters on, resume their run with "
        "--resume_from_checkpoint\n"
    )
    # peft's own layout (save_pretrained of a PeftModel, as on the hub) has no config.json: the same line.
    peft_only = tmp_path / "peft-only"
    peft_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, peft_only / name)
    assert run_app([*lora_args(tmp_path, peft_only, review_files, "peft")[:-1], *RUN]) == 2
    assert "holds LoRA adapters, not a model: fine-tune the merged model" in capsys.readouterr().err
    # Its base named nowhere (no training_args.yaml, an adapter_config.json without it): predict.py loaded the
    # embedded default model as the base.
    nameless = tmp_path / "nameless"
    shutil.copytree(out, nameless, ignore=shutil.ignore_patterns("training_args.yaml", "merged"))
    adapter_config = json.loads((nameless / "adapter_config.json").read_text())
    del adapter_config["base_model_name_or_path"]
    (nameless / "adapter_config.json").write_text(json.dumps(adapter_config))
    assert predict([text, "--model_name_or_path", str(nameless), "--mixed_precision", "no"]) == 2
    assert capsys.readouterr().err.endswith(
        f"adapter_config.json names no base model (base_model_name_or_path) and {nameless} holds no "
        "training_args.yaml: restore one of them\n"
    )
    # A damaged training_args.yaml, with --max_length given (which predict.py then needs not read from it): the base
    # comes from adapter_config.json, where it was a YAML traceback.
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged, ignore=shutil.ignore_patterns("merged"))
    (damaged / "training_args.yaml").write_text("max_length: [64\n")
    assert predict([text, "--model_name_or_path", str(damaged), "--max_length", "64", "--mixed_precision", "no"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].split(",")[-2] == label


def test_the_adapters_name_a_relative_base_by_its_absolute_path(tiny_model_dir, monkeypatch):
    # predict.py, or peft, run from another working directory would find another folder, or none.
    from app.config import TrainConfig
    from app.inputs.model import portable_name

    monkeypatch.chdir(tiny_model_dir.parent)
    assert portable_name(TrainConfig(model_name_or_path=tiny_model_dir.name)) == str(tiny_model_dir.resolve())
    assert portable_name(TrainConfig(model_name_or_path="owner/model")) == "owner/model"  # a hub id as given


def test_predict_finds_a_relative_base_from_another_working_directory(
    tiny_model_dir, review_files, tmp_path, monkeypatch, capsys
):
    # A folder saved before training_args.yaml recorded local paths absolute names the base as given, "tiny-bert0":
    # from another directory predict.py took it for a hub id, retried the hub for two minutes, and failed;
    # adapter_config.json names the folder it was.
    from app.adapters.trained import base_folder

    monkeypatch.chdir(tiny_model_dir.parent)
    args = lora_args(tmp_path, Path(tiny_model_dir.name), review_files)
    assert run_app([*args, *RUN, "--mixed_precision", "no"]) == 0
    out = tmp_path / "out"
    recorded = out / "training_args.yaml"
    assert yaml.safe_load(recorded.read_text())["model_name_or_path"] == str(tiny_model_dir.resolve())
    recorded.write_text(recorded.read_text().replace(str(tiny_model_dir.resolve()), tiny_model_dir.name))  # as before
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert base_folder(str(out), print, {}) == str(tiny_model_dir.resolve())
    from app.predict import main as predict

    capsys.readouterr()
    assert predict(["Fresh coffee.", "--model_name_or_path", str(out), "--mixed_precision", "no"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("Fresh coffee.,")


def test_a_lora_run_on_a_relative_base_resumes_from_another_working_directory_with_its_training_args(
    tiny_model_dir, review_files, tmp_path, monkeypatch, capsys
):
    # `--config out/training_args.yaml --resume_from_checkpoint latest`, as the docs offer: it recorded `base` as
    # typed, so from another working directory the resume found no model.
    from app.predict import main as predict

    out = trained_on_a_relative_base(tiny_model_dir, review_files, tmp_path, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resume = ["--config", out / "training_args.yaml", "--output_dir", out, "--resume_from_checkpoint", "latest"]
    capsys.readouterr()
    assert run_app([*resume, "--max_steps", "8"]) == 0, capsys.readouterr().err
    assert "resumed from" in capsys.readouterr().out and (out / "checkpoints" / "step-8").is_dir()
    assert predict(["Fresh coffee.", "--model_name_or_path", str(out), "--mixed_precision", "no"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("Fresh coffee.,")


def test_a_model_saved_over_another_with_overwrite_output_dir_leaves_none_of_its_files(
    tiny_model_dir, review_files, tmp_path
):
    out = tmp_path / "out"

    def run(name: str, *extra) -> set[str]:
        flags = [*data_flags(tiny_model_dir, review_files), "--output_dir", out, "--logdir", tmp_path / "runs"]
        flags += ["--run_name", name, "--max_length", "64", "--disable_tqdm", "--overwrite_output_dir", *RUN, *extra]
        assert run_app(flags) == 0
        return {path.name for path in out.iterdir()}

    full_model = {"model.safetensors", "config.json"}
    assert full_model <= run("full")
    adapters = {"adapter_config.json", "adapter_model.safetensors", "merged"}
    with_adapters = run("adapters", "--use_peft", "--save_merged_model")
    assert adapters <= with_adapters and "model.safetensors" not in with_adapters, "the full model's weights stayed"

    left = run("full-again")
    assert full_model <= left and not left & adapters, f"the adapters' run left {sorted(left & adapters)}"
    # Loaded as transformers loads any folder: a stale adapter_config.json would give the base with the old adapters.
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert not hasattr(loaded, "peft_config")
    trained = load_file(out / "checkpoints" / "step-6" / "model.safetensors")
    torch.testing.assert_close(loaded.classifier.weight, trained["classifier.weight"], rtol=0, atol=0)


def test_float16_weights_beyond_fp16s_range_are_named_before_loading(tiny_model_dir, review_files, tmp_path, capsys):
    model = tmp_path / "big-weights"
    model.mkdir()
    for file in tiny_model_dir.iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if k.endswith("attention.self.key.weight"))
    weights[name][0, 0] = 1.0e5  # fp32 holds it; fp16 (max 65504) would make it inf
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert run_app([*lora_args(tmp_path, model, review_files), "--amp", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: --dtype auto (float16 under fp16 AMP): "), "the flag given, not one never typed"
    assert f"1 weight of the base beyond fp16's range (65504) would be inf: {name} (max |w| = 1e+05)" in err
    assert "use --dtype bfloat16" in err
    assert run_app([*lora_args(tmp_path, model, review_files, "fp32-base"), "--amp", "--dtype", "float32", *RUN]) == 0


def test_a_causal_lm_trains_adapters_and_predict_generates_from_the_folder(
    tiny_llama_dir, review_files, tmp_path, capsys
):
    from app.predict import main as predict

    flags = ["--prompt_column", "text", "--response_column", "label", "--max_new_tokens", "3"]
    args = lora_args(tmp_path, tiny_llama_dir, review_files, "lm", "--mixed_precision", "bf16", *flags)
    assert run_app([*args, *RUN]) == 0
    out = capsys.readouterr().out
    assert "frozen base (--dtype auto follows the precision (bf16))" in out or "in bfloat16" in out
    folder = tmp_path / "lm"
    assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    assert predict(["Great coffee.", "--model_name_or_path", str(folder), "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("text,generated_text\n")
    # Resumed as a classifier, the refusal blamed --lora_modules_to_save ("on 0 modules, not score"), never given.
    classify = ["--task", "sequence_classification", "--text_column", "text", "--label_column", "label"]
    args = lora_args(tmp_path, tiny_llama_dir, review_files, "lm", "--mixed_precision", "bf16", *classify)
    assert run_app([*args, *RUN, "--resume_from_checkpoint", "latest"]) == 2
    assert capsys.readouterr().err == (
        f"error: --resume_from_checkpoint {folder / 'checkpoints' / 'step-6'} holds adapters trained for --task "
        "causal_lm, not this run's --task sequence_classification: resume with --task causal_lm, or start the new "
        "task in another --output_dir\n"
    )


def test_the_best_adapters_are_loaded_at_the_end(tiny_model_dir, review_files, tmp_path, capsys):
    args = lora_args(tmp_path, tiny_model_dir, review_files)
    # The best by the highest loss: the first evaluation, before the adapters learned (a fixed point to come back to)
    best = ["--eval_steps", "2", "--load_best_model_at_end", "--max_steps", "6", "--learning_rate", "5e-3"]
    assert (
        run_app([*args, *best, "--save_steps", "2", "--metric_for_best_model", "loss", "--greater_is_better", "true"])
        == 0
    )
    out = capsys.readouterr().out
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-6" / STATE_FILE).read_text())["state"]
    best_step = state["best_step"]
    saved = stored(tmp_path / "out" / "adapter_model.safetensors")
    checkpoint = stored(tmp_path / "out" / "checkpoints" / f"step-{best_step}" / "model.safetensors")
    # peft's file names drop the adapter's name and its copy's; the checkpoint keeps the model's parameter names
    for name, tensor in saved.items():
        key = next(k for k in checkpoint if k.replace(".default", "").replace(".modules_to_save", "") == name)
        assert torch.equal(checkpoint[key], tensor), name
    assert best_step == 2 and "loaded the best model, step 2 (eval/loss" in out


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "model-and-lora-dropout"])
def test_gradient_checkpointing_with_frozen_embeddings_trains_as_without_it(
    tiny_model_no_dropout, tiny_model_dir, review_files, dropout
):
    # peft users meet "element 0 of tensors does not require grad" here: the frozen embeddings feed the checkpointed
    # layers an input without gradient. The app's non-reentrant checkpointing trains, and to the same bits, with the
    # model's and the adapters' dropout recomputed with the masks of the forward pass.
    adapters = []
    for checkpointing in (False, True):
        run = harness.build_training(
            tiny_model_dir if dropout else tiny_model_no_dropout,
            review_files,
            use_peft=True,
            lora_dropout=0.05 if dropout else 0.0,
            mixed_precision="no",
            max_steps=3,
            gradient_checkpointing=checkpointing,
        )
        harness.train(run)
        adapters.append({n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad})
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


@pytest.fixture(scope="module")
def overflow_in_fp16_dir(tmp_path_factory) -> Path:
    """A tiny BERT whose weights fp16 holds (largest 3000), but whose layer-1 intermediate output fp16 cannot: its
    input LayerNorm is scaled up 3000 times and its weights 1000 times."""
    from transformers import BertModel

    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-fp16-overflow"), dropout=0.1)
    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule("encoder.layer.1.attention.output.LayerNorm").weight.mul_(3000)
        model.get_submodule(OVERFLOWING).weight.mul_(1000)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("has_bf16, target", [(True, torch.bfloat16), (False, torch.float32)])
def test_a_fallback_reloads_the_frozen_base_in_the_new_precision(
    overflow_in_fp16_dir, review_files, tmp_path, capsys, monkeypatch, has_bf16, target
):
    import app.amp.policy

    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: has_bf16)
    args = [*lora_args(tmp_path, overflow_in_fp16_dir, review_files), "--amp", "--max_consecutive_skips", "2"]
    assert run_app([*args, "--on_scale_collapse", "fallback", *RUN]) == 0
    captured = capsys.readouterr()
    assert "first overflow: base_model.model.bert.encoder.layer.1.intermediate.dense" in captured.err
    name = str(target).removeprefix("torch.")
    assert f"the frozen base reloaded in {name}" in captured.out
    logged = tb.scalars(tmp_path / "runs" / "out")
    assert logged[tags.AMP_HEADROOM_BITS], "the headroom probe measured the fp16 base with its adapters"
    assert f"base frozen in {name}" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.slow
def test_adapters_train_compiled(tiny_model_no_dropout, review_files):
    run = harness.build_training(
        tiny_model_no_dropout,
        review_files,
        use_peft=True,
        mixed_precision="no",
        max_steps=2,
        torch_compile=True,
        pad_to_multiple_of=64,  # both batches [8, 64]: one graph, compiled once
    )
    before = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    harness.train(run)
    after = dict(run.model.named_parameters())
    assert run.state.applied_updates == 2
    assert all(torch.isfinite(after[n]).all() for n in before) and any(
        not torch.equal(after[n], t) for n, t in before.items()
    )


@pytest.mark.slow
def test_two_ranks_train_adapters_on_an_fp16_base(tiny_model_dir, review_files, tmp_path):
    # DDP reduces only what trains: no unused-parameter error with a frozen base, and the ranks' adapters agree.
    from tests.conftest import ROOT, free_port, launch

    flags = ["--config_file", ROOT / "accelerate_configs" / "cpu_multi.yaml", "--main_process_port", free_port()]
    args = [*lora_args(tmp_path, tiny_model_dir, review_files), "--amp", *RUN]
    result = launch(tmp_path, flags, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: DDP, 2 processes" in result.stdout
    assert "unused" not in result.stderr.lower()
    checkpoint = tmp_path / "out" / "checkpoints" / "step-6" / "model.safetensors"
    saved = stored(checkpoint)
    final = stored(tmp_path / "out" / "adapter_model.safetensors")
    assert len(saved) == len(final) and all("lora_" in n or "modules_to_save" in n for n in saved)


def test_under_autocast_the_adapters_keep_no_float32_copy_of_their_inputs(tiny_llama_dir):
    # peft casts each layer's input to its float32 adapters before their dropout; under autocast they compute in
    # bfloat16 all the same, and the float32 copies (with their masks) took a gigabyte of the LM job's step.
    from transformers import AutoModelForCausalLM

    from app.adapters.lora import add_adapters, plan_adapters
    from app.config import TrainConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    plan = plan_adapters(TrainConfig(use_peft=True), model, [], classifier=False)
    model = add_adapters(model, plan, "causal_lm").train()
    inputs = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):  # its input is the dropout's output: what backward keeps for this layer
            module.register_forward_pre_hook(lambda module, args: inputs.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(3, 200, (4, 24))).logits.float().sum().backward()
    assert len(inputs) == len(plan.targets) and set(inputs) == {torch.bfloat16}, set(inputs)


def test_the_adapters_start_from_the_seed_alone_as_a_peft_users_do(tiny_llama_dir):
    # A peer (HF Trainer, trl) compared in the same batch order must start from the same adapters; so must two runs
    # with one --seed whatever was drawn before the adapters went on. The default generator's stream goes on unchanged.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from app.adapters.lora import add_adapters, plan_adapters
    from app.config import TrainConfig

    def adapters(model):
        return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_A" in name}

    cfg = TrainConfig(use_peft=True, seed=7)
    plan = plan_adapters(cfg, AutoModelForCausalLM.from_pretrained(tiny_llama_dir), [], classifier=False)
    torch.manual_seed(123)
    torch.rand(5)  # something drawn before the adapters go on
    ours = adapters(add_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), plan, "causal_lm"))
    after_ours = torch.rand(3)
    torch.manual_seed(123)
    torch.rand(5)
    assert torch.equal(after_ours, torch.rand(3))

    torch.manual_seed(cfg.seed)
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM")
    theirs = adapters(get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), config))
    assert ours.keys() == theirs.keys() and len(ours) == len(plan.targets)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_an_adapter_rank_no_layer_can_use_is_warned_of(tiny_llama_dir, tiny_gpt2_dir):
    # An update of a d_in x d_out layer has rank min(d_in, d_out) at most: an adapter of rank r >= that holds
    # r x (d_in + d_out) weights, more than the layer, to learn what training the layer in full would.
    from transformers import AutoModelForCausalLM

    from app.adapters.lora import add_adapters, plan_adapters
    from app.adapters.plan import ModelPlan, describe_trainable
    from app.config import TrainConfig

    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)  # q_proj 32 -> 32, k_proj and v_proj 32 -> 16

    def warning(model, r: int, targets: list[str]) -> str | None:
        cfg = TrainConfig(use_peft=True, lora_r=r, lora_target_modules=targets)
        return plan_adapters(cfg, model, [], classifier=False).rank_warning()

    assert warning(llama, 15, ["k_proj", "v_proj"]) is None
    said = warning(llama, 16, ["k_proj", "v_proj"])
    assert said.startswith("warning: --lora_r 16 is at least the rank of every adapted layer (at most 16, the smaller")
    assert "of model.layers.0.self_attn.k_proj" in said and "use --lora_r below 16" in said
    assert warning(llama, 16, ["all-linear"]) is None, "q_proj and the MLP can still use rank 16"
    assert "(at most 32," in warning(llama, 32, ["all-linear"])
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)  # GPT-2's Conv1D layers, c_attn 32 -> 96
    assert warning(gpt2, 31, ["c_attn"]) is None and "(at most 32," in warning(gpt2, 32, ["c_attn"])

    cfg = TrainConfig(use_peft=True, lora_r=16, lora_target_modules=["k_proj"])
    adapters = plan_adapters(cfg, llama, [], classifier=False)
    lines = describe_trainable(
        add_adapters(llama, adapters, "causal_lm"), ModelPlan(torch.float32, "", adapters, "", None, "causal_lm")
    )
    assert lines[0].startswith("adapters: LoRA r=16") and lines[1] == adapters.rank_warning(), lines


def test_a_target_name_that_the_head_shares_adapts_the_base_layers_and_leaves_the_head_in_full():
    # RoBERTa's classification head is classifier.dense and classifier.out_proj: `dense`, a common target, was refused
    # because it also named the head's dense layer, which trains in full.
    from transformers import RobertaConfig

    from app.adapters.lora import plan_adapters
    from app.config import TrainConfig
    from app.errors import UsageError

    config = RobertaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, num_labels=3
    )
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)

    def plan(*targets: str):
        return plan_adapters(TrainConfig(use_peft=True, lora_target_modules=list(targets)), model, [], True)

    adapters = plan("query", "value", "dense")
    dense = [name for name in adapters.targets if name.endswith(".dense")]
    assert len(dense) == 6 and all(name.startswith("roberta.encoder.") for name in dense), adapters.targets
    assert "classifier" in adapters.trained_in_full
    assert not any(name.startswith("classifier") for name in adapters.targets)
    with pytest.raises(UsageError, match="'out_proj' names classifier.out_proj, which trains in full"):
        plan("query", "out_proj")
    with pytest.raises(UsageError, match="matches no layer") as refused:
        plan("nothing")
    assert "classifier" not in str(refused.value) and "out_proj" not in str(refused.value), "advice that is refused"
    # Every layer trained in full by --lora_modules_to_save: the error blamed --lora_target_modules, never given.
    cfg = TrainConfig(use_peft=True, lora_target_modules=["all-linear"], lora_modules_to_save=["roberta"])
    with pytest.raises(UsageError) as refused:
        plan_adapters(cfg, model, [], True)
    assert str(refused.value).startswith("--lora_modules_to_save roberta trains every layer that LoRA could adapt in")


def test_adapters_on_a_tied_embedding_are_refused_and_on_an_untied_one_planned(tiny_llama_dir):
    # The tiny Llama ties lm_head to embed_tokens, as SmolLM2 does: adapters on embed_tokens trained right, but merging
    # them (--save_merged_model, and predict.py's load) changed lm_head too: eval loss 5.53 trained, 7.24 merged.
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.adapters.lora import plan_adapters
    from app.config import TrainConfig
    from app.errors import UsageError

    def plan(tie: bool, *targets: str):
        config = AutoConfig.from_pretrained(tiny_llama_dir, tie_word_embeddings=tie)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return plan_adapters(TrainConfig(use_peft=True, lora_target_modules=list(targets)), model, [], False)

    for adapted, other in (("model.embed_tokens", "lm_head"), ("lm_head", "model.embed_tokens")):
        with pytest.raises(UsageError) as refused:
            plan(True, "q_proj", adapted.rsplit(".")[-1])
        assert str(refused.value) == (
            f"--lora_target_modules: {adapted} shares its weight with {other} (the model ties its embeddings), so "
            "merging its adapters would change both: the merged model and predict.py's would not be the one trained; "
            "adapt other layers"
        )
        assert adapted in plan(False, "q_proj", adapted.rsplit(".")[-1]).targets
    assert "model.embed_tokens" not in plan(True, "all-linear").targets


def test_adapters_on_gpt2s_conv1d_layers_say_so_to_peft_instead_of_peft_warning(tiny_gpt2_dir, tiny_llama_dir):
    # peft's UserWarning on every GPT-2 run: "fan_in_fan_out is set to False but the target module is Conv1D".
    import warnings

    from transformers import AutoModelForCausalLM

    from app.adapters.lora import add_adapters, plan_adapters
    from app.config import TrainConfig

    for folder, conv1d in ((tiny_gpt2_dir, True), (tiny_llama_dir, False)):
        model = AutoModelForCausalLM.from_pretrained(folder)
        plan = plan_adapters(TrainConfig(use_peft=True), model, [], classifier=False)
        assert plan.lora_config("causal_lm").fan_in_fan_out is conv1d
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            add_adapters(model, plan, "causal_lm")
        assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]


def test_adapters_on_roberta_train_keep_its_new_head_whole_and_predict(review_files, tmp_path, capsys):
    # RoBERTa's new head is classifier holding classifier.dense and classifier.out_proj: all three went to
    # modules_to_save, and peft could not load the saved folder back (KeyError in predict.py). And the targets,
    # written as peft's docs write them, query,value,dense, matched no layer.
    from peft import PeftModel
    from transformers import RobertaConfig, RobertaModel

    from app.inputs.model import embedded_model_dir
    from app.predict import main as predict

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config = RobertaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=130,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    base = tmp_path / "tiny-roberta"
    RobertaModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    args = lora_args(tmp_path, base, review_files, "out", "--lora_target_modules", "query,value,dense")
    assert run_app([*args, *RUN, "--mixed_precision", "no"]) == 0
    out = tmp_path / "out"
    saved = json.loads((out / "adapter_config.json").read_text())["modules_to_save"]
    assert "classifier" in saved and not [name for name in saved if "." in name], saved  # peft adds its own names
    said = capsys.readouterr().out
    assert "on 10 layers (dense, query, value); trained in full: classifier\n" in said, said

    text = "Great coffee, fresh and strong."
    card = (out / "README.md").read_text()  # its recipe for transformers and peft, run as it is written
    recipe = card.split("With transformers and peft")[1].split("\n\n", 1)[1].split("\n## ")[0]
    scope = {}
    exec(textwrap.dedent(recipe), scope)
    model = scope["model"].eval()
    assert isinstance(model, PeftModel)
    with torch.no_grad():
        expected = model(**tokenizer(text, return_tensors="pt")).logits.softmax(-1)[0]
    assert predict([text, "--model_name_or_path", str(out), "--mixed_precision", "no"]) == 0
    probability = float(capsys.readouterr().out.strip().splitlines()[-1].rsplit(",", 1)[-1])
    assert probability == pytest.approx(float(expected.max()), abs=1e-5)


def test_predict_refuses_adapters_whose_base_changed_moved_or_whose_weights_are_gone(
    tiny_model_dir, review_files, tmp_path, capsys
):
    # Adapters on a base that was saved over since gave other probabilities with exit 0; a moved base was HF's
    # "Repo id must be in the form ..."; a folder without adapter_model.safetensors, or with adapters of other
    # shapes, was a traceback. And config.json said bfloat16, the dtype the base was frozen in, not its own.
    from app.predict import main as predict

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    bf16 = ["--mixed_precision", "bf16", "--dtype", "bfloat16"]  # a half-precision base, on any CPU
    assert run_app([*lora_args(tmp_path, base, review_files), *RUN, *bf16]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text()).get("dtype") == json.loads(
        (base / "config.json").read_text()
    ).get("dtype"), "the base's own dtype"

    def predicted(folder) -> tuple[int, str]:
        capsys.readouterr()
        code = predict(["Fresh coffee.", "--model_name_or_path", str(folder), "--mixed_precision", "no"])
        said = capsys.readouterr()
        return code, (said.err if code else said.out).strip().splitlines()[-1]  # the error, or the prediction

    assert predicted(out)[0] == 0
    missing = tmp_path / "missing"
    shutil.copytree(out, missing)
    (missing / "adapter_model.safetensors").unlink()
    assert predicted(missing) == (
        2,
        f"error: {missing} holds adapter_config.json but not the adapters' weights (adapter_model.safetensors): copy "
        "the whole output folder again",
    )
    reshaped = tmp_path / "reshaped"
    shutil.copytree(out, reshaped)
    weights = load_file(reshaped / "adapter_model.safetensors")
    weights = {name: (t[:2] if "lora_A" in name else t) for name, t in weights.items()}
    save_file(weights, reshaped / "adapter_model.safetensors")
    code, err = predicted(reshaped)
    assert code == 2 and err.startswith(
        f"error: the adapters in {reshaped} do not fit adapter_config.json and their"
    ), err
    assert "size mismatch" in err and err.count("\n") == 0

    weights = load_file(base / "model.safetensors")  # the base saved over: one weight changed
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    code, err = predicted(out)
    assert code == 2 and err.startswith(
        f"error: {out} holds adapters trained on another version of their base: the weight files of {base} had "
    ), err
    assert "put back the base they were trained on" in err

    base.rename(tmp_path / "moved")
    assert predicted(out) == (
        2,
        f"error: {out} holds adapters whose base folder {base} does not exist (moved or deleted): put the base back "
        "there, or predict with the merged model (--save_merged_model writes it)",
    )


def test_predict_checks_a_base_found_in_place_of_one_that_moved(
    tiny_model_dir, review_files, tmp_path, monkeypatch, capsys
):
    # Trained on the relative folder `base`: once that folder moved, predict.py from another working directory took
    # that directory's own `base`, another model, and merged the adapters into it: other labels, exit 0.
    from transformers import BertModel

    from app.predict import main as predict

    out = trained_on_a_relative_base(tiny_model_dir, review_files, tmp_path, monkeypatch)
    Path("base").rename("moved-away")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, elsewhere / "base")
    torch.manual_seed(123)
    BertModel(BertModel.from_pretrained(tiny_model_dir).config).save_pretrained(elsewhere / "base")  # another model
    monkeypatch.chdir(elsewhere)
    args = ["Fresh coffee.", "--model_name_or_path", str(out), "--mixed_precision", "no"]
    capsys.readouterr()
    assert predict(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(
        f"error: {out} holds adapters trained on another version of their base: the weight files of base (found in "
        f"place of {tmp_path / 'base'}) had the fingerprint "
    ), err
    # The same weights in the new place (a project copied whole): they are the base it was trained on.
    shutil.rmtree(elsewhere / "base")
    shutil.copytree(tmp_path / "moved-away", elsewhere / "base")
    assert predict(args) == 0


def test_predict_finds_the_relative_base_of_a_moved_project_from_above_it(
    tiny_model_dir, review_files, tmp_path, monkeypatch, capsys
):
    # Found from inside the moved project only: from above it, "its base folder does not exist (moved or deleted)".
    from app.predict import main as predict

    (tmp_path / "project").mkdir()
    trained_on_a_relative_base(tiny_model_dir, review_files, tmp_path / "project", monkeypatch)
    (tmp_path / "project").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert predict(["Fresh coffee.", "--model_name_or_path", "moved/out", "--mixed_precision", "no"]) == 0
    assert pd.read_csv(io.StringIO(capsys.readouterr().out))["text"].tolist() == ["Fresh coffee."]
    # Another model of the base's name in the working directory: the one beside the adapters is theirs; and the other
    # way round, another model beside them and theirs in the working directory.
    torch.manual_seed(7)
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model_dir)).save_pretrained("base")
    assert predict(["Fresh coffee.", "--model_name_or_path", "moved/out", "--mixed_precision", "no"]) == 0
    (tmp_path / "base").rename(tmp_path / "other")
    (tmp_path / "moved" / "base").rename(tmp_path / "base")
    (tmp_path / "other").rename(tmp_path / "moved" / "base")
    assert predict(["Fresh coffee.", "--model_name_or_path", "moved/out", "--mixed_precision", "no"]) == 0


def test_predict_merges_adapters_into_the_base_as_it_was_trained_the_same_model_as_merged(
    tiny_model_dir, review_files, tmp_path
):
    # The adapters went into the base loaded in float32 from its files, while the run trained on it rounded to
    # bfloat16, which merged/ holds: two models, and under bf16 10 of 24 of SmolLM2's generations differed.
    from app.adapters.trained import load_trained

    bf16 = ["--mixed_precision", "bf16", "--dtype", "bfloat16", "--save_merged_model"]
    assert run_app([*lora_args(tmp_path, tiny_model_dir, review_files), *RUN, *bf16]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "adapter_base.json").read_text())["frozen_in"] == "bfloat16"
    predicted = load_trained(str(out), AutoModelForSequenceClassification, print).state_dict()
    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged").state_dict()
    assert predicted.keys() == merged.keys()
    differ = [name for name in merged if not torch.equal(predicted[name], merged[name])]
    assert not differ, differ[:5]


def test_weights_transformers_renames_while_loading_are_not_new_modules():
    # An older BERT's LayerNorm.gamma/beta and a GPT-NeoX's embed_out load as LayerNorm.weight/bias and lm_head: taken
    # as stored they looked new, and --use_peft trained every LayerNorm, or Pythia's whole output head, in full.
    from transformers import BertConfig, GPTNeoXConfig

    from app.adapters.lora import new_modules

    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    with torch.device("meta"):
        bert = AutoModelForSequenceClassification.from_config(BertConfig(vocab_size=100, **small))
        neox = AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=100, tie_word_embeddings=False, **small))
    legacy = {
        key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        for key in bert.state_dict()
        if not key.startswith("classifier.")
    }
    assert any(key.endswith("LayerNorm.gamma") for key in legacy), "the test's premise"
    assert new_modules(bert, legacy) == ["classifier"]
    pythia = {"embed_out.weight" if key == "lm_head.weight" else key for key in neox.state_dict()}
    assert new_modules(neox, pythia) == []
