"""Fine-tune a transformer for text classification, with fp16 mixed precision as a switch you can watch.

    accelerate launch app/train.py                          # the embedded default; precision from the launcher (fp32)
    accelerate launch app/train.py --amp                    # fp16 autocast + dynamic loss scaling
    accelerate launch --mixed_precision fp16 app/train.py   # the same, chosen by the launcher
    accelerate launch app/train.py --mixed_precision auto   # whatever is fast here: fp16 on GPU, bf16/fp32 on CPU
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml app/train.py   # 2 processes on CPU (gloo)
    python app/train.py --config run.yaml                   # plain python works too
    tensorboard --logdir runs

Exit codes: 0 done, 1 another process of the run ended (killed, crashed; resume from the checkpoint it names), 2 bad
input, 3 numeric fault or loss-scale alarm, 4 disk full (the previous checkpoint intact), 130/143 stopped by
SIGINT/SIGTERM (after a checkpoint, or with the model saved whole if the signal came during the final evaluation or
save). Plain python passes these through; `accelerate launch` and `torchrun` report any failure
of a process as 1, and their failure summary gives each process's own code.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python app/train.py` from a checkout, without installing the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # a stop while the libraries import is one line too
    from app.host.starting import stop_at_once_while_starting

    stop_at_once_while_starting()

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable

from accelerate import Accelerator

from app.adapters.base import base_dtype, refuse_mixed_dtypes_under_fsdp1
from app.amp import fallback
from app.amp.policy import PrecisionPolicy, launcher_choice, refuse_amp_under_deepspeed, resolve_precision
from app.best import stopped_early, untracked_by_a_resume
from app.cli import exit_code_of, exit_process, ready_std_streams, say_why
from app.config import TrainConfig, parse_config
from app.errors import ProcessLost, TrainingHalted, UsageError, counted, with_sources
from app.host.device import device_type
from app.host.dropout import DropoutMasks
from app.host.memory import keep_freed_memory
from app.host.preemption import StopRequest
from app.host.runtime import (
    build_accelerator,
    compile_notes,
    describe_backend,
    end_accelerator,
    on_main_process,
    requested_backend,
    said_in_one_line_when_another_process_ends,
)
from app.inputs.batch_shape import keep_global_batch
from app.inputs.model import another_model_note
from app.inputs.sampling import keep_the_runs_seed, recorded_in_examples
from app.loop import train
from app.optim import check_resume_length, nothing_left_note, resumed_settings
from app.storage import folders
from app.storage.checkpoints import find_resume_point
from app.storage.final_model import save_merged_model
from app.storage.folders import FolderClaims, claim_output_dir, claim_run_folders
from app.telemetry import report
from app.telemetry.console import show_library_notices, show_progress_bars
from app.telemetry.writer import open_writer
from app.wiring import Training, build_training, load_inputs


def main(argv: list[str] | None = None, process_ends: bool = False) -> int:
    """The run, in this process; its exit code. `process_ends`: the process exits once it returns (app/train.py run
    as a program), so that a signal from the run's end on is ignored, not given back to the handlers it found."""
    return exit_code_of(lambda: _main(argv, process_ends))


