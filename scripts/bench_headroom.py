"""What amp/headroom_bits costs: fp16 log steps of the app's own loop with the probe armed and without, taking turns.

    python scripts/bench_headroom.py                 # embedded MiniLM, batch 16 x length 128, fp16 autocast
    python scripts/bench_headroom.py --tiny          # the tests' tiny BERT (2 layers, hidden 32)

One run of the app's train() with --logging_steps 1: every step is a log step, whose read includes the probe's. The
probe is switched on and off on alternate steps (`HeadroomProbe.enabled`, flipped from a forward hook), so drift of
the machine hits both alike. A step is timed from its forward to the next one's, as scripts/bench.py times a step:
forward, backward, optimizer step and the log. The ratio is the median over pairs of neighbouring steps of
(with probe / without). On a busy machine that ratio is noisy, so the probe's own work is also timed: the time
inside its hooks and its read (`take`), per armed step, as a share of a log step without it. Registering and removing
the hooks is left out of that figure (and in the ratio). Steps that are not log steps never arm the probe
(tests/test_host_syncs.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench import tiny_model_dir  # noqa: E402
from bench_job import exit_on_sigterm, scratch_dir  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from app.amp.headroom import HeadroomProbe  # noqa: E402
from app.amp.policy import resolve_precision  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.host.device import device_type  # noqa: E402
from app.host.runtime import build_accelerator, device_name  # noqa: E402
from app.inputs.model import resolve_model_path  # noqa: E402
from app.loop import train  # noqa: E402
from app.storage.folders import RunPaths  # noqa: E402
from app.telemetry.tags import AMP_HEADROOM_BITS  # noqa: E402
from app.telemetry.writer import TensorBoardWriter  # noqa: E402
from app.wiring import build_training  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="pairs of log steps: one with the probe, one without")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT built from a config instead of MiniLM")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    workdir = scratch_dir("bench-headroom-")
    model_path = tiny_model_dir(workdir / "tiny") if args.tiny else resolve_model_path(None)
    cfg = replace(
        TrainConfig(),
        model_name_or_path=model_path,
        mixed_precision="fp16",
        max_steps=args.warmup + 2 * args.rounds + 1,
        logging_steps=1,
        per_device_train_batch_size=args.batch_size,
        max_length=args.max_length,
        eval_steps=0,
        save_steps=0,
        disable_tqdm=True,
        max_train_samples=1000,
        train_sampling_strategy="random",  # full-length batches: every step costs about the same
        skip_amp_preflight=True,
    )
    policy, _ = resolve_precision(False, "fp16", device_type(), launcher=None)
    accelerator = build_accelerator(cfg)
    paths = RunPaths("bench", workdir / "app", workdir / "runs")
    run = build_training(cfg, accelerator, policy, paths=paths, writer=TensorBoardWriter(paths.log_dir))
    probe = run.telemetry.headroom
    stamps, armed, inside = [], [], []  # per step: start, armed or not, seconds inside the probe's hooks and read
    synchronize = torch.cuda.synchronize if accelerator.device.type == "cuda" else (lambda: None)

    def timed(work):
        def run_timed(*args):
            synchronize()
            started = time.perf_counter()
            found = work(*args)
            synchronize()  # the probe's kernels, not the forward's, are on the clock
            inside[-1] += time.perf_counter() - started
            return found

        return run_timed

    original_record, original_take = HeadroomProbe._record, probe.take
    HeadroomProbe._record = staticmethod(lambda *args: timed(original_record(*args)))
    probe.take = timed(original_take)

    def tick(module, args) -> None:
        if module.training:
            synchronize()  # the previous step's kernels are part of its time
            stamps.append(time.perf_counter())
            armed.append(probe.enabled)  # as the loop read it when it armed (or not) this forward
            inside.append(0.0)
            probe.enabled = not probe.enabled  # for the next step

    run.model.register_forward_pre_hook(tick)
    train(run)
    run.close()
    logged = EventAccumulator(str(paths.log_dir), size_guidance={"scalars": 0})
    logged.Reload()  # the steps that measured: the armed ones, and those only
    measured = [event.step for event in logged.Scalars(AMP_HEADROOM_BITS)]
    steps = [(armed[i], stamps[i + 1] - stamps[i]) for i in range(args.warmup, len(stamps) - 1)]
    seconds = {flag: [t for armed_, t in steps if armed_ == flag] for flag in (True, False)}
    ratios = [with_probe / without for with_probe, without in zip(seconds[True], seconds[False])]  # neighbours
    probe_seconds = statistics.median(inside[i] for i in range(args.warmup, len(stamps) - 1) if armed[i])
    result = {
        "model": "tiny BERT (2 layers, hidden 32)" if args.tiny else "all-MiniLM-L6-v2",
        "device": f"{device_name(accelerator.device)}, {torch.get_num_threads()} threads",
        "batch": f"{args.batch_size} x {args.max_length}",
        "pairs": len(ratios),
        "log_step_s_with_probe": round(statistics.median(seconds[True]), 4),
        "log_step_s_without": round(statistics.median(seconds[False]), 4),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
        "ratios": [round(r, 4) for r in ratios],
        "probe_s_per_armed_step": round(probe_seconds, 5),
        "probe_share_of_log_step": round(probe_seconds / statistics.median(seconds[False]), 5),
        "headroom_logged_at": measured,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
