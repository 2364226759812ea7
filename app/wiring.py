"""The wiring: one training built in one place from a config, an accelerator and a precision policy.

train.py, the tests' harness and the scripts all build their trainings here, so they train the same wiring:

    inputs = load_inputs(cfg, accelerator)                                # every check of user input, then tokenizing
    training = build_training(cfg, accelerator, policy, inputs, paths=paths)  # weights, optimizer, scaler, resume, ...
    train(training)                                                       # app/loop.py
    training.close()

`load_inputs` is separate so that every input check comes before the heavy work; `build_training` readies the run's
folders through train.py's callback: a new run's before its weights load, a resume's once its checkpoint has loaded.
`Training` holds the parts and the few acts that need several of them (a precision switch, a rewind, the fp16
diagnostics, the model card); every part below it is given what it needs, never the `Training`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from datasets import DatasetDict
from transformers import PretrainedConfig

from app.adapters.base import base_dtype_after_fallback, dtype_name
from app.adapters.lora import keep_trainable_weights, trainable_names
from app.adapters.plan import (
    ModelPlan,
    check_resume,
    check_resume_labels,
    describe_trainable,
    load_model,
    plan_model,
    reload_base,
)
from app.amp import diagnose
from app.amp.fallback import Fallback
from app.amp.policy import PrecisionPolicy
from app.amp.scaler import ScalerCheckpoint, make_scaler
from app.best import check_best_checkpoint, check_resume_best, final_competes
from app.cli import as_utf8
from app.config import TrainConfig, metric_tag
from app.host.dropout import (
    DropoutMasks,
    drops_out,
    masks_context,
    masks_of_run,
    recompute_under_the_masks_mode,
)
from app.host.preemption import StopRequest
from app.host.runtime import HostCollective, backend_name, on_main_process
from app.inputs import data, gguf
from app.inputs.batch_shape import uneven_epoch_note
from app.inputs.model import (
    check_max_length,
    check_weight_files,
    load_model_config,
    load_tokenizer,
    portable_name,
    refuse_adapters_alone,
    refuse_quantized,
    resolve_model_path,
)
from app.inputs.sampling import DataPosition
from app.optim import (
    build_optimizer,
    build_schedule,
    ends_an_epoch,
    follow_the_schedule,
    steps_per_epoch,
    total_optimizer_steps,
)
from app.state import TrainState
from app.storage.checkpoints import CheckpointRecord, Checkpoints, ResumePoint, run_commands, weights_unusable
from app.storage.final_model import AdaptersBase, save_final_model
from app.storage.folders import RunPaths
from app.storage.model_card import write_model_card
from app.tasks.classification import class_names
from app.tasks.first_token import cut_layer
from app.tasks.task import Task, build_task, resolve_task
from app.telemetry import report, tags
from app.telemetry.meters import Telemetry
from app.telemetry.tags import MEMORY_ESTIMATE_GIB, MODEL_TRAINABLE_PARAMS
from app.telemetry.writer import NullWriter, TensorBoardWriter


@dataclass
class Inputs:
    """The checked, tokenized data, the task that tokenized it, and what it takes to load the model."""

    model_path: str
    model_config: PretrainedConfig  # as stored, before any weight loads
    tokenizer: object
    task: Task
    tokenized: DatasetDict  # "train" and "validation"
    plan: ModelPlan  # what trains (every weight, or adapters on a frozen base) and in which dtype


def load_inputs(
    cfg: TrainConfig, accelerator: Accelerator, policy: PrecisionPolicy, resume: ResumePoint | None = None
) -> Inputs:
    """Check every input (model config, task, tokenizer, length, columns, labels, adapters, the checkpoint to resume
    from) before any weights load, then tokenize."""
    model_path, gguf_file = resolve_model_path(cfg)
    if gguf_file:  # a converted copy loads like any model folder; else config and tokenizer come from the file
        gguf.check_gguf(model_path, gguf_file)
        converted = gguf.converted_folder(model_path, gguf_file)
        if gguf.is_converted(converted):
            model_path, gguf_file = str(converted), None
        else:
            gguf.check_cache(converted)
    refuse_adapters_alone(model_path)  # first: peft's own folders hold no config.json
    model_config = load_model_config(model_path, gguf_file)
    check_weight_files(model_path)
    refuse_quantized(model_path, model_config)
    task_name, why = resolve_task(cfg.task, model_config)
    accelerator.print(f"task: {task_name} ({why})")
    tokenizer = load_tokenizer(model_path, model_config, gguf_file)
    check_max_length(cfg.max_length, model_config, tokenizer, bool(cfg.text_pair_column), cfg.pad_to_multiple_of)
    raw = data.load_raw(cfg)
    for note in data.held_out_note(raw, cfg):
        accelerator.print(note)
    task = build_task(task_name, cfg, raw, tokenizer, model_config)
    if gguf_file:  # every input is checked: now the heavy conversion, by the main process first
        with accelerator.main_process_first():
            model_path = str(gguf.convert(model_path, gguf_file, converted, accelerator.print))
    plan = plan_model(cfg, policy, task, model_config, model_path)  # reads the base's files, loads no weight
    if resume:
        check_resume(resume.record.adapters, plan, resume.path, task.empty_model(model_config))
        check_resume_labels(resume.record.labels, class_names(task), resume.path)
        check_resume_best(cfg, resume.record.state, resume.path)
        on_main_process(accelerator, lambda: check_best_checkpoint(cfg, resume.record, resume.path))
    tokenized = task.tokenize(raw, accelerator)
    for note in task.notes:
        accelerator.print(note)
    return Inputs(model_path, model_config, tokenizer, task, tokenized, plan)


@dataclass
class Training:
    """A training's parts. The model, optimizer and loaders have been through `accelerator.prepare`; the schedule has
    not (a prepared schedule would step once per process, and on skipped steps too)."""

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
    host: HostCollective  # sums and maxima of host values over the ranks (the loop's step weights)
    stop: StopRequest
    scaler_state: ScalerCheckpoint  # what Accelerate checkpoints; it holds `scaler`
    masks: DropoutMasks  # how this run draws its CPU dropout masks (host/dropout.py)
    draws_masks: bool  # whether the model drops out at all (host/dropout.drops_out): else nothing is said of masks
    evaluated: tuple[int, dict[str, float]] | None = None  # the last evaluation: its optimizer step and metrics
    # With --load_best_model_at_end, the best step, whose weights the model has at the end (a lost checkpoint: None).
    saved_best: int | None = None
    # Whether `stop` is this training's own (build_training's), for close() to give back: train.py's handler stays
    # until the run's line is said, or a Ctrl-C more would be a KeyboardInterrupt in between.
    owns_stop: bool = False

    def dropout_masks(self) -> contextlib.AbstractContextManager:
        """What a training forward runs under: faster CPU dropout masks where torch draws them serially."""
        return masks_context(self.masks)()

    def loss(self, batch: dict) -> torch.Tensor:
        """The task's loss of a batch: the mean over its items (examples, or label tokens)."""
        return self.inputs.task.loss(self.model, batch)

    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole validation set."""
        return self.inputs.task.evaluate(self.accelerator, self.policy, self.model, self.eval_loader)

    def evaluated_at(self, step: int) -> bool:
        return self.evaluated is not None and self.evaluated[0] == step

    def evaluate_and_log(self) -> dict[str, float]:
        """evaluate(), logged at the current step; kept, so that a step the loop evaluated (one that stopped the run
        early) is not evaluated again as the final model: the same weights, a second point at the same step, and
        the time of a pass over the validation set."""
        step = self.state.opt_step
        if self.evaluated_at(step):
            return self.evaluated[1]
        metrics = self.evaluate()
        self.telemetry.log_eval(step, metrics)
        self.evaluated = (step, metrics)
        return metrics

    # ---- a precision fallback: switch, then rewind ------------------------------------------------------------------
    def fall_back(self, fallback: Fallback) -> str:
        """Train on in the fallback's precision from its checkpoint, with a fresh scaler (and a frozen base loaded
        again in a dtype the new precision computes with). Returns the note to say."""
        old, plan = self.policy, self.inputs.plan
        self.policy = fallback.policy
        reloaded = ""
        if plan.adapters and (dtype := base_dtype_after_fallback(self.cfg.dtype, fallback.policy)) != plan.dtype:
            raw = self.accelerator.unwrap_model(self.model)
            reload_base(raw, self.inputs.task, self.inputs.model_path, dtype)
            self.inputs.plan = dataclasses.replace(plan, dtype=dtype, why=f"reloaded for {fallback.policy.label}")
            held = sorted({dtype_name(p.dtype) for p in raw.parameters() if not p.requires_grad})
            reloaded = f"; the frozen base reloaded in {', '.join(held)}"
        self.scaler = make_scaler(fallback.policy, self.cfg.init_loss_scale, self.cfg.loss_scale_growth_interval, "")
        self.scaler_state.scaler = self.scaler  # Accelerate knows the checkpointed object by position: keep it
        self.checkpoints.switch_precision(fallback.policy.mode, fallback.record)
        self.rewind_to(fallback.checkpoint)  # the saved scaler state was fp16's: ScalerCheckpoint keeps the fresh one
        at_step = fallback.record["at_step"]
        note = fallback.note(self.state.opt_step) + reloaded
        self.telemetry.writer.text(tags.AMP_FALLBACK, note, at_step)
        self.telemetry.writer.text(tags.RUN_PRECISION, fallback.precision_text(old, at_step), at_step)
        return note

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step, with the logging interval it cuts. Collective."""
        self.telemetry.record_interval(self.state)
        return self.checkpoints.save(self.state)

    def rewind_to(self, checkpoint: Path) -> None:
        """Back to a checkpoint of this run: weights, optimizer, schedule, scaler, RNG streams and counters."""
        self.checkpoints.load(checkpoint)
        vars(self.state).update(vars(CheckpointRecord.read(checkpoint).state))
        self.telemetry.rewind(self.state)
        self.evaluated = None  # of weights that are gone

    # ---- fp16 diagnostics ------------------------------------------------------------------------------------------
    def preflight(self) -> None:
        """amp/diagnose.preflight before the first fp16 step, said and written as TensorBoard text. Main process."""
        if self.policy.mode != "fp16" or not self.accelerator.is_main_process:
            return
        if backend_name(self.accelerator).startswith("FSDP"):  # a sharded forward on one rank would wait for the others
            self.accelerator.print("amp pre-flight: skipped under FSDP (each rank holds a shard of the weights)")
            return
        batch = diagnose.first_training_batch(self.train_loader, self.accelerator.device)
        model = self.accelerator.unwrap_model(self.model)
        lines = diagnose.preflight(self.policy, model, self.inputs.task.loss, batch, self.inputs.model_config)
        for line in lines:
            self.accelerator.print(line)
        self.telemetry.writer.text(tags.AMP_PREFLIGHT, "\n\n".join(lines))

    def overflow_report(self, batch: dict, multiplier: float) -> str | None:
        """amp/diagnose.overflow_report of `batch` (this rank's), under this training's autocast and dropout masks,
        its loss times `multiplier`."""
        return diagnose.overflow_report(
            self.policy,
            self.accelerator.unwrap_model(self.model),
            self.inputs.task.loss,
            batch,
            multiplier,
            lambda: self.accelerator.no_sync(self.model),
            self.dropout_masks,
        )

    def report_overflow(self, batch: dict | None, multiplier: float, step: int) -> None:
        """The overflow report, on stderr and as TensorBoard text. Each rank replays its own batch; the main one says
        what the first rank that found an overflow found. Collective."""
        found = self.overflow_report(batch, multiplier) if batch is not None else None
        line = diagnose.overflow_said(gather_object([found]), batch is not None)
        if self.accelerator.is_main_process:
            print(line, file=sys.stderr, flush=True)
        self.telemetry.writer.text(tags.AMP_OVERFLOW_REPORT, line, step)

    # ---- the end ---------------------------------------------------------------------------------------------------
    def end_with_best(self, final: dict[str, float]) -> tuple[dict[str, float], bool]:
        """After the final evaluation: let it compete for best, then load the best weights if asked.

        Returns:
            The evaluation metrics of the model that ends the run, and whether its weights are the best checkpoint's
            rather than the trained ones (then they are to be saved in the trained model's place).
        """
        step = final_competes(self.cfg, self.state, self.total_steps, final)
        self.saved_best = self.state.best_step if self.cfg.load_best_model_at_end else None
        if step is None:
            return final, False
        path = self.checkpoints.best(self.state)
        # Checked at a resume; gone or damaged since (by hand, during the training): the trained model stays.
        if problem := on_main_process(self.accelerator, lambda: weights_unusable(path)):
            self.saved_best = None
            self.accelerator.print(
                f"warning: the best checkpoint, step {step}, cannot be loaded ({problem}): the model saved is the "
                f"last step's, step {self.state.opt_step}"
            )
            return final, False
        self.checkpoints.load_model_weights(self.model, path)
        self.accelerator.print(
            f"loaded the best model, step {step} ({metric_tag(self.cfg.metric_for_best_model)} "
            f"{self.state.best_metric:.4f}), from {path} in place of step {self.state.opt_step}'s"
        )
        return self.evaluate(), True

    def save_model(self, output_dir: Path) -> None:
        """The model as it is now (or its adapters), and the tokenizer, into `output_dir`, atomically
        (storage/final_model.py). Adapters name their base as another machine would find it."""
        plan, raw = self.inputs.plan, self.accelerator.unwrap_model(self.model)
        frozen = next(
            (dtype_name(p.dtype) for p in raw.parameters() if not p.requires_grad), None
        )  # after a fallback too
        path = Path(self.inputs.model_path)
        conversion = path.name if path.resolve().parent == gguf.cache_root().resolve() else None
        name, given = portable_name(self.cfg), self.cfg.model_name_or_path
        relative = given if given and given != name else None
        base = AdaptersBase(name, plan.base, self.inputs.model_config.dtype, frozen, conversion, relative)
        base = base if plan.adapters else None
        last = self.checkpoints.last_saved
        save_final_model(self.accelerator, self.model, self.inputs.tokenizer, output_dir, last, base)

    def write_model_card(self, run_name: str, output_dir: Path, final: dict[str, float]) -> None:
        write_model_card(
            output_dir,
            final,
            run_name=run_name,
            cfg=self.cfg,
            task=self.inputs.task,
            policy=self.policy,
            state=self.state,
            total_steps=self.total_steps,
            processes=self.accelerator.num_processes,
            examples=(len(self.inputs.tokenized["train"]), len(self.inputs.tokenized["validation"])),
            adapters=self.inputs.plan.adapters.describe() if self.inputs.plan.adapters else None,
            base_dtype=dtype_name(self.inputs.plan.dtype),
            commands=self.checkpoints.record.commands,
            best_step=self.saved_best,
        )

    def write_hparams_row(self) -> None:
        """The run's row in TensorBoard's HPARAMS tab, at the step it reached."""
        row = report.hparams(self.cfg, self.policy, self.accelerator, self.state)
        self.telemetry.write_hparams_row(self.state.opt_step, row)

    def close(self) -> None:
        self.telemetry.close()
        if self.owns_stop:
            self.stop.restore()