def _main(argv: list[str] | None, process_ends: bool) -> int:
    cfg = parse_config(argv)
    show_library_notices(cfg.verbose)
    show_progress_bars(not cfg.disable_tqdm)
    # One precision decision, before any heavy work; Accelerate never sees it.
    policy, notes = resolve_precision(cfg.amp, cfg.mixed_precision, device_type(), launcher_choice())
    refuse_amp_under_deepspeed(policy, requested_backend())
    refuse_mixed_dtypes_under_fsdp1(base_dtype(cfg.dtype, policy, cfg.use_peft)[0], requested_backend())
    accelerator = build_accelerator(cfg)
    stop = StopRequest.for_run(accelerator, loading=True)
    try:
        # The main process's claims on the run's folders, removed after bad input or a process lost while loading.
        # (A process lost once training has started is said by fine_tune, with the checkpoint to resume from.)
        with (
            FolderClaims() as claims,
            stopped_when_another_process_ends(stop, lost_while_loading_line, before_training=True),
        ):
            return fine_tune(cfg, accelerator, policy, notes, stop, claims)
    except (UsageError, TrainingHalted) as halt:
        say_why(halt)  # before the process group ends (app/cli.py)
        raise
    finally:
        # A signal from here on (Ctrl-C pressed again) changes nothing, as during the run: given back to Python's
        # handler, it was a KeyboardInterrupt in the teardown (Accelerate's end, a finalizer, atexit) and a traceback
        # after the stop's one line. The run's files are complete by now, a checkpoint's included.
        stop.restore(ignore=process_ends)
        end_accelerator(accelerator)


