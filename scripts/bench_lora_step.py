"""The LM job's optimizer step, full fine-tune against LoRA adapters, interleaved in one process on the same batches.

    python scripts/bench_lora_step.py                      # make train-lm's and make train-lm-lora's configs
    python scripts/bench_lora_step.py --steps 3 --rounds 6 --json step.json

Both trainings are built as the app builds them (app/wiring.py, `auto` precision, the embedded SmolLM2), each trains
one untimed step, then they take turns: `--steps` optimizer steps of one, then of the other, `--rounds` times, so that
a slower stretch of a noisy machine falls on both. Both start from the same seed, so their batches are the same. The
whole jobs, one after the other, are `make train-lm` and `make train-lm-lora` ([benchmarks](../docs/benchmarks.md)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_job import ROOT, _device_name, exit_on_sigterm, scratch_dir

sys.path.insert(0, str(ROOT))

CONFIGS = {"full": ROOT / "configs" / "smollm2.yaml", "lora": ROOT / "configs" / "smollm2-lora.yaml"}


def build(name: str, workdir: Path, accelerator, model: list[str]):
    from app.amp.policy import resolve_precision
    from app.config import parse_config
    from app.host.device import device_type
    from app.storage.folders import RunPaths
    from app.wiring import build_training, load_inputs

    out = workdir / name
    flags = ["--config", str(CONFIGS[name]), "--mixed_precision", "auto", "--eval_on_start", "false"]
    cfg = parse_config([*flags, *model, "--disable_tqdm", "--output_dir", str(out / "out"), "--max_eval_samples", "16"])
    policy, _ = resolve_precision(False, cfg.mixed_precision, device_type(), None)
    inputs = load_inputs(cfg, accelerator, policy)
    return build_training(cfg, accelerator, policy, inputs, paths=RunPaths(name, out / "out", out / "runs"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of each per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model_name_or_path", help="another causal LM (default: the embedded SmolLM2)")
    args = parser.parse_args()
    model = ["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []

    from app.host.memory import keep_freed_memory
    from app.host.runtime import build_accelerator
    from app.loop import train
    from app.telemetry.console import show_library_notices

    keep_freed_memory()  # as app/train.py does before a run
    show_library_notices(False)

    workdir = scratch_dir("bench-lora-step-")
    from app.config import parse_config

    accelerator = build_accelerator(parse_config(["--config", str(CONFIGS["full"])]))
    trainings = {}
    for name in CONFIGS:
        trainings[name] = build(name, workdir, accelerator, model)
        train(trainings[name], budget=1)  # warm-up: the first step allocates what the others reuse
    seconds = dict.fromkeys(trainings, 0.0)
    for round_ in range(args.rounds):
        for name, training in trainings.items():
            start = time.perf_counter()
            train(training, budget=args.steps)
            seconds[name] += time.perf_counter() - start
        done = (round_ + 1) * args.steps
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {s / done:.2f} s/step" for n, s in seconds.items()))
    result = {
        "device": _device_name(),
        "steps": args.steps * args.rounds,
        **{f"{name}_s_per_step": round(s / (args.steps * args.rounds), 6) for name, s in seconds.items()},
        "lora_vs_full": round(seconds["lora"] / seconds["full"], 3),
    }
    print(f"LoRA step / full fine-tune step: {result['lora_vs_full']} ({result['device']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