def checkpoint_activations(model: torch.nn.Module, masks: DropoutMasks) -> None:
    """Gradient checkpointing, with the backward's recomputation drawing the forward's dropout masks."""
    # Non-reentrant: works under DDP and with inputs that need no gradient (token ids).
    options = {"use_reentrant": False}
    # torch's own masks come back from the RNG state torch restores, with no help; and torch.compile (whose runs draw
    # torch's masks) takes only dispatch modes from a context_fn.
    if masks != DropoutMasks.TORCH:
        options["context_fn"] = recompute_under_the_masks_mode
    # A classifier never reads a key/value cache, but BERT's config asks for one, and transformers then warns on the
    # console that it turns it off. (A causal LM's training forward passes use_cache=False; its saved config stays.)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and not model.can_generate():
        config.use_cache = False
    # Newer transformers 5.x renamed it (the old name warns, and goes in v6); older 5.x releases have only the old one.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def build_training(
    cfg: TrainConfig,
    accelerator: Accelerator,
    policy: PrecisionPolicy,
    inputs: Inputs | None = None,
    *,
    paths: RunPaths,
    resume: ResumePoint | None = None,
    writer: TensorBoardWriter | NullWriter | None = None,
    stop: StopRequest | None = None,
    model: torch.nn.Module | None = None,
    prepare_folders: Callable[[], None] = lambda: None,
    batch_flags: tuple[int, int] | None = None,
) -> Training:
    """Build a training, resumed from `resume` if given.

    Args:
        inputs: from load_inputs; loaded here if not given.
        paths: the run's folders; checkpoints go into `paths.output_dir`.
        resume: where to continue from, its record with its position in examples (sampling.recorded_in_examples);
            `cfg` has then the batch shape that keeps the run's examples per step (batch_shape.keep_global_batch).
        writer: the TensorBoard writer (main process) or a NullWriter; a NullWriter if not given.
        stop: the signal handler, installed by the caller before any heavy work, who gives it back; a new one if not
            given, which close() gives back.
        model: a model built elsewhere (e.g. from a config); default: loaded from `inputs.model_path`.
        prepare_folders: readies the run's folders (train.py: storage/folders.prepare); called before anything is
            written there: for a resume once its checkpoint has loaded, so that a refusal or a crash while loading
            leaves them as they were; for a new run before its weights load, so that its refusals come first.
        batch_flags: the per-device batch and accumulation the command gave, before a resume kept the run's global
            batch (batch_shape.keep_global_batch); the checkpoints record them. Default: `cfg`'s.
    """
    inputs = inputs or load_inputs(cfg, accelerator, policy, resume)
    owns_stop = stop is None
    stop = stop or StopRequest.for_run(accelerator)
    pad_to = cfg.pad_to_multiple_of or policy.pad_to_multiple_of  # the flag overrides the policy's choice
    collate = inputs.task.collator(pad_to)
    train_loader, eval_loader = data.make_loaders(inputs.tokenized, collate, cfg, accelerator.num_processes)
    started_with = resume.record.dropout_masks if resume else None
    masks = masks_of_run(cfg, accelerator.device, started_with)
    plan = inputs.plan
    accelerator.print(plan.footprint.line())
    as_begun = resume.record.first_token_alone if resume else True  # a resume continues as its run began
    say = accelerator.print  # what the model's files lack, made at random: a resume then loads it from its checkpoint
    if resume:
        say = lambda line: accelerator.print(f"{line}, then loaded from {resume.path}")  # noqa: E731
    if not resume:  # its refusals (--overwrite_output_dir's) before the heavy work
        prepare_folders()
    model = model or load_model(inputs.task, inputs.model_path, plan, say, as_begun)
    draws_masks = drops_out(model)  # once, for the masks line and a resume's notes of masks
    first_token_alone = cut_layer(model) is not None  # where it applies (tasks/first_token.py)
    for line in describe_trainable(model, plan):
        accelerator.print(line)
    if plan.adapters:  # checkpoints hold what trains, not the frozen base
        accelerator.register_save_state_pre_hook(keep_trainable_weights)
    if cfg.gradient_checkpointing:
        checkpoint_activations(model, masks)
    if cfg.torch_compile:
        # The model only: autocast and the scaler stay eager. In place, so that no wrapper module prefixes the
        # parameter names ("_orig_mod.") in checkpoints and in the saved model.
        model.compile()
    optimizer = build_optimizer(model, cfg)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total_steps = total_optimizer_steps(cfg, len(train_loader))
    trained = resume.record.state.opt_step if resume else 0
    if ends_an_epoch(trained, total_steps, steps_per_epoch(cfg, len(train_loader))):  # else no example repeats
        examples = len(inputs.tokenized["train"])
        for note in uneven_epoch_note(examples, cfg.per_device_train_batch_size, accelerator.num_processes):
            accelerator.print(note)
    tracking = cfg.best_model_flags()
    if tracking and cfg.eval_steps >= total_steps:  # the first evaluation is the last
        accelerator.print(
            f"note: --eval_steps {cfg.eval_steps} leaves no evaluation before the run's last step ({total_steps}): "
            f"{' and '.join(tracking)} act{'s' if len(tracking) == 1 else ''} on the final evaluation alone"
        )
    # Built on the raw optimizer, the one the scaler steps (see loop.optimizer_step); it shares the wrapper's groups.
    schedule = build_schedule(optimizer.optimizer, cfg, total_steps)
    scaler = make_scaler(policy, cfg.init_loss_scale, cfg.loss_scale_growth_interval, backend_name(accelerator))
    scaler_state = ScalerCheckpoint(scaler)
    accelerator.register_for_checkpointing(schedule, scaler_state)

    position = DataPosition(
        train_loader, cfg.per_device_train_batch_size, accelerator.num_processes, cfg.gradient_accumulation_steps
    )
    record = CheckpointRecord(
        paths.run_name,
        policy.mode,
        accelerator.num_processes,
        fallback=resume.record.fallback if resume else None,
        dropout_masks=masks,
        adapters=plan.record(),
        commands=[*run_commands(resume), shlex.join(map(as_utf8, sys.argv))],
        first_token_alone=first_token_alone,
        labels=class_names(inputs.task),
        batch_flags=list(batch_flags or (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)),
        folders={"output_dir": str(paths.output_dir.resolve()), "logdir": str(Path(cfg.logdir).resolve())},
    )
    trainable = trainable_names(accelerator.unwrap_model(model)) if plan.adapters else None
    checkpoints = Checkpoints(accelerator, paths.output_dir, cfg.save_total_limit, record, position, trainable)
    state = TrainState()
    writer = writer or NullWriter()
    if resume:
        checkpoints.load(resume.path)
        prepare_folders()  # only now: a refusal or crash while loading leaves the folders as they were
        follow_the_schedule(schedule)  # for this run's length, which may not be the checkpoint's
        checkpoints.resumed = resume.path
        state = copy.deepcopy(resume.record.state)  # its lists too: the record stays as the checkpoint holds it
        accelerator.print(f"resumed from {resume.path} at optimizer step {state.opt_step}")
        notes = resume.record.resume_notes(policy.mode, scaler_state.toggled) + position.resume(state, resume.record)
        # The replaced line's curves go aside with its checkpoints, from where the lines part, and first.
        if set_aside := checkpoints.set_aside_later(resume.path, state.opt_step, writer.set_aside_replaced_line):
            notes.append(set_aside)
        if draws_masks and masks != masks_of_run(cfg, accelerator.device):  # what a new run would draw
            notes.append(
                f"note: dropout masks drawn as when the run started ({masks.said}), so that it continues exactly; "
                "--fast_cpu_dropout applies to new runs"
            )
        elif draws_masks and masks != resume.record.dropout_masks:  # compiled, or on a GPU: torch's own
            notes.append(
                f"note: the run started with dropout masks from {resume.record.dropout_masks.said}; this resume draws "
                f"{masks.said} ({'compiled' if cfg.torch_compile else 'on ' + accelerator.device.type}), so it does "
                "not continue exactly as the run would have"
            )
        for line in notes:
            accelerator.print(line)
    checkpoints.remove_staging()

    telemetry = Telemetry(
        accelerator,
        writer,
        model,
        policy,
        total_steps,
        state,
        cfg.disable_tqdm,
        not cfg.torch_compile,
        inputs.task.metrics,
    )
    if not resume:  # step 0's values: a resume would write them a second time
        trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
        estimate = plan.footprint.total_bytes / 2**30
        telemetry.writer.log({MODEL_TRAINABLE_PARAMS: trains, MEMORY_ESTIMATE_GIB: estimate}, 0)
    return Training(
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
        host=stop.host,
        stop=stop,
        scaler_state=scaler_state,
        masks=masks,
        draws_masks=draws_masks,
        owns_stop=owns_stop,
    )
