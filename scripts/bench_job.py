"""Benchmark the whole default job, each process timed from start to end: this app against HF Trainer.

    python scripts/bench.py --job                                      # the default job, three times over
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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import TrainConfig  # noqa: E402
from app.telemetry import tags  # noqa: E402

ACCELERATE = Path(sys.executable).parent / "accelerate"
TINY_SAMPLES = 64  # --tiny: training and validation reviews each


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py --job", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_train_samples", type=int, help="train on the first N reviews (default: all 4,000)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny BERT on {TINY_SAMPLES} + {TINY_SAMPLES} reviews")
    parser.add_argument("--json", type=Path, help="write the figures here")
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
    parser.add_argument("--hf_worker", type=Path, help=argparse.SUPPRESS)  # internal: one HF run, figures to this file
    parser.add_argument("--peer", choices=("hf", "trl"), default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--max_eval_samples", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task == "causal_lm":
        import bench_job_lm

        return bench_job_lm.hf_worker(args) if args.hf_worker else bench_job_lm.main(args)
    if args.hf_worker:
        return hf_worker(args)

    from app.amp.policy import resolve_precision
    from app.host.runtime import device_type

    workdir = Path(tempfile.mkdtemp(prefix="bench-job-"))
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
    app_cmd = [
        *(str(ACCELERATE), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--num_cpu_threads_per_process", str(threads)),  # the Makefile's LAUNCH_FLAGS
        *(str(ROOT / "app" / "train.py"), "--mixed_precision", args.mixed_precision, "--disable_tqdm"),
        *("--output_dir", str(workdir / "app"), "--logdir", str(workdir / "runs"), "--run_name", "job"),
        *_flag("model_name_or_path", model),
        *samples,
    ]
    app_wall = timed(app_cmd)
    app_accuracy = tensorboard_last(workdir / "runs" / "job", tags.EVAL_ACCURACY)

    hf = {}
    for name, strategy in (("hf", "random"), ("hf_grouped", "group_by_length")):
        out = workdir / f"{name}.json"
        hf_cmd = [sys.executable, __file__, "--hf_worker", str(out), "--precision", policy.mode, "--strategy", strategy]
        hf[name] = (timed([*hf_cmd, *_flag("model", model), *samples]), json.loads(out.read_text())["accuracy"])

    result = {
        "model": "tiny BERT (2 layers, hidden 32)" if args.tiny else "all-MiniLM-L6-v2",
        "device": _device_name(),
        "precision": policy.mode,
        "precision_reason": policy.describe(),
        "train_samples": train_samples or 4000,
        "app_wall_s": round(app_wall, 1),
        "hf_wall_s": round(hf["hf"][0], 1),
        "hf_grouped_wall_s": round(hf["hf_grouped"][0], 1),
        "app_accuracy": app_accuracy,
        "hf_accuracy": hf["hf"][1],
        "hf_grouped_accuracy": hf["hf_grouped"][1],
    }
    # Ratios of the rounded walls, so that the printed figures check out by hand.
    result["app_vs_hf"] = round(result["app_wall_s"] / result["hf_wall_s"], 3)
    result["app_vs_hf_grouped"] = round(result["app_wall_s"] / result["hf_grouped_wall_s"], 3)

    print(f"job: {result['model']}, {result['train_samples']} training reviews, 1 epoch; {result['device']}")
    print(f"precision for all three: {policy.mode} ({policy.describe()})")
    print(f"  {'':<12}{'wall s':>10}{'accuracy':>10}{'app vs':>10}")
    print(f"  {'app':<12}{result['app_wall_s']:>10.1f}{app_accuracy:>10.4f}{'':>10}")
    for name in ("hf", "hf_grouped"):
        ratio = result["app_vs_hf" if name == "hf" else "app_vs_hf_grouped"]
        print(f"  {name:<12}{result[f'{name}_wall_s']:>10.1f}{result[f'{name}_accuracy']:>10.4f}{ratio:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _flag(name: str, value) -> list[str]:
    return [] if value is None else [f"--{name}", str(value)]


def timed(cmd: list[str]) -> float:
    """Seconds from the process's start to its end; its output is shown only if it fails."""
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed with exit code {result.returncode}:\n{result.stderr[-3000:]}")
    return seconds


def tensorboard_last(run_dir: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)[-1].value


def _device_name() -> str:
    """The CPU's model and core count, and whether it has the instructions that decide bf16 and fp16 speed."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1].split() for line in info if line.startswith("flags")))
    except (OSError, StopIteration):
        pass
    have = ", ".join(
        f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16")
    )
    return f"{model}, {os.cpu_count()} cores ({have})"


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

    from app.host.runtime import device_type
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
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench-hf-"),
        train_sampling_strategy=args.strategy,
        per_device_train_batch_size=defaults.per_device_train_batch_size,
        per_device_eval_batch_size=defaults.per_device_eval_batch_size,
        learning_rate=defaults.learning_rate,
        warmup_steps=defaults.warmup_ratio,  # a float below 1: a fraction of the steps
        weight_decay=defaults.weight_decay,
        max_grad_norm=defaults.max_grad_norm,
        num_train_epochs=defaults.num_train_epochs,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        use_cpu=device_type() == "cpu",
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=defaults.seed,
    )

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
    args.hf_worker.write_text(json.dumps({"accuracy": metrics["eval_accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
