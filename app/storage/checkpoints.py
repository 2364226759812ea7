"""Checkpoints: atomic save, `latest`, pruning and resume. The one module that knows the layout on disk:

`<output_dir>/checkpoints/step-<N>/`, N = optimizer steps. A checkpoint is written by `accelerator.save_state`
into `.staging-step-<N>` and renamed into place only when every rank has written its part, so `latest` (the highest
complete `step-<N>`) never picks a half-written one. The last file written into the staging folder is the record of
every file's size and checksum (integrity.py), which a resume checks before any model loads. Checkpoints are taken
only right after an optimizer step. A full disk stops the run with exit code 4 (disk.py), the previous one intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import load_model

from app.errors import UsageError, plural
from app.host.dropout import DropoutMasks
from app.state import TrainState
from app.storage import disk, integrity

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"  # Accelerate's name for the first model's weights
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STAGING = ".staging-"  # the prefix of a checkpoint folder until every rank has written its part
_SET_ASIDE = re.compile(r"^replaced-after-step-(\d+)(-\d+)?$")  # Checkpoints.set_aside_later's folders
_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # HF Trainer's checkpoints, in its output_dir


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint records besides Accelerate's state: the run it belongs to, and where training stood."""

    run_name: str
    precision: str  # the policy's mode: "no", "fp16" or "bf16"
    num_processes: int
    state: TrainState = field(default_factory=TrainState)
    fallback: dict | None = None  # {"from": "fp16", "at_step": N} once --on_scale_collapse fallback switched precision
    data: dict | None = None  # the training order and global batch size (sampling.DataPosition); None before both
    dropout_masks: DropoutMasks = DropoutMasks.TORCH  # how the run draws its CPU dropout masks (host/dropout.py)
    adapters: dict | None = None  # LoRA's shape and its base's fingerprint (adapters/lora.py); None: a full model
    # The command lines of the run: the one that started it, then each resume's (the model card shows them). None in
    # checkpoints written before they were recorded.
    commands: list[str | None] | None = None
    # Whether the classifier's last layer computes the first token alone (tasks/first_token.py); False in checkpoints
    # written before it did, whose runs then compute every row to their end.
    first_token_alone: bool = False
    # A classifier's labels in class-id order: a resume on data whose labels differ would change what each id means.
    # None for a causal LM, and in checkpoints written before they were recorded.
    labels: list[str] | None = None
    # --per_device_train_batch_size and --gradient_accumulation_steps as the saving run's command gave them, which a
    # resume may have changed to keep the global batch (inputs/batch_shape.py): the next resume that gives them again
    # has nothing new to be told. None in checkpoints written before they were recorded.
    batch_flags: list[int] | None = None
    # The run's output folder and --logdir, absolute, as they were when it was saved: a resume from another working
    # directory, or of a project moved or copied whole, finds its curves from them (storage/folders.resumed_logdir).
    # None in checkpoints written before they were recorded.
    folders: dict | None = None

    @classmethod
    def read(cls, checkpoint: Path) -> CheckpointRecord:
        """The record in `checkpoint`. KeyError for a value it lacks; UnfitRecord for one this app never writes."""
        saved = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
        check_recorded_values(saved)
        counters = {f.name for f in dataclasses.fields(TrainState)}  # counters of older versions are dropped
        state = TrainState(**{k: v for k, v in saved.pop("state").items() if k in counters})
        return cls(
            saved["run_name"],
            saved["precision"],
            saved["num_processes"],
            state,
            saved.get("fallback"),
            saved.get("data"),
            DropoutMasks.recorded(saved.get("dropout_masks")),
            saved.get("adapters"),
            saved.get("commands"),
            saved.get("first_token_alone", False),
            saved.get("labels"),
            saved.get("batch_flags"),
            saved.get("folders"),
        )

    def write(self, checkpoint: Path) -> None:
        disk.write_atomically(checkpoint / STATE_FILE, json.dumps(dataclasses.asdict(self), indent=2))

    def resume_notes(self, precision: str, scaler_toggled: str | None) -> list[str]:
        """How a run resuming from this checkpoint differs in precision from the run that saved it, one line each.

        (A change of process count or batch size: sampling.DataPosition.resume.)
        """
        notes = []
        if self.precision != precision:
            notes.append(f"note: precision changed since the checkpoint ({self.precision} -> {precision})")
        if scaler_toggled:
            notes.append(
                f"note: loss scaling toggled since the checkpoint ({scaler_toggled}): starting a fresh scaler state"
            )
        return notes


