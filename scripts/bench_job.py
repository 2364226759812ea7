"""Benchmark the whole default job, each process timed from start to end: this app against HF Trainer.

    python scripts/bench.py --job                                      # the three runs of the default job, once
    python scripts/bench.py --job --repeats 3 --json job.json          # three rounds of it, against the targets
    python scripts/bench.py --job --repeats 3 --without_hf_defaults    # the same without HF's longest run
    python scripts/bench.py --job --repeats 3 --app_torch_masks        # the app as it runs on Intel CPUs with MKL
    python scripts/bench.py --job --max_train_samples 800 --json job.json
    python scripts/bench.py --job --tiny                               # a tiny BERT: checks that it runs, no speed
    python scripts/bench.py --job --task causal_lm                     # the causal-LM job: scripts/bench_job_lm.py

One after the other, each in its own subprocess, so that each pays its own start-up, loading, tokenizing, training
and final evaluation:
  app          `accelerate launch <the Makefile's LAUNCH_FLAGS> app/train.py --mixed_precision auto`, as
               `make train` runs it (its defaults: grouped batches, one evaluation)
  hf           HF Trainer on the same job with TrainingArguments' defaults (random batches)
  hf_grouped   HF Trainer with train_sampling_strategy="group_by_length"
The job is the same for all three: the embedded MiniLM and reviews (4,000/1,000 split), batch 16, max_length 128,
lr 5e-5 with 10% linear warm-up, weight decay 0.01, clipping at 1.0, 1 epoch, dynamic padding, one final evaluation
at batch 64. HF runs in the precision the app resolves here (`auto`: bf16 on a CPU with native bf16, else fp32;
`--mixed_precision no` for fp32 on any CPU), printed with the figures. Wall-time ratios below 1 mean the app is
faster.

`--repeats N` runs N rounds, each starting one run further along (app, hf, hf_grouped; then hf, hf_grouped, app; ...),
so that none always runs first on a machine whose speed drifts. It prints each round and the medians, and writes
--json after every round, so that the rounds already run survive a failure or an interrupted session. The last line
checks the rounds against the job's targets: the median of app / HF grouped at most 0.95, no round above 1.00, the
app's accuracy within a point of HF grouped's in every round, at least three rounds, and the whole default job.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import TrainConfig  # noqa: E402
from app.storage.disk import write_atomically  # noqa: E402
from app.telemetry import tags  # noqa: E402

ACCELERATE = Path(sys.executable).parent / "accelerate"
TINY_SAMPLES = 64  # --tiny: training and validation reviews each
CONTENDERS = ("app", "hf", "hf_grouped")
# The targets of this job against HF grouped: the median of the rounds' ratios, every round's, the accuracy's gap.
TARGET_MEDIAN, TARGET_EACH, TARGET_POINTS, TARGET_ROUNDS = 0.95, 1.00, 1.0, 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py --job", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_train_samples", type=int, help="train on the first N reviews (default: all 4,000)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny BERT on {TINY_SAMPLES} + {TINY_SAMPLES} reviews")
    parser.add_argument("--json", type=json_file, help="write the figures here")
    parser.add_argument(
        "--task",
        choices=("sequence_classification", "causal_lm"),
        default="sequence_classification",
        help="the classification job (make train) or the causal-LM job (make train-lm, scripts/bench_job_lm.py)",
    )
    parser.add_argument(
        "--use_peft",
        action="store_true",
        help="--task causal_lm: the job with LoRA adapters (configs/smollm2-lora.yaml), against HF Trainer with the "
        "same peft model and trl's SFTTrainer with use_peft (if trl is installed: pip install trl)",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=("auto", "no", "bf16", "fp16"),
        default="auto",
        help="the precision of every run (default: auto, what `make train` gets on this machine); `no` compares in "
        "fp32, as on a CPU without native bf16",
    )
    parser.add_argument(
        "--repeats",
        type=at_least(1),
        default=1,
        help="rounds of every run, one after the other, each round starting one run further along: the medians are "
        "printed, and --json is written after every round",
    )
    parser.add_argument(
        "--without_hf_defaults",
        action="store_true",
        help="leave out HF Trainer with its defaults (random batches), the longest run: the app against HF grouped",
    )
    parser.add_argument(
        "--app_torch_masks",
        action="store_true",
        help="the app with --fast_cpu_dropout false: torch's own dropout masks and attention, as HF's runs draw them "
        "and as the app runs on Intel CPUs with MKL; elsewhere, what the app gains besides its masks (not the "
        "default job: the targets' line says so)",
    )
    parser.add_argument("--hf_worker", type=Path, help=argparse.SUPPRESS)  # internal: one HF run, figures to this file
    parser.add_argument("--peer", choices=("hf", "trl"), default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--max_eval_samples", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task == "causal_lm" and (args.repeats != 1 or args.without_hf_defaults or args.app_torch_masks):
        parser.error(
            "--repeats, --without_hf_defaults and --app_torch_masks are for the classification job; leave them out "
            "with --task causal_lm"
        )
    if args.task == "causal_lm":
        import bench_job_lm

        return bench_job_lm.hf_worker(args) if args.hf_worker else bench_job_lm.main(args)
    if args.hf_worker:
        return hf_worker(args)

    from app.amp.policy import resolve_precision
    from app.host.device import device_type

    workdir = scratch_dir("bench-job-")
    if args.tiny:
        from bench import tiny_model_dir

        model = tiny_model_dir(workdir / "tiny")
    else:
        model = None  # the app's default: the embedded MiniLM
    train_samples = args.max_train_samples or (TINY_SAMPLES if args.tiny else None)
    eval_samples = TINY_SAMPLES if args.tiny else None
    # The precision `make train` gets here; HF runs in the same one, so that the comparison is of equals.
    policy, _ = resolve_precision(False, args.mixed_precision, device_type(), launcher=None)
    threads = os.cpu_count() or 1

    samples = [*_flag("max_train_samples", train_samples), *_flag("max_eval_samples", eval_samples)]
    app_flags = ["--fast_cpu_dropout", "false"] if args.app_torch_masks else []

    def run_app(round_: int) -> tuple[float, float]:
        name = f"job{round_}"  # a run of its own each round: the app refuses to write over an earlier one
        app_cmd = [
            *(str(ACCELERATE), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"),
            *("--dynamo_backend", "no", "--num_cpu_threads_per_process", str(threads)),  # the Makefile's LAUNCH_FLAGS
            *(str(ROOT / "app" / "train.py"), "--mixed_precision", args.mixed_precision, "--disable_tqdm"),
            *("--output_dir", str(workdir / name), "--logdir", str(workdir / "runs"), "--run_name", name),
            *_flag("model_name_or_path", model),
            *samples,
            *app_flags,
        ]
        wall = timed(app_cmd)
        return wall, tensorboard_last(workdir / "runs" / name, tags.EVAL_ACCURACY)

    def run_hf(strategy: str, round_: int) -> tuple[float, float]:
        out = workdir / f"hf-{strategy}{round_}.json"
        hf_cmd = [sys.executable, __file__, "--hf_worker", str(out), "--precision", policy.mode, "--strategy", strategy]
        wall = timed([*hf_cmd, *_flag("model", model), *samples])
        return wall, json.loads(out.read_text(encoding="utf-8"))["accuracy"]

    runners = {
        "app": run_app,
        "hf": functools.partial(run_hf, "random"),
        "hf_grouped": functools.partial(run_hf, "group_by_length"),
    }
    contenders = [name for name in CONTENDERS if name != "hf" or not args.without_hf_defaults]
    result = {
        "model": "tiny BERT (2 layers, hidden 32)" if args.tiny else "all-MiniLM-L6-v2",
        "device": _device_name(),
        "precision": policy.mode,
        "precision_reason": policy.describe(),
        "train_samples": train_samples or 4000,
        "app_flags": app_flags,
        "rounds": [],
    }
    print(f"job: {result['model']}, {result['train_samples']} training reviews, 1 epoch; {result['device']}")
    if app_flags:
        print(f"the app with {' '.join(app_flags)}: torch's own dropout masks and attention")
    print(f"precision for all: {policy.mode} ({policy.describe()})", flush=True)
    for round_ in range(args.repeats):
        # Each round starts one further along, so that no contender always runs first (or last) on a drifting machine.
        order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
        ran = {name: runners[name](round_) for name in order}
        figures = {"order": order}
        for name in contenders:  # the same keys in the same order every round, whatever order they ran in
            figures[f"{name}_wall_s"], figures[f"{name}_accuracy"] = round(ran[name][0], 1), ran[name][1]
        for peer in contenders[1:]:  # ratios of the rounded walls, so that the printed figures check out by hand
            figures[f"app_vs_{peer}"] = round(figures["app_wall_s"] / figures[f"{peer}_wall_s"], 3)
        result["rounds"].append(figures)
        print(f"round {round_ + 1} of {args.repeats} (in this order: {', '.join(order)})")
        _print_table(figures, contenders)
        result.update(_medians(result["rounds"], contenders))
        if args.json:  # after every round, atomically: a session that ends early keeps the rounds it finished
            write_atomically(args.json, json.dumps(result, indent=2))
    if args.repeats > 1:
        print(f"medians of {args.repeats} rounds (app vs: the median of the rounds' ratios)")
        _print_table(result, contenders)
    print(_against_targets(result["rounds"], whole_job=_runs_the_default_job(args)))
    return 0


def _medians(rounds: list[dict], contenders: list[str]) -> dict:
    """Each figure's median over the rounds (a ratio's median is of the rounds' ratios, as the targets ask)."""
    keys = [f"{name}_{what}" for name in contenders for what in ("wall_s", "accuracy")]
    keys += [f"app_vs_{peer}" for peer in contenders[1:]]
    return {key: round(statistics.median(figures[key] for figures in rounds), 4) for key in keys}


