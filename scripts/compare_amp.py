"""Run the same job with AMP off and on (and bf16 with --with_bf16), then report what AMP did on this hardware.

    python scripts/compare_amp.py --max_steps 20                        # the embedded default, fp32 vs fp16
    python scripts/compare_amp.py --with_bf16 --max_steps 200 --eval_steps 50
    python scripts/compare_amp.py --launcher "accelerate launch --config_file accelerate_configs/gpu.yaml"
    python scripts/compare_amp.py --model_name_or_path bert-base-uncased --train_file train.csv --max_steps 500

Every flag this script does not know passes through to app/train.py, unchanged, for every run: same seed, data
order and steps. They are read first as app/train.py reads them (a --config YAML included), so a flag no run takes
stops the script before any run, and so does one it sets itself (--amp, --mixed_precision, --run_name, --output_dir,
--resume_from_checkpoint); a --config's values of these give way to each run's own, but a resume. The runs differ in
precision only: `--pad_to_multiple_of` is set once for all of them (default: what AMP runs pad to on this device, 8 on
a GPU and none on a CPU), so every run sees the same batch shapes and, with them, the same dropout masks.
The runs go to <logdir>/<name>-no, <name>-fp16 (and <name>-bf16), and the comparison to <logdir>/<name>/<fp32|fp16|
bf16>: in TensorBoard's Custom Scalars tab, its charts put the precisions' gradient norm, train loss, eval loss,
samples/s and peak memory on one chart each, one line (and colour) per precision. A run without the scaler's tags
(amp/loss_scale, ...) had loss scaling off: the report says "off".
--report_dir gets report.md and comparison.png: loss curves, loss scale, throughput and peak memory, a table of
ratios, eval metrics, padding, the fp16 pre-flight, whether this device has native fp16/bf16 matmuls, and a verdict
in words that names the likely cause when fp16 did not pay off.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from app.amp.policy import cpu_features, cpu_has_native_bf16, is_arm  # noqa: E402
from app.config import given_fields, parse_config  # noqa: E402
from app.errors import UsageError  # noqa: E402
from app.telemetry import layout, tags  # noqa: E402
from app.telemetry.meters import peak_memory_tag  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_ENOUGH = "Not enough steps to judge"
OWNED_FLAGS = ("amp", "mixed_precision", "run_name", "output_dir", "resume_from_checkpoint")  # TrainConfig's
LABELS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
EVAL_METRICS = (tags.EVAL_ACCURACY, tags.EVAL_F1, tags.EVAL_PERPLEXITY, tags.EVAL_EXACT_MATCH)
SHARES = {tags.EVAL_ACCURACY: "accuracy", tags.EVAL_EXACT_MATCH: "exact-match"}  # metrics whose change is in points


def amp_padding() -> int:
    """What an AMP run pads to on its own on this device (PrecisionPolicy.pad_to_multiple_of); 1 for none."""
    from app.amp.policy import resolve_precision
    from app.host.device import device_type

    return resolve_precision(True, None, device_type(), None)[0].pad_to_multiple_of or 1


def default_launcher() -> list[str]:
    """One process, with every value accelerate launch would otherwise default (and warn of in a banner) given, as
    `make train` gives them; precision is each run's own flag."""
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "1"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if not torch.cuda.is_available():  # accelerate launch gives a CPU process one thread unless told otherwise
        launcher += ["--num_cpu_threads_per_process", str(os.cpu_count() or 1)]
    return launcher


