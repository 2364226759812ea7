"""A trained output folder that holds adapters, loaded for prediction: its base found as training found it, the
adapters merged into it (one plain model, as fast as a full one).

The base is found from the folder's training_args.yaml (the flags the run was given: the embedded model, a hub id, a
folder, recorded absolute, a GGUF file converted once into the cache; in folders saved before, a relative folder as the
absolute one adapter_config.json names, so that it is found from any working directory), else from
adapter_config.json's base_model_name_or_path, where the embedded models stand under their hub names. A folder that is
gone is looked for where training was given it, relative to the working directory (a project copied whole).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig

from app.adapters.base import DTYPES, fingerprint
from app.config import TrainConfig
from app.errors import UsageError, first_line
from app.inputs import gguf, hub
from app.inputs.model import MISSING_WEIGHTS, adapters_base_name, embedded_source, load_weights, resolve_model_path
from app.storage.folders import ADAPTER_BASE_FILE, CONFIG_FILE, recorded_config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's names, new and old


def holds_adapters(folder: str) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def base_folder(folder: str, say, record: dict) -> str:
    """The local folder of the base the adapters in `folder` were trained on. `say` reports a GGUF conversion;
    `record`: the folder's ADAPTER_BASE_FILE ({} where it has none)."""
    saved = recorded_config(Path(folder))  # empty if missing or damaged: then adapter_config.json's name
    if saved:
        keys = ("model_name_or_path", "gguf_file", "task")
        cfg = TrainConfig(**{key: saved.get(key) for key in keys})
        if (absolute := _as_trained(cfg.model_name_or_path, adapters_base_name(folder))) is not None:
            cfg = TrainConfig(model_name_or_path=absolute, gguf_file=cfg.gguf_file, task=cfg.task)
    else:
        name = adapters_base_name(folder)
        if name is None:  # else TrainConfig(model_name_or_path=None) would be the embedded default: another base
            raise UsageError(
                f"{Path(folder) / ADAPTER_CONFIG} names no base model (base_model_name_or_path) and {folder} holds no "
                f"{CONFIG_FILE}: restore one of them"
            )
        cfg = embedded_source(name) or TrainConfig(model_name_or_path=name)
    path, gguf_file = resolve_model_path(cfg)
    if Path(path).is_absolute() and not Path(path).exists():  # else it would be looked up on the hub, by a path
        found = _copied_along(folder, record)  # its fingerprint is checked (check_same_base)
        if found is None:
            raise UsageError(
                f"{folder} holds adapters whose base folder {path} does not exist (moved or deleted): put the base "
                "back there, or predict with the merged model (--save_merged_model writes it)"
            )
        path = found
    hub.before_looking_up(path)
    if gguf_file:
        target = gguf.converted_folder(path, gguf_file)
        check_same_gguf(folder, target.name, record)  # before minutes of converting another file
        path = str(gguf.convert(path, gguf_file, target, say))
    return path


def _copied_along(folder: str, record: dict) -> str | None:
    """The base folder as training was given it, relative, found from a folder above the adapters' `folder`, nearest
    first, else from this working directory: a project copied whole, or moved, with the base beside it, predicted from
    inside it or from above it (where a folder of that name in the working directory may be another model).
    `record`: the folder's ADAPTER_BASE_FILE."""
    given = record.get("given_as")
    if not isinstance(given, str) or Path(given).is_absolute():
        return None
    places = [*(above / given for above in Path(folder).resolve().parents), Path(given)]
    found, seen = [], set()  # each folder once (the working directory may be one above the adapters), nearest first
    for place in places:
        if place.is_dir() and place.resolve() not in seen:
            seen.add(place.resolve())
            found.append(str(place))
    recorded = record.get("fingerprint")
    if len(found) <= 1 or not isinstance(recorded, str):  # nothing to choose: check_same_base checks the one returned
        return found[0] if found else None
    # Of several, the one with the recorded fingerprint (hashing each reads its weights): another model of that name
    # may stand nearer.
    return next((place for place in found if fingerprint(place) == recorded), found[0])


def _as_trained(given: str | None, named: str | None) -> str | None:
    """The absolute folder that adapter_config.json names for a base given to training as a relative folder, as the
    training_args.yaml of a folder saved before local paths were recorded absolute holds it (from another working
    directory it is another folder, or a hub id), else None."""
    if not given or not named or Path(given).is_absolute() or not Path(named).is_absolute():
        return None
    parts = Path(given).parts
    return named if Path(named).is_dir() and Path(named).parts[-len(parts) :] == parts else None