def _print_table(figures: dict, contenders: list[str]) -> None:
    print(f"  {'':<12}{'wall s':>10}{'accuracy':>10}{'app vs':>10}")
    for name in contenders:
        ratio = f"{figures[f'app_vs_{name}']:>10.3f}" if name != "app" else ""
        print(f"  {name:<12}{figures[f'{name}_wall_s']:>10.1f}{figures[f'{name}_accuracy']:>10.4f}{ratio}", flush=True)


def _runs_the_default_job(args: argparse.Namespace) -> bool:
    """Whether the app runs the job `make train` runs: the embedded model on all its reviews, with its defaults."""
    return not (args.tiny or args.max_train_samples or args.app_torch_masks)


def _against_targets(rounds: list[dict], whole_job: bool) -> str:
    """The project's speed targets for the default job, against HF Trainer's group_by_length (docs/benchmarks.md):
    whether `rounds` meet them. `whole_job`: the rounds ran that job (_runs_the_default_job)."""
    ratios = [figures["app_vs_hf_grouped"] for figures in rounds]
    median = statistics.median(ratios)
    # In points, each accuracy rounded first: the app's comes from TensorBoard as a float32 (0.841 reads
    # 0.84100002), and an evaluation of 1,000 reviews moves in tenths of a point.
    points = [
        round(round(100 * figures["app_accuracy"], 3) - round(100 * figures["hf_grouped_accuracy"], 3), 3) + 0.0
        for figures in rounds  # + 0.0: an equal pair prints +0.0, not -0.0
    ]
    checks = [
        (f"median app / HF grouped {median:.3f} <= {TARGET_MEDIAN}", median <= TARGET_MEDIAN),
        (f"each round <= {TARGET_EACH:.2f} (highest {max(ratios):.3f})", max(ratios) <= TARGET_EACH),
        (
            f"accuracy within {TARGET_POINTS:g} point of HF grouped's ({min(points):+.1f} to {max(points):+.1f})",
            all(abs(point) <= TARGET_POINTS for point in points),
        ),
        (f"at least {TARGET_ROUNDS} rounds ({len(rounds)})", len(rounds) >= TARGET_ROUNDS),
        ("the whole default job", whole_job),
    ]
    said = "; ".join(f"{text}: {'yes' if met else 'NO'}" for text, met in checks)
    return f"targets of the job (docs/benchmarks.md) {'met' if all(met for _, met in checks) else 'not met'}: {said}"


