"""Every shipped config: accelerate's own loader accepts each launch config, its 'no'/'NO' are quoted, every key is
explained; the shipped training config loads and equals the defaults."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from app.errors import UsageError
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
EXPECTED = {"cpu.yaml", "cpu_multi.yaml", "gpu.yaml", "multi_gpu.yaml", "fsdp.yaml", "multi_node.yaml"}


def test_the_expected_configs_ship():
    assert {path.name for path in CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_accelerate_loads_it(path):
    config = load_config_from_file(str(path))
    assert config.mixed_precision in ("no", "fp16", "bf16")
    assert config.num_processes >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_bare_no_and_every_key_commented(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, rest = line.partition(":")
        value = rest.split("#")[0].strip()
        assert value not in ("no", "NO", "No"), f"{path.name}:{number}: quote it, YAML reads a bare {value} as false"
        if rest.strip() and key.strip() != "fsdp_config":
            assert "#" in rest, f"{path.name}:{number}: {key.strip()} has no comment"
    # YAML itself must agree: no key parsed into a boolean where accelerate expects a string.
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw["distributed_type"], str) and isinstance(raw["mixed_precision"], str)


def test_cpu_multi_starts_two_gloo_processes():
    raw = yaml.safe_load((ROOT / "accelerate_configs" / "cpu_multi.yaml").read_text())
    assert raw["distributed_type"] == "MULTI_GPU" and raw["use_cpu"] is True and raw["num_processes"] == 2


# What each shipped file must say, as accelerate's loader reads it (the launcher's own view of the file).
KEY_SETTINGS = {
    "cpu.yaml": dict(distributed_type="NO", use_cpu=True, num_processes=1, num_machines=1, mixed_precision="no"),
    "cpu_multi.yaml": dict(
        distributed_type="MULTI_GPU", use_cpu=True, num_processes=2, num_machines=1, mixed_precision="no"
    ),
    "gpu.yaml": dict(
        distributed_type="NO", use_cpu=False, num_processes=1, num_machines=1, gpu_ids="0", mixed_precision="fp16"
    ),
    "multi_gpu.yaml": dict(
        distributed_type="MULTI_GPU",
        use_cpu=False,
        num_processes=2,
        num_machines=1,
        gpu_ids="all",
        mixed_precision="fp16",
    ),
    # FSDP's own mixed precision would cast a second time: the app drives fp16 itself.
    "fsdp.yaml": dict(distributed_type="FSDP", use_cpu=False, num_processes=2, num_machines=1, mixed_precision="no"),
    "multi_node.yaml": dict(
        distributed_type="MULTI_GPU", num_machines=2, num_processes=2, machine_rank=0, mixed_precision="no"
    ),
}


def test_every_shipped_config_has_its_key_settings_listed():
    assert KEY_SETTINGS.keys() == EXPECTED


@pytest.mark.parametrize("name", sorted(KEY_SETTINGS))
def test_key_settings(name):
    config = load_config_from_file(str(ROOT / "accelerate_configs" / name))
    got = {key: getattr(config, key) for key in KEY_SETTINGS[name]}
    got["distributed_type"] = got["distributed_type"].value  # accelerate parses it into its DistributedType enum
    assert got == KEY_SETTINGS[name]


def test_fsdp_config_asks_for_fsdp2_sharded_per_transformer_layer():
    fsdp = load_config_from_file(str(ROOT / "accelerate_configs" / "fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2  # the app's plain GradScaler is right for FSDP2 only
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_multi_node_config_names_its_main_node():
    config = load_config_from_file(str(ROOT / "accelerate_configs" / "multi_node.yaml"))
    assert config.main_process_ip and config.main_process_port


def test_the_shipped_training_config_is_the_defaults_with_every_key():
    from app.config import TrainConfig, parse_config

    path = ROOT / "configs" / "default.yaml"
    assert parse_config(["--config", str(path)]) == TrainConfig()
    keys = set(yaml.safe_load(path.read_text()))
    assert keys == {field.name for field in dataclasses.fields(TrainConfig)}


def test_the_shipped_training_config_is_what_its_script_writes_comments_and_all():
    # The values were checked, not the comments: a flag's help changed in app/config.py stayed old in the file.
    import subprocess
    import sys

    script = ROOT / "scripts" / "write_default_config.py"
    checked = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--check" in helped.stdout  # it took --help for a run, and wrote the file


def test_the_config_check_names_a_missing_file_in_one_line(tmp_path, monkeypatch, capsys):
    # --check read the file unguarded: a checkout without configs/default.yaml got a FileNotFoundError traceback.
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("write_default_config", ROOT / "scripts" / "write_default_config.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "app").mkdir()
    shutil.copy(ROOT / "app" / "config.py", tmp_path / "app" / "config.py")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 1
    assert "default.yaml is missing: run python scripts/write_default_config.py" in capsys.readouterr().err
    assert not (tmp_path / "configs").exists()  # a check writes nothing


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_training_config_loads(path):
    from app.config import TrainConfig, parse_config

    cfg = parse_config(["--config", str(path)])
    assert isinstance(cfg, TrainConfig)


def test_a_hand_written_yaml_may_spell_floats_as_the_command_line_does(tmp_path):
    from app.config import parse_config

    # YAML 1.1 reads 5e-5 and 1E-2 (no dot) as strings; the same text on the command line is a float.
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 5e-5\nweight_decay: 1E-2\nwarmup_ratio: .05\n")
    cfg = parse_config(["--config", str(path)])
    assert (cfg.learning_rate, cfg.weight_decay, cfg.warmup_ratio) == (5e-5, 1e-2, 0.05)


def test_a_yaml_may_merge_its_anchors_and_override_their_keys_but_not_write_one_key_twice(tmp_path):
    from app.config import parse_config
    from app.errors import UsageError

    # The duplicate-key check built every key, the merge key `<<` too: a YAML of anchors was "not valid YAML".
    path = tmp_path / "run.yaml"
    path.write_text("_base: &base\n  learning_rate: 2.0e-5\n  seed: 3\n")
    with pytest.raises(UsageError, match="unknown key '_base'"):  # the loader read it; the key is not a flag
        parse_config(["--config", str(path)])
    path.write_text("<<: {learning_rate: 2.0e-5, seed: 3}\nseed: 7\n")  # a merged key overridden: allowed
    cfg = parse_config(["--config", str(path)])
    assert (cfg.learning_rate, cfg.seed) == (2e-5, 7)
    path.write_text("seed: 3\nseed: 7\n")
    with pytest.raises(UsageError, match="key 'seed' is written twice"):
        parse_config(["--config", str(path)])


def test_a_hand_written_yaml_may_say_mixed_precision_no_unquoted(tmp_path):
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text("mixed_precision: no\n")  # YAML 1.1 reads it as false
    assert parse_config(["--config", str(path)]).mixed_precision == "no"


@pytest.mark.parametrize(
    ("in_yaml", "flags", "expected"),
    [
        ("resume_from_checkpoint: true", [], "latest"),  # HF Trainer's True
        ("resume_from_checkpoint: false", [], None),
        ("", ["--resume_from_checkpoint", "True"], "latest"),
        ("", ["--resume_from_checkpoint", "Latest"], "latest"),
        ("", ["--resume_from_checkpoint", "false"], None),  # "no such folder", where the YAML's false was a new run
        ("resume_from_checkpoint: latest", ["--resume_from_checkpoint", "False"], None),
    ],
)
def test_resume_from_checkpoint_true_in_any_spelling_is_latest(tmp_path, in_yaml, flags, expected):
    # "Latest" was taken for a folder of that name, and "true" for latest in one place but not in the other.
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text(in_yaml)
    assert parse_config(["--config", str(path), *flags]).resume_from_checkpoint == expected


@pytest.mark.parametrize(
    ("in_yaml", "on_the_command_line"), [("amp: true", "--mixed_precision=bf16"), ("mixed_precision: bf16", "--amp")]
)
def test_a_precision_on_the_command_line_wins_over_the_other_precision_key_of_the_yaml(
    tmp_path, in_yaml, on_the_command_line
):
    # --amp and --mixed_precision ask for one thing two ways: each from its own source was an error of two requests.
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text(f"{in_yaml}\nmax_steps: 3\n")
    cfg = parse_config(["--config", str(path), on_the_command_line])
    assert (cfg.amp, cfg.mixed_precision, cfg.max_steps) == (
        (False, "bf16", 3) if on_the_command_line.startswith("--mixed") else (True, None, 3)
    )


def test_amp_false_under_a_launcher_that_asks_for_fp16_is_refused(tmp_path, monkeypatch):
    # accelerate launch --mixed_precision fp16 (or its config file) passes fp16 on; --amp false then trained in fp16
    # without a word, where the same pair from a --config was refused.
    from app.config import parse_config

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(UsageError, match="--amp false, but accelerate launch asks for fp16 .*; pass --mixed_precision"):
        parse_config(["--amp", "false"])
    path = tmp_path / "run.yaml"
    path.write_text("mixed_precision: bf16\n")
    assert parse_config(["--amp", "false", "--config", str(path)]).mixed_precision == "bf16"  # the app's flag decides
    assert parse_config(["--amp", "false", "--mixed_precision", "no"]).mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert not parse_config(["--amp", "false"]).amp


@pytest.mark.parametrize(
    "in_yaml, on_the_command_line, expected",
    [
        (
            "prompt_column: prompt\nresponse_column: completion",
            ["--messages_column", "messages"],
            {"messages_column": "messages", "prompt_column": None, "response_column": None},
        ),
        ("messages_column: messages", ["--text_column", "body"], {"messages_column": None, "text_column": "body"}),
        ("messages_column: messages", ["--messages_column", ""], {"messages_column": None}),
        (  # "--text_column $UNSET": it chose plain text, and the YAML's pairs went without a word
            "prompt_column: prompt\nresponse_column: answer",
            ["--text_column", ""],
            {"prompt_column": "prompt", "response_column": "answer", "text_column": None},
        ),
        ("use_peft: true\nlora_r: 4\nsave_merged_model: true", ["--use_peft", "false"], {"lora_r": 16}),
        (
            "use_peft: true\nlora_r: 4\nsave_merged_model: true",
            ["--use_peft"],
            {"lora_r": 4, "save_merged_model": True},
        ),
        ("lora_r: 4", ["--use_peft", "true"], {"lora_r": 4}),
    ],
    ids=[
        "a data format",
        "another data format",
        "a column unset",
        "another format's column unset",
        "adapters off",
        "adapters on",
        "adapters on, true",
    ],
)
def test_the_command_line_replaces_what_a_yaml_set_for_the_same_choice(
    tmp_path, in_yaml, on_the_command_line, expected
):
    # "give --messages_column alone, or --prompt_column with --response_column" for a command line that gave it alone,
    # "--lora_r applies to adapters only" for a --lora_r in the YAML, and no way to unset a YAML's column.
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text(f"{in_yaml}\nmax_steps: 3\n")
    cfg = parse_config(["--config", str(path), *on_the_command_line])
    assert {name: getattr(cfg, name) for name in expected} == expected and cfg.max_steps == 3


def test_a_line_that_names_a_flag_the_yaml_set_says_where_it_came_from(tmp_path, capsys):
    from tests.conftest import run_app

    path = tmp_path / "run.yaml"  # use_peft at its default, as a training_args.yaml holds it: it set nothing
    path.write_text("lora_r: 4\nlearning_rate: 0.0001\nuse_peft: false\n")
    assert run_app(["--config", path]) == 2
    assert capsys.readouterr().err == (
        "error: --lora_r applies to adapters only; add --use_peft, or drop --lora_r (--lora_r: from --config "
        f"{path}; a flag on the command line overrides it)\n"
    )
    assert run_app(["--lora_r", "4"]) == 2  # typed: nothing to add, though the run before named a --config
    assert capsys.readouterr().err == "error: --lora_r applies to adapters only; add --use_peft, or drop --lora_r\n"
    (tmp_path / "bad.yaml").write_text("learning_rat: 1\n")
    assert run_app(["--config", path]) == 2
    capsys.readouterr()
    assert run_app(["--config", tmp_path / "bad.yaml"]) == 2  # refused while reading: the last file's keys are not it
    assert "from --config" not in capsys.readouterr().err


def test_a_relative_path_of_a_yaml_that_is_not_found_says_it_is_read_from_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    # As on the command line, and as HF's and accelerate's YAMLs are read: a file beside the YAML is not found by its
    # name alone, and the line only said "no such file".
    from tests.conftest import run_app

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.csv").write_text("text,label\nfine,1\n")
    (tmp_path / "conf" / "run.yaml").write_text("train_file: train.csv\n")
    monkeypatch.chdir(tmp_path)
    assert run_app(["--config", "conf/run.yaml"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --train_file train.csv: no such file (--train_file: from --config conf/run.yaml, whose relative paths "
        f"are read from the working directory ({tmp_path}); a flag on the command line overrides it)"
    )


@pytest.mark.parametrize(
    "argv, advice",
    [
        (["--fp16", "false"], "use --mixed_precision fp16, or --amp; --mixed_precision no for fp32"),
        (["--num_cpu_threads_per_process", "2"], "a flag of accelerate launch: give it before app/train.py"),
        (["--use_fsdp"], "a flag of accelerate launch: give it before app/train.py"),  # "did you mean --use_peft?"
        (["--bf16_full_eval"], "drop it: evaluation and app/predict.py run under the autocast of --mixed_precision"),
        (["--log_dir", "x"], "did you mean --logdir?"),  # accelerate launch has one too: this app's is meant
        (["--debug", "underflow_overflow"], "drop it: the fp16 pre-flight (with --amp) and the overflow report"),
    ],
)
def test_an_unknown_flag_gets_advice_that_leads_to_what_was_meant(argv, advice, tmp_path):
    from app.config import parse_config

    with pytest.raises(UsageError, match=re.escape(f"unknown flag '{argv[0]}'; {advice}")):
        parse_config(argv)
    path = tmp_path / "run.yaml"
    path.write_text(f"{argv[0].removeprefix('--')}: {argv[1] if len(argv) > 1 else 'true'}\n")
    with pytest.raises(UsageError, match=re.escape(f"unknown key '{argv[0].removeprefix('--')}' ({advice}")):
        parse_config(["--config", str(path)])


def test_hf_s_no_form_of_a_switch_gets_advice_in_its_own_syntax(tmp_path):
    # "did you mean --amp?" switched fp16 on. A --config key got the command line's "use --amp false".
    from app.config import parse_config

    with pytest.raises(UsageError, match=re.escape("unknown flag '--no_amp'; use --amp false")):
        parse_config(["--no_amp"])
    # A value that is no true or false (0, an empty value) was read as true: advice against what was meant.
    for value, advice in (("true", "use amp: false"), ("false", "use amp: true"), ("0", "use amp: true or false")):
        path = tmp_path / "run.yaml"
        path.write_text(f"no_amp: {value}\n")
        with pytest.raises(UsageError, match=re.escape(f"unknown key 'no_amp' ({advice});")):
            parse_config(["--config", str(path)])


def test_the_advice_for_hf_and_trl_flag_names_names_flags_that_exist():
    # Each name that HF TrainingArguments or trl gives a flag of another name here (app/cli.OTHER_NAMES) is no flag
    # of the app, and the advice names only flags that the app or accelerate launch has.

    from accelerate.commands.launch import launch_command_parser

    from app.cli import OTHER_NAMES
    from app.config import TrainConfig

    flags = {field.name for field in dataclasses.fields(TrainConfig)} | {"config"}
    launcher = {option.lstrip("-") for action in launch_command_parser()._actions for option in action.option_strings}
    assert not flags & set(OTHER_NAMES)
    for name, advice in OTHER_NAMES.items():
        named = re.findall(r"--(\w+)", advice)
        assert all(flag in flags or flag in launcher for flag in named), (name, advice)


def test_module_names_may_be_separated_by_commas_as_peft_writes_them():
    from app.config import parse_config

    cfg = parse_config(
        ["--use_peft", "--lora_target_modules", "q_proj,v_proj", "k_proj", "--lora_modules_to_save", "a,"]
    )
    assert (cfg.lora_target_modules, cfg.lora_modules_to_save) == (["q_proj", "v_proj", "k_proj"], ["a"])


def test_a_loss_scale_below_the_alarms_is_refused_only_where_a_scaler_may_run():
    from app.config import TrainConfig
    from app.errors import UsageError

    for asked in ({"amp": True}, {"mixed_precision": "fp16"}):
        with pytest.raises(UsageError, match="is below --min_loss_scale"):
            TrainConfig(min_loss_scale=131072, **asked).validate()
    for asked in ({"mixed_precision": "bf16"}, {"mixed_precision": "no"}):  # no scaler: nothing to collapse
        TrainConfig(min_loss_scale=131072, **asked).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks fp16 on a GPU")
def test_a_loss_scale_below_the_alarms_is_no_refusal_where_auto_cannot_pick_fp16():
    # auto on a CPU picks bf16 or fp32: no scaler to start collapsed (it was refused as if fp16 were coming).
    from app.config import TrainConfig

    for asked in ({"mixed_precision": "auto"}, {}):
        TrainConfig(min_loss_scale=131072, **asked).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, where auto picks fp16")
def test_a_loss_scale_below_the_alarms_is_refused_where_auto_picks_fp16():
    from app.config import TrainConfig
    from app.errors import UsageError

    for asked in ({"mixed_precision": "auto"}, {}):
        with pytest.raises(UsageError, match="is below --min_loss_scale"):
            TrainConfig(min_loss_scale=131072, **asked).validate()


def test_a_loss_scale_below_the_alarms_under_a_launchers_precision(monkeypatch):
    from app.config import TrainConfig
    from app.errors import UsageError

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # the launcher's choice: no scaler to start collapsed
    TrainConfig(min_loss_scale=131072).validate()
    with pytest.raises(UsageError, match="is below --min_loss_scale"):
        TrainConfig(min_loss_scale=131072, amp=True).validate()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(UsageError, match="is below --min_loss_scale"):
        TrainConfig(min_loss_scale=131072).validate()


def test_amp_false_over_a_yaml_that_asks_for_fp16_is_refused(tmp_path, capsys):
    # A copied training_args.yaml of an fp16 run records amp: false and mixed_precision: fp16: with --amp false on
    # top, it trained in fp16 without a word.
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text("amp: false\nmixed_precision: fp16\n")
    with pytest.raises(UsageError, match=f"--amp false, but --config {path} asks for mixed_precision fp16; pass"):
        parse_config(["--config", str(path), "--amp", "false"])


@pytest.mark.parametrize(
    "in_yaml, on_the_command_line, expected",
    [
        # The YAML's mixed_precision was dropped for any precision flag, and `auto` picked bf16 (fp16 on a GPU).
        ('mixed_precision: "no"', ["--amp", "false"], {"amp": False, "mixed_precision": "no"}),
        ("amp: true", ["--amp", "false"], {"amp": False, "mixed_precision": None}),
        # A copied training_args.yaml of a --max_steps run: its steps overrode the epochs asked for, without a word.
        ("max_steps: 5", ["--num_train_epochs", "2"], {"max_steps": -1, "num_train_epochs": 2.0}),
        ("num_train_epochs: 3", ["--max_steps", "4"], {"max_steps": 4, "num_train_epochs": 3.0}),
    ],
    ids=["amp false keeps the yaml's precision", "amp false over amp", "epochs over steps", "steps over epochs"],
)
def test_the_command_line_asks_for_a_length_or_precision_and_the_yaml_keeps_the_rest(
    tmp_path, in_yaml, on_the_command_line, expected
):
    from app.config import parse_config

    path = tmp_path / "run.yaml"
    path.write_text(f"{in_yaml}\nlearning_rate: 1.0e-4\n")
    cfg = parse_config(["--config", str(path), *on_the_command_line])
    assert {name: getattr(cfg, name) for name in expected} == expected and cfg.learning_rate == 1e-4


@pytest.mark.parametrize(
    "name, nearest, meant",
    [
        ("max_train_steps", "--max_train_samples", "--max_steps"),  # the accelerate examples' flag: steps, not samples
        ("checkpointing_steps", "--gradient_checkpointing", "--save_steps"),
        ("gradient_clip_val", "--gradient_checkpointing", "--max_grad_norm"),  # Lightning's
        ("max_epochs", "--max_steps", "--num_train_epochs"),
    ],
)
def test_a_flag_of_another_trainer_gets_its_meaning_here_not_the_nearest_spelling(name, nearest, meant, capsys):
    from app.train import main

    assert main([f"--{name}", "1"]) == 2
    said = capsys.readouterr().err
    assert f"; use {meant}" in said and f"did you mean {nearest}" not in said, said


def test_a_home_folder_in_a_path_flag_or_a_yaml_is_the_users_home(tmp_path, monkeypatch):
    # A shell expands `--output_dir ~/x`, not `--output_dir=~/x` nor a YAML's `~/x`: the run wrote to a folder named
    # `~` in the working folder while its header said `model: ~/x`, the user's home.
    from app.config import parse_config
    from app.predict import parse_args

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "run.yaml").write_text("output_dir: ~/out\ntrain_file: ~/data/train.csv\n")
    cfg = parse_config(["--config=~/run.yaml", "--logdir=~/runs", "--max_steps", "2"])
    home = tmp_path / "home"
    assert (cfg.output_dir, cfg.train_file, cfg.logdir) == (f"{home}/out", f"{home}/data/train.csv", f"{home}/runs")
    predicting, _ = parse_args(["a text", "--model_name_or_path=~/out", "--output_file=~/predicted.csv"])
    assert (predicting.model_name_or_path, predicting.output_file) == (f"{home}/out", f"{home}/predicted.csv")


def test_a_precision_from_a_config_says_where_it_came_from(tmp_path, quick_args, capsys, monkeypatch):
    # "(from --mixed_precision ...)" and "note: --mixed_precision no overrides the launcher's 'fp16'" named a flag the
    # user had not typed.
    from tests.conftest import run_app

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    path = tmp_path / "run.yaml"
    path.write_text("mixed_precision: 'no'\n")
    assert run_app([*quick_args, "--config", path, "--max_steps", 1, "--eval_steps", 0]) == 0
    said = capsys.readouterr().out.splitlines()
    source = f"(--mixed_precision: from --config {path}; a flag on the command line overrides it)"
    assert (
        said[0]
        == f"precision: fp32, no autocast, on cpu, loss scaling off (from --mixed_precision: no was asked for) {source}"
    )
    assert said[1] == f"note: --mixed_precision no overrides ACCELERATE_MIXED_PRECISION=fp16 {source}"
