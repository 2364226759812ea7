"""Sequence classification: a text (or a pair of texts) -> one of N labels.

The task owns what is particular to it: its columns and their checks, the label space (int labels 0..N-1 or sorted
strings; a trained head keeps its own), tokenizing, the model class with its head, the loss (the model's own), and
the metrics (loss, accuracy, macro-F1).
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from datasets import ClassLabel, DatasetDict
from transformers import AutoConfig, AutoModelForSequenceClassification, DataCollatorWithPadding, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from app.adapters.base import folder_shapes
from app.adapters.trained import holds_adapters, load_trained
from app.amp.policy import PrecisionPolicy
from app.config import TrainConfig, refuse_flags_of_other_tasks
from app.errors import UsageError, counted
from app.inputs.data import EMBEDDED_LABEL_COLUMN, EMBEDDED_TEXT_COLUMN, is_embedded, map_splits
from app.inputs.model import headless, is_decoder, load_weights
from app.inputs.reading import check_label_cells, check_text_cells, file_row, header_hint, row_of
from app.tasks.first_token import compute_the_first_token_alone
from app.telemetry.tags import EVAL_ACCURACY, EVAL_F1, EVAL_LOSS

NAME = "sequence_classification"
# A string label column with this many training rows, all different, is text (a wrong --label_column), not labels,
# unless the validation labels are all among them (few-shot data, a class per example).
FREE_TEXT_ROWS = 20


@dataclass(frozen=True)
class LabelSpace:
    """The classes, in id order. String labels keep their names; int labels are named by their value."""

    names: tuple[str, ...]
    string_labels: bool

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.names))

    def encoder(self):
        """label value -> class id. By name for string labels, and for a json file's ints that a trained head has as
        its names (ratings 1 to 5 on a head trained on "1" to "5")."""
        if self.string_labels:
            ids = {name: i for i, name in enumerate(self.names)}
            return lambda value: ids[str(value)]
        return int


@dataclass(frozen=True)
class Columns:
    """The data's column names: the text, an optional second text (sentence pairs), and the label."""

    text: str
    pair: str | None
    label: str


def resolve_columns(cfg: TrainConfig) -> Columns:
    """The column names, with the defaults of the embedded data or of user data."""
    refuse_flags_of_other_tasks(cfg, NAME, ("prompt_column", "response_column", "messages_column", "max_new_tokens"))
    text = cfg.text_column or (EMBEDDED_TEXT_COLUMN if is_embedded(cfg) else "text")
    label = cfg.label_column or (EMBEDDED_LABEL_COLUMN if is_embedded(cfg) else "label")
    # Flags that name one column twice are refused with the config; here a flag that names the column a default role
    # reads (--text_column label trained on the labels themselves, and scored 100%).
    roles = [
        ("--text_column", text, cfg.text_column is None),
        ("--text_pair_column", cfg.text_pair_column, False),
        ("--label_column", label, cfg.label_column is None),
    ]
    for (flag, column, defaulted), (other, theirs, other_defaulted) in itertools.combinations(roles, 2):
        if column is None or column != theirs or not (defaulted or other_defaulted):
            continue
        given, default = (other, flag) if defaulted else (flag, other)
        raise UsageError(
            f"{given} {column!r} is the column that {default} reads by default: each role takes its own column; give "
            f"{given} another column, or {default} too"
        )
    return Columns(text, cfg.text_pair_column, label)


def check_columns(raw: DatasetDict, columns: Columns) -> None:
    text, pair, label = columns.text, columns.pair, columns.label
    for split in ("train", "validation"):
        present = raw[split].column_names
        for option, name in (("--text_column", text), ("--text_pair_column", pair), ("--label_column", label)):
            if name is not None and name not in present:
                raise UsageError(
                    f"{option} {name!r} is not in the {split} data; its columns are: {', '.join(present)}"
                    f"{header_hint(present, option, name)}"
                )
        for name in filter(None, (text, pair)):
            check_text_cells(raw, split, name)


def has_trained_head(config: PretrainedConfig) -> bool:
    """A checkpoint saved as a sequence classifier has a trained head whose label count is fixed."""
    return any(arch.endswith("ForSequenceClassification") for arch in (config.architectures or []))