class UnfitRecord(ValueError):
    """A checkpoint's record holds a value of a type or range that this app never writes (a hand edit)."""


Kind = tuple[str, Callable[[object], bool]]  # what a recorded value may be: in words, and the test


def _optional(kind: Kind) -> Kind:
    return f"{kind[0]} or null", lambda value: value is None or kind[1](value)


def _list_of(kind: Kind) -> Kind:
    return f"a list of {kind[0]}", lambda value: isinstance(value, list) and all(map(kind[1], value))


# `type(value) is int` leaves out JSON's true and false, which Python counts as ints.
_WHOLE: Kind = "a whole number", lambda value: type(value) is int
_COUNT: Kind = "a whole number of 0 or more", lambda value: type(value) is int and value >= 0
_POSITIVE: Kind = "a whole number of 1 or more", lambda value: type(value) is int and value >= 1
_NUMBER: Kind = "a number", lambda value: type(value) in (int, float)
_TEXT: Kind = "text", lambda value: isinstance(value, str)
_FLAG: Kind = "true or false", lambda value: isinstance(value, bool)
_MAPPING: Kind = "a mapping", lambda value: isinstance(value, dict)
_PRECISION: Kind = '"no", "fp16" or "bf16"', lambda value: value in ("no", "fp16", "bf16")
_STEP_PRECISION: Kind = (
    'a first step and "no", "fp16" or "bf16"',
    lambda value: isinstance(value, list) and len(value) == 2 and _POSITIVE[1](value[0]) and _PRECISION[1](value[1]),
)
_TWO_POSITIVE: Kind = (
    "two whole numbers of 1 or more",
    lambda value: isinstance(value, list) and len(value) == 2 and all(map(_POSITIVE[1], value)),
)
# What each value of a record may be, by where it is. Those it must have are read by name (a KeyError if absent).
_RECORD_VALUES: dict[str, dict[str, Kind]] = {
    "": {
        "run_name": _TEXT,
        "precision": _PRECISION,
        "num_processes": _POSITIVE,
        "state": _MAPPING,
        "fallback": _optional(_MAPPING),
        "data": _optional(_MAPPING),
        "adapters": _optional(_MAPPING),
        "commands": _optional(_list_of(_optional(_TEXT))),
        "first_token_alone": _FLAG,
        "labels": _optional(_list_of(_TEXT)),
        "batch_flags": _optional(_TWO_POSITIVE),
        "folders": _optional(_MAPPING),
    },
    "state.": {
        **dict.fromkeys(("epoch", "batches_in_epoch", "opt_step", "applied_updates", "skipped_steps"), _COUNT),
        **dict.fromkeys(("consecutive_skips", "evals_without_improvement"), _COUNT),
        **dict.fromkeys(("samples_in_epoch", "best_step"), _optional(_COUNT)),
        "best_metric": _optional(_NUMBER),
        **dict.fromkeys(("best_checkpoint", "best_metric_tag"), _optional(_TEXT)),
        "best_greater_is_better": _optional(_FLAG),
        "interval_losses": _optional(_list_of(_NUMBER)),
        **dict.fromkeys(("interval_items", "interval_start"), _optional(_list_of(_COUNT))),
        "precisions": _list_of(_STEP_PRECISION),
    },
    "fallback.": {"from": _PRECISION, "at_step": _COUNT},
    "data.": {"order": _MAPPING, "global_batch_size": _POSITIVE, "seed": _WHOLE, "examples": _COUNT},
    "data.order.": {"group_size": _POSITIVE, "mega_batch_size": _POSITIVE},
}