def at_least(least: int):
    """An argparse type: an int of `least` or more, else argparse's one-line error (exit 2) before anything runs."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error for a non-number
    return parse


def json_file(text: str) -> Path:
    """An argparse type: where the figures go, a file in a folder that exists; checked before minutes of runs."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name a file, e.g. figures.json")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file in it, e.g. {path / 'figures.json'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no folder {path.parent}; create it or write the figures elsewhere")
    return path


def scratch_dir(prefix: str) -> Path:
    """A new folder for a benchmark's runs, removed when the script ends: what it keeps is its figures (a run of the
    default job leaves a few hundred MB of models and checkpoints)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def exit_on_sigterm() -> None:
    """A `kill` (SIGTERM) ends the script as an exit: `timed` stops the run it waits on, and the scratch folders are
    removed (atexit). By default the script would die at once and leave both behind. In a script's main block."""
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def _flag(name: str, value) -> list[str]:
    return [] if value is None else [f"--{name}", str(value)]


def timed(cmd: list[str]) -> float:
    """Seconds from the process's start to its end; its output is shown only if it fails.

    The run is a process group of its own: `accelerate launch` starts the app as a child, and a benchmark stopped
    while it waits (SIGTERM through exit_on_sigterm, Ctrl-C) kills the whole group, where killing the launcher alone
    would leave the app training on.
    """
    started = time.perf_counter()
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(cmd, start_new_session=True, **pipes) as run:
        try:
            _, stderr = run.communicate()
        except BaseException:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            raise
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed with exit code {run.returncode}:\n{stderr[-3000:]}")
    return seconds


def tensorboard_last(run_dir: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)[-1].value


def _device_name() -> str:
    """The CPU's model and core count, and whether it has the instructions that decide bf16 and fp16 speed."""
    from app.amp.policy import cpu_features, cpu_has_native_bf16, cpu_model

    flags = cpu_features()
    have = ", ".join(
        f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16")
    )
    return f"{cpu_model()}, {os.cpu_count()} cores ({have}; native bf16 {'yes' if cpu_has_native_bf16() else 'no'})"


def hf_options(cfg: TrainConfig, args, scratch_prefix: str) -> dict:
    """HF TrainingArguments for the app's job `cfg`: its optimizer, schedule, batch sizes, epochs and seed, the
    precision and length grouping (`train_sampling_strategy`) the benchmark gives its peer, nothing saved or evaluated
    on the way (the app's job evaluates once, at its end)."""
    from app.host.device import device_type

    return dict(
        output_dir=str(scratch_dir(scratch_prefix)),
        train_sampling_strategy=args.strategy,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_ratio,  # a float below 1: a fraction of the steps
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        num_train_epochs=cfg.num_train_epochs,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        use_cpu=device_type() == "cpu",
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
    )


def hf_worker(args) -> int:
    """One HF Trainer run of the job, as a user would write it; its accuracy goes to the file `args.hf_worker`."""
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from app.inputs.data import EMBEDDED_LABEL_COLUMN, EMBEDDED_TEXT_COLUMN, load_raw
    from app.inputs.model import embedded_model_dir

    defaults = TrainConfig()
    raw = load_raw(replace(defaults, max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples))
    model_path = args.model or str(embedded_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    labels = sorted(set(raw["train"][EMBEDDED_LABEL_COLUMN]))

    def encode(batch: dict) -> dict:
        encoded = tokenizer(batch[EMBEDDED_TEXT_COLUMN], truncation=True, max_length=defaults.max_length)
        encoded["labels"] = [labels.index(label) for label in batch[EMBEDDED_LABEL_COLUMN]]
        return encoded

    tokenized = raw.map(encode, batched=True, remove_columns=raw["train"].column_names)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=len(labels))
    training_args = TrainingArguments(**hf_options(defaults, args, "bench-hf-"))

    def accuracy(prediction) -> dict:
        return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    trainer.train()
    metrics = trainer.evaluate()
    args.hf_worker.write_text(json.dumps({"accuracy": metrics["eval_accuracy"]}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
