"""GPU check: the app's loop in fp32 and in fp16 AMP on a BERT-base-sized model, built from its config (no download).

    python scripts/gpu_check.py --json gpu_check.json              # on a CUDA GPU: a few minutes
    python scripts/gpu_check.py --device cpu --tiny --steps 3      # a dry run of the script itself, no GPU needed

For fp32, then fp16 autocast + GradScaler, it runs the app's own train() on random token ids at sequence length 128 and
reports samples/s, peak memory and MFU (against the GPU's dense peak for the dtype, from app/telemetry/flops.py). It
then runs the hot loop under torch.cuda.set_sync_debug_mode("warn") and counts host-device syncs per optimizer step,
between log steps, and those of a log step, by the line that made them, for both precisions. Peak memory is the
timed steps' (the run's own probe); each precision runs on an Accelerator of its own, and the JSON says whether the
last one's model was freed before the next began. Everything lands in one JSON.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
import warnings
import weakref
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_job import at_least, exit_on_sigterm, json_file, scratch_dir  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification  # noqa: E402

from app.adapters.plan import plan_model  # noqa: E402
from app.amp.policy import resolve_precision  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.host.runtime import build_accelerator, device_name, tf32_matmuls  # noqa: E402
from app.inputs.model import embedded_model_dir  # noqa: E402
from app.loop import train  # noqa: E402
from app.storage.folders import RunPaths  # noqa: E402
from app.tasks.classification import Columns, LabelSpace, SequenceClassification  # noqa: E402
from app.telemetry.flops import peak_flops, training_flops  # noqa: E402
from app.wiring import Inputs, build_training  # noqa: E402

GIB = 2**30


def synthetic_tokens(vocab_size: int, rows: int, length: int) -> DatasetDict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab_size, (rows, length), generator=generator)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    table = {
        "input_ids": ids.tolist(),
        "attention_mask": [[1] * length] * rows,
        "labels": torch.randint(0, 2, (rows,), generator=generator).tolist(),
    }
    return DatasetDict(train=Dataset.from_dict(table), validation=Dataset.from_dict(table).select(range(8)))


def count_syncs(run, steps: int) -> dict:
    """Host-device syncs per optimizer step between log steps, and those a train() call adds once (its first step's
    set-up and its last step's log), by the line that made each: every synchronizing CUDA call warns in torch's sync
    debug mode. A call's last step always logs, so a call of one step is told apart from a call of `steps` steps."""
    counted = []
    for budget in (1, steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train(run, budget=budget)
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counted.append(collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught))
    one, many = counted
    per_step = (many.total() - one.total()) / (steps - 1)
    return {
        "per_step": round(per_step, 3),
        "segment_ends": round(one.total() - per_step, 3),  # a train() call's first step and its last, logged, step
        "sites_over_the_steps": dict(many - one),  # each site's count over steps - 1 steps
        "sites_of_a_one_step_call": dict(one),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch_size", type=at_least(1), default=32)
    parser.add_argument("--seq_len", type=at_least(2), default=128)
    parser.add_argument("--steps", type=at_least(2), default=40, help="timed optimizer steps per precision")
    parser.add_argument("--warmup", type=at_least(0), default=5)
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a dry run")
    parser.add_argument("--json", type=json_file, default="gpu_check.json")  # a string: argparse checks it
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU here; run it on a GPU machine, or pass --device cpu --tiny for a dry run",
            file=sys.stderr,
        )
        return 2

    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if args.tiny else {}
    config = BertConfig(num_labels=2, max_position_embeddings=512, **size)  # BERT-base unless --tiny
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())  # the embedded MiniLM's 30,522-token vocabulary
    tokens = synthetic_tokens(config.vocab_size, args.batch_size * (args.warmup + 2 * args.steps + 4), args.seq_len)
    columns = Columns("text", None, "label")
    task = SequenceClassification(columns, LabelSpace(("0", "1"), string_labels=False), tokenizer, args.seq_len)
    total = 4 * (args.warmup + 2 * args.steps)
    cfg = replace(
        TrainConfig(),
        model_name_or_path="bert-base (from config)",
        per_device_train_batch_size=args.batch_size,
        max_length=args.seq_len,
        max_steps=total,
        logging_steps=10_000,
        eval_steps=0,
        save_steps=0,
        disable_tqdm=True,
    )
    full_fine_tune = plan_model(cfg, resolve_precision(False, "no", args.device, launcher=None)[0], task, config, "")
    inputs = Inputs("bert-base (from config)", config, tokenizer, task, tokens, full_fine_tune)
    results: dict[str, dict] = {}
    workdir = str(scratch_dir("gpu-check-"))  # save_steps=0: only the folders, nothing in them
    syncs: dict[str, dict] = {}

    for mode in ("no", "fp16"):
        # An Accelerator per precision: the last one's would keep its model, optimizer and schedule (and with them its
        # GPU memory) referenced through the next precision's run, and in its peak.
        accelerator = build_accelerator(cfg)
        device = accelerator.device
        policy, _ = resolve_precision(False, mode, device.type, launcher=None)
        torch.manual_seed(0)
        paths = RunPaths(mode, Path(workdir) / mode / "out", Path(workdir) / mode / "runs")  # checkpoints: none
        run = build_training(cfg, accelerator, policy, inputs, paths=paths, model=BertForSequenceClassification(config))
        train(run, budget=args.warmup)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        run.telemetry.peak_memory_gib = 0.0  # the timed steps' peak: the log at their end reads (and resets) it
        started = time.perf_counter()
        train(run, budget=args.steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        samples_per_sec = args.batch_size * args.steps / seconds
        per_token = training_flops(run.model).per_token(args.seq_len)  # a classifier: no LM head
        peak = peak_flops(device, mode)
        name = "fp32" if mode == "no" else mode
        results[name] = {
            "samples_per_sec": round(samples_per_sec, 2),
            "step_time_ms": round(1000 * seconds / args.steps, 2),
            "peak_memory_gib": round(run.telemetry.peak_memory_gib, 3) if device.type == "cuda" else None,
            "mfu_pct": round(100 * per_token * args.seq_len * samples_per_sec / peak, 2) if peak else None,
            "peak_tflops_used": peak / 1e12 if peak else None,
        }
        if device.type == "cuda":
            syncs[name] = count_syncs(run, args.steps)
        model = weakref.ref(accelerator.unwrap_model(run.model))
        run.close()
        accelerator.free_memory()
        del run, accelerator
        gc.collect()
        results[name]["memory_released_after"] = model() is None  # else the next precision's peak holds it
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "device": device_name(device),
        "torch": torch.__version__,
        "model": "tiny BERT" if args.tiny else "BERT-base from config (110M parameters)",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "timed_steps": args.steps,
        "results": results,
        "fp16_speedup": round(results["fp16"]["samples_per_sec"] / results["fp32"]["samples_per_sec"], 3),
        "fp16_memory_ratio": (
            round(results["fp16"]["peak_memory_gib"] / results["fp32"]["peak_memory_gib"], 3)
            if device.type == "cuda"
            else None
        ),
        "host_syncs": syncs or "not measured on CPU",
        "tf32_matmul": tf32_matmuls(),
    }
    args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