def check_recorded_values(saved: object) -> None:
    """UnfitRecord naming the first value of a checkpoint's record (trainer_state.json, as read) that this app never
    writes: a hand-edited older checkpoint, which no file record vouches for, failed deep in the resume instead."""
    if not isinstance(saved, dict):
        raise UnfitRecord(f"holds {json.dumps(saved)[:40]}, not a mapping")
    data = saved.get("data")
    sections = {"": saved, "state.": saved.get("state"), "fallback.": saved.get("fallback"), "data.": data}
    sections["data.order."] = data.get("order") if isinstance(data, dict) else None
    for where, values in sections.items():  # outer first: an inner section is known to be a mapping or null
        for key, (said, fits) in _RECORD_VALUES[where].items():
            if isinstance(values, dict) and key in values and not fits(values[key]):
                raise UnfitRecord(f"records {where}{key} {json.dumps(values[key])}, not {said}")


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint to continue from, and what it recorded."""

    path: Path
    record: CheckpointRecord
    notes: tuple[str, ...] = ()  # what the check of the checkpoints found: a fallback, no record, no random state

    @property
    def output_dir(self) -> Path:
        return output_dir_of(self.path)


def run_commands(resume: ResumePoint | None) -> list[str | None]:
    """The command lines that made the run before this process: none for a new run; for a resume, those its
    checkpoint records, or one unknown (None) where it records none."""
    return list(resume.record.commands or [None]) if resume else []


def output_dir_of(checkpoint: Path) -> Path:
    """The output folder of the run that saved a checkpoint: checkpoints live in <output_dir>/checkpoints/step-<N>,
    or, set aside by a resume from an earlier one, in <output_dir>/checkpoints/replaced-after-step-<M>/step-<N>."""
    parent = checkpoint.parent
    return parent.parent.parent if _SET_ASIDE.match(parent.name) else parent.parent


class DataPositionRecord(Protocol):
    """Where training stands in the data, as each checkpoint records it (inputs/sampling.DataPosition)."""

    def samples(self, state: TrainState) -> int: ...

    def record(self) -> dict: ...


class Checkpoints:
    """This run's checkpoints under <output_dir>/checkpoints. Each holds `record` with the state of its step.

    Args:
        record: what every checkpoint of this run records besides its state (run name, precision, process count,
            dropout masks, adapters, a fallback); changed only through `switch_precision`.
        position: where training stands in the data, recorded with the state.
        trainable: with adapters, the names of the parameters that train: all that an adapter checkpoint holds.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: Path,
        save_total_limit: int | None,
        record: CheckpointRecord,
        position: DataPositionRecord,
        trainable: set[str] | None = None,
    ):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.save_total_limit = save_total_limit
        self.record, self.position, self.trainable = record, position, trainable
        self.last_saved: Path | None = None  # the newest complete checkpoint of this run, saved or resumed from
        self.resumed: Path | None = None  # the checkpoint this run resumed from
        self.last_bytes: int | None = None  # its size: what the next one will need (main process)

    def switch_precision(self, mode: str, fallback: dict) -> None:
        """Later checkpoints record a precision fallback (amp/fallback.py): the new mode, and from where."""
        self.record = dataclasses.replace(self.record, precision=mode, fallback=fallback)

    def remove_staging(self) -> None:
        """Drop what a run killed mid-save left behind. Main process, at start."""
        if self.accelerator.is_main_process and self.root.is_dir():
            for leftover in filter(is_staging, self.root.iterdir()):
                shutil.rmtree(leftover, ignore_errors=True)

    def set_aside_later(
        self, resumed: Path, step: int, curves: Callable[[str, int], None] = lambda name, parted: None
    ) -> str | None:
        """A resume from a checkpoint older than the run's newest: move the later ones, a continuation that this
        resume replaces, into a folder of their own, so that `latest` and pruning see only this resume's line and
        nothing is deleted. Returns the note that says so, or None. Main process, after every input check.

        `step`: the resumed checkpoint's, as it records it (a copy or a link in checkpoints/ may have any name). A
        checkpoint set aside this way can be resumed from too: the line that replaced it is set aside in turn, from
        where the two lines part (the step its folder is named after). `curves(name, parted)` moves the line's
        TensorBoard points first: a kill between the two then leaves them aside, never for the next resume to
        remove as a killed run's."""
        if not self.accelerator.is_main_process:
            return None
        if resumed.parent.resolve() == self.root.resolve():
            parted = step
        elif (
            aside := _SET_ASIDE.match(resumed.parent.name)
        ) and resumed.parent.parent.resolve() == self.root.resolve():
            parted = int(aside.group(1))
        else:
            return None  # another run's checkpoint: its folder is left as it is
        later = [path for path in _step_folders(self.root) if _step_of(path) > parted]
        if not later:
            return None
        name = f"replaced-after-step-{parted}"
        aside, attempt = self.root / name, 1
        while aside.exists():  # the same checkpoint resumed from more than once
            attempt += 1
            aside = self.root / f"{name}-{attempt}"
        curves(aside.name, parted)
        aside.mkdir()
        for path in later:
            os.replace(path, aside / path.name)
        return (
            f"note: the run had gone on past step-{parted}: its later checkpoints "
            f"({', '.join(path.name for path in later)}) are moved to {aside}, so that --resume_from_checkpoint latest "
            "continues this run; delete that folder when you no longer need them"
        )

    def newest(self) -> Path | None:
        """The newest complete checkpoint of this run: the last one published under its folder (a save that failed
        after publishing never set `last_saved`), else the one it resumed from elsewhere; None if there is none."""
        published = completed_checkpoints(self.root)
        return published[-1] if published else self.last_saved

    def path(self, step: int) -> Path:
        """Where the checkpoint of optimizer step `step` is (or would be)."""
        return self.root / f"step-{step}"

    def best(self, state: TrainState) -> Path:
        """Where the checkpoint of the best step is (best_checkpoint)."""
        return best_checkpoint(state, self.resumed, self.root, self.record.commands)

    def save(self, state: TrainState) -> Path:
        """Write a checkpoint of this step on every rank, publish it atomically, then prune. Collective."""
        final = self.path(state.opt_step)
        if final == self.last_saved:
            return final  # e.g. a preemption right after a periodic save of the same step
        staging = self.root / f"{_STAGING}{final.name}"
        acc = self.accelerator
        if acc.is_main_process and (warning := disk.short_of_space(self.root, self.last_bytes, "checkpoint")):
            acc.print(warning)
        state.samples_in_epoch = self.position.samples(state)
        if state.best_step == state.opt_step:  # evaluated just before: this checkpoint is the best's
            state.best_checkpoint = str(final.resolve())
        record = dataclasses.replace(self.record, state=state, data=self.position.record())
        acc.wait_for_everyone()

        def write_state() -> None:
            acc.save_state(str(staging))  # every rank writes its own RNG file, so every rank takes part
            if acc.is_main_process:
                record.write(staging)

        def write_record() -> None:  # last: it vouches for every file, the other ranks' RNG files included
            if acc.is_main_process:
                disk.share_as_umask_allows(staging)
                self.last_bytes = integrity.write_record(staging)

        intact = f"{self.last_saved} is intact" if self.last_saved else "this run has no earlier checkpoint"
        for write in (write_state, write_record):
            # Agreeing on the outcome is also the barrier without which a slow rank's RNG file could still be
            # missing when the record is written and the folder renamed.
            disk.write_on_every_rank(
                acc,
                write,
                self.root,
                f"checkpoint {final.name}",
                self.last_bytes,
                intact,
                clean_up=lambda: shutil.rmtree(staging, ignore_errors=True),
            )
        if acc.is_main_process:
            if final.exists():  # a stale copy of this step from an earlier, interrupted attempt
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune(keep=final, best=state.best_step)
        acc.wait_for_everyone()
        self.last_saved = final
        return final

    def _prune(self, keep: Path, best: int | None) -> None:
        if self.save_total_limit is None:
            return
        # The newest, and the best (loaded at the end with --load_best_model_at_end), count towards the limit and stay,
        # as in HF Trainer: a limit of 2 keeps them alone, a limit of 1 keeps both all the same.
        spared = {keep, self.path(best)}
        old = [p for p in completed_checkpoints(self.root) if p not in spared]
        staying = sum(path.is_dir() for path in spared)
        for path in old[: max(0, len(old) + staying - self.save_total_limit)]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> None:
        """Restore model, optimizer, schedule, scaler and RNG states on every rank (the counters: CheckpointRecord).

        An adapter run's checkpoint holds what trains, not the frozen base: loaded over the model, not strictly.
        """
        self._check_weights(path)
        self.accelerator.load_state(str(path), strict=self.record.adapters is None)
        self.last_saved = path
        self.last_bytes = integrity.recorded_bytes(path)

    def load_model_weights(self, model: torch.nn.Module, path: Path) -> None:
        """Only the model's weights from checkpoint `path` (as accelerator.save_state wrote them), on every rank."""
        self._check_weights(path)
        # safetensors' own loader, as Accelerate's save_state wrote the file with its saver: a tied LM head is stored
        # once, under the embeddings' name, and a plain strict load_state_dict missed it.
        load_model(self.accelerator.unwrap_model(model), path / MODEL_FILE, strict=self.record.adapters is None)
        self.accelerator.wait_for_everyone()

    def _check_weights(self, path: Path) -> None:
        """An adapter checkpoint must hold exactly the weights this run trains: a load that is not strict would
        otherwise skip a mismatch without a word."""
        # FSDP's checkpoints hold the model in a layout of their own (pytorch_model_fsdp*), which Accelerate reads.
        if self.record.adapters is None or not (path / MODEL_FILE).is_file():
            return
        if set(stored_shapes(path / MODEL_FILE)) != self.trainable:  # the names, from the file's header alone
            raise UsageError(f"{path / MODEL_FILE} does not hold this run's adapters; resume from a checkpoint of it")


