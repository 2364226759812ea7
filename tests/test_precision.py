"""The precision mapping: launcher setting x app flag -> what actually runs, resolved once and said in one line."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.errors import UsageError
from app.precision import cpu_has_native_bf16, resolve_precision
from tests.conftest import launch, python_app

AUTO_CPU = "bf16" if cpu_has_native_bf16() else "no"


@pytest.mark.parametrize(
    "amp, flag, device, launcher, mode, source, disagreement",
    [
        (False, None, "cpu", None, AUTO_CPU, "auto", False),  # plain python: fast for the device
        (False, None, "cuda", None, "fp16", "auto", False),
        (False, None, "cpu", "fp16", "fp16", "accelerate launch", False),  # the launcher decides
        (False, None, "cpu", "no", "no", "accelerate launch", False),
        (True, None, "cpu", "no", "fp16", "--amp", True),  # an app flag wins, and says so
        (True, "fp16", "cpu", "fp16", "fp16", "--amp", False),
        (False, "no", "cpu", "bf16", "no", "--mixed_precision", True),
        (False, "bf16", "cpu", None, "bf16", "--mixed_precision", False),
        (False, "auto", "cpu", "no", AUTO_CPU, "--mixed_precision", AUTO_CPU != "no"),
    ],
)
def test_resolution_table(amp, flag, device, launcher, mode, source, disagreement):
    policy, notes = resolve_precision(amp, flag, device, launcher)
    assert (policy.mode, policy.source) == (mode, source)
    assert any("overrides the launcher" in n for n in notes) == disagreement
    assert policy.scaler_enabled == (mode == "fp16")
    assert policy.autocast_enabled == (mode != "no")


@pytest.mark.parametrize(
    "native_bf16, launcher, expected_note",
    [
        (False, "no", None),  # auto resolves to fp32: it agrees with the launcher, nothing to say
        (True, "no", "note: --mixed_precision auto (-> bf16) overrides the launcher's 'no'"),
        (False, "bf16", "note: --mixed_precision auto (-> no) overrides the launcher's 'bf16'"),
        (True, "bf16", None),
    ],
)
def test_the_override_note_compares_what_runs_with_the_launcher(monkeypatch, native_bf16, launcher, expected_note):
    monkeypatch.setattr("app.precision.cpu_has_native_bf16", lambda: native_bf16)
    policy, notes = resolve_precision(False, "auto", "cpu", launcher)
    assert policy.mode == ("bf16" if native_bf16 else "no")
    assert [n for n in notes if n.startswith("note:")] == ([expected_note] if expected_note else [])


def test_fp16_on_cpu_warns_and_names_the_alternatives():
    _, notes = resolve_precision(True, None, "cpu", None)
    warning = next(n for n in notes if n.startswith("warning:"))
    assert "rarely fast" in warning and "kept because it was asked for" in warning and "--mixed_precision no" in warning
    assert ("--mixed_precision bf16" in warning) == cpu_has_native_bf16()


@pytest.mark.parametrize(
    "bad", [dict(amp=True, flag="bf16", launcher=None), dict(amp=False, flag=None, launcher="fp8")]
)
def test_conflicts_and_unsupported_modes_are_usage_errors(bad):
    with pytest.raises(UsageError):
        resolve_precision(bad["amp"], bad["flag"], "cpu", bad["launcher"])


def test_disabled_tools_are_exact_no_ops():
    policy, _ = resolve_precision(False, "no", "cpu", None)
    scaler = policy.make_scaler(65536.0, 2000, backend="single process")
    loss = torch.tensor(3.0, requires_grad=True)
    with policy.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


PRECISION_LINE = re.compile(r"^precision: .*$", re.MULTILINE)


def test_launcher_and_app_flags_map_to_what_runs(tmp_path, quick_args):
    """Real `accelerate launch` subprocesses: its flag, a --config_file YAML, the wizard's default config, --amp.

    The YAML case says bf16 and the app flag overrides it, so its note shows the YAML was read."""
    bf16_yaml = tmp_path / "bf16.yaml"
    bf16_yaml.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nuse_cpu: true\n"
        "num_processes: 1\nmixed_precision: bf16\n"
    )
    wizard_home = tmp_path / "wizard_home"
    (wizard_home / "accelerate").mkdir(parents=True)
    (wizard_home / "accelerate" / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nuse_cpu: true\nnum_processes: 1\n"
        "mixed_precision: fp16\n"
    )
    cases = {  # name: (launcher flags, app flags, env, expected start of the precision line, expected note)
        "launcher fp16": (
            ["--mixed_precision", "fp16"],
            [],
            {},
            "precision: fp16 autocast on cpu, loss scaling on (from accelerate launch",
            None,
        ),
        "launcher no": (
            ["--mixed_precision", "no"],
            [],
            {},
            "precision: fp32, no autocast, on cpu, loss scaling off (from accelerate launch",
            None,
        ),
        "--amp over launcher default": (
            [],
            ["--amp"],
            {},
            "precision: fp16 autocast on cpu, loss scaling on (from --amp",
            "note: --amp (fp16) overrides the launcher's 'no'",
        ),
        "app flag over yaml": (
            ["--config_file", bf16_yaml],
            ["--mixed_precision", "no"],
            {},
            "precision: fp32, no autocast",
            "note: --mixed_precision no overrides the launcher's 'bf16'",
        ),
        "wizard default config": (
            [],
            [],
            {"HF_HOME": str(wizard_home)},
            "precision: fp16 autocast on cpu, loss scaling on (from accelerate launch",
            None,
        ),
    }

    def run_case(item):
        name, (launcher_flags, app_flags, env, _, _) = item
        args = [
            *quick_args,
            "--max_steps",
            "1",
            "--eval_steps",
            "0",
            "--max_eval_samples",
            "8",
            "--output_dir",
            tmp_path / name / "out",
            "--logdir",
            tmp_path / name / "runs",
            *app_flags,
        ]
        return name, launch(tmp_path, launcher_flags, args, **env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(run_case, cases.items()))
    for name, (_, _, _, expected_line, expected_note) in cases.items():
        result = results[name]
        assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}"
        lines = PRECISION_LINE.findall(result.stdout)
        assert len(lines) == 1 and lines[0].startswith(expected_line), f"{name}: {lines}"
        if expected_note:
            assert expected_note in result.stdout, f"{name}: {result.stdout[:1500]}"
        else:
            assert "overrides the launcher" not in result.stdout, name


def test_plain_python_picks_the_fast_precision(tmp_path, quick_args):
    result = python_app(tmp_path, [*quick_args, "--max_steps", "1", "--eval_steps", "0", "--max_eval_samples", "8"])
    assert result.returncode == 0, result.stderr[-2000:]
    expected = "bf16 autocast on cpu" if AUTO_CPU == "bf16" else "fp32, no autocast, on cpu"
    assert f"precision: {expected}, loss scaling off (from auto:" in result.stdout