def native_matmuls(gpu: bool) -> dict[str, str | None]:
    """Per low precision, the hardware that runs its matmuls natively on this machine, or None where it is emulated."""
    if gpu:
        major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        return {
            "fp16": f"tensor cores (sm_{major}{minor})" if major >= 7 else None,
            "bf16": f"tensor cores (sm_{major}{minor})" if major >= 8 else None,
        }
    flags = cpu_features()
    named = {"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}
    have = lambda *keys: ", ".join(named[k] for k in keys if k in flags) or None  # noqa: E731
    # Arm's BF16 extension, as the app's auto counts it (its fp16 arithmetic is no matmul unit: left out, as before)
    arm_bf16 = "Arm BF16" if is_arm(platform.machine()) and cpu_has_native_bf16() else None
    return {"fp16": have("avx512_fp16", "amx_fp16"), "bf16": have("avx512_bf16", "amx_bf16") or arm_bf16}


def read_run(run_dir: Path) -> dict:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    curves = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    device, preflight, fallback = "unknown device", None, None
    for tag in events.Tags()["tensors"]:
        if not tag.endswith("/text_summary"):
            continue  # the custom-scalars layout is a tensor too, but not text
        text = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        if tag.startswith("run/environment"):
            device = next(
                (row.split("|")[2].strip() for row in text.splitlines() if row.startswith("| device |")), device
            )
        if tag.startswith(tags.AMP_PREFLIGHT + "/"):
            preflight = text
        if tag.startswith(tags.AMP_FALLBACK + "/"):  # --on_scale_collapse fallback: it ended in another precision
            fallback = text
    gpu_run = tags.MEMORY_PEAK_ALLOCATED_GIB in curves
    memory_tag, memory_kind = peak_memory_tag(torch.device("cuda" if gpu_run else "cpu"))
    last = lambda tag: curves[tag][max(curves[tag])] if curves.get(tag) else float("nan")  # noqa: E731
    speeds = list(curves.get(tags.PERF_SAMPLES_PER_SEC, {}).values())
    padding = list(curves.get(tags.PERF_PADDING_FRACTION, {}).values())
    # The scaler's tags are written only while loss scaling is on; a run that fell back ended without it.
    scaled = bool(curves.get(tags.AMP_LOSS_SCALE)) and fallback is None
    return {
        "curves": curves,
        "device": device,
        "gpu": gpu_run,
        "timed_intervals": len(speeds),  # log intervals with a throughput: the first step is warm-up, not timed
        "samples_per_sec": last(tags.RUN_SAMPLES_PER_SEC),  # the run's, as its summary says: not a mean of intervals
        "padding_fraction": sum(padding) / len(padding) if padding else float("nan"),
        "preflight": preflight,
        "peak_memory_gib": max(curves.get(memory_tag, {0: float("nan")}).values()),
        "memory_kind": memory_kind,
        "metrics": {tag: last(tag) for tag in EVAL_METRICS if curves.get(tag)},  # the task's: a classifier's or an LM's
        "eval_loss": last(tags.EVAL_LOSS),
        "loss_scaling": scaled,
        "skipped_steps": last(tags.AMP_SKIPPED_STEPS) if scaled else 0,
        "loss_scale": last(tags.AMP_LOSS_SCALE) if scaled else None,
        "fallback": fallback,
    }


def largest_deviation(reference: dict[int, float], other: dict[int, float]) -> float:
    common = reference.keys() & other.keys()
    return max((abs(reference[s] - other[s]) for s in common), default=float("nan"))


def _deviation(base: dict, run: dict) -> str:
    reference, other = base["curves"].get(tags.TRAIN_LOSS, {}), run["curves"].get(tags.TRAIN_LOSS, {})
    common = reference.keys() & other.keys()
    if not common:
        return "no common logged steps"
    if not all(math.isfinite(reference[step]) and math.isfinite(other[step]) for step in common):
        return "not finite (a loss was inf or nan)"  # max() would skip a nan that is not first
    return f"{largest_deviation(reference, other):.2e}"


def verdict(runs: dict[str, dict], native: dict[str, str | None]) -> str:
    """The comparison in words. `native`: as native_matmuls says, for the device the runs ran on."""
    base, fp16 = runs["no"], runs["fp16"]
    where = f"on this {base['device']}"
    where_first = where[0].upper() + where[1:]  # at the start of a sentence
    if fp16.get("fallback"):  # its speed, memory and metrics are the other precision's: nothing to say of fp16's
        instead = "--mixed_precision bf16" if native["bf16"] else "--mixed_precision no"
        return (
            f"fp16 did not train this job {where}: its loss scale collapsed, and the run fell back "
            f"({fp16['fallback']}), so its column is mostly the other precision's. Use {instead} here, or fix what "
            "overflows (the pre-flight and the overflow report name the module)."
        )
    if not (base["timed_intervals"] and fp16["timed_intervals"]):
        return (
            f"{NOT_ENOUGH} {where}: the fp32 run timed {base['timed_intervals']} log interval(s) and fp16 "
            f"{fp16['timed_intervals']} (the first optimizer step is warm-up and is never timed); "
            "give more --max_steps than --logging_steps."
        )
    speed = fp16["samples_per_sec"] / base["samples_per_sec"]
    memory = fp16["peak_memory_gib"] / base["peak_memory_gib"]
    name, points, change = quality_change(base, fp16)
    steps = max(fp16["curves"].get(tags.TRAIN_LOSS, {1: 0}))
    skipped = fp16["skipped_steps"] if fp16["skipped_steps"] > 0.05 * steps else 0
    if speed >= 1.1:
        text = (
            f"{where_first} fp16 is {speed:.2f}x the speed of fp32 with {memory:.2f}x the peak memory and {change}: "
            "use --amp here."
        )
    else:
        if speed < 0.9:
            better = "--mixed_precision no"
            if "bf16" in runs and runs["bf16"]["timed_intervals"]:
                bf16_speed = runs["bf16"]["samples_per_sec"] / base["samples_per_sec"]
                better += f" or bf16 ({bf16_speed:.2f}x fp32)" if bf16_speed > 1 else ""
            elif native["bf16"]:
                better += f" or try bf16 (this device has {native['bf16']}: --with_bf16 measures it)"
            text = f"{where_first} fp16 is {speed:.2f}x the speed of fp32: use {better} here."
        else:
            text = (
                f"{where_first} fp16 runs at about the speed of fp32 ({speed:.2f}x) with {memory:.2f}x the peak "
                "memory; use --amp only if the memory matters."
            )
        text += f" Likely cause: {likely_cause(native)}."
    if skipped:  # samples/s counts a skipped step's batches as any other's: the skips cost updates, not speed
        fewer = "no update at all" if skipped >= steps else "fewer updates"
        text += (
            f" Note: the scaler skipped {skipped:.0f} of {steps} steps, so fp16 trained with {fewer} (a matter "
            "of quality, not speed); watch amp/loss_scale."
        )
    if fp16["preflight"] and fp16["preflight"].lstrip().startswith("warning"):
        text += " The fp16 pre-flight warned before step 1 (see below)."
    if points is not None and points < -1:
        text += f" {name.capitalize()} fell by {-points:.1f} points with fp16."
    return text


def quality_change(base: dict, run: dict) -> tuple[str | None, float | None, str]:
    """The change of the task's headline metric from `base` to `run`: its name, the change in points (for a share:
    a classifier's accuracy, an LM's exact match), and in words. Without either (an LM on plain text): eval/loss."""
    for tag, name in SHARES.items():
        if tag in base["metrics"] and tag in run["metrics"]:
            points = 100 * (run["metrics"][tag] - base["metrics"][tag])
            return name, points, f"an {name} change of {points:+.1f} points"
    return None, None, f"an eval/loss change of {run['eval_loss'] - base['eval_loss']:+.4f}"


def likely_cause(native: dict[str, str | None]) -> str:
    """Why fp16 was no faster: the hardware, else the job's size. Not skipped steps: a skipped step computed its
    forward and backward passes as an applied one did, and samples/s counts its batches."""
    if not native["fp16"]:
        return "this device has no native fp16 matmuls (no tensor cores, AVX512-FP16 or AMX-FP16), so fp16 is emulated"
    return (
        "the model or batch is too small for matmuls to dominate a step: casts, the loss scaler and the optimizer "
        "cost the same in both runs"
    )


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((loss_ax, scale_ax), (speed_ax, memory_ax)) = plt.subplots(2, 2, figsize=(11, 8))
    for mode, run in runs.items():
        loss = run["curves"].get(tags.TRAIN_LOSS, {})
        loss_ax.plot(list(loss), list(loss.values()), label=LABELS[mode], marker=".")
        if scale := run["curves"].get(tags.AMP_LOSS_SCALE):  # runs without loss scaling have none
            scale_ax.plot(list(scale), list(scale.values()), label=LABELS[mode], marker=".")
    loss_ax.set(title="train/loss", xlabel="optimizer step")
    scale_ax.set(title="amp/loss_scale", xlabel="optimizer step", yscale="log")
    names = [LABELS[m] for m in runs]
    speed_ax.bar(names, [run["samples_per_sec"] for run in runs.values()], color="tab:blue")
    speed_ax.set(title="throughput (samples/s)")
    memory_ax.bar(names, [run["peak_memory_gib"] for run in runs.values()], color="tab:orange")
    memory_ax.set(title=f"peak memory (GiB, {runs['no']['memory_kind']})")
    for ax in (loss_ax, scale_ax):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _metric(tag: str):
    return lambda run: f"{run['metrics'][tag]:.4f}" if tag in run["metrics"] else "none"


def _delta(base: dict, tag: str):
    return lambda run: f"{100 * (run['metrics'][tag] - base['metrics'][tag]):+.2f}" if tag in run["metrics"] else "none"


def _timed(run: dict, text: str) -> str:
    return text if run["timed_intervals"] else "not enough steps"


def write_report(runs: dict[str, dict], command: list[str], path: Path, pad_to: str) -> str:
    base = runs["no"]
    native = native_matmuls(base["gpu"])
    rows = {
        "samples/s": lambda r: _timed(r, f"{r['samples_per_sec']:.2f}"),
        "speed-up vs fp32": lambda r: _timed(base, _timed(r, f"{r['samples_per_sec'] / base['samples_per_sec']:.2f}x")),
        "timed log intervals": lambda r: f"{r['timed_intervals']}",
        f"peak memory (GiB, {base['memory_kind']})": lambda r: f"{r['peak_memory_gib']:.3f}",
        "peak-memory ratio vs fp32": lambda r: f"{r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x",
        **{f"final {tag}": _metric(tag) for tag in base["metrics"]},
        **{
            f"eval-{name} delta vs fp32 (points)": _delta(base, tag)
            for tag, name in SHARES.items()
            if tag in base["metrics"]
        },
        "final eval/loss": lambda r: f"{r['eval_loss']:.4f}",
        "largest train/loss deviation vs fp32": lambda r: _deviation(base, r),
        "padding fraction": lambda r: f"{r['padding_fraction']:.3f}",
        "skipped steps": lambda r: f"{r['skipped_steps']:.0f}" if r["loss_scaling"] else "off",
        "final loss scale": lambda r: f"{r['loss_scale']:g}" if r["loss_scaling"] else "off",
    }
    modes = list(runs)
    table = [f"| | {' | '.join(LABELS[m] for m in modes)} |", "|---|" + "---|" * len(modes)]
    table += [f"| {name} | {' | '.join(cell(runs[m]) for m in modes)} |" for name, cell in rows.items()]
    said = verdict(runs, native)
    where = "GPU" if base["gpu"] else "CPU"
    hardware = ", ".join(f"{mode}: {native[mode] or 'no (emulated)'}" for mode in ("fp16", "bf16"))
    preflight = runs["fp16"]["preflight"] or "not run (--skip_amp_preflight, or an older app)"
    path.write_text(
        "\n".join(
            [
                "# AMP off vs on",
                "",
                f"Device: {base['device']}",
                "",
                f"Native low-precision matmuls on this {where}: {hardware}",
                "",
                f"Padding: every run pads to a multiple of {pad_to} (`--pad_to_multiple_of {pad_to}`), so all runs "
                "see the same batch shapes and dropout masks; they differ in precision only.",
                "",
                f"Command (each run adds `--mixed_precision <mode>`): `{shlex.join(command)}`",
                "",
                *table,
                "",
                "Throughput is each run's samples over its timed seconds, as its summary says (run/samples_per_sec: "
                "warm-up and evaluation excluded).",
                "",
                f"fp16 pre-flight: {preflight}",
                "",
                f"**Verdict:** {said}",
                "",
                "![comparison](comparison.png)",
                "",
            ]
        ),
        encoding="utf-8",
    )
    return said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--name", default=f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}", help="run name prefix")
    parser.add_argument("--report_dir", "--report-dir", type=Path, help="default: reports/<name>")
    parser.add_argument("--with_bf16", "--with-bf16", action="store_true", help="also run bf16 autocast")
    parser.add_argument("--launcher", help='how to launch each run, e.g. "accelerate launch --config_file X.yaml"')
    args, train_flags = parser.parse_known_args()
    try:  # as each run will read them, YAML and spellings included: the folders and padding it will use
        cfg = parse_config(train_flags)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Typed in any spelling: refused. From a --config: each run's own flag wins over it, but a resume, which no flag of
    # the script's undoes, would have each run go on from a checkpoint.
    typed = set(given_fields(train_flags))
    if clashing := [
        name for name in OWNED_FLAGS if name in typed or name == "resume_from_checkpoint" and cfg.resume_from_checkpoint
    ]:
        parser.error(f"--{clashing[0]} is set by this script for each run; leave it out")
    report_dir = args.report_dir or Path("reports") / args.name
    logdir = Path(cfg.logdir)
    modes = ("no", "fp16", *(("bf16",) if args.with_bf16 else ()))
    # Folders of an earlier comparison: its runs would be refused, and their old curves read and reported as this
    # call's. Checked before anything is launched.
    taken = [logdir / args.name, report_dir / "report.md"]
    taken += [path for mode in modes for path in (logdir / f"{args.name}-{mode}", report_dir / "models" / mode)]
    if used := next((path for path in taken if path.exists()), None):
        other = "--name" if used.is_relative_to(logdir) or args.report_dir is None else "--report_dir"
        print(f"error: {used} exists, from an earlier comparison; pick another {other}", file=sys.stderr)
        return 2
    report_dir.mkdir(parents=True, exist_ok=True)
    launcher = shlex.split(args.launcher) if args.launcher else default_launcher()
    pad_to = cfg.pad_to_multiple_of or amp_padding()
    if cfg.pad_to_multiple_of is None:  # once, for every run: same batches, same masks
        train_flags += ["--pad_to_multiple_of", str(pad_to)]
    command = [*launcher, str(ROOT / "app" / "train.py"), *train_flags]

    runs, failed = {}, []
    for mode in modes:
        run_name = f"{args.name}-{mode}"
        print(f"==> {run_name}", flush=True)
        owned = ["--mixed_precision", mode, "--run_name", run_name, "--output_dir", str(report_dir / "models" / mode)]
        code = subprocess.call([*command, *owned])
        if code != 0:
            failed.append(f"{mode} (exit {code})")
        if (logdir / run_name).is_dir():
            runs[mode] = read_run(logdir / run_name)
    if "no" not in runs or "fp16" not in runs:
        print(f"error: no comparison: the runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    plot(runs, report_dir / "comparison.png")
    layout.write_comparison({LABELS[mode]: run["curves"] for mode, run in runs.items()}, logdir / args.name)
    said = write_report(runs, command, report_dir / "report.md", pad_to)
    print(f"\n{said}\nreport: {report_dir / 'report.md'}\nTensorBoard: {logdir}, Custom Scalars ({args.name}/*)")
    if failed:
        print(f"failed runs: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
