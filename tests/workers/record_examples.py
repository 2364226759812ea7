"""Run app/train.py as one rank of a real launch, and record the examples each of its training forward passes saw.

python tests/workers/record_examples.py OUT <train.py flags>
accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/record_examples.py OUT <flags>

Each forward pass in training mode appends one line to OUT/forward-<rank>.jsonl: the token ids of its rows, without
padding. The app itself records nothing of the kind; the hook goes onto the model as the app loads it.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import exit_process  # noqa: E402
from app.tasks.classification import SequenceClassification  # noqa: E402
from app.train import main  # noqa: E402

out, argv = Path(sys.argv[1]), sys.argv[2:]
log = out / f"forward-{os.environ.get('RANK', '0')}.jsonl"


def record(module, args, kwargs):
    if module.training:
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])]
        with log.open("a") as file:
            file.write(json.dumps(rows) + "\n")


def load_and_watch(task, model_path):
    model = load_model(task, model_path)
    model.register_forward_pre_hook(record, with_kwargs=True)
    return model


load_model, SequenceClassification.load_model = SequenceClassification.load_model, load_and_watch
exit_process(main(argv))  # as app/train.py ends