def check_one_label_per_text(name: str, config: PretrainedConfig) -> None:
    """predict.py gives each text the label of the largest softmax probability: a regression head's one score, or a
    multi-label head's independent sigmoids, read so are nonsense (every row LABEL_0 with probability 1.0)."""
    kind = getattr(config, "problem_type", None)
    if kind == "regression" or config.num_labels == 1:
        what = "a regression model (one score per text)"
    elif kind == "multi_label_classification":
        what = "a multi-label classifier (a sigmoid per label, any number of labels per text)"
    else:
        return
    raise UsageError(
        f"--model_name_or_path {name} is {what}; predict.py gives a text the one label of a softmax over its classes: "
        "read this model's outputs with transformers (AutoModelForSequenceClassification)"
    )


def check_head_stored(name: str, config: PretrainedConfig) -> None:
    """A classifier folder whose weight files lack its head's (a base model's weights copied over a trained one's)
    would predict with a head made at random, and one whose weights are of other shapes than its config.json gives
    (another run's config copied in) would not load: one line each, before anything loads (safetensors headers)."""
    quantized = getattr(config, "quantization_config", None)  # packed weights: other shapes than the config gives
    if holds_adapters(name) or quantized or (stored := folder_shapes(name)) is None:
        return  # adapters bring their head along; PyTorch .bin files are checked as they load (load_weights)
    try:
        with torch.device("meta"):  # the names and shapes alone, no memory
            model = AutoModelForSequenceClassification.from_config(config)
    except Exception:  # a model that cannot be built this way: left to the load, which checks the head too
        return
    expected, prefix = {key: list(t.shape) for key, t in model.state_dict().items()}, f"{model.base_model_prefix}."
    if missing := [key for key in expected if not key.startswith(prefix) and key not in stored]:
        raise headless(name, missing)
    if other := next((key for key in expected if key in stored and stored[key] != expected[key]), None):
        raise UsageError(
            f"{name}: its weight {other} is {stored[other]} in the weight files but {expected[other]} by its "
            "config.json, which belongs to another model (another label count?); copy the whole output folder again"
        )


# A csv's cells are read as written, as strings (inputs/data.py): its labels that are numbers are told apart here.
WHOLE_NUMBER = re.compile(r"0|[1-9][0-9]*")
NUMBER = re.compile(r"[+-]?([0-9]+(?P<point>\.[0-9]*)?|(?P<fraction>\.[0-9]+))(?P<exponent>[eE][+-]?[0-9]+)?")


def written_class_ids(train: list, validation: list, fixed: dict[int, str] | None) -> bool:
    """Labels written as the whole numbers 0..N-1, each among the training labels, are class ids, as a json file's int
    labels are; for a trained head, whole numbers that are not its label names are its ids. Other numbers written as
    text are names ("1" to "5", "01", or a trained head's "1" to "3"), and decimals are refused by infer_labels."""
    if not all(isinstance(v, str) and WHOLE_NUMBER.fullmatch(v) for v in train + validation):
        return False
    if fixed is not None:
        return not set(train + validation) <= set(fixed.values())
    ids = {int(v) for v in train}
    return ids == set(range(len(ids)))


def ints_named_by_trained_head(raw: DatasetDict, label_column: str, labels: list, fixed: dict[int, str] | None) -> bool:
    """Int labels (a json or parquet file's) that are all names of a trained head (ratings 1 to 5 on a head trained
    on "1" to "5") are those classes, as the same numbers in a csv are; taken as ids they trained every rating one
    class too high. Not a datasets ClassLabel column's: its ints are ids of names of its own."""
    if fixed is None or isinstance(raw["train"].features.get(label_column), ClassLabel):
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        return False
    return {str(v) for v in labels} <= set(fixed.values())


