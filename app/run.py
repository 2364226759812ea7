"""One training run: everything it is made of, built in one place from a config, an accelerator and a policy.

train.py, the tests' harness and the scripts all build their runs here, so they train the same wiring:

    inputs = load_inputs(cfg, accelerator)                 # every check of user input, then tokenizing
    run = build_run(cfg, accelerator, policy, inputs)      # weights, optimizer, schedule, scaler, resume, telemetry
    train(run)                                             # app/loop.py
    run.close()

`load_inputs` is separate so that train.py can create its folders between the input checks and the heavy work.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from datasets import DatasetDict
from transformers import PretrainedConfig

from app import data, gguf_convert
from app.amp.policy import PrecisionPolicy
from app.amp.scaler import ScalerCheckpoint, make_scaler
from app.checkpoint import Checkpoints, ResumePoint, RunInfo
from app.config import TrainConfig
from app.dropout import MASKS_SAID, masks_context, masks_of_run
from app.model import check_max_length, load_model_config, load_tokenizer, refuse_quantized, resolve_model_path
from app.optim import build_optimizer, build_schedule, total_optimizer_steps
from app.outputs import RunPaths
from app.preemption import StopRequest
from app.runtime import HostCollective, backend_name
from app.sampling import DataPosition
from app.state import TrainState
from app.tasks import Task, build_task, resolve_task
from app.telemetry.meters import Telemetry
from app.telemetry.writer import NullWriter, TensorBoardWriter


@dataclass
class Inputs:
    """The checked, tokenized data, the task that tokenized it, and what it takes to load the model."""

    model_path: str
    model_config: PretrainedConfig  # as stored, before the weights load in fp32
    tokenizer: object
    task: Task
    tokenized: DatasetDict  # "train" and "validation"


def load_inputs(cfg: TrainConfig, accelerator: Accelerator) -> Inputs:
    """Check every input (model config, task, tokenizer, length, columns, labels) before any weights load, then
    tokenize."""
    model_path, gguf_file = resolve_model_path(cfg)
    if gguf_file:  # a converted copy loads like any model folder; else config and tokenizer come from the file
        gguf_convert.check_gguf(model_path, gguf_file)
        converted = gguf_convert.converted_folder(model_path, gguf_file)
        model_path, gguf_file = (
            (str(converted), None) if gguf_convert.is_converted(converted) else (model_path, gguf_file)
        )
    model_config = load_model_config(model_path, gguf_file)
    refuse_quantized(model_path, model_config)
    task_name, why = resolve_task(cfg.task, model_config)
    accelerator.print(f"task: {task_name} ({why})")
    tokenizer = load_tokenizer(model_path, gguf_file)
    check_max_length(cfg.max_length, model_config, tokenizer)
    raw = data.load_raw(cfg)
    task = build_task(task_name, cfg, raw, tokenizer, model_config)
    if gguf_file:  # every input is checked: now the heavy conversion, by the main process first
        with accelerator.main_process_first():
            model_path = str(gguf_convert.convert(model_path, gguf_file, converted, accelerator.print))
    tokenized = task.tokenize(raw, accelerator)
    for note in task.notes:
        accelerator.print(note)
    return Inputs(model_path=model_path, model_config=model_config, tokenizer=tokenizer, task=task, tokenized=tokenized)


@dataclass
class Run:
    """A run's parts. The model, optimizer and loaders have been through `accelerator.prepare`; the schedule has not
    (a prepared schedule would step once per process, and on skipped steps too)."""

    cfg: TrainConfig
    accelerator: Accelerator
    policy: PrecisionPolicy
    inputs: Inputs
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # Accelerate's wrapper; `.optimizer` is the raw one that the scaler steps
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader
    total_steps: int
    state: TrainState
    checkpoints: Checkpoints
    telemetry: Telemetry
    stop: StopRequest
    scaler_state: ScalerCheckpoint  # what Accelerate checkpoints; it holds `scaler`
    dropout_masks: Callable[[], contextlib.AbstractContextManager]  # what a training forward runs under: dropout.py

    def switch_precision(self, policy: PrecisionPolicy, record: dict) -> None:
        """Train on in `policy` (a precision fallback), with a fresh scaler; later checkpoints record the switch."""
        self.policy = policy
        self.scaler = make_scaler(policy, self.cfg.init_loss_scale, self.cfg.loss_scale_growth_interval, "")
        self.scaler_state.scaler = self.scaler  # Accelerate knows the checkpointed object by position: keep it
        self.checkpoints.precision, self.checkpoints.fallback = policy.mode, record

    def rewind_to(self, checkpoint: Path) -> None:
        """Back to a checkpoint of this run: weights, optimizer, schedule, scaler, RNG streams and counters."""
        self.checkpoints.load(checkpoint)
        vars(self.state).update(vars(RunInfo.read(checkpoint).state))
        self.telemetry.rewind(self.state)

    def loss(self, batch: dict) -> torch.Tensor:
        """The task's loss of a batch: the mean over its items (examples, or label tokens)."""
        return self.inputs.task.loss(self.model, batch)

    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole validation set."""
        return self.inputs.task.evaluate(self.accelerator, self.policy, self.model, self.eval_loader)

    def close(self) -> None:
        self.telemetry.close()
        self.stop.restore()


def build_run(
    cfg: TrainConfig,
    accelerator: Accelerator,
    policy: PrecisionPolicy,
    inputs: Inputs | None = None,
    *,
    paths: RunPaths | None = None,
    resume: ResumePoint | None = None,
    writer: TensorBoardWriter | NullWriter | None = None,
    stop: StopRequest | None = None,
    model: torch.nn.Module | None = None,
) -> Run:
    """Build a run, resumed from `resume` if given.

    Args:
        inputs: from load_inputs; loaded here if not given.
        paths: where checkpoints go; a temporary folder if not given (the run then never keeps them).
        writer: the TensorBoard writer (main process) or a NullWriter; a NullWriter if not given.
        stop: the signal handler, installed by the caller before any heavy work; a new one if not given.
        model: a model built elsewhere (e.g. from a config); default: loaded from `inputs.model_path`.
    """
    inputs = inputs or load_inputs(cfg, accelerator)
    paths = paths or RunPaths("run", Path(tempfile.mkdtemp(prefix="run-")), Path(tempfile.mkdtemp(prefix="runs-")))
    stop = stop or StopRequest(HostCollective(accelerator.num_processes))
    pad_to = cfg.pad_to_multiple_of or policy.pad_to_multiple_of  # the flag overrides the policy's choice
    collate = inputs.task.collator(pad_to)
    train_loader, eval_loader = data.make_loaders(inputs.tokenized, collate, cfg, accelerator.num_processes)
    model = model or inputs.task.load_model(inputs.model_path)
    if cfg.gradient_checkpointing:
        # Non-reentrant: works under DDP and with inputs that need no gradient (token ids). Newer transformers 5.x
        # renamed it (the old name warns, and goes in v6); older 5.x releases have only the old one.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.torch_compile:
        # The model only: autocast and the scaler stay eager. In place, so that no wrapper module prefixes the
        # parameter names ("_orig_mod.") in checkpoints and in the saved model.
        model.compile()
    optimizer = build_optimizer(model, cfg)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total_steps = total_optimizer_steps(cfg, len(train_loader))
    # Built on the raw optimizer, the one the scaler steps (see loop.optimizer_step); it shares the wrapper's groups.
    schedule = build_schedule(optimizer.optimizer, cfg, total_steps)
    scaler = make_scaler(policy, cfg.init_loss_scale, cfg.loss_scale_growth_interval, backend_name(accelerator))
    scaler_state = ScalerCheckpoint(scaler)
    accelerator.register_for_checkpointing(schedule, scaler_state)

    checkpoints = Checkpoints(accelerator, paths.output_dir, cfg.save_total_limit, paths.run_name, policy.mode)
    checkpoints.remove_staging()
    checkpoints.data_position = position = DataPosition(
        train_loader, cfg.per_device_train_batch_size, accelerator.num_processes, cfg.gradient_accumulation_steps
    )
    state = TrainState()
    checkpoints.dropout_masks = masks_of_run(cfg, accelerator.device, resume.info.dropout_masks if resume else None)
    if resume:
        checkpoints.load(resume.path)
        state = TrainState(**vars(resume.info.state))
        checkpoints.fallback = resume.info.fallback
        accelerator.print(f"resumed from {resume.path} at optimizer step {state.opt_step}")
        notes = resume.info.resume_notes(policy.mode, scaler_state.toggled) + position.resume(state, resume.info)
        if checkpoints.dropout_masks != masks_of_run(cfg, accelerator.device):
            notes.append(
                f"note: dropout masks drawn as when the run started ({MASKS_SAID[checkpoints.dropout_masks]}), so that "
                "it continues exactly; --fast_cpu_dropout applies to new runs"
            )
        for line in notes:
            accelerator.print(line)

    telemetry = Telemetry(
        accelerator, writer or NullWriter(), model, policy, total_steps, state, cfg.disable_tqdm, not cfg.torch_compile
    )
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        policy=policy,
        inputs=inputs,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        scaler=scaler,
        train_loader=train_loader,
        eval_loader=eval_loader,
        total_steps=total_steps,
        state=state,
        checkpoints=checkpoints,
        telemetry=telemetry,
        stop=stop,
        scaler_state=scaler_state,
        dropout_masks=masks_context(checkpoints.dropout_masks),
    )
