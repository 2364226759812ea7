"""The run's folders: its name, its claim on them (one run per folder), the checks that keep earlier work safe, the
config recorded in them, and giving them back.

Every claim and check happens on the main process, at the very start, before any tokenizing or loading; the other
ranks learn the outcome (host/runtime.on_main_process). A folder is claimed first and checked second, so that no
other run can fill it in between. Bad input later on (exit code 2) gives the claims back and removes every folder this
run created, so it leaves nothing behind; however else the run ends, the claims are given back and its files stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import yaml

from app.cli import local_paths_absolute
from app.config import TrainConfig
from app.errors import ProcessLost, UsageError
from app.storage.checkpoints import (
    CheckpointRecord,
    ResumePoint,
    checkpoint_around,
    completed_checkpoints,
    find_checkpoint,
    is_checkpoint_folder,
    is_staging,
    output_dir_of,
)
from app.storage.disk import is_full_disk, write_atomically
from app.storage.lease import Held, Lease, Refresher, is_lease_file
from app.telemetry.writer import event_files, holds_only_a_start

CONFIG_FILE = "training_args.yaml"
MERGED_FOLDER = "merged"  # the adapters merged into their base (--save_merged_model; storage/final_model.py)
MODEL_CARD = "README.md"
ADAPTER_BASE_FILE = "adapter_base.json"  # the base adapters were trained on: its name and fingerprint
# In a TensorBoard run folder: the output folder of the run that writes there, and where that TensorBoard folder was
# (check_log_dir_owner): a resume of another output folder must not write into a live run's curves.
OWNER_FILE = "written_for.json"
CARD_TAG = "amp-trainer"  # among the model card's tags (storage/model_card.py): a README.md that this app wrote

# What save_pretrained writes at the top of a folder for a model, peft's adapters and a tokenizer, and the merged model.
# An earlier model in the output folder (--overwrite_output_dir) leaves those that the new one does not write, and the
# folder would load as a mix of two runs: a stale adapter_config.json makes transformers load the base with the old
# adapters in place of a new full fine-tune.
# The names alone that they write: a user's tokenizer.py or vocab.md in the folder is not a model's.
MODEL_FILES = (
    *("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors"),
    *("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json"),
    *("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", ADAPTER_BASE_FILE),
    *("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json"),
    *("vocab.txt", "vocab.json", "merges.txt", "spiece.model", "spm.model", "sentencepiece.bpe.model"),
    *("sentencepiece.model", "spm_char.model", "entity_vocab.json"),
    *("chat_template.jinja", "chat_template.json", "additional_chat_templates"),
)

# What a start that failed before its first checkpoint leaves: nothing worth keeping, nothing to resume.
_LEFT_BY_A_FAILED_START = {CONFIG_FILE, "checkpoints"}
WRITTEN_BY = "# written by app/train.py"  # the first line of a run's training_args.yaml (a user's copy has its own)
ASIDE = ".overwritten-"  # the folder that --overwrite_output_dir moves an earlier run into, then deletes


class Taken(UsageError):
    """The folder is held by a live run, or holds another run's work."""


@dataclass(frozen=True)
class RunPaths:
    run_name: str
    output_dir: Path
    log_dir: Path  # <logdir>/<run_name>: this run's TensorBoard folder
    continues: bool = False  # a resume into the output folder of the run it continues (else a new run, or a branch)