def stored_shapes(weights: Path) -> dict[str, list[int]] | None:
    """The name and shape of each weight in a checkpoint's `weights` file, from its header alone (DDP's wrapper
    prefix dropped); None if there is no such file (FSDP's sharded state and DeepSpeed's have their own layout, which
    Accelerate reads)."""
    if not weights.is_file():
        return None
    with safe_open(weights, "pt") as stored:
        return {name.removeprefix("module."): stored.get_slice(name).get_shape() for name in stored.keys()}


def weights_mismatch(stored: dict[str, list[int]], model: torch.nn.Module) -> str | None:
    """How `stored` (stored_shapes) differs from `model`'s weights, in words: a weight that only one side has
    (names_mismatch), else the first stored weight of another shape in the model; None if they fit."""
    if mismatch := names_mismatch(stored, model):
        return mismatch
    expected = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    for name, shape in stored.items():
        if expected[name] != shape:
            return f"{name} is {shape} there, {expected[name]} in this run's model"
    return None


def names_mismatch(stored: Iterable[str], model: torch.nn.Module) -> str | None:
    """The first stored weight that `model` lacks, else the first weight of `model` that is not stored, in words;
    None if both hold the same. Tied weights (an LM head that is the embeddings) count as stored when one of their
    names is: save_state stores them once."""
    aliases: dict[int, list[str]] = {}  # the names of each tensor
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    known = {name for names in aliases.values() for name in names}
    if extra := next((name for name in stored if name not in known), None):
        return f"{extra} is not in this run's model"
    held = set(stored)
    lacking = next((names[0] for names in aliases.values() if held.isdisjoint(names)), None)
    return f"{lacking} is not in the checkpoint" if lacking else None


