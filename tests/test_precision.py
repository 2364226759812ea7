"""The precision mapping: launcher setting x app flag -> what actually runs, resolved once and said in one line."""

from __future__ import annotations

import os
import platform
import re

import pytest
import torch
from accelerate.utils import compare_versions

from app.amp.policy import resolve_precision
from app.amp.scaler import make_scaler
from app.errors import UsageError
from tests.conftest import BF16_SWITCH, REAL_BF16_PROBE, force_bf16_probe, launch, run_app

# `auto` on a CPU in the table below. The table forces the app's bf16 probe to match, so it holds on any host; the
# suite-wide switch picks the branch (bf16 unless AMP_TRAINER_TEST_BF16=0), and the tests after it cover both anyway.
AUTO_CPU = "no" if os.environ.get(BF16_SWITCH) == "0" else "bf16"


def as_launched(monkeypatch) -> None:
    """The environment of a process that accelerate launch started: beside its choice, its dynamo settings."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False")


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
def test_resolution_table(monkeypatch, amp, flag, device, launcher, mode, source, disagreement):
    force_bf16_probe(monkeypatch, AUTO_CPU == "bf16")
    as_launched(monkeypatch)
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
    force_bf16_probe(monkeypatch, native_bf16)
    as_launched(monkeypatch)
    policy, notes = resolve_precision(False, "auto", "cpu", launcher)
    assert policy.mode == ("bf16" if native_bf16 else "no")
    assert [n for n in notes if n.startswith("note:")] == ([expected_note] if expected_note else [])


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_auto_on_a_cpu_follows_the_bf16_probe(monkeypatch, native):
    force_bf16_probe(monkeypatch, native)
    for flag, launcher in ((None, None), ("auto", "fp16")):  # plain python, and --mixed_precision auto over a launcher
        policy, _ = resolve_precision(False, flag, "cpu", launcher)
        assert policy.mode == ("bf16" if native else "no"), (flag, launcher)
        assert ("has native bf16" in policy.reason) == native


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_fp16_on_cpu_warns_and_names_the_alternatives(monkeypatch, native):
    force_bf16_probe(monkeypatch, native)
    _, notes = resolve_precision(True, None, "cpu", None)
    warning = next(n for n in notes if n.startswith("warning:"))
    assert "rarely fast" in warning and "kept because it was asked for" in warning and "--mixed_precision no" in warning
    assert ("--mixed_precision bf16" in warning) == native


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_bf16_asked_for_on_a_cpu_without_native_bf16_warns(monkeypatch, native):
    # Emulated, it is several times slower than fp32: fp16 on a CPU warned, bf16 said nothing.
    force_bf16_probe(monkeypatch, native)
    expected = (
        "warning: this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 is emulated, several times slower than fp32 "
        "here (docs/precision.md). It is kept because it was asked for. For speed use --mixed_precision no."
    )
    for amp, flag, launcher in ((False, "bf16", None), (False, None, "bf16")):
        policy, notes = resolve_precision(amp, flag, "cpu", launcher)
        assert policy.mode == "bf16"
        assert [n for n in notes if n.startswith("warning:")] == ([] if native else [expected])


GRAVITON3 = (
    "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
    "cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca "
    "pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
)
GRAVITON2 = (
    "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
    "lrcpc dcpop asimddp ssbs\nCPU part\t: 0xd0c\n"
)


def x86(*flags: str) -> str:
    """/proc/cpuinfo of an x86 CPU with AVX-512 and `flags`; an Intel CPU's `vmx flags` line names no CPU feature."""
    return f"processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {' '.join(flags)}\nvmx flags\t: vnmi ept\n"


