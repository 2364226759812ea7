"""Build one training in this process through the app's own wiring (app/wiring.py), so a test can hook into its parts.

The training keeps its checkpoints in a temporary folder, removed as the process ends, and writes no TensorBoard
files.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from app import loop
from app.amp.policy import resolve_precision
from app.config import TrainConfig
from app.host.runtime import build_accelerator
from app.storage.folders import RunPaths
from app.wiring import Training
from app.wiring import build_training as build_app_training

# What a harness run uses unless the test says otherwise.
DEFAULTS = dict(per_device_train_batch_size=8, max_length=64, eval_steps=0, save_steps=0, disable_tqdm=True)
# Every harness run's folders, in one folder removed as the process ends (a test session builds hundreds).
_SCRATCH = tempfile.TemporaryDirectory(prefix="harness-")


def remove_folders() -> None:
    """Remove every run folder this process made: for a process that ends by os._exit (tests/forked.py), which
    skips the clean-up at the interpreter's exit."""
    _SCRATCH.cleanup()


def build_training(model_dir: Path, files: dict[str, Path], **overrides) -> Training:
    cfg = replace(
        TrainConfig(),
        model_name_or_path=str(model_dir),
        train_file=str(files["train"]),
        validation_file=str(files["validation"]),
        **(DEFAULTS | overrides),
    )
    cfg.validate()
    accelerator = build_accelerator(cfg)
    policy, _ = resolve_precision(cfg.amp, cfg.mixed_precision, accelerator.device.type, launcher=None)
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=_SCRATCH.name))
    paths = RunPaths("run", folder / "output", folder / "runs")
    paths.output_dir.mkdir()
    paths.log_dir.mkdir()
    return build_app_training(cfg, accelerator, policy, paths=paths)


def train(run: Training) -> None:
    """The app's loop over the whole run, then the run closed (its signal handlers put back)."""
    try:
        loop.train(run)
    finally:
        run.close()