def fine_tune(
    cfg: TrainConfig,
    accelerator: Accelerator,
    policy: PrecisionPolicy,
    notes: list[str],
    stop: StopRequest,
    claims: FolderClaims,
) -> int:
    started = time.perf_counter()
    if cfg.resume_from_checkpoint == "latest" and cfg.run_name and not cfg.output_dir:
        cfg = dataclasses.replace(cfg, output_dir=str(folders.default_output_dir(cfg.run_name)))  # the run's own
    # ---- folders: claimed first (one run per folder), then the checkpoint to resume from, checked ------------------
    on_main_process(accelerator, lambda: claim_output_dir(cfg, claims))
    resume = on_main_process(
        accelerator, lambda: find_resume_point(cfg.resume_from_checkpoint, cfg.output_dir, accelerator.num_processes)
    )
    resume_notes = []
    batch_flags = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps  # before a resume keeps its batch
    if resume:  # a resume keeps the run's examples per optimizer step, whatever its process count or batch size
        check_resume_length(cfg.max_steps, resume.record.state.opt_step, resume.path)  # before notes of its length
        recorded = folders.recorded_config(resume.output_dir)
        resume = dataclasses.replace(resume, record=recorded_in_examples(resume.record, cfg, recorded))
        cfg, resume_notes = keep_global_batch(cfg, resume.record, accelerator.num_processes)
        cfg, seed_notes = keep_the_runs_seed(cfg, resume.record, recorded)
        resume_notes += seed_notes
        cfg, kept_notes = resumed_settings(cfg, recorded)
        cfg, logdir_notes = folders.resumed_logdir(cfg, resume.output_dir, resume.record)
        resume_notes += kept_notes + logdir_notes
        resume_notes += untracked_by_a_resume(cfg, recorded) + another_model_note(cfg, recorded)
    policy, resumed_notes = fallback.resumed_policy(policy, resume)  # a run that fell back continues in its precision
    notes = resumed_notes or notes  # the requested precision's notes no longer apply
    # ---- what runs: precision with its reason, backend, device ----------------------------------------------------
    compiling = compile_notes(cfg.torch_compile, accelerator.device)
    for line in (
        # A precision or a scaler flag that a --config asked for says so (not in a warning's advice).
        *(line if line.startswith("warning:") else with_sources(line) for line in (policy.describe(), *notes)),
        *map(with_sources, fallback.unused_scaler_notes(cfg, policy)),
        *compiling,
        *describe_backend(accelerator),
        *(resume.notes if resume else ()),
        *resume_notes,
    ):
        accelerator.print(line)
    paths = on_main_process(accelerator, lambda: claim_run_folders(cfg, policy.label, resume, claims))
    if paths.continues and cfg.overwrite_output_dir:  # HF scripts pass both; the resume wins, and says so
        accelerator.print(
            f"note: --overwrite_output_dir is not applied: --resume_from_checkpoint continues the run in "
            f"{paths.output_dir}, and keeps its files"
        )
    if (
        resume
        and paths.output_dir.resolve() == resume.output_dir.resolve()
        and paths.run_name != resume.record.run_name
    ):
        accelerator.print(
            f"note: --run_name {paths.run_name} continues run {resume.record.run_name}: its curves go on in "
            f"{paths.log_dir}, apart from its earlier steps' (in run {resume.record.run_name}); leave --run_name out "
            "to keep them in one TensorBoard run"
        )
    # As resolved, so that training_args.yaml says what runs: `--config` it to run the same again, on any launcher.
    cfg = dataclasses.replace(
        cfg, run_name=paths.run_name, output_dir=str(paths.output_dir), amp=False, mixed_precision=policy.mode
    )

    # ---- every input check, before any weights load ----------------------------------------------------------------
    inputs = load_inputs(cfg, accelerator, policy, resume)
    purge_step = resume.record.state.opt_step + 1 if resume else None
    writer = open_writer(paths.log_dir, accelerator.is_main_process, purge_step)  # the file opens at its first write

    # ---- model, optimizer, schedule, scaler, checkpoints and telemetry, resumed if asked ---------------------------
    # The folders are prepared in there: a new run's before its weights load, a resume's once its checkpoint has.
    training = build_training(
        cfg,
        accelerator,
        policy,
        inputs,
        paths=paths,
        resume=resume,
        writer=writer,
        stop=stop,
        prepare_folders=lambda: prepare_folders(cfg, accelerator, paths, stop, claims),
        batch_flags=batch_flags,
    )
    finished = resume and (resume.record.state.opt_step >= training.total_steps or stopped_early(cfg, training.state))
    if finished:  # its final evaluation is of the checkpoint's step, which the earlier run may have logged
        writer.replace_evaluation_at(resume.record.state.opt_step)  # before the first write, which purges
    report.write_start_texts(writer, cfg, accelerator, policy, notes)
    accelerator.print(
        f"run {paths.run_name}: {counted(training.total_steps, 'optimizer step')}; TensorBoard: {paths.log_dir}; "
        f"model: {paths.output_dir}"
    )
    for line in nothing_left_note(resume.record.state.opt_step, training.total_steps) if resume else ():
        accelerator.print(line)
    if training.masks != DropoutMasks.TORCH and training.draws_masks:  # a model without dropout draws none
        accelerator.print(
            f"dropout: masks from {training.masks.said}, faster than torch's serial draw on this CPU "
            "(--fast_cpu_dropout false: torch's own)"
        )

    # ---- train, then save ---------------------------------------------------------------------------------------
    try:
        with stopped_when_another_process_ends(stop, lambda: another_process_ended_line(training)):
            # A signal that came while loading or tokenizing: nothing trained yet, a checkpoint to resume from.
            stop.training_starts()  # before the check: a signal after it is the loop's, and checkpoints a step
            if signum := stop.agreed():
                path = training.save_checkpoint()
                raise TrainingHalted(
                    f"stopped by signal {signum} before training started; resume from {path}", stop.exit_code(signum)
                )
            # From this line on, a signal is caught by the loop at its next optimizer step (tests wait for this line).
            accelerator.print(stop.training_line())
            train(training)
            stop.training_ended()
            if cfg.save_steps:  # a SIGKILL after the grace period must not lose the steps since the last checkpoint
                with training.telemetry.paused():
                    training.save_checkpoint()
            # The trained model first, so that nothing after training (a final evaluation that fails) can lose it.
            training.save_model(paths.output_dir)
            step, saved = training.state.opt_step, paths.output_dir
            accelerator.print(
                f"the trained model is step {step}'s, evaluated above (saved in {saved})"  # an early stop's, the last's
                if training.evaluated_at(step)
                else f"evaluating the final model (step {step}'s, saved in {saved})"
            )
            final = training.evaluate_and_log()
            final, best_loaded = training.end_with_best(final)
            if best_loaded:  # --load_best_model_at_end: the best checkpoint's weights take the trained model's place
                # Logged after the trained model's, as HF's evaluate() after training: the last eval/* values (HPARAMS'
                # cells) are then the saved model's, as in the model card and the summary.
                training.telemetry.log_eval(training.state.opt_step, final)
                training.save_model(paths.output_dir)
            if accelerator.is_main_process:
                training.write_model_card(paths.run_name, paths.output_dir, final)
            if cfg.save_merged_model:  # last: it merges the adapters into the model in place
                merged = save_merged_model(accelerator, training.model, inputs.tokenizer, paths.output_dir)
                accelerator.print(f"merged model, float32: {merged}")
            training.write_hparams_row()  # last, for its cells: the run's final eval/* and throughput
            signum = stop.agreed()  # it came during the final evaluation or save, which were let finish
    except TrainingHalted:  # the loss-scale alarm, a fault, a signal, a full disk: the run's row as it stands, to
        training.write_hparams_row()  # compare it with the others (a resume's replaces it)
        raise
    finally:
        training.close()
    wall = time.perf_counter() - started
    accelerator.print(report.summary_table(wall, training.telemetry, training.state, final, inputs.plan.footprint))
    accelerator.print(f"model saved to {paths.output_dir}")
    signum = signum or stop.signum  # one that came after the ranks agreed, while closing, is this rank's alone
    if signum:  # never exit 0 on a signal: a scheduler must see that the job was stopped
        raise TrainingHalted(
            f"stopped by signal {signum} during the final evaluation or save; the model is complete in "
            f"{paths.output_dir}, nothing to resume",
            stop.exit_code(signum),
        )
    return 0