@pytest.mark.parametrize(
    "machine, cpuinfo, native",
    [
        ("aarch64", GRAVITON3, True),  # `auto` picked fp32 there, and bf16 asked for warned of emulation
        ("aarch64", GRAVITON2, False),
        ("aarch64", GRAVITON3 + GRAVITON2.replace(": 0", ": 1", 1), False),  # one CPU without it
        ("arm64", GRAVITON3, True),
        ("aarch64", x86("avx512_bf16"), False),  # x86's names mean nothing on Arm
        ("x86_64", x86("avx512_bf16"), True),
        ("x86_64", x86("amx_bf16", "amx_tile"), True),
        ("x86_64", x86("avx512_fp16"), False),
        ("x86_64", GRAVITON3, False),
        ("aarch64", "", False),  # no /proc/cpuinfo
    ],
    ids=[
        *("graviton3", "graviton2", "one-arm-cpu-without", "arm64-graviton3", "x86-flags-on-arm", "avx512-bf16"),
        *("amx", "avx512-fp16-only", "arm-features-on-x86", "no-cpuinfo"),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags_of_x86_and_arm(machine, cpuinfo, native):
    from app.amp.policy import cpuinfo_has_native_bf16

    assert cpuinfo_has_native_bf16(machine, cpuinfo) == native


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_an_arm_cpu_is_told_of_its_own_bf16(monkeypatch, native):
    # "AVX512-BF16 or AMX" on a Graviton named features an Arm CPU never has.
    force_bf16_probe(monkeypatch, native)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    auto, _ = resolve_precision(False, "auto", "cpu", None)
    _, notes = resolve_precision(False, "bf16", "cpu", None)
    assert auto.mode == ("bf16" if native else "no")
    assert ("this CPU has native bf16 (Arm BF16)" in auto.reason) == native
    assert [n for n in notes if "(Arm BF16)" in n] == ([] if native else [notes[0]]), notes


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="the CPU's flags are read from /proc/cpuinfo")
def test_the_bf16_probe_agrees_with_the_cpu_flags():
    """The real probe (not the one the suite's switch may force), against what the kernel says this CPU has."""
    from app.amp.policy import cpuinfo_has_native_bf16, is_arm

    if is_arm(platform.machine()):  # there the probe is that reading itself, which the table above tests
        pytest.skip("on Arm the probe reads /proc/cpuinfo itself; torch's probes are checked on x86")

    with open("/proc/cpuinfo") as cpuinfo:
        assert REAL_BF16_PROBE() == cpuinfo_has_native_bf16(platform.machine(), cpuinfo.read())


@pytest.mark.parametrize(
    "bad", [dict(amp=True, flag="bf16", launcher=None), dict(amp=False, flag=None, launcher="fp8")]
)
def test_conflicts_and_unsupported_modes_are_usage_errors(bad):
    with pytest.raises(UsageError):
        resolve_precision(bad["amp"], bad["flag"], "cpu", bad["launcher"])


def test_the_launchers_variable_is_read_as_accelerate_reads_it(monkeypatch):
    # ACCELERATE_MIXED_PRECISION=FP16, which Accelerate takes as fp16, was "mixed precision 'FP16' (from accelerate
    # launch) is not supported"; an empty one the same, and neither came from accelerate launch.
    from app.amp.policy import launcher_choice

    for value, read in (("FP16", "fp16"), (" bf16 ", "bf16"), ("", None)):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
        assert launcher_choice() == read, value
    with pytest.raises(UsageError, match=r"mixed precision 'fp8' \(from ACCELERATE_MIXED_PRECISION\) is not supported"):
        resolve_precision(False, None, "cpu", "fp8")


@pytest.mark.parametrize("launched", [False, True])
def test_a_launchers_precision_the_app_lacks_gets_advice_for_where_it_was_set(monkeypatch, launched):
    # An exported ACCELERATE_MIXED_PRECISION=bogus was told to use accelerate launch, with app/train.py named to
    # predict.py too; accelerate launch --mixed_precision fp8 is the launcher's own value, fixed at the launcher.
    monkeypatch.delenv("ACCELERATE_CONFIG_DS_FIELDS", raising=False)
    if launched:
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False")
    else:
        monkeypatch.delenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", raising=False)
    with pytest.raises(UsageError) as refused:
        resolve_precision(False, None, "cpu", "fp8" if launched else "bogus")
    line = str(refused.value)
    assert "app/train.py" not in line and "--mixed_precision fp16, bf16 or no" in line
    where = "launch with --mixed_precision" if launched else "set ACCELERATE_MIXED_PRECISION to fp16, bf16, no or auto"
    assert where in line


@pytest.mark.parametrize("mark", ["", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "ACCELERATE_CONFIG_DS_FIELDS"])
def test_the_variable_exported_in_a_shell_is_named_where_no_launcher_ran(monkeypatch, mark):
    # `export ACCELERATE_MIXED_PRECISION=fp16; python app/train.py` said "(from accelerate launch: ...)", and a flag
    # against it "overrides the launcher's", where no launcher had run. accelerate launch sets its dynamo settings
    # beside it (one process, torchrun's ranks), or a DeepSpeed config's fields.
    for variable in ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "ACCELERATE_CONFIG_DS_FIELDS"):
        monkeypatch.delenv(variable, raising=False)
    if mark:
        monkeypatch.setenv(mark, "False" if "DYNAMO" in mark else "")
    who = "accelerate launch" if mark else "ACCELERATE_MIXED_PRECISION"
    policy, _ = resolve_precision(False, None, "cpu", "fp16")
    assert policy.describe() == f"precision: fp16 autocast on cpu, loss scaling on (from {who}: fp16 was asked for)"
    _, notes = resolve_precision(False, "no", "cpu", "fp16")
    overridden = "the launcher's 'fp16'" if mark else "ACCELERATE_MIXED_PRECISION=fp16"
    assert notes == [f"note: --mixed_precision no overrides {overridden}"]


