"""Train several short runs one after the other on one rank of a real multi-process launch; save each one's weights.

accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/train_runs.py RUNS.json OUT

RUNS.json: {"files": {"train": ..., "validation": ...}, "runs": {name: {"model_dir": ..., "options": {...}}}}, the
options being TrainConfig fields. OUT/rank-<rank>.pt: {name: {"masks": the dropout masks the run drew, "model_flag":
whether the model said gradient checkpointing was on, "params": its parameters at the end}}. As in the in-process
tests, the CPU counts as one where torch draws its dropout masks serially, whatever this host is.
"""

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import app.host.dropout  # noqa: E402
from tests.harness import build_training, train  # noqa: E402

app.host.dropout.intel_cpu = lambda: False  # where --fast_cpu_dropout picks the SFC64 masks

spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
files = {split: Path(path) for split, path in spec["files"].items()}
saved = {}
for name, run_spec in spec["runs"].items():
    run = build_training(Path(run_spec["model_dir"]), files, **run_spec["options"])
    model = run.accelerator.unwrap_model(run.model)
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers' newer name; older 5.x: the old one
    train(run)
    saved[name] = {
        "masks": run.masks.value,
        "model_flag": model.is_gradient_checkpointing if flag is None else flag,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    rank, world = run.accelerator.process_index, run.accelerator.num_processes
torch.save({"world": world, "runs": saved}, out / f"rank-{rank}.pt")
gc.collect()  # before tearing down: gloo otherwise sometimes aborts at interpreter exit
run.accelerator.end_training()
