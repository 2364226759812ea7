"""Build one run from the app's own parts, in this process, so a test can hook into the model and the loop.

The wiring is train.py's: the same builders in the same order, minus folders and TensorBoard.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from app import data
from app.checkpoint import Checkpoints
from app.config import TrainConfig
from app.loop import Trainables, build_trainables, train
from app.metrics import NullWriter, Telemetry
from app.model import load_model, load_tokenizer
from app.precision import PrecisionPolicy, resolve_precision
from app.preemption import StopRequest
from app.runtime import build_accelerator
from app.state import TrainState


@dataclass
class Run:
    cfg: TrainConfig
    accelerator: object
    policy: PrecisionPolicy
    parts: Trainables
    total_steps: int
    state: TrainState

    def train(self) -> None:
        telemetry = Telemetry(self.accelerator, NullWriter(), self.parts.model, self.policy.mode, self.total_steps,
                              self.state, disable_progress=True)
        checkpoints = Checkpoints(self.accelerator, Path(tempfile.mkdtemp(prefix="harness-")), None, run_info={})
        stop = StopRequest(self.accelerator.num_processes)
        try:
            return train(self.cfg, self.accelerator, self.policy, self.parts, self.state, self.total_steps, telemetry,
                         checkpoints, stop)
        finally:
            stop.restore()


def build_run(model_dir: Path, files: dict[str, Path], **overrides) -> Run:
    cfg = replace(TrainConfig(), model_name_or_path=str(model_dir), train_file=str(files["train"]),
                  validation_file=str(files["validation"]), per_device_train_batch_size=8, max_length=64,
                  eval_steps=0, save_steps=0, disable_tqdm=True, **overrides)
    cfg.validate()
    accelerator = build_accelerator(cfg)
    policy, _ = resolve_precision(cfg.amp, cfg.mixed_precision, accelerator.device.type, launcher=None)
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    columns = data.resolve_columns(cfg)
    raw = data.load_raw(cfg)
    labels = data.infer_labels(raw, columns[2], fixed=None)
    tokenized = data.tokenize(raw, tokenizer, columns, labels, cfg.max_length, accelerator)
    train_loader, eval_loader = data.make_loaders(tokenized, tokenizer, cfg, 8 if policy.autocast_enabled else None)
    model = load_model(cfg.model_name_or_path, labels.id2label)
    parts, total_steps = build_trainables(cfg, accelerator, policy, model, train_loader, eval_loader)
    return Run(cfg, accelerator, policy, parts, total_steps, TrainState())
