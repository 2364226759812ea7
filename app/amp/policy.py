"""The precision decision: made once, at start, into a frozen `PrecisionPolicy` that carries its reason.

The loop then calls `policy.autocast()` and the loss scaler the same way whatever was chosen: with AMP off,
`torch.autocast(enabled=False)` and `GradScaler(enabled=False)` are exact no-ops, so the loop has no `if amp:`.

Accelerate is always built with `mixed_precision="no"` (see host/runtime.py): if it autocast or scaled as well, its
autocast would override ours and the loss would be scaled twice.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from app.errors import UsageError

MODES = ("no", "fp16", "bf16")
LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"
# What accelerate launch sets beside LAUNCHER_ENV, and a shell seldom exports: its dynamo settings (for its one process
# and for torchrun's ranks) or, under a DeepSpeed config, which fields that config holds.
LAUNCHER_MARKS = ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "ACCELERATE_CONFIG_DS_FIELDS")
_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CPU_FP16_NOTE = (
    "fp16 on a CPU is real but rarely fast: CPUs without native fp16 emulate it, and even those with AVX512-FP16 "
    "seldom beat fp32 (docs/benchmarks.md). It is kept because it was asked for"
)

_CPU_EMULATED_BF16_NOTE = (
    "this CPU has no native bf16 ({native}): bf16 is emulated, several times slower than fp32 here "
    "(docs/precision.md). It is kept because it was asked for"
)
ARM_MACHINES = ("aarch64", "arm64")  # platform.machine() on Linux, and on macOS


@dataclass(frozen=True)
class PrecisionPolicy:
    """What runs, on which device, who asked for it and why."""

    mode: str  # "no", "fp16" or "bf16"
    device_type: str  # the torch device type that autocast applies to: "cpu", "cuda", ...
    source: str  # who decided: "--amp", "--mixed_precision", "accelerate launch", LAUNCHER_ENV or "auto"
    reason: str  # the why, in words, printed with the decision
    picked_by_auto: bool = False  # the mode is what `auto` picked for the device, not one asked for by name

    @property
    def autocast_enabled(self) -> bool:
        return self.mode != "no"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.mode]

    @property
    def label(self) -> str:
        """The name people use for the mode: "fp32" for "no"."""
        return "fp32" if self.mode == "no" else self.mode

    @property
    def pad_to_multiple_of(self) -> int | None:
        # Sequence lengths in multiples of 8 keep a GPU's fp16/bf16 matmuls on its tensor cores. A CPU has none, and
        # fp32 gains nothing: there the padding would only add tokens to compute.
        return 8 if self.autocast_enabled and self.device_type == "cuda" else None

    @property
    def scaler_enabled(self) -> bool:
        # bf16 has fp32's exponent range, so small gradients don't underflow and nothing needs scaling.
        return self.mode == "fp16"

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast_enabled)

    def describe(self, inference: bool = False) -> str:
        """The decision in one line; `inference` leaves out the loss scaling, which only training has."""
        compute = f"{self.mode} autocast" if self.autocast_enabled else "fp32, no autocast,"
        scaling = "" if inference else f", loss scaling {'on' if self.scaler_enabled else 'off'}"
        return f"precision: {compute} on {self.device_type}{scaling} (from {self.source}: {self.reason})"


def cpu_has_native_bf16() -> bool:
    """True on CPUs where bf16 matmuls run natively: AVX512-BF16 or AMX on x86, as torch's own probes find them; Arm's
    BF16 extension (Graviton3 and 4), which torch has no probe for, as the kernel lists the CPU's features."""
    machine = platform.machine()
    if is_arm(machine):
        return cpuinfo_has_native_bf16(machine, cpuinfo_text())
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def cpuinfo_has_native_bf16(machine: str, cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text names native bf16 for every CPU it lists: `avx512_bf16` or `amx_bf16` among an
    x86 CPU's `flags`, `bf16` among an Arm CPU's `Features` (Graviton2 has none)."""
    wanted = {"bf16"} if is_arm(machine) else {"avx512_bf16", "amx_bf16"}
    listed = cpus_features(cpuinfo)
    return bool(listed) and all(wanted & features for features in listed)


def cpus_features(cpuinfo: str) -> list[set[str]]:
    """Per CPU that /proc/cpuinfo's text lists, its features: an x86 CPU's `flags`, an Arm CPU's `Features`."""
    return [set(value.split()) for value in _cpuinfo_values(cpuinfo, ("flags", "Features"))]


def _cpuinfo_values(cpuinfo: str, names: tuple[str, ...]) -> list[str]:
    """The values of /proc/cpuinfo's lines named one of `names` (`model name : AMD EPYC`), one per CPU it lists."""
    return [value for name, _, value in (line.partition(":") for line in cpuinfo.splitlines()) if name.strip() in names]


def cpu_features() -> set[str]:
    """This machine's CPU features, as the benchmarks name them beside their figures (the first CPU's; none where
    /proc/cpuinfo is missing)."""
    return next(iter(cpus_features(cpuinfo_text())), set())


def cpu_model() -> str:
    """The CPU's model as lscpu names it on x86 (`model name`), else the machine's architecture."""
    models = _cpuinfo_values(cpuinfo_text(), ("model name",))
    return models[0].strip() if models else platform.processor() or platform.machine()


def native_bf16_kinds(machine: str) -> tuple[str, ...]:
    """What native bf16 is called on a CPU of this architecture, for the lines that say whether it has it."""
    return ("Arm BF16",) if is_arm(machine) else ("AVX512-BF16", "AMX")


def is_arm(machine: str) -> bool:
    return machine.lower() in ARM_MACHINES


@functools.cache  # asked by the policy, each of its lines, the backend line and the dropout masks: the CPU stays
def cpuinfo_text() -> str:
    """/proc/cpuinfo, read once; empty where there is none (not Linux: macOS on Apple silicon has no features to read,
    so none is taken as native)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")  # a model name in another encoding
    except OSError:
        return ""


def bf16_available(device_type: str) -> bool:
    """Whether this device runs bf16 natively (a GPU of compute capability 8.0 or more, or a CPU with AVX512-BF16/AMX
    or Arm BF16). A T4's or V100's bf16 is emulated, slower than fp32: torch's is_bf16_supported() counts it."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False
        return bool(torch.version.hip) or torch.cuda.get_device_capability()[0] >= 8  # Ampere on; every AMD GPU
    return device_type == "cpu" and cpu_has_native_bf16()


def wider_range_advice(device_type: str) -> str:
    """What to switch to where fp16's range is too narrow: bf16 where the device runs it natively, else fp32 (bf16
    emulated in software would train, slowly; a fallback would not pick it either)."""
    if bf16_available(device_type):
        return "--mixed_precision bf16 (no loss scaling needed)"
    return "--mixed_precision no (fp32: this device has no native bf16)"


def launcher_choice() -> str | None:
    """The mixed precision that `accelerate launch` asked for: its flag, a YAML or the wizard's default config."""
    return os.environ.get(LAUNCHER_ENV, "").strip().lower() or None  # as accelerate launch writes it: FP16 is fp16


def launcher_source() -> str:
    """Who set LAUNCHER_ENV: accelerate launch, or the variable itself, exported in a shell that runs the script with
    plain python (where "from accelerate launch" sent the user looking for a launcher that never ran)."""
    return "accelerate launch" if launched_by_accelerate() else LAUNCHER_ENV


def launched_by_accelerate() -> bool:
    return any(mark in os.environ for mark in LAUNCHER_MARKS)


def resolve_precision(
    amp: bool, mixed_precision: str | None, device_type: str, launcher: str | None
) -> tuple[PrecisionPolicy, list[str]]:
    """Resolve the one precision decision of this run.

    An explicit app flag (`--amp` or `--mixed_precision`) wins over the launcher; with neither, the launcher decides;
    with no launcher (plain `python`), "auto" picks what is fast on this device.

    Returns:
        The policy, and the notes to print with it (a disagreement with the launcher, a slow-fp16 warning).
    """
    if amp and mixed_precision not in (None, "fp16"):
        raise UsageError(f"--amp means fp16 but --mixed_precision is {mixed_precision!r}; pass only one of them")
    notes = []
    requested, source = requested_precision(amp, mixed_precision, launcher)

    if requested not in (*MODES, "auto"):
        # Only the launcher's value reaches here (the flags take their choices): fp8, or a shell's typo.
        fix = (
            "launch with --mixed_precision fp16, bf16 or no"
            if source == "accelerate launch"
            else f"set {LAUNCHER_ENV} to fp16, bf16, no or auto, or unset it"
        )
        raise UsageError(
            f"mixed precision {requested!r} (from {LAUNCHER_ENV}) is not supported; {fix}, or give the script "
            "--mixed_precision fp16, bf16 or no"
        )
    mode, reason = _pick_mode(requested, device_type)
    # What runs is compared, not the word asked for: `auto` that resolves to the launcher's mode agrees with it.
    if source.startswith("--") and launcher is not None and launcher != mode:
        asked = f"--amp ({mode})" if amp else f"--mixed_precision {requested}"
        if requested == "auto":
            asked += f" (-> {mode})"
        launched = launcher_source() == "accelerate launch"
        overridden = f"the launcher's {launcher!r}" if launched else f"{LAUNCHER_ENV}={launcher}"
        notes.append(f"note: {asked} overrides {overridden}")
    if mode == "fp16" and device_type == "cpu":
        alternative = "--mixed_precision bf16 (this CPU has native bf16) or " if cpu_has_native_bf16() else ""
        notes.append(f"warning: {_CPU_FP16_NOTE}. For speed use {alternative}--mixed_precision no.")
    if mode == "bf16" and device_type == "cpu" and not cpu_has_native_bf16():
        native = " or ".join(native_bf16_kinds(platform.machine()))
        notes.append(f"warning: {_CPU_EMULATED_BF16_NOTE.format(native=native)}. For speed use --mixed_precision no.")
    if mode == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("bf16 was asked for but this GPU has no bf16 support; use --mixed_precision fp16 or no")
    return PrecisionPolicy(mode, device_type, source, reason, picked_by_auto=requested == "auto"), notes


def requested_precision(amp: bool, mixed_precision: str | None, launcher: str | None) -> tuple[str, str]:
    """What is asked for, and by whom: an app flag, else the launcher, else `auto`."""
    if amp:
        return "fp16", "--amp"
    if mixed_precision is not None:
        return mixed_precision, "--mixed_precision"
    if launcher is not None:
        return launcher, launcher_source()
    return "auto", "auto"


def picks_fp16(amp: bool, mixed_precision: str | None, launcher: str | None, device_type: str) -> bool:
    """Whether the run would compute in fp16 (with a loss scaler), as resolve_precision decides it."""
    return _pick_mode(requested_precision(amp, mixed_precision, launcher)[0], device_type)[0] == "fp16"


def _pick_mode(requested: str, device_type: str) -> tuple[str, str]:
    if requested != "auto":
        return requested, f"{requested} was asked for"
    if device_type == "cuda":
        return "fp16", "a GPU, where fp16 tensor cores are fastest"
    if device_type == "cpu" and cpu_has_native_bf16():
        native = "/".join(native_bf16_kinds(platform.machine()))
        return "bf16", f"this CPU has native bf16 ({native}), which beats fp32 and fp16 on CPUs that have it"
    if device_type == "cpu":
        return "no", "this CPU has no native bf16 or fp16, so fp32 is fastest"
    return "no", f"no measured fast low precision on {device_type}"


def refuse_amp_under_deepspeed(policy: PrecisionPolicy, requested_backend: str | None) -> None:
    """DeepSpeed's engine owns precision: it scales the loss itself (this app's scaler would scale it twice) and casts
    the model for bf16 (this app's autocast would run on top of it). Refuse, don't delegate.

    Args:
        requested_backend: what the launch config asked for, as runtime.requested_backend reads it.
    """
    if requested_backend == "DeepSpeed" and policy.autocast_enabled:
        owns = (
            "loss scaling and this app's would scale twice"
            if policy.scaler_enabled
            else "the model's precision (its bf16 setting casts the model)"
        )
        raise UsageError(
            f"{what_was_asked(policy)} under a DeepSpeed launch config is refused, not delegated: DeepSpeed's engine "
            f"owns {owns}; "
            "launch with accelerate_configs/fsdp.yaml (or multi_gpu.yaml) instead, or set "
            f"{policy.mode} in DeepSpeed's own config and pass --mixed_precision no"
        )


def what_was_asked(policy: PrecisionPolicy) -> str:
    """The mode, and where `auto` picked it, the auto that did: a refusal of what auto picked read as if that mode
    had been asked for by name."""
    if not policy.picked_by_auto:
        return policy.mode
    who = {"auto": "auto, as no precision was asked for", "--mixed_precision": "--mixed_precision auto"}.get(
        policy.source, f"{LAUNCHER_ENV}=auto"
    )
    return f"{policy.mode} (picked for this {policy.device_type} by {who})"
