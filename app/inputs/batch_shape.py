"""The examples of an optimizer step, and how a resume keeps them under another process count or batch size.

A run's steps, its LR schedule and its epochs are counted in optimizer steps of a fixed number of examples (the
global batch: per-device batch x processes x micro-batches accumulated), which every checkpoint records. A resume
keeps that number, as torchtitan's and Megatron-LM's `global_batch_size` stays when the data-parallel degree changes:
with fewer processes it accumulates more micro-batches, with more it takes fewer examples per device. It continues at
the checkpoint's example (sampling.DataPosition) in steps of the same size, so the steps, the LR at each of them and
the epoch are those of the uninterrupted run. `--per_device_train_batch_size` is then the most per device (memory),
and `--gradient_accumulation_steps` gives way; changing the global batch takes a new run.
"""

from __future__ import annotations

import dataclasses

from app.config import TrainConfig
from app.errors import UsageError, counted, plural


def resumed_shape(global_batch: int, num_processes: int, most_per_device: int) -> tuple[int, int]:
    """(examples per device, micro-batches accumulated) that make `global_batch` examples per optimizer step on
    `num_processes`: the largest per-device batch up to `most_per_device` that divides each process's share.

    Raises:
        UsageError: the processes cannot share the global batch equally.
    """
    per_process, rest = divmod(global_batch, num_processes)
    if rest:
        divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise UsageError(
            f"--resume_from_checkpoint: the run trains {counted(global_batch, 'example')} per optimizer step, which "
            f"{num_processes} processes cannot share equally; resume with {', '.join(map(str, divisors))} "
            f"{plural(len(divisors), 'process')}"
        )
    per_device = max(n for n in range(1, min(most_per_device, per_process) + 1) if per_process % n == 0)
    return per_device, per_process // per_device


def keep_global_batch(cfg: TrainConfig, record, num_processes: int) -> tuple[TrainConfig, list[str]]:
    """The config of a resume from `record` (storage/checkpoints.CheckpointRecord, with its data position) on
    `num_processes`: its per-device batch and accumulation make the checkpoint's global batch. Returns the notes:
    none where the run trains as its flags say, or as the run that saved the checkpoint did, given the same flags."""
    saved_batch, state = record.data["global_batch_size"], record.state
    per_device, accumulation = resumed_shape(saved_batch, num_processes, cfg.per_device_train_batch_size)
    asked = (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    kept = dataclasses.replace(cfg, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation)
    # The flags make the global batch here, or are the saving run's own (which a resume on another count changed).
    as_flagged = asked == (per_device, accumulation) or _given_before(asked, record)
    if record.num_processes == num_processes and as_flagged:
        return kept, []
    note = (
        f"note: the checkpoint was saved by {counted(record.num_processes, 'process')} with "
        f"{counted(saved_batch, 'example')} per optimizer step; this run keeps them: "
        f"{counted(num_processes, 'process')} x {per_device} per device x {accumulation} accumulated, and continues at "
        f"example {state.samples_in_epoch} of epoch {state.epoch}, so the "
        "steps and their LR are the uninterrupted run's and, on the same training data, no example is trained twice or "
        "skipped; dropout and rounding differ from it"
    )
    if not as_flagged:  # the flags ask for another batch
        note += (
            f" (the flags asked for {asked[0]} per device x {asked[1]} accumulated: a resume keeps the run's examples "
            "per step; a new run can change them)"
        )
    return kept, [note]


def _given_before(asked: tuple[int, int], record) -> bool:
    """Whether the per-device batch and accumulation `asked` are those the command of the run that saved `record`
    gave: after a resume on another process count, not the shape it trained. Checkpoints that record no flags: the
    shape that made the global batch on the saving run's process count."""
    if record.batch_flags is not None:
        return asked == tuple(record.batch_flags)
    return asked[0] * record.num_processes * asked[1] == record.data["global_batch_size"]


def uneven_epoch_note(examples: int, per_device: int, num_processes: int) -> list[str]:
    """Several processes take a batch each per micro-step; where the epoch's examples leave its last micro-step short,
    Accelerate fills it from the epoch's first examples (even_batches, as under HF Trainer), so those train twice
    in that epoch and a run on one process would not match: said once, at the start of a run that finishes an
    epoch (one that ends before trains none of the repeats)."""
    per_micro_step = per_device * num_processes
    repeated = -examples % per_micro_step
    if num_processes == 1 or repeated == 0:
        return []
    filled = (
        f"the epoch's first {'example' if repeated == 1 else f'{repeated} examples'} again"
        if repeated <= examples
        else f"{repeated} repeats of the epoch's {counted(examples, 'example')}"
    )
    return [
        f"note: with {counted(examples, 'training example')}, each epoch's last micro-step is {repeated} short on "
        f"{num_processes} processes x {per_device}: Accelerate fills it with {filled}, trained "
        f"{'twice' if repeated <= examples else 'two or more times'} in that epoch (as under HF Trainer); a multiple "
        f"of {per_micro_step} examples would not"
    ]