def is_checkpoint_folder(path: Path) -> bool:
    """A folder that a run writes in checkpoints/: a `step-<N>` checkpoint, complete or not, one being written, or
    later checkpoints set aside by a resume from an earlier one."""
    name = path.name.removeprefix(_STAGING)
    return bool(_STEP_DIR.match(name) or _SET_ASIDE.match(name)) and path.is_dir()


def is_staging(path: Path) -> bool:
    """A checkpoint being written, or left half-written by a kill: never one to resume from."""
    return path.name.startswith(_STAGING)


def completed_checkpoints(root: Path) -> list[Path]:
    """The complete `step-<N>` checkpoints under `root`, oldest first."""
    return [path for path in _step_folders(root) if (path / STATE_FILE).is_file()]


def _step_of(checkpoint: Path) -> int:
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def _step_folders(root: Path) -> list[Path]:
    """Every `step-<N>` folder under `root`, oldest first: published whole, though a file may have gone since."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def best_checkpoint(
    state: TrainState, resumed: Path | None, root: Path | None = None, commands: list | None = None
) -> Path:
    """The checkpoint of `state.best_step`: where the run saved it, as the state records it through resumes and
    branches; else (the run's folder moved, or a state that does not record it) in this run's checkpoints folder
    `root`, beside the checkpoint `resumed` from, or in that one's run (a resume from a set-aside line). A folder of
    that name that another line wrote (`another_line`, of the run's `commands`) is passed over. The first place if it
    is in none, for the message."""
    name = f"step-{state.best_step}"
    recorded = Path(state.best_checkpoint) if state.best_checkpoint else None
    places = [recorded] if recorded and recorded.name == name else []
    places += [root / name] if root else []
    places += [resumed.parent / name, output_dir_of(resumed) / "checkpoints" / name] if resumed else []
    return next((path for path in places if path.is_dir() and not another_line(path, state, commands)), places[0])


def another_line(path: Path, state: TrainState, commands: list | None = None) -> str | None:
    """Why checkpoint `path`, of the best step's name, is not the best of the run whose state is `state` and whose
    command lines are `commands` (the start's, then each resume's), or None. A resume from an earlier step wrote a new
    checkpoint of that name where the recorded best was (the recorded one set aside): its own commands are not the
    start of the run's (that resume's is among them), or its state records another best. A checkpoint whose record
    cannot be read passes."""
    try:
        own = CheckpointRecord.read(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    lineage = own.commands and commands and list(own.commands) != list(commands[: len(own.commands)])
    if not lineage and (own.state.best_step, own.state.best_metric) == (state.best_step, state.best_metric):
        return None
    return f"{path} is another line's step {state.best_step}: a resume from an earlier step replaced the run's there"


def weights_unusable(path: Path) -> str | None:
    """Why the model weights of checkpoint `path` cannot be loaded (gone, or damaged: its file record says how); None
    if they can. Its optimizer state is not read (load_model_weights), so not checked either."""
    if not path.is_dir():
        return f"{path} is missing"
    if integrity.is_recorded(path):
        return integrity.damage(path, only={MODEL_FILE})
    return None if (path / MODEL_FILE).is_file() else f"{path / MODEL_FILE} is missing"  # an older, unrecorded one


def checkpoint_around(path: Path) -> Path | None:
    """The checkpoint, or the checkpoints folder of a run, that `path` is or is inside; None if neither."""
    for folder in (path, *path.parents):
        try:
            if integrity.is_recorded(folder) or (_STEP_DIR.match(folder.name) and (folder / STATE_FILE).is_file()):
                return folder
            if folder.name == "checkpoints" and any(
                _STEP_DIR.match(p.name) or _SET_ASIDE.match(p.name) for p in folder.iterdir() if p.is_dir()
            ):
                return folder
        except OSError:  # a folder above that cannot be read holds no checkpoint of a run here
            continue
    return None


def find_resume_point(spec: str | None, output_dir: str | None, num_processes: int = 1) -> ResumePoint | None:
    """What `--resume_from_checkpoint` names, checked against its file record; None if not given.

    `latest` falls back from a damaged checkpoint to the newest intact one, with a note; a damaged checkpoint named
    by path, or no intact one at all, is a UsageError that names the file. Reads files only: run it on one process.
    """
    if not spec:
        return None
    candidates = _candidates(spec, output_dir)
    skipped = []
    for path in candidates:
        record, problem = _checked(path)
        if problem is None:
            notes = [
                f"note: {bad} is damaged ({why}); resuming from {path}, the newest intact one" for bad, why in skipped
            ]
            return ResumePoint(path, record, tuple(notes + _resume_notes(path, record, num_processes)))
        skipped.append((path, problem))
    bad, why = skipped[0]
    if spec != "latest":
        raise UsageError(f"--resume_from_checkpoint {spec} is damaged: {why}; resume from another checkpoint")
    every = f"all {len(skipped)} are damaged, the newest: " if len(skipped) > 1 else "its one checkpoint is damaged: "
    raise UsageError(
        f"--resume_from_checkpoint latest: no intact checkpoint in {bad.parent}, {every}{why}; restore one, or start "
        "fresh with --overwrite_output_dir, which deletes them and the run's model"
    )


def _checked(path: Path) -> tuple[CheckpointRecord | None, str | None]:
    """What the checkpoint recorded, and what is wrong with it (None if nothing)."""
    problem = integrity.damage(path) if integrity.is_recorded(path) else None
    if problem is None and not (path / STATE_FILE).is_file():  # an unrecorded one, as earlier versions wrote
        problem = f"{path / STATE_FILE} is missing"
    if problem is not None:
        return None, problem
    try:
        record = CheckpointRecord.read(path)
    except UnfitRecord as e:  # an unrecorded checkpoint whose state file was edited
        return None, f"{path / STATE_FILE} {e}"
    except (ValueError, KeyError, TypeError) as e:  # an unrecorded checkpoint whose state file was damaged
        return None, f"{path / STATE_FILE} cannot be read ({type(e).__name__})"
    if record.data is not None and not integrity.is_recorded(path):  # the versions that record data record files
        return None, f"{path / integrity.RECORD} is missing"
    return record, None


def _resume_notes(path: Path, record: CheckpointRecord, num_processes: int) -> list[str]:
    notes = []
    if not integrity.is_recorded(path):
        notes.append(f"note: {path} has no record of its files (an older checkpoint): resuming from it unchecked")
    if missing := integrity.missing_random_states(path, min(num_processes, record.num_processes)):
        notes.append(
            f"note: {path} has no random state for {plural(len(missing), 'process')} "
            f"{', '.join(map(str, missing))}: their dropout and "
            "other random draws start afresh, so the resume is not exact"
        )
    return notes


def find_checkpoint(spec: str, output_dir: str | None) -> Path:
    """The folder `--resume_from_checkpoint` names, unchecked: "latest" in `output_dir`, or a path."""
    return _candidates(spec, output_dir)[0]


def is_hf_trainer_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint that HF Trainer wrote: its trainer_state.json (TrainerState) counts global_step
    and keeps a log_history, where this app's records the run and its state."""
    try:
        saved = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"global_step", "log_history"} <= saved.keys() and "state" not in saved


