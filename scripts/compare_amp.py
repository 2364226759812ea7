"""Run the same job with AMP off and on (and bf16 with --with_bf16), then report what AMP did on this hardware.

    python scripts/compare_amp.py --max_steps 20                        # the embedded default, fp32 vs fp16
    python scripts/compare_amp.py --with_bf16 --max_steps 200 --eval_steps 50
    python scripts/compare_amp.py --launcher "accelerate launch --config_file accelerate_configs/gpu.yaml"
    python scripts/compare_amp.py --model_name_or_path bert-base-uncased --train_file train.csv --max_steps 500

Every flag this script does not know passes through to app/train.py, unchanged, for every run: same seed, data
order and steps. The runs go to <logdir>/<name>-no, <name>-fp16 (and <name>-bf16), so TensorBoard overlays them.
--report_dir gets report.md and comparison.png: loss curves, loss scale, throughput and peak memory, a table of
ratios, and a verdict in words.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from app import tags  # noqa: E402
from app.telemetry import peak_memory_tag  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OWNED_FLAGS = ("--amp", "--mixed_precision", "--run_name", "--output_dir", "--resume_from_checkpoint")


def default_launcher() -> list[str]:
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "1"]
    if not torch.cuda.is_available():  # accelerate launch gives a CPU process one thread unless told otherwise
        launcher += ["--num_cpu_threads_per_process", str(os.cpu_count() or 1)]
    return launcher


def read_run(run_dir: Path) -> dict:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    curves = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    device = "unknown device"
    for tag in events.Tags()["tensors"]:
        if tag.startswith("run/environment"):
            table = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
            device = next(
                (row.split("|")[2].strip() for row in table.splitlines() if row.startswith("| device |")), device
            )
    gpu_run = tags.MEMORY_PEAK_ALLOCATED_GIB in curves
    memory_tag, memory_kind = peak_memory_tag(torch.device("cuda" if gpu_run else "cpu"))
    last = lambda tag: curves[tag][max(curves[tag])] if curves.get(tag) else float("nan")  # noqa: E731
    speeds = list(curves.get(tags.PERF_SAMPLES_PER_SEC, {}).values())
    return {
        "curves": curves,
        "device": device,
        "samples_per_sec": sum(speeds) / len(speeds) if speeds else float("nan"),
        "peak_memory_gib": max(curves.get(memory_tag, {0: float("nan")}).values()),
        "memory_kind": memory_kind,
        "accuracy": last(tags.EVAL_ACCURACY),
        "f1": last(tags.EVAL_F1),
        "eval_loss": last(tags.EVAL_LOSS),
        "skipped_steps": last(tags.AMP_SKIPPED_STEPS),
        "loss_scale": last(tags.AMP_LOSS_SCALE),
    }


def largest_deviation(reference: dict[int, float], other: dict[int, float]) -> float:
    common = reference.keys() & other.keys()
    return max((abs(reference[s] - other[s]) for s in common), default=float("nan"))


def verdict(runs: dict[str, dict]) -> str:
    base, fp16 = runs["no"], runs["fp16"]
    speed = fp16["samples_per_sec"] / base["samples_per_sec"]
    memory = fp16["peak_memory_gib"] / base["peak_memory_gib"]
    accuracy = 100 * (fp16["accuracy"] - base["accuracy"])
    where = f"on this {base['device']}"
    if speed >= 1.1:
        text = (
            f"{where} fp16 is {speed:.2f}x the speed of fp32 with {memory:.2f}x the peak memory and an accuracy "
            f"change of {accuracy:+.1f} points: use --amp here."
        )
    elif speed < 0.9:
        better = "--mixed_precision no"
        if "bf16" in runs:
            bf16_speed = runs["bf16"]["samples_per_sec"] / base["samples_per_sec"]
            better += f" or bf16 ({bf16_speed:.2f}x fp32)" if bf16_speed > 1 else ""
        text = f"{where} fp16 is {speed:.2f}x the speed of fp32: use {better} here."
    else:
        text = (
            f"{where} fp16 runs at about the speed of fp32 ({speed:.2f}x) with {memory:.2f}x the peak memory; "
            "use --amp only if the memory matters."
        )
    if fp16["skipped_steps"] and fp16["skipped_steps"] > 0.05 * max(fp16["curves"].get(tags.TRAIN_LOSS, {1: 0})):
        text += f" Note: the scaler skipped {fp16['skipped_steps']:.0f} steps; watch amp/loss_scale."
    if accuracy < -1:
        text += f" Accuracy fell by {-accuracy:.1f} points with fp16."
    return text


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((loss_ax, scale_ax), (speed_ax, memory_ax)) = plt.subplots(2, 2, figsize=(11, 8))
    label = {"no": "fp32"}
    for mode, run in runs.items():
        loss = run["curves"].get(tags.TRAIN_LOSS, {})
        loss_ax.plot(list(loss), list(loss.values()), label=label.get(mode, mode), marker=".")
        scale = run["curves"].get(tags.AMP_LOSS_SCALE, {})
        scale_ax.plot(list(scale), list(scale.values()), label=label.get(mode, mode), marker=".")
    loss_ax.set(title="train/loss", xlabel="optimizer step")
    scale_ax.set(title="amp/loss_scale", xlabel="optimizer step", yscale="log")
    names = [label.get(m, m) for m in runs]
    speed_ax.bar(names, [run["samples_per_sec"] for run in runs.values()], color="tab:blue")
    speed_ax.set(title="throughput (samples/s)")
    memory_ax.bar(names, [run["peak_memory_gib"] for run in runs.values()], color="tab:orange")
    memory_ax.set(title=f"peak memory (GiB, {runs['no']['memory_kind']})")
    for ax in (loss_ax, scale_ax):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(runs: dict[str, dict], command: list[str], path: Path) -> str:
    base = runs["no"]
    rows = {
        "samples/s": lambda r: f"{r['samples_per_sec']:.2f}",
        "speed-up vs fp32": lambda r: f"{r['samples_per_sec'] / base['samples_per_sec']:.2f}x",
        f"peak memory (GiB, {base['memory_kind']})": lambda r: f"{r['peak_memory_gib']:.3f}",
        "peak-memory ratio vs fp32": lambda r: f"{r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x",
        "final eval/accuracy": lambda r: f"{r['accuracy']:.4f}",
        "eval-accuracy delta vs fp32 (points)": lambda r: f"{100 * (r['accuracy'] - base['accuracy']):+.2f}",
        "final eval/f1": lambda r: f"{r['f1']:.4f}",
        "largest train/loss deviation vs fp32": lambda r: (
            f"{largest_deviation(base['curves'].get(tags.TRAIN_LOSS, {}), r['curves'].get(tags.TRAIN_LOSS, {})):.2e}"
        ),
        "skipped steps": lambda r: f"{r['skipped_steps']:.0f}",
        "final loss scale": lambda r: f"{r['loss_scale']:g}",
    }
    modes = list(runs)
    table = [f"| | {' | '.join('fp32' if m == 'no' else m for m in modes)} |", "|---|" + "---|" * len(modes)]
    table += [f"| {name} | {' | '.join(cell(runs[m]) for m in modes)} |" for name, cell in rows.items()]
    said = verdict(runs)
    path.write_text(
        "\n".join(
            [
                "# AMP off vs on",
                "",
                f"Device: {base['device']}",
                "",
                f"Command (each run adds `--mixed_precision <mode>`): `{shlex.join(command)}`",
                "",
                *table,
                "",
                "Throughput is the mean of perf/samples_per_sec (warm-up and evaluation excluded).",
                "",
                f"**Verdict:** {said}",
                "",
                "![comparison](comparison.png)",
                "",
            ]
        )
    )
    return said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--name", default=f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}", help="run name prefix")
    parser.add_argument("--report_dir", type=Path, help="default: reports/<name>")
    parser.add_argument("--with_bf16", action="store_true", help="also run bf16 autocast")
    parser.add_argument("--launcher", help='how to launch each run, e.g. "accelerate launch --config_file X.yaml"')
    args, train_flags = parser.parse_known_args()
    clashing = [flag for flag in train_flags if flag.split("=")[0] in OWNED_FLAGS]
    if clashing:
        parser.error(f"{clashing[0]} is set by this script for each run; leave it out")
    report_dir = args.report_dir or Path("reports") / args.name
    report_dir.mkdir(parents=True, exist_ok=True)
    logdir = Path(train_flags[train_flags.index("--logdir") + 1]) if "--logdir" in train_flags else Path("runs")
    launcher = shlex.split(args.launcher) if args.launcher else default_launcher()
    command = [*launcher, str(ROOT / "app" / "train.py"), *train_flags]

    runs, failed = {}, []
    for mode in ("no", "fp16", *(("bf16",) if args.with_bf16 else ())):
        run_name = f"{args.name}-{mode}"
        print(f"==> {run_name}", flush=True)
        code = subprocess.call(
            [
                *command,
                "--mixed_precision",
                mode,
                "--run_name",
                run_name,
                "--output_dir",
                str(report_dir / "models" / mode),
            ]
        )
        if code != 0:
            failed.append(f"{mode} (exit {code})")
        if (logdir / run_name).is_dir():
            runs[mode] = read_run(logdir / run_name)
    if "no" not in runs or "fp16" not in runs:
        print(f"error: no comparison: the runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    plot(runs, report_dir / "comparison.png")
    said = write_report(runs, command, report_dir / "report.md")
    print(f"\n{said}\nreport: {report_dir / 'report.md'}" + (f"\nfailed runs: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