class FolderClaims:
    """The folders this run claimed (main process), the ones it created, and how to give them back.

    As a context manager: every claim is given back at the end, and after bad input (UsageError), or another process
    of the run lost before training started, the folders this run created are removed as well.
    """

    def __init__(self) -> None:
        self.claims: list[tuple[Lease, list[Path]]] = []  # a lease, and the folders its claim created, outermost first
        self.refresher: Refresher | None = None

    def __enter__(self) -> FolderClaims:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if isinstance(error, UsageError) or (isinstance(error, ProcessLost) and error.before_training):
            self.remove_created()  # a run that trained nothing leaves nothing behind
        self.release()

    def claim(self, folder: Path, what: str, instead: str) -> None:
        """Create `folder` if needed and take its lease. Taken if a live run holds it; UsageError if it cannot be.

        Args:
            what, instead: for the messages: what the folder is (a flag), and what to do instead of waiting.
        """
        if any(lease.folder.resolve() == folder.resolve() for lease, _ in self.claims):
            return  # one folder for both (an --output_dir inside --logdir, named as the run): this run holds it
        created = _make_folder(folder, what)
        try:
            lease, note = Lease.take(folder)
        except Held as held:  # the folder is the holder's now, whoever created it: leave it be
            message = f"{what} {folder} is in use by another run ({held}); wait for it to end, or {instead}"
            raise Taken(message) from None
        except OSError as e:
            _remove_empty(created)
            raise UsageError(f"{what} {folder} cannot be written: {e.strerror}; {instead}") from None
        self.claims.append((lease, created))
        if note:
            print(f"note: {what} {folder}: {note}")
        self.refresher = self.refresher or Refresher()
        self.refresher.leases = [lease for lease, _ in self.claims]

    def give_back(self, folder: Path) -> None:
        """Give back the claim on `folder`, and remove the folders it created (a default name that was taken)."""
        for claim in [claim for claim in self.claims if claim[0].folder == folder]:
            self.claims.remove(claim)
            if self.refresher:
                self.refresher.leases = [lease for lease, _ in self.claims]
            _give_back(*claim, remove=True)

    def release(self) -> None:
        """Give back every claim; the files stay. Safe to call more than once."""
        if self.refresher:
            self.refresher.stop()
        while self.claims:
            _give_back(*self.claims.pop(), remove=False)

    def remove_created(self) -> None:
        """After bad input: give back every claim and remove every folder this run created, newest first."""
        if self.refresher:
            self.refresher.stop()
        while self.claims:
            _give_back(*self.claims.pop(), remove=True)


def _give_back(lease: Lease, created: list[Path], remove: bool) -> None:
    if remove and created:
        # While still holding the folder, everything in it is this run's: empty it, then let go, then remove it
        # only if still empty (a run that claimed it in between keeps it).
        for path in created[-1].iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path != lease.path:
                path.unlink()
    lease.release()
    if remove:
        _remove_empty(created)


def claim_output_dir(cfg: TrainConfig, claims: FolderClaims) -> None:
    """Claim --output_dir (or, resuming from a checkpoint path without it, that checkpoint's run folder) before
    anything reads it. A fresh run with the default folder claims it with its name (claim_run_folders)."""
    if cfg.output_dir:
        claims.claim(Path(cfg.output_dir), "--output_dir", "choose another --output_dir")
    elif cfg.resume_from_checkpoint:  # it exists (or this raises), so its run folder is a real one
        run_folder = output_dir_of(find_checkpoint(cfg.resume_from_checkpoint, None))
        claims.claim(run_folder, "--output_dir", "pass another --output_dir")


def claim_run_folders(
    cfg: TrainConfig, precision_label: str, resume: ResumePoint | None, claims: FolderClaims
) -> RunPaths:
    """Name the run, claim its TensorBoard folder (and its default output folder), and check both. Main process.

    A resumed run keeps its name, so its curves continue in TensorBoard. A default name is the date, time and
    precision; a run started in the same second as another one takes the next free suffix (-2, -3, ...).
    """
    output_dir = Path(cfg.output_dir) if cfg.output_dir else resume.output_dir if resume else None
    # A resume into another output folder branches off into a new run: its own name, its own curves, and the checks
    # of a new run's folders (the folder may hold another run).
    continues = resume is not None and output_dir.resolve() == resume.output_dir.resolve()
    if output_dir is not None:  # given (and claimed), or the resumed run's: no run name can make it free
        check_output_folder(output_dir, cfg, resuming=continues)
    continued_name = resume.record.run_name if continues else None
    if name := cfg.run_name or continued_name:
        return _claim(cfg, name, output_dir, continues, continued_name, claims)
    base = f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{precision_label}"
    for suffix in range(1, 100):
        try:
            return _claim(cfg, base if suffix == 1 else f"{base}-{suffix}", output_dir, continues, None, claims)
        except Taken:
            continue
    raise UsageError(f"no free default run name {base}-N in --logdir {cfg.logdir}; pass --run_name")


def _claim(
    cfg, name: str, output_dir: Path | None, continues: bool, continued_name: str | None, claims: FolderClaims
) -> RunPaths:
    """Claim and check the run's folders. `continues`: a resume into the output folder of the run it continues,
    whose TensorBoard folder it continues too if it keeps that run's name (`continued_name`)."""
    paths = RunPaths(name, output_dir or default_output_dir(name), Path(cfg.logdir) / name, continues)
    claimed = []
    try:
        if output_dir is None:  # a new run's default output folder, named after it; else claimed and checked already
            claims.claim(paths.output_dir, "--output_dir", "pass another --run_name or an --output_dir")
            claimed.append(paths.output_dir)
            check_output_folder(paths.output_dir, cfg, resuming=False)
        claims.claim(paths.log_dir, "TensorBoard run folder", "pass another --run_name")
        claimed.append(paths.log_dir)
        check_log_dir(paths, resuming=name == continued_name, overwrite=cfg.overwrite_output_dir)
        check_log_dir_owner(paths)
    except Taken:
        for folder in claimed:
            claims.give_back(folder)
        raise
    return paths