@contextlib.contextmanager
def stopped_when_another_process_ends(stop: StopRequest, line: Callable[[], str], before_training: bool = False):
    """Another process of the run gone (killed, crashed): ProcessLost with `line()`, not gloo's traceback. A signal
    from then on is not acknowledged: the checkpoint it promises cannot be written."""
    try:
        with said_in_one_line_when_another_process_ends(line, before_training):
            yield
    except ProcessLost:
        stop.ending()
        raise


def another_process_ended_line(training: Training) -> str:
    newest = training.checkpoints.newest()
    resume = (
        f"resume with --resume_from_checkpoint {newest} (or latest)"
        if newest
        else "it has no checkpoint to resume from: start it again with --overwrite_output_dir and another --run_name "
        "(its TensorBoard run holds this one's curves)"
    )
    return f"stopped: another process of this run ended (killed or crashed), so {unwritten(training.stop)}; {resume}"


def lost_while_loading_line() -> str:
    """The same whether a signal came or not: its acknowledgment promised no checkpoint (preemption.py)."""
    return (
        "stopped: another process of this run ended (killed or crashed) before training started, so this one stops "
        "too: nothing was trained or saved; run the same command again"
    )


def unwritten(stop: StopRequest) -> str:
    """What this process cannot do without the one gone: the checkpoint a signal asked for, or any."""
    if stop.signum:
        return f"the checkpoint that {signal.Signals(stop.signum).name} asked for could not be written"
    return "this one stops too (a checkpoint needs every process)"


def prepare_folders(
    cfg: TrainConfig, accelerator: Accelerator, paths: folders.RunPaths, stop: StopRequest, claims: FolderClaims
) -> None:
    """The run's folders made ready (storage/folders.prepare: --overwrite_output_dir, training_args.yaml), on every
    rank, after every input check."""
    if cfg.overwrite_output_dir and (signum := stop.agreed()):  # a Ctrl-C on seeing the folder must keep its run
        on_main_process(accelerator, claims.remove_created)
        raise TrainingHalted(
            f"stopped by signal {signum} before --overwrite_output_dir removed anything: {paths.output_dir} is as it "
            "was",
            stop.exit_code(signum),
        )
    on_main_process(accelerator, lambda: folders.prepare(paths, cfg))  # its bad input stops every rank


if __name__ == "__main__":
    ready_std_streams()
    keep_freed_memory()  # the process's malloc, so here and not in main(): tests call main() in their own process
    exit_process(main(process_ends=True))
