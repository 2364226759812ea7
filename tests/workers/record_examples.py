"""Run app/train.py as one rank of a real launch, and record the examples each of its training forward passes saw.

python tests/workers/record_examples.py OUT <train.py flags>
accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/record_examples.py OUT <flags>

Each forward pass in training mode appends one line to OUT/forward-<rank>.jsonl: the token ids of its rows, without
padding. The app itself records nothing of the kind; the hook goes onto the model as the app loads it. A test that
runs the app in its own process installs the same hook with `recording_load`.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import exit_process  # noqa: E402
from app.tasks.classification import SequenceClassification  # noqa: E402
from app.train import main  # noqa: E402


def recording_load(out: Path, rank: str, load_model):
    """`load_model` (SequenceClassification's), with a hook that records each training forward pass's rows."""
    log = out / f"forward-{rank}.jsonl"

    def record(module, args, kwargs):
        if module.training:
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])]
            with log.open("a") as file:
                file.write(json.dumps(rows) + "\n")

    def load_and_watch(task, model_path, say):
        model = load_model(task, model_path, say)
        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    return load_and_watch


if __name__ == "__main__":
    out, rank = Path(sys.argv[1]), os.environ.get("RANK", "0")
    SequenceClassification.load_model = recording_load(out, rank, SequenceClassification.load_model)
    exit_process(main(sys.argv[2:]))  # as app/train.py ends