def infer_labels(raw: DatasetDict, label_column: str, fixed: dict[int, str] | None) -> LabelSpace:
    """The label space from the training labels, or the model's own when its head is already trained.

    Args:
        fixed: the id2label of a model whose classification head is trained, else None.
    """
    values, validation = list(raw["train"][label_column]), list(raw["validation"][label_column])
    for split in ("train", "validation"):
        check_label_cells(raw, split, label_column, values if split == "train" else validation)
    if written_class_ids(values, validation, fixed):  # a csv's "0" and "1": ints (the encoder's int())
        values, validation = [int(v) for v in values], [int(v) for v in validation]
    elif ints_named_by_trained_head(raw, label_column, values + validation, fixed):  # as a csv's "1" to "5" are
        values, validation = [str(v) for v in values], [str(v) for v in validation]
    if all(isinstance(v, str) for v in values):
        numbers = [NUMBER.fullmatch(v) for v in values]
        decimal = lambda number: number["point"] or number["fraction"] or number["exponent"]  # noqa: E731
        if all(numbers) and any(map(decimal, numbers)):  # a csv's decimals: as a json file's floats
            _refuse_floats(label_column, [float(v) for v in values])
        # Classes of one example each are few-shot data where every validation label is one of them, in validation
        # rows of their own: the training file given as the validation file too (a smoke test) proves nothing.
        few_shot = set(validation) <= set(values) and validation != values
        if len(values) >= FREE_TEXT_ROWS and len(set(values)) == len(values) and not few_shot:
            raise UsageError(
                f"label column {label_column!r} holds a different value in each of its {len(values)} training rows: "
                f"text, not labels; name the column of labels with --label_column "
                f"(the columns: {', '.join(raw['train'].column_names)})"
            )
        spaced = [row for row, v in enumerate(values, start=1) if v != v.strip()]
        # "great " beside "great" is another class; a text with an unquoted comma among clean rows leaves its tail as
        # a label. Labels that all carry their spaces ("text, label" written by hand) are classes as consistent.
        merged = len({v.strip() for v in values}) < len(set(values))
        if spaced and (merged or len(spaced) < len(values)):
            raise UsageError(
                f"label {values[spaced[0] - 1]!r} in {row_of(raw, 'train', spaced[0])} has spaces around it"
                f"{_more_rows(len(spaced) - 1)}, which would make it a class of "
                "its own: remove the spaces, and quote texts that hold commas, as csv writers do"
            )
        space = LabelSpace(tuple(sorted(set(values))), string_labels=True)  # as HF's scripts sort them
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise UsageError(
                f"label column {label_column!r} has the negative label {min(values)}; int labels must be 0..N-1"
            )
        declared = raw["train"].features.get(label_column)
        if isinstance(declared, ClassLabel) and fixed is None:  # datasets' names (a hub dataset, save_to_disk, ...)
            space = LabelSpace(tuple(declared.names), string_labels=False)  # as HF's run_glue names them
            return _checked(raw, space, label_column, values, validation, fixed)
        absent = sorted(set(range(max(values) + 1)) - set(values))
        if absent and fixed is None and absent[0] in validation and getattr(raw, "held_out", False):
            raise _held_out_all_of(absent[0], tuple(map(str, sorted(set(values)))))
        if absent and fixed is None:  # a class the head would have and never see: star ratings 1..5, or a gap
            raise UsageError(
                f"label column {label_column!r} holds int labels {_listed(tuple(map(str, sorted(set(values)))))}, "
                f"without {absent[0]}: int labels are class ids 0..N-1, each among the training examples (after "
                "--max_train_samples and a held-out split, if any); renumber them from 0, or write them as strings "
                "(each its own class)"
            )
        space = LabelSpace(tuple(str(i) for i in range(max(values) + 1)), string_labels=False)
    else:
        odd = next((v for v in values if not isinstance(v, (str, int)) or isinstance(v, bool)), None)
        if odd is None:  # ints and strings both: a JSON file can hold that, and datasets keeps it as it is
            number = next(row for row, v in enumerate(values, start=1) if isinstance(v, int))
            text = next(row for row, v in enumerate(values, start=1) if isinstance(v, str))
            raise UsageError(
                f"label column {label_column!r} mixes ints and strings: {values[number - 1]!r} in row "
                f"{file_row(raw, 'train', number)} and {values[text - 1]!r} in {row_of(raw, 'train', text)}; write "
                "every label as a string, or every one as an int 0..N-1"
            )
        if isinstance(odd, float):
            _refuse_floats(label_column, [v for v in values if isinstance(v, float)])
        raise UsageError(
            f"label column {label_column!r} must hold only ints or only strings; found {type(odd).__name__} {odd!r}: "
            "give classes as ints 0..N-1 or as strings"
        )
    return _checked(raw, space, label_column, values, validation, fixed)


