"""Run app/train.py as one rank of a real launch, and record the examples each of its training forward passes saw.

python tests/workers/record_examples.py OUT [--sigterm_at_forward N] <train.py flags>
accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/record_examples.py OUT <flags>

Each forward pass in training mode appends one line to OUT/forward-<rank>.jsonl: the token ids of its rows, without
padding. The app itself records nothing of the kind; the hook goes onto the model as the app loads it. A test that
runs the app in its own process installs the same hook with `recording_load`.

With `--sigterm_at_forward N`, rank 0 sends itself a real SIGTERM during its N-th training forward pass: a preemption
at a known optimizer step (the ranks agree on it at the end of that step, checkpoint, and stop).
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import exit_process  # noqa: E402
from app.tasks.classification import SequenceClassification  # noqa: E402
from app.train import main  # noqa: E402


def recording_load(out: Path, rank: str, load_model, sigterm_at_forward: int | None = None):
    """`load_model` (SequenceClassification's), with a hook that records each training forward pass's rows."""
    log = out / f"forward-{rank}.jsonl"
    passes = [0]

    def record(module, args, kwargs):
        if module.training:
            rows = [ids[mask.bool()].tolist() for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])]
            with log.open("a") as file:
                file.write(json.dumps(rows) + "\n")
            passes[0] += 1
            if passes[0] == sigterm_at_forward and rank == "0":
                os.kill(os.getpid(), signal.SIGTERM)

    def load_and_watch(task, model_path, *args, **kwargs):
        model = load_model(task, model_path, *args, **kwargs)
        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    return load_and_watch


if __name__ == "__main__":
    out, rank, flags = Path(sys.argv[1]), os.environ.get("RANK", "0"), sys.argv[2:]
    sigterm_at = int(flags[1]) if flags[:1] == ["--sigterm_at_forward"] else None
    flags = flags[2:] if sigterm_at else flags
    SequenceClassification.load_model = recording_load(out, rank, SequenceClassification.load_model, sigterm_at)
    exit_process(main(flags))  # as app/train.py ends