def newest_hf_trainer_checkpoint(folder: Path) -> Path | None:
    """The newest of HF Trainer's `checkpoint-N` folders in its output folder `folder`; None if it holds none."""
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _HF_CHECKPOINT.match(p.name))]
    return next((path for _, path in sorted(found, reverse=True) if is_hf_trainer_checkpoint(path)), None)


def _from_hf_trainer(checkpoint: Path) -> str:
    """What to do with HF Trainer's `checkpoint`, which this app cannot resume (another layout and record)."""
    if (checkpoint / "adapter_config.json").is_file():  # peft's adapters alone: no model to start from
        return (
            "this app cannot resume HF Trainer's checkpoints, and this one holds peft adapters, not a model: merge "
            "them into their base with peft (merge_and_unload, then save_pretrained) and pass that folder as "
            "--model_name_or_path, or train new adapters on the base with --use_peft"
        )
    return (
        f"this app cannot resume HF Trainer's checkpoints; --model_name_or_path {checkpoint} starts a new run from its "
        "weights"
    )


def _hf_trainer_output(folder: Path) -> str | None:
    """What to say of `folder` where it is HF Trainer's output folder, with its checkpoint-N; None if it is not."""
    if hf := newest_hf_trainer_checkpoint(folder):
        return f"{folder} holds HF Trainer's checkpoint-N folders (the newest: {hf.name}): {_from_hf_trainer(hf)}"
    return None