def case_twins(space: LabelSpace) -> list[str]:
    """A note for string labels that differ only in case ("Great" beside "great"): two classes, as written (labels
    can be case-sensitive codes), which a hand-labelled file more often means as one."""
    first: dict[str, str] = {}
    for name in space.names if space.string_labels else ():
        if (twin := first.setdefault(name.lower(), name)) != name:  # not casefold(): "straße" is no "strasse"
            return [
                f"note: the labels {twin!r} and {name!r} differ only in case, so they are two classes; if they are "
                "one, write them alike"
            ]
    return []


def _held_out_all_of(label, names: tuple[str, ...]) -> UsageError:
    """A class that the held-out validation split drew every row of, so that the head would never learn it."""
    return UsageError(
        f"validation label {label!r} does not occur in the training labels ({_listed(names)}): the validation rows "
        "held out from the training data (--validation_split_percentage, drawn with --seed) took every row of it; add "
        "examples of it, or give a --validation_file"
    )


def _checked(
    raw: DatasetDict, space: LabelSpace, label_column: str, values: list, validation: list, fixed: dict | None
) -> LabelSpace:
    """The label space, fitted to a trained head, with two classes or more, and every validation label in it."""
    if fixed is not None:
        space = _fit_to_trained_head(space, fixed, label_column)
    elif len(set(values)) < 2:  # one class to learn: loss 0 and accuracy 1 from the first step, having learned nothing
        only = values[0] if space.string_labels else space.names[int(values[0])]
        raise UsageError(
            f"label column {label_column!r} holds one class in the training data ({only!r}): a classifier "
            "learns to tell two or more apart; add examples of the others (if the file has them, --max_train_samples "
            "or the held-out validation split left them out: raise the one, or give a --validation_file)"
        )
    known = set(space.names) if space.string_labels else set(range(len(space.names)))
    unknown = [v for v in validation if v not in known]
    if unknown and isinstance(unknown[0], str) != space.string_labels:
        kinds = ("strings", "ints") if space.string_labels else ("ints", "strings")
        raise UsageError(
            f"the training labels are {kinds[0]} and the validation labels {kinds[1]} (such as {unknown[0]!r}): write "
            "them the same way in both files"
        )
    if unknown and "train" in getattr(raw, "cut", ()) and _among(unknown[0], raw.uncut_train[label_column]):
        raise UsageError(
            f"validation label {unknown[0]!r} does not occur in the {counted(len(values), 'training row')} that "
            f"--max_train_samples keeps ({_listed(space.names)}); the head learns only those: raise "
            "--max_train_samples, or add examples of it"
        )
    if unknown and getattr(raw, "held_out", False):  # no validation data was given: the split drew it there
        raise _held_out_all_of(unknown[0], space.names)
    if unknown:
        raise UsageError(
            f"validation label {unknown[0]!r} does not occur in the training labels ({_listed(space.names)}); the "
            "head learns only those: add examples of it to the training data or drop its validation rows"
        )
    return space


def _among(label, column) -> bool:
    """Whether `label` (a name, or a class id read from text) is written in `column`."""
    return str(label) in {str(value) for value in column}


def _refuse_floats(label_column: str, floats: list[float]) -> None:
    """Float labels: a regression target if any has a fraction (the first such is named), else class ids that a
    spreadsheet or pandas wrote as floats."""
    fraction = next((v for v in floats if not v.is_integer()), None)
    if fraction is not None:
        odd, fix = (
            fraction,
            "a float target is regression, which this app does not train; give classes as ints 0..N-1 or strings",
        )
    else:
        odd = floats[0]
        fix = f"write class ids as ints ({int(odd)}, not {odd!r})"
    raise UsageError(f"label column {label_column!r} must hold only ints or only strings; found float {odd!r}: {fix}")


def _more_rows(n: int) -> str:
    return f" (and {counted(n, 'more row')})" if n else ""