def default_output_dir(run_name: str) -> Path:
    return Path("outputs") / run_name


def check_output_folder(output_dir: Path, cfg: TrainConfig, resuming: bool) -> None:
    """Every check of an output folder: outside any checkpoint, apart from the model being fine-tuned, and free for
    this run (empty, resumed or overwritten)."""
    check_outside_checkpoints(output_dir)
    check_apart_from_model(output_dir, cfg.model_name_or_path)
    check_output_dir(output_dir, resuming=resuming, overwrite=cfg.overwrite_output_dir)


def check_output_dir(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    work = _work_in(output_dir)
    if not work or resuming or overwrite:
        return
    if completed_checkpoints(output_dir / "checkpoints"):
        raise Taken(
            f"--output_dir {output_dir} is not empty; pass --resume_from_checkpoint latest to continue that run, "
            "--overwrite_output_dir to replace it, or another --output_dir"
        )
    raise Taken(
        f"--output_dir {output_dir} is not empty (it holds {work[0]}); pass --overwrite_output_dir to replace what "
        "is there, or another --output_dir"
    )


def check_outside_checkpoints(output_dir: Path) -> None:
    """The output folder is no checkpoint and is not inside one, or inside a run's checkpoints folder: the run's
    files would be mixed into a checkpoint (its weights replaced, and its check then fails) or into the folder whose
    checkpoints `latest` reads."""
    if output_dir.exists() and (checkpoints := checkpoint_around(output_dir.resolve())):
        what = "a run's checkpoints folder" if checkpoints.name == "checkpoints" else "a checkpoint"
        where = "is" if checkpoints == output_dir.resolve() else "is inside"
        raise UsageError(
            f"--output_dir {output_dir} {where} {what} ({checkpoints}): this run's files would be mixed into it; pass "
            "an --output_dir outside it (a checkpoint is resumed with --resume_from_checkpoint)"
        )


def check_apart_from_model(output_dir: Path, model_name_or_path: str | None) -> None:
    """The model folder being fine-tuned is neither the run's output folder nor in a subfolder the run replaces
    (merged/, checkpoints/): the final save replaces the model files there, and an adapters run would lose its base.
    A model elsewhere under the output folder is left alone, as the run leaves it."""
    if not model_name_or_path or not output_dir.exists():
        return
    model, out = Path(model_name_or_path).resolve(), output_dir.resolve()
    inside = (out / MERGED_FOLDER, out / "checkpoints")
    if Path(model_name_or_path).is_dir() and (model == out or any(model.is_relative_to(path) for path in inside)):
        where = "is" if model == out else "holds"
        raise UsageError(
            f"--output_dir {output_dir} {where} the model being fine-tuned (--model_name_or_path "
            f"{model_name_or_path}): the run's model would replace it; pass another --output_dir"
        )


def _work_in(folder: Path) -> list[str]:
    """What in `folder` is worth keeping: anything but leases and what a failed start leaves (its config, a
    checkpoints folder with no checkpoint, at most the staging folder of a first one cut short), which a new run may
    reuse."""
    try:
        found = sorted(p.name for p in folder.iterdir() if not is_lease_file(p.name))
    except OSError as e:
        raise UsageError(f"--output_dir {folder} cannot be read: {e.strerror}") from None
    checkpoints = folder / "checkpoints"
    saved = checkpoints.is_dir() and any(not is_staging(p) for p in checkpoints.iterdir())
    # A training_args.yaml of the user's own (`--config exp1/training_args.yaml --output_dir exp1`, a copy of
    # configs/default.yaml) is no start's: reused, the folder lost the user's file, comments and all.
    users_config = CONFIG_FILE in found and not written_by_a_run(folder / CONFIG_FILE)
    return [] if set(found) <= _LEFT_BY_A_FAILED_START and not saved and not users_config else found


def written_by_a_run(config: Path) -> bool:
    """Whether a training_args.yaml is as write_config wrote it: its line, then the flags as YAML dumps them. A copy
    with the user's comments or values (the header travels with it) is the user's."""
    try:
        first, _, rest = config.read_text(encoding="utf-8").partition("\n")
        return first.startswith(WRITTEN_BY) and rest == yaml.safe_dump(yaml.safe_load(rest), sort_keys=False)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def check_log_dir(paths: RunPaths, resuming: bool, overwrite: bool = False) -> None:
    """A new run's TensorBoard folder holds no other run's curves. What a start left before it logged a training
    step (its step-0 texts) is reused, as the output folder of a failed start is, and removed by prepare(). The curves
    of a run killed before its first checkpoint are the user's to delete: nothing else can continue them."""
    if not resuming and not all(holds_only_a_start(events) for events in event_files(paths.log_dir)):
        raise Taken(
            f"TensorBoard run {paths.log_dir} already exists and would mix two runs: it holds an earlier run's curves"
            + (" (--overwrite_output_dir replaces the model folder, not TensorBoard runs)" if overwrite else "")
            + "; pass another --run_name, leave it unset for a unique one, or delete that folder to use the name again"
        )


def check_log_dir_owner(paths: RunPaths) -> None:
    """A TensorBoard run folder that holds the curves of a run in another output folder, still there, is not this
    run's to write: a resume of a copy into the original's curves (a --logdir outside the project), or of a project
    into another's of the same run name, moved that run's later points aside and replaced its HPARAMS row. A folder
    copied or moved whole (it is not where it was stamped) is the copy's own; one whose output folder is gone (moved) is
    taken over. Folders of runs written before the stamp have none: as before."""
    stamp_file = paths.log_dir / OWNER_FILE
    if not stamp_file.exists() and not stamp_file.is_symlink():
        return
    try:
        stamp = json.loads(stamp_file.read_text(encoding="utf-8"))
        owner, stamped_at = Path(stamp["output_dir"]), Path(stamp["log_dir"])
    except (OSError, ValueError, KeyError, TypeError):  # not read as absent: a copy would take the curves over
        raise Taken(
            f"{stamp_file} cannot be read (damaged, or not a file): it names the output folder whose run writes "
            f"these curves; delete it if they are this run's ({paths.output_dir}), or pass another --logdir or "
            "--run_name"
        ) from None
    if stamped_at != paths.log_dir.resolve() or owner == paths.output_dir.resolve() or not owner.exists():
        return
    raise Taken(
        f"TensorBoard run {paths.log_dir} holds the curves of the run in {owner}, not of this one in "
        f"{paths.output_dir}; pass another --logdir or --run_name for this run's"
    )


def _make_folder(path: Path, flag: str) -> list[Path]:
    """Create `path` and its missing parents; return the ones created, outermost first. UsageError if it cannot."""
    missing, existing = [], path
    try:
        while not existing.exists():
            missing.insert(0, existing)
            existing = existing.parent
        if not existing.is_dir():
            raise UsageError(f"{flag} {path} cannot be created: {existing} is a file, not a folder")
        for folder in missing:
            folder.mkdir()
    except FileExistsError:  # another run created it a moment ago: it is a folder all the same
        return _make_folder(path, flag)
    except OSError as e:  # e.g. a parent that cannot be read or written
        _remove_empty([folder for folder in missing if folder.is_dir()])
        raise UsageError(
            f"{flag} {path} cannot be created: {e.strerror} ({e.filename or existing}); choose a folder you can write"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} cannot be written: no write permission on {path}")
    return missing


def _remove_empty(created: list[Path]) -> None:
    """Remove folders this run created, innermost first, as long as they are empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return


def prepare(paths: RunPaths, cfg: TrainConfig) -> None:
    """Create the folders and record the resolved config in both. Main process, after every input check (and for a
    resume, once its checkpoint has loaded: wiring.build_training), so that bad input, or a checkpoint that fails to
    load, leaves them as they were: only here are an earlier run's checkpoints and model deleted
    (`--overwrite_output_dir`), and the event files of a start that failed before logging a step (check_log_dir),
    which the new run's replace."""
    if not paths.continues:
        if cfg.overwrite_output_dir:
            _remove_earlier_run(paths.output_dir)
        for events in event_files(paths.log_dir):
            if holds_only_a_start(events):  # as check_log_dir found them: nothing else is removed, ever
                events.unlink()
    for folder in (paths.output_dir, paths.log_dir):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            write_config(cfg, folder)
            if folder == paths.log_dir:  # whose curves these are: check_log_dir_owner
                stamp = {"output_dir": str(paths.output_dir.resolve()), "log_dir": str(folder.resolve())}
                write_atomically(folder / OWNER_FILE, json.dumps(stamp))
        except OSError as error:  # TensorBoard's copy on a full disk: its curves go too (telemetry/writer.py says so)
            if folder != paths.log_dir or not is_full_disk(error, folder, None):
                raise
            print(
                f"warning: the disk under {folder} is full: its copy of {CONFIG_FILE} or its {OWNER_FILE} was not "
                "written",
                file=sys.stderr,
            )


def _remove_earlier_run(output_dir: Path) -> None:
    """--overwrite_output_dir: the earlier run's checkpoints and model go as a whole, when this run starts. Its model
    left until this run's final save would sit beside this run's training_args.yaml, and predict.py would read it as
    trained with this run's flags."""
    checkpoints, model = output_dir / "checkpoints", _earlier_model(output_dir, keep=set(), card=True)
    # The run's checkpoints, whole or half-written; other files there are not a run's, and stay (so does a link to
    # where the user keeps checkpoints, on another disk, emptied of them).
    runs = [path for path in _entries(checkpoints) if is_checkpoint_folder(path)]
    removed = (["model"] if model else []) + (["checkpoints"] if completed_checkpoints(checkpoints) else [])
    # What an earlier overwrite set aside and could not delete, or was killed before deleting, goes too
    aside = [path for folder in (output_dir, checkpoints) for path in _entries(folder) if path.name.startswith(ASIDE)]
    doomed = runs + model + aside
    if locked := _first_locked_folder(doomed):  # all or nothing: half deleted, the earlier run would be lost
        raise UsageError(
            f"--overwrite_output_dir: the earlier run's files in {locked} cannot be deleted (no permission to change "
            "that folder); nothing was deleted: make it writable, or choose another --output_dir"
        )
    # Moved aside first, all or none (a rename is undone where the next one fails), then deleted: a file that cannot
    # be deleted (an immutable flag) is then left aside, out of the new run's way, with the earlier run gone whole.
    left = [folder for folder in _set_aside(doomed) if not _deleted(folder)]
    if runs and not checkpoints.is_symlink() and not any(checkpoints.iterdir()):
        checkpoints.rmdir()
    if removed:
        verb = "are" if len(removed) > 1 else "is"
        print(f"note: --overwrite_output_dir: the earlier {' and '.join(removed)} in {output_dir} {verb} removed")
    for folder in left:
        print(
            f"warning: --overwrite_output_dir: what is left of the earlier run in {folder} cannot be deleted; delete it"
        )


def _set_aside(paths: list[Path]) -> list[Path]:
    """Move `paths` into a hidden folder beside each (links as links), all of them or, on an OSError, none: those
    moved go back, and the refusal is a UsageError. Returns the folders they are in."""
    aside: dict[Path, Path] = {}
    moved = []
    try:
        for path in paths:
            if path.parent not in aside:  # a name of its own: one left by a run killed earlier may be there
                aside[path.parent] = Path(tempfile.mkdtemp(prefix=ASIDE, dir=path.parent))
            os.rename(path, aside[path.parent] / path.name)
            moved.append(path)
    except OSError as e:
        for path in reversed(moved):
            os.rename(aside[path.parent] / path.name, path)
        for folder in aside.values():
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise UsageError(
            f"--overwrite_output_dir: the earlier run's {e.filename} cannot be moved aside to be deleted "
            f"({e.strerror}); nothing was deleted: make it deletable, or choose another --output_dir"
        ) from None
    return list(aside.values())


def _deleted(folder: Path) -> bool:
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _first_locked_folder(paths: list[Path]) -> Path | None:
    """The first folder that forbids deleting `paths` and all in them (no permission, a read-only mount, an immutable
    flag), or one that cannot be read; None if every one can be."""
    unreadable = []
    for path in paths:
        folders = [path.parent]
        if path.is_dir() and not path.is_symlink():
            folders += [Path(root) for root, _, _ in os.walk(path, onerror=lambda e: unreadable.append(e.filename))]
        for folder in [*folders, *map(Path, unreadable)]:
            if not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
                return folder
    return None


def remove_earlier_model(output_dir: Path, keep: set[str], card: bool = False) -> list[str]:
    """Remove what an earlier model left in `output_dir` (MODEL_FILES, and with `card` this app's model card) but
    `keep`: the folder then loads as this run's model alone. Returns the names removed."""
    removed = _earlier_model(output_dir, keep, card)
    for path in removed:
        _remove(path)
    return [path.name for path in removed]


def _earlier_model(output_dir: Path, keep: set[str], card: bool) -> list[Path]:
    return [
        path
        for path in sorted(output_dir.iterdir())
        if path.name not in keep
        and (
            any(fnmatch(path.name, pattern) for pattern in MODEL_FILES)
            or (path.name == MERGED_FOLDER and (path / "config.json").is_file())  # a folder of the user's notes stays
            or (card and _is_model_card(path))
        )
    ]


def _remove(path: Path) -> None:
    """A file, a folder with all in it, or a link alone (not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _is_model_card(path: Path) -> bool:
    """A README.md that this app wrote: its front matter tags it. A user's own README.md stays."""
    if path.name != MODEL_CARD or not path.is_file():
        return False
    try:
        front = path.read_text(errors="replace", encoding="utf-8")[:1000]
    except OSError:
        return False
    return front.startswith("---") and any(
        line.startswith("tags:") and CARD_TAG in line for line in front.split("---")[1].splitlines()
    )


def recorded_config(folder: Path) -> dict:
    """The training_args.yaml that a run wrote into `folder`, as a mapping; empty if there is none to read."""
    try:
        recorded = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def resumed_logdir(cfg: TrainConfig, output_dir: Path, record: CheckpointRecord) -> tuple[TrainConfig, list[str]]:
    """The --logdir of a resume of the run in `output_dir`, from the folders its checkpoint records (`record.folders`,
    absolute, as they were when it was saved).

    Resumed in the folder that saved it, from any working directory: the run's own --logdir, where the flag is at its
    default (the default `runs` of another working directory put the curves' second part there, apart from their
    first); a --logdir given that is another is kept, and said to split the curves. Resumed in another folder (a
    project moved or copied: the two cannot be told apart): the flag's, as given, with a note where the run's earlier
    curves lie elsewhere and did not come along. Whose curves a TensorBoard folder holds is check_log_dir_owner's.
    """
    if not record.folders:  # a checkpoint written before they were recorded
        return cfg, []
    saved_in, ran_in = Path(record.folders["output_dir"]), Path(record.folders["logdir"])
    if cfg.output_dir and Path(cfg.output_dir).resolve() != output_dir.resolve():
        return cfg, []  # a new run from the checkpoint, in a folder of its own
    name = cfg.run_name or record.run_name
    earlier, goes_to = ran_in / record.run_name, Path(cfg.logdir).resolve() / name
    if output_dir.resolve() == saved_in:
        if Path(cfg.logdir).resolve() == ran_in or not earlier.is_dir():
            return cfg, []
        if cfg.logdir == TrainConfig.defaults()["logdir"]:
            return dataclasses.replace(cfg, logdir=str(ran_in)), []
        return cfg, [
            f"note: --logdir {cfg.logdir} is not the run's ({ran_in}): the curves of this resume go there, apart from "
            "the run's earlier steps; leave --logdir out to keep them in one TensorBoard run"
        ]
    if goes_to != earlier and earlier.is_dir() and not goes_to.is_dir():  # not where a copy of them came along
        return cfg, [
            f"note: the curves of this run's earlier steps are in {earlier} (saved from {saved_in}); this resume's go "
            f"in {goes_to}"
        ]
    return cfg, []


def write_config(cfg: TrainConfig, folder: Path) -> None:
    """The resolved config as `training_args.yaml`, the name HF Trainer users know (its `training_args.bin`, in YAML
    that `--config` reads back). The one config file of an output folder; predict.py reads `max_length` from it.
    What one command does to the folders is not recorded: `--config` with a copy of it, to run the same again with a
    change, would have deleted this run (--overwrite_output_dir) or resumed it (--resume_from_checkpoint). Nor are
    the run's own folders (--output_dir, --run_name: the file lies in the one, its header names the other): a copy's
    run was refused as this run's folders, taken. Local paths are recorded absolute, hub ids as given: from another
    working directory, a relative one would name other data, another model, or none."""
    once = dataclasses.replace(
        local_paths_absolute(cfg),
        overwrite_output_dir=False,
        resume_from_checkpoint=None,
        output_dir=None,
        run_name=None,
    )
    header = (
        f"{WRITTEN_BY} for run {cfg.run_name}: every flag as it ran, but the run's folders and what was done to them"
    )
    write_atomically(folder / CONFIG_FILE, f"{header}\n{once.to_yaml()}")  # a kill mid-write: no file of half a run