def _candidates(spec: str, output_dir: str | None) -> list[Path]:
    """The folders `--resume_from_checkpoint` may mean, preferred first: the path it names, or for "latest" every
    complete checkpoint in `output_dir`, newest first. UsageError if there is none."""
    if spec != "latest":  # config.parse_config reads true and Latest as latest too
        return [_named_checkpoint(spec)]
    if not output_dir:
        raise UsageError(
            "--resume_from_checkpoint latest needs --output_dir, the folder of the run to continue (or the "
            "--run_name of a run in outputs/)"
        )
    found = _step_folders(Path(output_dir) / "checkpoints")  # a damaged newest one is named, not passed over
    if not found and (hf_trainer := _hf_trainer_output(Path(output_dir))):
        raise UsageError(f"--resume_from_checkpoint latest: no checkpoint in {output_dir}/checkpoints; {hf_trainer}")
    if not found:
        raise UsageError(
            f"--resume_from_checkpoint latest: no checkpoint in {output_dir}/checkpoints; pass the --output_dir of the "
            "run to continue, or drop the flag to start fresh"
        )
    return found[::-1]


def _named_checkpoint(spec: str) -> Path:
    """The checkpoint folder that `--resume_from_checkpoint PATH` names; UsageError, saying what to pass, if it is
    none (a file, a run's output folder, HF Trainer's checkpoint)."""
    path = Path(spec)
    if not path.is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {spec}: {'a file, not a folder' if path.exists() else 'no such folder'}; "
            "give a checkpoint folder "
            "(<output_dir>/checkpoints/step-N), or latest with the run's --output_dir"
        )
    if is_hf_trainer_checkpoint(path):
        raise UsageError(f"--resume_from_checkpoint {spec} is HF Trainer's checkpoint: {_from_hf_trainer(path)}")
    if (path / STATE_FILE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {spec} is a run's output folder; pass --resume_from_checkpoint latest "
            f"--output_dir {spec}, or one of its checkpoints ({path / 'checkpoints' / 'step-N'})"
        )
    if hf_trainer := _hf_trainer_output(path):
        raise UsageError(f"--resume_from_checkpoint {hf_trainer}")
    raise UsageError(f"--resume_from_checkpoint {spec}: not a complete checkpoint folder (no {STATE_FILE})")
