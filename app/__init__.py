"""A fine-tuning app on Hugging Face Accelerate with fp16 mixed precision as a switch, made visible.

    train.py, predict.py   the entry points; cli.py what they share (help, one-line errors, exit codes)
    config.py              TrainConfig: every flag with its default and help
    wiring.py              one training built from the config (Training); loop.py the one training loop
    amp/                   precision: the policy and its reason, the scaler, the watches, the doctor, the fallback
    tasks/                 what differs between a classifier and a causal LM
    inputs/                the data and the model: loading, checks, batch order, GGUF conversion
    storage/               what a run writes and reads back: folders and leases, checkpoints, the final model, the card
    host/                  the machine: the Accelerator and ranks, signals, host memory, CPU dropout masks
    telemetry/             TensorBoard tags, layout, writer, meters, the summary

docs/architecture.md draws the whole house.
"""

import importlib.abc
import sys

# Modules that moved to a package of their own: a script that imports the old path learns the new one in one line.
MOVED = {
    "app.run": "app.wiring (Run is now Training, build_run is build_training)",
    "app.checkpoint": "app.storage.checkpoints (RunInfo is now CheckpointRecord)",
    "app.integrity": "app.storage.integrity",
    "app.disk": "app.storage.disk",
    "app.claim": "app.storage.lease",
    "app.folders": "app.storage.folders (RunFolders is now FolderClaims)",
    "app.outputs": "app.storage.final_model and app.storage.folders (RunPaths, write_config)",
    "app.model_card": "app.storage.model_card",
    "app.runtime": "app.host.runtime",
    "app.preemption": "app.host.preemption",
    "app.host_memory": "app.host.memory",
    "app.dropout": "app.host.dropout",
    "app.data": "app.inputs.data",
    "app.reading": "app.inputs.reading",
    "app.sampling": "app.inputs.sampling",
    "app.model": "app.inputs.model",
    "app.gguf_convert": "app.inputs.gguf",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} has moved: import {MOVED[name]}; see docs/architecture.md", name=name)
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
