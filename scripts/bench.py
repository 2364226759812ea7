"""Benchmark this app's training step against a bare PyTorch loop and HF Trainer, in one process, interleaved.

    python scripts/bench.py                          # embedded MiniLM, batch 16 x length 128, fp32, this device
    python scripts/bench.py --precision fp16 --json bench.json
    python scripts/bench.py --tiny --steps 3         # a tiny BERT: checks that it runs, says nothing about speed
    python scripts/bench.py --job                    # the whole default job against HF Trainer (scripts/bench_job.py)

All three train copies of the same model (same initial weights) on the same tokenized data, with the same batch size,
collator, AdamW settings, clipping and precision:
  app          the app's own train() (accumulate, autocast, scaler, telemetry to TensorBoard, AMP watches)
  bare         autocast + GradScaler + clip + fused AdamW in ten lines: no Accelerate, no logging
  hf_trainer   transformers.Trainer with equivalent TrainingArguments
All batches are full: only the reviews that fill --max_length are kept, so that every step of every contender
computes the same shapes. Each warms up, then they take turns for --rounds rounds of --steps steps, so drift of the
machine hits all alike.
Step time is measured the same way for all three: between consecutive training forward calls, which leaves out
per-call set-up (Trainer builds its optimizer on every train() call) and includes everything done per step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from bench_job import at_least, exit_on_sigterm, json_file, scratch_dir  # noqa: E402
from datasets import DatasetDict  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertConfig,
    BertModel,
    DataCollatorWithPadding,
    PrinterCallback,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,  # noqa: E402
)

from app.amp.policy import resolve_precision  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.errors import UsageError  # noqa: E402
from app.host.device import device_type  # noqa: E402
from app.host.runtime import build_accelerator  # noqa: E402
from app.inputs.model import embedded_model_dir  # noqa: E402
from app.loop import train  # noqa: E402
from app.storage.folders import RunPaths  # noqa: E402
from app.telemetry.console import show_library_notices  # noqa: E402
from app.telemetry.writer import TensorBoardWriter  # noqa: E402
from app.wiring import Inputs, build_training, load_inputs  # noqa: E402

GIB = 2**30


class StepClock:
    """Timestamps of a model's training forward calls, the batch shapes they took, and the peak memory seen while they
    ran."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.stamps: list[float] = []
        self.shapes: set[tuple[int, ...]] = set()
        self.device, self.process, self.peak = device, psutil.Process(), 0.0
        model.register_forward_pre_hook(self._tick, with_kwargs=True)

    def _tick(self, module, args, kwargs) -> None:
        if module.training:
            self.stamps.append(time.perf_counter())
            self.shapes.add(tuple(kwargs["input_ids"].shape))  # all three call model(**batch)
            if self.device.type != "cuda":
                self.peak = max(self.peak, self.process.memory_info().rss / GIB)

    def segment(self, run_steps) -> tuple[int, float]:
        """Run a segment; return (timed step intervals, seconds)."""
        self.stamps.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        run_steps()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) / GIB)
        return len(self.stamps) - 1, self.stamps[-1] - self.stamps[0]


