"""Run the app's loop on one rank of a real multi-process launch; record what this rank trained on and its result.

accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/ddp_worker.py OUT MODEL TRAIN VAL
"""

import gc
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.harness import build_training, train  # noqa: E402

out, model_dir, train_csv, val_csv = map(Path, sys.argv[1:5])
run = build_training(model_dir, {"train": train_csv, "validation": val_csv}, mixed_precision="no", max_steps=4)
rows = []


def record(module, args, kwargs):
    if module.training:
        for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"]):
            rows.append(hashlib.sha1(ids[mask.bool()].numpy().tobytes()).hexdigest())


run.model.register_forward_pre_hook(record, with_kwargs=True)
train(run)
final = run.evaluate()
rank = run.accelerator.process_index
torch.save(
    {n: p.detach().clone() for n, p in run.accelerator.unwrap_model(run.model).named_parameters()},
    out / f"params-{rank}.pt",
)
(out / f"rank-{rank}.json").write_text(
    json.dumps({"world": run.accelerator.num_processes, "rows": rows, "eval": final})
)
gc.collect()  # before tearing down: gloo otherwise sometimes aborts at interpreter exit
run.accelerator.end_training()
