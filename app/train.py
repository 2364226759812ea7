"""Fine-tune a transformer for text classification, with fp16 mixed precision as a switch you can watch.

    accelerate launch app/train.py                          # the embedded default; precision from the launcher (fp32)
    accelerate launch app/train.py --amp                    # fp16 autocast + dynamic loss scaling
    accelerate launch --mixed_precision fp16 app/train.py   # the same, chosen by the launcher
    accelerate launch app/train.py --mixed_precision auto   # whatever is fast here: fp16 on GPU, bf16/fp32 on CPU
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml app/train.py   # 2 processes on CPU (gloo)
    python app/train.py --config run.yaml                   # plain python works too
    tensorboard --logdir runs

Exit codes: 0 done, 2 bad input, 3 numeric fault or loss-scale alarm, 130/143 stopped by SIGINT/SIGTERM (after a
checkpoint). `accelerate launch` reports any failure of its single process as 1; `torchrun` and plain python pass
these through.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python app/train.py` from a checkout, without installing the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gc
import os
import time

from app import checkpoint, data, model as model_lib, outputs, report
from app.config import TrainConfig, parse_config
from app.errors import TrainingHalted, UsageError
from app.loop import build_trainables, evaluate, train
from app.metrics import NullWriter, Telemetry, TensorBoardWriter
from app.precision import PrecisionPolicy, check_backend, launcher_choice, resolve_precision
from app.preemption import StopRequest
from app.runtime import build_accelerator, describe_backend, device_type
from app.state import TrainState


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        # One precision decision, before any heavy work; Accelerate never sees it.
        policy, notes = resolve_precision(cfg.amp, cfg.mixed_precision, device_type(), launcher_choice())
        check_backend(policy)
        accelerator = build_accelerator(cfg)
        try:
            return run(cfg, accelerator, policy, notes)
        finally:
            _end(accelerator)
    except (UsageError, TrainingHalted) as stop:
        if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one of them says why
            print(f"error: {stop}" if isinstance(stop, UsageError) else str(stop), file=sys.stderr)
        return stop.exit_code


def run(cfg: TrainConfig, accelerator, policy: PrecisionPolicy, notes: list[str]) -> int:
    started = time.perf_counter()
    # ---- what runs: precision with its reason, backend, device ----------------------------------------------------
    for line in (policy.describe(), *notes, *describe_backend(accelerator)):
        accelerator.print(line)

    # ---- folders: decide and check, create nothing yet ------------------------------------------------------------
    resume_path = checkpoint.find_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir) if cfg.resume_from_checkpoint else None
    resume_info = checkpoint.read_run_info(resume_path) if resume_path else {}
    paths = outputs.resolve_paths(cfg, policy.mode, resume_info.get("run_name"),
                                  resume_path.parent.parent if resume_path else None)
    outputs.check_output_dir(paths, resuming=resume_path is not None, overwrite=cfg.overwrite_output_dir)
    outputs.check_log_dir(paths, resuming=resume_path is not None)

    # ---- model config, tokenizer and data: every input check runs before the weights load -------------------------
    model_path = model_lib.resolve_model_path(cfg.model_name_or_path)
    model_config = model_lib.load_model_config(model_path)
    tokenizer = model_lib.load_tokenizer(model_path)
    model_lib.check_max_length(cfg.max_length, model_config, tokenizer)
    columns = data.resolve_columns(cfg)
    raw = data.load_raw(cfg)
    data.check_columns(raw, columns)
    trained_head = model_config.id2label if model_lib.has_trained_head(model_config) else None
    labels = data.infer_labels(raw, columns[2], trained_head)
    tokenized = data.tokenize(raw, tokenizer, columns, labels, cfg.max_length, accelerator)
    # Multiples of 8 keep fp16/bf16 matmuls on tensor cores.
    train_loader, eval_loader = data.make_loaders(tokenized, tokenizer, cfg, 8 if policy.autocast_enabled else None)

    # ---- model, optimizer, schedule and scaler --------------------------------------------------------------------
    model = model_lib.load_model(model_path, labels.id2label)
    parts, total_steps = build_trainables(cfg, accelerator, policy, model, train_loader, eval_loader)
    scaler_state = checkpoint.ScalerCheckpoint(parts.scaler)
    accelerator.register_for_checkpointing(parts.schedule, scaler_state)

    # ---- resume or start ------------------------------------------------------------------------------------------
    run_info = {"run_name": paths.run_name, "precision": policy.mode, "num_processes": accelerator.num_processes}
    checkpoints = checkpoint.Checkpoints(accelerator, paths.output_dir, cfg.save_total_limit, run_info)
    if accelerator.is_main_process:
        outputs.prepare(paths, cfg, overwrite_checkpoints=cfg.overwrite_output_dir and resume_path is None)
    checkpoints.remove_staging()
    state = TrainState()
    if resume_path:
        checkpoints.load(resume_path)
        state = TrainState(**resume_info["state"])
        accelerator.print(f"resumed from {resume_path} at optimizer step {state.opt_step}")
        for line in _resume_notes(resume_info, policy.mode, accelerator.num_processes, scaler_state.toggled):
            accelerator.print(line)

    # ---- telemetry ------------------------------------------------------------------------------------------------
    writer = (TensorBoardWriter(paths.log_dir, purge_step=state.opt_step + 1 if resume_path else None)
              if accelerator.is_main_process else NullWriter())
    report.write_start_texts(writer, cfg, accelerator, policy, notes, paths.run_name)
    telemetry = Telemetry(accelerator, writer, parts.model, policy.mode, total_steps, state, cfg.disable_tqdm)
    accelerator.print(f"run {paths.run_name}: {total_steps} optimizer steps; TensorBoard: {paths.log_dir}; "
                      f"model: {paths.output_dir}")

    # ---- train, then save ---------------------------------------------------------------------------------------
    stop = StopRequest(accelerator.num_processes)
    try:
        train(cfg, accelerator, policy, parts, state, total_steps, telemetry, checkpoints, stop)
        final = evaluate(accelerator, policy, parts.model, parts.eval_loader)
        telemetry.log_eval(state.opt_step, final)
        outputs.save_final_model(accelerator, parts.model, tokenizer, paths.output_dir)
        writer.hparams(report.hparams(cfg, policy, accelerator), report.HPARAM_METRICS)
    finally:
        telemetry.close()
        stop.restore()
    accelerator.print(report.summary_table(time.perf_counter() - started, telemetry, state, final))
    accelerator.print(f"model saved to {paths.output_dir}")
    return 0


def _resume_notes(saved: dict, mode: str, num_processes: int, scaler_toggled: str | None) -> list[str]:
    notes = []
    if saved.get("precision") != mode:
        notes.append(f"note: precision changed since the checkpoint ({saved.get('precision')} -> {mode})")
    if scaler_toggled:
        notes.append(f"note: loss scaling toggled since the checkpoint ({scaler_toggled}): starting a fresh scaler state")
    if saved.get("num_processes") != num_processes:
        notes.append(f"note: the checkpoint was saved by {saved.get('num_processes')} process(es), this run has "
                     f"{num_processes}: the data is sharded differently, so the resume is not exact")
    return notes


def _end(accelerator) -> None:
    # Collect before tearing down: gloo otherwise sometimes aborts at interpreter exit.
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(main())