def tiny_model_dir(folder: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def full_batches_only(inputs: Inputs, batch_size: int, max_length: int) -> Inputs:
    """The inputs with only training examples that fill --max_length, a whole number of batches of them: every batch of
    every contender is then batch x max_length, whichever examples it draws (with dynamic padding, a contender that
    drew shorter batches would look faster; HF Trainer's train() starts its epoch afresh at each call, and draws the
    same first batches)."""
    train = inputs.tokenized["train"]
    full = train.filter(lambda ids: len(ids) == max_length, input_columns="input_ids")
    if len(full) < batch_size:
        raise UsageError(
            f"fewer than {batch_size} training reviews fill --max_length {max_length}; "
            "pass a smaller --max_length or --batch_size"
        )
    full = full.select(range(len(full) - len(full) % batch_size))  # no short last batch
    return replace(inputs, tokenized=DatasetDict(train=full, validation=inputs.tokenized["validation"]))


def main() -> int:
    if "--job" in sys.argv[1:]:  # the whole-job benchmark has its own flags and file
        import bench_job

        return bench_job.main([arg for arg in sys.argv[1:] if arg != "--job"])
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="--job: the whole default job, this app against HF Trainer, each in its own process (its own flags: "
        "bench.py --job --help)",
    )
    parser.add_argument(
        "--steps",
        type=at_least(2),
        default=10,
        help="timed steps per implementation per round (time is measured between steps)",
    )
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps per implementation first")
    parser.add_argument("--precision", choices=("no", "fp16", "bf16"), default="no")
    parser.add_argument("--batch_size", type=at_least(1), default=16)
    parser.add_argument("--max_length", type=at_least(2), default=128)
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT built from a config instead of MiniLM")
    parser.add_argument("--json", type=json_file, help="write the figures here")
    args = parser.parse_args()

    show_library_notices(False)  # transformers' load report of each contender's new head, as app/train.py does
    workdir = scratch_dir("bench-")
    model_path = tiny_model_dir(workdir / "tiny") if args.tiny else str(embedded_model_dir())
    total = (args.warmup + args.steps * args.rounds) * 4
    cfg = replace(
        TrainConfig(),
        model_name_or_path=model_path,
        mixed_precision=args.precision,
        max_steps=total,
        per_device_train_batch_size=args.batch_size,
        max_length=args.max_length,
        eval_steps=0,
        save_steps=0,
        disable_tqdm=True,
        max_train_samples=2000,
        # The same kind of batches as the bare loop and HF Trainer (random order): a step is compared with a step.
        # What length-grouping saves shows in --job, where each side runs its own defaults.
        train_sampling_strategy="random",
    )
    policy, _ = resolve_precision(False, args.precision, device_type(), launcher=None)
    accelerator = build_accelerator(cfg)
    device = accelerator.device

    try:
        inputs = full_batches_only(load_inputs(cfg, accelerator, policy), args.batch_size, args.max_length)
    except UsageError as e:  # the app's checks of the model and data, and the one above
        parser.error(str(e))  # one line, exit code 2
    tokenized, pad_to = inputs.tokenized, policy.pad_to_multiple_of

    def fresh_model():
        torch.manual_seed(0)
        return inputs.task.load_model(model_path, torch.float32, lambda line: None)  # the same model for each contender

    # ---- (a) the app: the same wiring as app/train.py, --save_steps 0 (only a signal would save) -------------------
    paths = RunPaths("bench", workdir / "app", workdir / "runs")
    run = build_training(
        cfg, accelerator, policy, inputs, paths=paths, writer=TensorBoardWriter(paths.log_dir), model=fresh_model()
    )

    def app_steps(n: int) -> None:
        train(run, budget=n)

    # ---- (b) a bare PyTorch loop ---------------------------------------------------------------------------------
    bare_model = fresh_model().to(device).train()
    bare_optimizer = torch.optim.AdamW(
        bare_model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True
    )  # the same kernel as the app and HF Trainer
    bare_schedule = get_linear_schedule_with_warmup(bare_optimizer, 0, total)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    collate = DataCollatorWithPadding(inputs.tokenizer, pad_to_multiple_of=pad_to)
    bare_batches = iter(())

    def bare_steps(n: int) -> None:
        nonlocal bare_batches
        for _ in range(n):
            batch = next(bare_batches, None)
            if batch is None:
                bare_batches = iter(
                    DataLoader(tokenized["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
                )
                batch = next(bare_batches)
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=policy.dtype, enabled=policy.autocast_enabled):
                loss = bare_model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(bare_optimizer)
            torch.nn.utils.clip_grad_norm_(bare_model.parameters(), cfg.max_grad_norm)
            scaler.step(bare_optimizer)
            scaler.update()
            bare_optimizer.zero_grad(set_to_none=True)
            bare_schedule.step()

    # ---- (c) HF Trainer ------------------------------------------------------------------------------------------
    # Trainer builds its own Accelerator with its own mixed precision; Accelerate allows one per process unless reset.
    AcceleratorState._reset_state()
    hf_model = fresh_model()
    hf_args = TrainingArguments(
        output_dir=str(workdir / "hf"),
        per_device_train_batch_size=args.batch_size,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type="linear",
        max_steps=1,
        fp16=args.precision == "fp16",
        bf16=args.precision == "bf16",
        use_cpu=device.type == "cpu",
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=hf_model, args=hf_args, train_dataset=tokenized["train"], data_collator=collate)
    trainer.remove_callback(PrinterCallback)  # one summary line per train() call would flood the table

    def hf_steps(n: int) -> None:
        trainer.args.max_steps = n
        trainer.train()

    # ---- measure: warm up each, then take turns ------------------------------------------------------------------
    contenders = {"app": (run.model, app_steps), "bare": (bare_model, bare_steps), "hf_trainer": (hf_model, hf_steps)}
    clocks = {name: StepClock(model, device) for name, (model, _) in contenders.items()}
    for _, run_steps in contenders.values():
        run_steps(args.warmup)
    timed = {name: [0, 0.0] for name in contenders}
    for _ in range(args.rounds):
        for name, (_, run_steps) in contenders.items():
            intervals, seconds = clocks[name].segment(functools.partial(run_steps, args.steps))
            timed[name][0] += intervals
            timed[name][1] += seconds
    run.close()

    rates = {name: args.batch_size * steps / seconds for name, (steps, seconds) in timed.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    result = {
        "model": "tiny BERT (2 layers, hidden 32)" if args.tiny else "all-MiniLM-L6-v2",
        "device": where,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        **{f"{name}_samples_per_sec": round(rate, 3) for name, rate in rates.items()},
        "app_vs_bare": round(rates["app"] / rates["bare"], 4),
        "app_vs_hf_trainer": round(rates["app"] / rates["hf_trainer"], 4),
        **{f"{name}_peak_memory_gib": round(clock.peak, 3) for name, clock in clocks.items()},
        **{f"{name}_batch_shapes": sorted(clock.shapes) for name, clock in clocks.items()},
        "peak_memory_kind": "GPU allocated, per segment"
        if device.type == "cuda"
        else "process RSS (shared by all three)",
    }
    print(
        f"bench: {result['model']}, batch {args.batch_size} x {args.max_length}, {args.precision}, {where}, "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps"
    )
    print(f"  {'':<12}{'samples/s':>12}{'vs bare':>10}{'peak GiB':>10}")
    for name, rate in rates.items():
        print(f"  {name:<12}{rate:>12.2f}{rate / rates['bare']:>10.3f}{clocks[name].peak:>10.2f}")
    print(
        f"  app_vs_bare {result['app_vs_bare']:.3f} (target >= 0.97), "
        f"app_vs_hf_trainer {result['app_vs_hf_trainer']:.3f} (target >= 1.0); memory: {result['peak_memory_kind']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