def _listed(names: tuple[str, ...], shown: int = 10) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _fit_to_trained_head(space: LabelSpace, id2label: dict[int, str], label_column: str) -> LabelSpace:
    trained = tuple(id2label[i] for i in range(len(id2label)))
    if space.string_labels:
        missing = sorted(set(space.names) - set(trained))
        if missing and trained == tuple(f"LABEL_{i}" for i in range(len(trained))):  # transformers' names for ids
            if re.fullmatch(r"LABEL_\d+", missing[0]):  # an id's name, out of range
                raise UsageError(
                    f"label {missing[0]!r} is out of range for the model's {len(trained)} labels ({trained[0]} to "
                    f"{trained[-1]}); fix the labels or start from a model without a trained classification head"
                )
            raise UsageError(  # a class's own name
                f"label {missing[0]!r} names a class, but the model's head was trained on class ids 0 to "
                f"{len(trained) - 1} without names ({trained[0]} to {trained[-1]}, as HF Trainer saves int labels): "
                "write the labels as those ids, or start from a model without a trained classification head"
            )
        if missing:
            raise UsageError(
                f"label {missing[0]!r} is not one of the model's trained labels ({', '.join(trained)}); name the "
                "labels as the model does, or start from a model without a trained classification head"
            )
        return LabelSpace(trained, string_labels=True)
    if len(space.names) > len(trained):
        raise UsageError(
            f"label {len(space.names) - 1} in {label_column!r} is out of range for the model's {len(trained)} labels "
            f"(0..{len(trained) - 1}); fix the labels or start from a model without a trained classification head"
        )
    return LabelSpace(trained, string_labels=False)


class SequenceClassification:
    """The task, once its columns and labels are known (from `SequenceClassification.from_data`)."""

    name = NAME
    auto_model = AutoModelForSequenceClassification  # the model class for a config, the head transformers gives it
    metrics = (EVAL_LOSS, EVAL_ACCURACY, EVAL_F1)
    pipeline_tag = "text-classification"
    summary = "A sequence classifier"

    def __init__(self, columns: Columns, labels: LabelSpace, tokenizer, max_length: int):
        self.columns, self.labels, self.tokenizer, self.max_length = columns, labels, tokenizer, max_length
        self.notes: list[str] = []

    @classmethod
    def from_data(
        cls, cfg: TrainConfig, raw: DatasetDict, tokenizer, model_config: PretrainedConfig
    ) -> SequenceClassification:
        """Check the columns and labels of `raw` (UsageError if they don't fit), before anything heavy."""
        kind = model_config.model_type
        if kind not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:  # else a traceback once the folders were made
            also = " (or train it with --task causal_lm)" if is_decoder(model_config) else ""
            raise UsageError(
                f"model type {kind} has no sequence-classification head in transformers "
                f"(AutoModelForSequenceClassification); use a model that has one{also}"
            )
        columns = resolve_columns(cfg)
        check_columns(raw, columns)
        trained_head = model_config.id2label if has_trained_head(model_config) else None
        task = cls(columns, infer_labels(raw, columns.label, trained_head), tokenizer, cfg.max_length)
        task.notes += case_twins(task.labels) + pad_as_the_head_reads(tokenizer, model_config)
        return task

    def tokenize(self, raw: DatasetDict, accelerator: Accelerator) -> DatasetDict:
        """Token ids and integer labels; the main process tokenizes first so that the others read its cache."""
        text, pair, label = self.columns.text, self.columns.pair, self.columns.label
        label_id, tokenizer, max_length = self.labels.encoder(), self.tokenizer, self.max_length

        def encode(batch: dict) -> dict:
            texts = (batch[text],) if pair is None else (batch[text], batch[pair])
            encoded = tokenizer(*texts, truncation=True, max_length=max_length)
            encoded["labels"] = [label_id(v) for v in batch[label]]
            return encoded

        with accelerator.main_process_first():
            return map_splits(raw, encode, batched=True, desc="Tokenizing")

    def collator(self, pad_to_multiple_of: int | None):
        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    def _head_config(self, model_config: PretrainedConfig) -> PretrainedConfig:
        config = copy.deepcopy(model_config)
        id2label = self.labels.id2label
        config.num_labels, config.id2label = len(id2label), id2label
        config.label2id = {label: i for i, label in id2label.items()}
        # Fixed up front so that torch.compile does not recompile when the loss first sets it.
        config.problem_type = "single_label_classification"
        if is_decoder(config):  # its head reads the last token before the padding the tokenizer adds
            config.get_text_config().pad_token_id = self.tokenizer.pad_token_id  # where the head reads it (Gemma 3)
        return config

    def empty_model(self, model_config: PretrainedConfig) -> torch.nn.Module:
        """The classifier on the meta device: its layers and sizes, no memory (the memory estimate, the adapters'
        plan)."""
        with torch.device("meta"):
            return self.auto_model.from_config(self._head_config(model_config))

    def load_model(self, model_path: str, dtype: torch.dtype, say: Callable[[str], None]) -> torch.nn.Module:
        """The classifier with its weights in `dtype` (float32 master weights unless a frozen base asks for less); a
        new head if the checkpoint has none, said in one line."""
        config = self._head_config(AutoConfig.from_pretrained(model_path))
        return load_weights(
            AutoModelForSequenceClassification, model_path, say, "new classification head", config=config, dtype=dtype
        )

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The model's own loss: the mean over the batch's examples."""
        return model(**batch).loss

    def items(self, batch: dict) -> int:
        """What the loss is a mean over: examples. A shape, so no host sync."""
        return batch["input_ids"].shape[0]

    @torch.no_grad()
    def evaluate(
        self, accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module, loader
    ) -> dict[str, float]:
        """Loss, accuracy and macro-F1 over the whole validation set, gathered from every rank without duplicates."""
        model.eval()
        losses, predictions, references = [], [], []
        for batch in loader:
            with policy.autocast():
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            per_example = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
            # NaN or inf logits predict nothing: argmax would read them as class 0, the majority class here and there,
            # and report its share as the accuracy of a model whose every output overflowed.
            predicted = logits.argmax(dim=-1).masked_fill(~logits.isfinite().all(dim=-1), NO_PREDICTION)
            gathered = accelerator.gather_for_metrics((per_example, predicted, batch["labels"]))
            for store, values in zip((losses, predictions, references), gathered):
                store.append(values)
        model.train()
        loss, predicted, labels = (torch.cat(values).cpu() for values in (losses, predictions, references))
        return {
            EVAL_LOSS: loss.mean().item(),
            EVAL_ACCURACY: (predicted == labels).float().mean().item(),
            EVAL_F1: macro_f1(predicted, labels),
        }

    def card(self) -> dict[str, str]:
        """What the model card says of the task."""
        return {"task": "sequence classification", "labels": ", ".join(self.labels.names)}


def class_names(task) -> list[str] | None:
    """A classifier's labels in class-id order (what its checkpoints record); None for another task."""
    return list(task.labels.names) if isinstance(task, SequenceClassification) else None