def load_trained(folder: str, model_class, say: Callable[[str], None], dtype: torch.dtype = torch.float32):
    """`model_class.from_pretrained(folder)` for a full model (the weights it lacked said); for adapters, the base
    with them merged in. `say` also reports a GGUF base being converted."""
    if not holds_adapters(folder):
        return load_weights(model_class, folder, say, MISSING_WEIGHTS, head_required=True, dtype=dtype)
    from peft import PeftModel

    if not any((Path(folder) / name).is_file() for name in ADAPTER_WEIGHTS):
        raise UsageError(
            f"{folder} holds {ADAPTER_CONFIG} but not the adapters' weights ({ADAPTER_WEIGHTS[0]}): copy the whole "
            "output folder again"
        )
    record = _base_record(folder)
    base = base_folder(folder, say, record)
    check_same_base(folder, base, record)
    frozen = DTYPES.get(record.get("frozen_in"), dtype)
    try:
        # The base rounded to the dtype it was frozen in, as it trained, then merged in float32, as merged/ is.
        model = model_class.from_pretrained(base, config=AutoConfig.from_pretrained(folder), dtype=frozen).float()
    except (OSError, ValueError) as e:
        raise UsageError(
            f"{folder} holds adapters whose base {base} cannot be loaded: {first_line(e)}; make the base available"
        ) from None
    try:
        return PeftModel.from_pretrained(model, folder).merge_and_unload().to(dtype)
    except RuntimeError as e:  # torch's load_state_dict: adapters of other shapes than adapter_config.json gives
        said = str(e).splitlines()
        why = next((line.strip() for line in said if "size mismatch" in line), None)
        if why is None:  # out of memory, or a bug: not the folder's
            raise
        raise UsageError(
            f"the adapters in {folder} do not fit {ADAPTER_CONFIG} and their base ({why}): the folder is damaged or "
            "mixed with another run's; copy the whole output folder again"
        ) from None


def _base_record(folder: str) -> dict:
    """ADAPTER_BASE_FILE of an output folder, or {} (folders saved before it was written)."""
    try:
        record = json.loads((Path(folder) / ADAPTER_BASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def check_same_gguf(folder: str, conversion: str, record: dict) -> None:
    """A GGUF base is named in the cache by its file's digest: another name is another file than the one trained on.
    `record`: the folder's ADAPTER_BASE_FILE."""
    trained = record.get("gguf_conversion")
    if isinstance(trained, str) and trained != conversion:
        raise UsageError(
            f"{folder} holds adapters trained on another version of their base's GGUF file: its conversion was "
            f"{trained}, would be {conversion} now (the file changed), so the predictions would not be the trained "
            "model's; put back the file they were trained on, or predict with the merged model (--save_merged_model)"
        )


def check_same_base(folder: str, base: str, record: dict) -> None:
    """Adapters are a difference to the weights they were trained on: on another base (a folder retrained or saved
    over since, or another folder found in place of one that moved) their predictions are not the trained model's.
    Compared by the fingerprint the run recorded (ADAPTER_BASE_FILE, in folders saved since it exists), where the run
    trained on a user's folder, wherever the base is found now: an embedded model, a hub id or a GGUF file's
    conversion is loaded from a package or cache, whose bytes another machine's libraries may write otherwise for the
    same weights. `record`: the folder's ADAPTER_BASE_FILE."""
    try:
        named, recorded = Path(record["base_model_name_or_path"]), record["fingerprint"]
    except (TypeError, KeyError):
        return
    if not isinstance(recorded, str) or not named.is_absolute() or "gguf_conversion" in record:
        return  # not a user's folder (an absolute path is how the record names one)
    if not Path(base).is_dir() or (now := fingerprint(base)) == recorded:
        return
    moved = "" if named.is_dir() and named.resolve() == Path(base).resolve() else f" (found in place of {named})"
    raise UsageError(
        f"{folder} holds adapters trained on another version of their base: the weight files of {base}{moved} had "
        f"the fingerprint {recorded}, have {now} now, so the predictions would not be the trained model's; put back "
        "the base they were trained on, or predict with the merged model (--save_merged_model writes it)"
    )