def test_disabled_tools_are_exact_no_ops():
    policy, _ = resolve_precision(False, "no", "cpu", None)
    scaler = make_scaler(policy, 65536.0, 2000, backend="single process")
    loss = torch.tensor(3.0, requires_grad=True)
    with policy.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


PRECISION_LINE = re.compile(r"^precision: .*$", re.MULTILINE)


@pytest.mark.slow
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

    # One launch at a time: two forked from this process's threads at once now and then lost one's exit status to the
    # fork server (exit code 255, nothing said), a fault of the test's harness, not of the app.
    results = dict(map(run_case, cases.items()))
    for name, (_, _, _, expected_line, expected_note) in cases.items():
        result = results[name]
        assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}"
        lines = PRECISION_LINE.findall(result.stdout)
        assert len(lines) == 1 and lines[0].startswith(expected_line), f"{name}: {lines}"
        if expected_note:
            assert expected_note in result.stdout, f"{name}: {result.stdout[:1500]}"
        else:
            assert "overrides the launcher" not in result.stdout, name
        # accelerate launch 1.16 and later kills its one process 5 s after passing a signal on; the app says how to
        # give a checkpoint longer.
        told = re.search(r"accelerate launch kills this process 5 s .* kill -TERM \d+\n", result.stdout) is not None
        assert told == compare_versions("accelerate", ">=", "1.16.0"), f"{name}: {result.stdout[:1500]}"


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_plain_python_picks_the_fast_precision(quick_args, monkeypatch, capfd, native):
    """Without a launcher, as `python app/train.py` runs: no launcher choice in the environment, so the app's own
    default decides. In this process (the launched cases are above)."""
    force_bf16_probe(monkeypatch, native)
    for name in [name for name in os.environ if name.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    code = run_app([*quick_args, "--max_steps", "1", "--eval_steps", "0", "--max_eval_samples", "8"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    expected = "bf16 autocast on cpu" if native else "fp32, no autocast, on cpu"
    assert f"precision: {expected}, loss scaling off (from auto:" in out
    assert "training: SIGTERM or Ctrl-C saves a checkpoint, then stops\n" in out  # no launcher to warn of