NO_PREDICTION = -1  # an example whose logits are not finite: wrong whatever its label, and no class of its own


def macro_f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """F1 averaged over the classes that occur in the labels or the predictions (as sklearn's average="macro");
    NO_PREDICTION counts as a miss of the example's label, not as a class."""
    scores = []
    for cls in torch.unique(torch.cat([predicted, labels])):
        if cls == NO_PREDICTION:
            continue
        true_pos = ((predicted == cls) & (labels == cls)).sum()
        errors = (predicted == cls).sum() + (labels == cls).sum() - 2 * true_pos  # false positives + false negatives
        scores.append(2 * true_pos / (2 * true_pos + errors))
    return torch.stack(scores).mean().item()


def pad_as_the_head_reads(tokenizer, model_config: PretrainedConfig) -> list[str]:
    """Give a tokenizer without a pad token its EOS to pad with (GPT-2's and Llama's come without one: a batch of
    two texts could not be padded), and say where a decoder's config names another pad token than the tokenizer's:
    its head reads the last token that is not that one, so it read padding as text, and its answers changed with the
    batch size. Returns the notes. UsageError where there is nothing to pad with."""
    notes = []
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError(
                "the tokenizer has no pad token to pad a batch with, nor an EOS token to pad with; set pad_token in "
                "the model's tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        notes.append(f"note: the tokenizer has no pad token: batches are padded with its EOS, {tokenizer.eos_token}")
    configured = getattr(model_config.get_text_config(), "pad_token_id", None)  # a composite config's text part's
    if is_decoder(model_config) and configured is not None and configured != tokenizer.pad_token_id:
        notes.append(
            f"note: the model config's pad_token_id {configured} is not the tokenizer's pad token "
            f"({tokenizer.pad_token_id}): the classifier reads the last token before the tokenizer's padding"
        )
    return notes


class LabelPredictor:
    """predict.py's output for a sequence classifier: each text's most likely label and its probability."""

    columns = ("predicted_label", "probability")
    unit, done = "text", "predicted"  # as predict.py counts its inputs: "predicted 2 texts"

    def __init__(
        self, model_path: str, tokenizer, max_length: int, batch_size: int, device: torch.device, say: Callable
    ):
        self.model = load_trained(model_path, AutoModelForSequenceClassification, say)  # full, or a base with adapters
        for note in pad_as_the_head_reads(tokenizer, self.model.config):
            say(note)
        if is_decoder(self.model.config):  # as in training: the last token before the tokenizer's padding
            self.model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        compute_the_first_token_alone(self.model)
        self.model.to(device).eval()
        self.tokenizer, self.max_length, self.batch_size = tokenizer, max_length, batch_size
        self.cut_note: str | None = None  # how many texts the last predict() cut to --max_length

    @torch.no_grad()
    def predict(
        self, accelerator: Accelerator, policy: PrecisionPolicy, texts: list[list[str]], progress
    ) -> torch.Tensor:
        """Class probabilities (fp32, on the CPU) of every row, in the input's order; each process predicts a share.

        Args:
            texts: the text column, and the pair column if there is one.
        """
        with accelerator.split_between_processes(list(range(len(texts[0])))) as mine:
            # fewer texts than processes leave one with none, and a tokenizer refuses an empty batch
            found, cut = self._predict_share(mine, texts, accelerator, policy, progress) if mine else ([], 0)
        cut = sum(gather_object([cut]))
        self.cut_note = (
            f"{cut} of {counted(len(texts[0]), 'text')} were cut to --max_length {self.max_length} tokens"
            if cut
            else None
        )
        return torch.stack([probs for _, probs in sorted(gather_object(found), key=lambda pair: pair[0])])

    def _predict_share(
        self, mine: list[int], texts: list[list[str]], accelerator: Accelerator, policy: PrecisionPolicy, progress
    ) -> tuple[list, int]:
        """(row, class probabilities) of this process's rows `mine`, and how many of them were cut."""
        found = []
        encoded = self.tokenizer(
            *([column[i] for i in mine] for column in texts), truncation=True, max_length=self.max_length
        )
        cut = self._cut(encoded, [[column[i] for i in mine] for column in texts])
        # Longest first: texts of similar length share a batch (little padding), and a batch too big fails at once.
        order = sorted(range(len(mine)), key=lambda i: len(encoded["input_ids"][i]), reverse=True)
        collate = DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=policy.pad_to_multiple_of)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = collate([{k: encoded[k][i] for k in encoded} for i in chunk]).to(accelerator.device)
            with policy.autocast():
                logits = self.model(**batch).logits
            found.extend(zip((mine[i] for i in chunk), logits.float().softmax(-1).cpu()))  # a host sync per batch
            progress(len(chunk))
        return found, cut

    def _cut(self, encoded, texts: list[list[str]]) -> int:
        """How many of the encoded texts truncation cut: a fast tokenizer keeps what it cut off (`overflowing`); with
        a slow one the texts at the limit are tokenized again whole, those alone."""
        if encoded.encodings is not None:
            return sum(bool(encoding.overflowing) for encoding in encoded.encodings)
        full = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) == self.max_length]
        whole = self.tokenizer(*([column[i] for i in full] for column in texts))["input_ids"] if full else []
        return sum(len(ids) > self.max_length for ids in whole)

    def columns_of(self, probs: torch.Tensor) -> dict[str, list]:
        best, label_ids = probs.max(-1)
        return {
            "predicted_label": [self.model.config.id2label[i] for i in label_ids.tolist()],
            "probability": best.tolist(),
        }

    def compare(self, label: str, probs: torch.Tensor, reference: torch.Tensor) -> str:
        """How predictions in another precision agree with fp32's, in one line."""
        agree, rows = (probs.argmax(-1) == reference.argmax(-1)).sum().item(), len(probs)
        return (
            f"compare_fp32: {label} vs fp32 on {counted(rows, 'text')}: label agreement {agree / rows} "
            f"({agree}/{rows}), max probability difference {(probs - reference).abs().max().item():.3g}"
        )
