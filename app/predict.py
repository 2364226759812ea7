"""Predict with a fine-tuned model, in the input's order: a classifier's label and its probability for each text, or
a causal LM's greedy continuation of each prompt (`generated_text`).

    python app/predict.py --model_name_or_path outputs/RUN --input_file reviews.csv --output_file predicted.csv
    python app/predict.py "Great coffee, will buy again." "Stale and bitter." --model_name_or_path outputs/RUN
    cat reviews.txt | python app/predict.py --model_name_or_path outputs/RUN            # one text per line
    python app/predict.py --model_name_or_path outputs/RUN --input_file reviews.csv --mixed_precision bf16 \\
        --compare_fp32                                                 # what bf16 costs against fp32
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml app/predict.py --model_name_or_path outputs/RUN \\
        --input_file reviews.csv --output_file predicted.csv           # the input split over 2 processes
    python app/predict.py "Is this review great or other? Tasty." --model_name_or_path outputs/LM_RUN   # a causal LM

Results go to --output_file (.csv or .jsonl) or, without it, to stdout as CSV; reports and the progress bar go to
stderr. Texts on the command line come before the flags. Exit codes: 0 done, 1 another process of the run ended
(killed, crashed), 2 bad input, 3 predictions from NaN or inf logits (fp16 overflow in the model), 130/143 stopped by
SIGINT/SIGTERM; each with one line on stderr and nothing written.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python app/predict.py` from a checkout, without installing the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # a stop while the libraries import is one line too
    from app.host.starting import stop_at_once_while_starting

    stop_at_once_while_starting()

import dataclasses
import math
import time
import traceback
from dataclasses import dataclass
from textwrap import shorten
from typing import Literal, Optional

import pandas as pd
import torch
import yaml
from tqdm.auto import tqdm

from app import errors
from app.amp.policy import PrecisionPolicy, launcher_choice, resolve_precision
from app.cli import (
    PREDICT_OTHER_NAMES,
    OneLineParser,
    check_names_this_locale_can_write,
    exit_code_of,
    exit_process,
    expand_home,
    flag,
    ready_std_streams,
    say_why,
    unknown_flag_advice,
)
from app.config import TrainConfig, refuse_empty_values
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted, UsageError, counted, first_line, reached_the_app
from app.host.device import device_type, launched_world_size
from app.host.preemption import HANDLED, give_back
from app.host.runtime import (
    another_process_ended,
    connect_accelerator,
    describe_backend,
    end_accelerator,
    first_to_find_a_process_gone,
    said_in_one_line_when_another_process_ends,
)
from app.inputs.data import EMBEDDED_TEXT_COLUMN, read_table
from app.inputs.model import (
    check_max_length,
    check_weight_files,
    load_model_config,
    load_tokenizer,
    max_positions,
    position_table,
)
from app.inputs.reading import header_hint, stdin_lines
from app.storage.folders import CONFIG_FILE, recorded_config
from app.storage.predictions import check_output_file, write_table
from app.tasks import lm_data
from app.tasks.causal_lm import TextGenerator, check_decoder
from app.tasks.classification import LabelPredictor, check_head_stored, check_one_label_per_text, has_trained_head
from app.tasks.task import resolve_task
from app.telemetry.console import show_library_notices, show_progress_bars

OUTPUT_TYPES = (".csv", ".jsonl")
# What decides a causal LM's data format in training_args.yaml (tasks/lm_data.resolve_columns reads them).
LM_DATA_KEYS = ("train_file", "dataset_name", "text_column", "prompt_column", "response_column", "messages_column")
DEFAULT_NEW_TOKENS = 128


@dataclass
class PredictConfig:
    model_name_or_path: Optional[str] = flag(
        "A folder saved by app/train.py, or any sequence classifier or causal LM (local folder or cached hub id).",
        default=None,
    )
    input_file: Optional[str] = flag(
        "Texts to classify: .csv, .json, .jsonl or .parquet. Default: the texts given on the command line, or stdin.",
        default=None,
    )
    text_column: Optional[str] = flag(
        "Column of --input_file with the text (a classifier's input, or a causal LM's prompt). Default: a "
        "classifier's --text_column as it was trained (its training_args.yaml; review for the embedded reviews), "
        "else text.",
        default=None,
    )
    text_pair_column: Optional[str] = flag(
        "Second text column, for sentence-pair models. Default: the --text_pair_column a classifier was trained with.",
        default=None,
    )
    prompt_column: Optional[str] = flag(
        "Causal LM: column of --input_file with the prompts. Default: --text_column, else the prompt or text column "
        "the model was trained on (its training_args.yaml), else text.",
        default=None,
    )
    max_new_tokens: Optional[int] = flag(
        "Causal LM: the most tokens generated per prompt (greedy; it stops at the end token). Default: the "
        f"--max_new_tokens the model was trained with (its training_args.yaml), else {DEFAULT_NEW_TOKENS} (at most "
        "half the model's positions).",
        default=None,
    )
    output_file: Optional[str] = flag(
        "Where the predictions go: .csv or .jsonl, the input's columns plus predicted_label and probability (a "
        "classifier) or generated_text (a causal LM). Default: CSV on stdout.",
        default=None,
    )
    overwrite_output_file: bool = flag("Replace an --output_file that exists (else it is refused).", default=False)
    mixed_precision: Optional[Literal["auto", "no", "fp16", "bf16"]] = flag(
        "Precision, as in training: unset means `accelerate launch`'s choice, or auto under plain python.", default=None
    )
    per_device_eval_batch_size: int = flag("Texts per batch per process.", default=64)
    max_length: Optional[int] = flag(
        "Tokens per text; longer ones are truncated. Default: the --max_length the model was trained with (its "
        "training_args.yaml), else the model's limit.",
        default=None,
    )
    compare_fp32: bool = flag(
        "Predict again in fp32 and report how often the results agree: labels and the largest probability difference, "
        "or identical generations.",
        default=False,
    )
    disable_tqdm: bool = flag("Hide the progress bar.", default=False)
    verbose: bool = flag(
        "Also show the libraries' routine notices, such as transformers' load report; without it the app says which "
        "weights the checkpoint lacked, if any, in one line.",
        default=False,
    )

    def validate(self, texts: list[str]) -> None:
        refuse_empty_values(self)
        if not self.model_name_or_path:
            raise UsageError(
                "give --model_name_or_path: the output folder of a training run, a sequence classifier or a causal LM"
            )
        if self.input_file and texts:
            raise UsageError("give texts on the command line or --input_file, not both")
        for number, text in enumerate(texts, start=1):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
                raise UsageError(
                    f"text {number} on the command line is not UTF-8 (it holds the byte "
                    f"0x{ord(text[e.start]) & 0xFF:02x}); convert it first, e.g. with iconv -f latin1 -t utf-8"
                ) from None
        if self.output_file and Path(self.output_file).suffix.lower() not in OUTPUT_TYPES:
            raise UsageError(f"--output_file {self.output_file}: unsupported type; use {' or '.join(OUTPUT_TYPES)}")
        same_file = os.path.realpath(self.output_file or "") == os.path.realpath(self.input_file or "")
        if self.input_file and self.output_file and same_file:  # realpath: Path.resolve() raises on a loop of links
            raise UsageError(
                f"--output_file {self.output_file} is the --input_file: the predictions would replace the file they "
                "are made from; write them to another file"
            )
        for name in ("per_device_eval_batch_size", "max_length", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name} must be 1 or more, got {getattr(self, name)}")


def parse_args(argv: list[str] | None) -> tuple[PredictConfig, list[str]]:
    parser = OneLineParser(PredictConfig, "app/predict.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "texts", nargs="*", help="Texts or prompts (all before the flags or all after them), if no --input_file."
    )
    errors.set_config_sources({})  # no --config here: a train.py run in this process does not name its flags
    argv = parser.texts_after_switches(sys.argv[1:] if argv is None else [str(arg) for arg in argv])
    namespace, extras = parser.parse_known_args(argv)
    if extras and extras[0].startswith("-"):
        advice = unknown_flag_advice(
            extras[0], parser.flag_names(), "app/predict.py", PREDICT_OTHER_NAMES, parser.switch_names()
        )
        raise UsageError(f"unknown flag {extras[0]!r}; {advice}")
    if extras:  # argparse takes the texts in one run: those after a flag's value are left over
        raise UsageError(
            f"unexpected argument {extras[0]!r}: give the texts in one run, all before the flags or all after them, "
            "or use --input_file"
        )
    names = {f.name for f in dataclasses.fields(PredictConfig)}
    cfg = expand_home(PredictConfig(**{k: v for k, v in vars(namespace).items() if k in names}))
    check_names_this_locale_can_write(cfg)
    cfg.validate(namespace.texts)
    return cfg, namespace.texts


def read_input(
    cfg: PredictConfig,
    texts: list[str],
    num_processes: int,
    text_columns: tuple[str, ...],
    output_columns: tuple[str, ...],
    defaulted: str | None = None,
) -> pd.DataFrame:
    """The rows to predict, with their own columns; the text columns checked.

    Args:
        text_columns: the columns the model reads (texts, pairs or prompts); the first one takes texts given as
            arguments or on stdin.
        output_columns: the columns the predictions will go into, which the input must not have.
        defaulted: a causal LM's prompt column that no flag named (predict.py's default, or the training's).
    """
    if cfg.input_file:
        table = read_table(cfg.input_file, "--input_file")
    elif texts:
        table = pd.DataFrame({text_columns[0]: texts})
    elif sys.stdin.isatty():
        raise UsageError("nothing to predict: give texts, --input_file, or lines on stdin")
    elif num_processes > 1:
        raise UsageError("several processes cannot share stdin; pass --input_file")
    else:
        table = pd.DataFrame({text_columns[0]: stdin_lines(sys.stdin.buffer)})  # blank lines too: rows stay aligned
    for name in text_columns:
        if name == defaulted and name not in table.columns:  # the user named no column: say where they are looked for
            prompts = cfg.prompt_column == name
            what, flag = ("prompts", "--prompt_column") if prompts else ("texts", "--text_column")
            unread = " (a conversation's turns are not read)" if prompts else ""
            raise UsageError(
                f"the input has no column {name!r}, where the {what} are looked for by default; its columns are: "
                f"{', '.join(map(str, table.columns))}; give {flag} with the column of {what}, one plain text per row"
                f"{unread}{header_hint(list(table.columns), flag, name)}"
            )
        if name not in table.columns:
            option = next((f"--{k}" for k, v in vars(cfg).items() if k.endswith("_column") and v == name), "column")
            raise UsageError(
                f"{option} {name!r} is not in the input; its columns are: {', '.join(table.columns)}"
                f"{header_hint(list(table.columns), option, name)}"
            )
        odd = next((row for row, v in enumerate(table[name]) if not isinstance(v, str) and not is_empty_cell(v)), None)
        if odd is not None:
            value = table[name].iloc[odd]
            value = value.tolist() if hasattr(value, "tolist") else value  # numpy's arrays and scalars, as Python's
            listed = isinstance(value, (list, dict))  # a JSON list: a conversation?
            shown = shorten(" ".join(repr(value).split()), 80)
            raise UsageError(
                f"column {name!r} holds {'a list' if listed else type(value).__name__} in row {odd + 1} of the input "
                f"({shown}); texts must be strings{', one prompt each, not conversations' if listed else ''}"
            )
    if len(table) == 0:
        raise UsageError("the input has no texts to predict; give texts, an --input_file with rows, or lines on stdin")
    taken = [c for c in output_columns if c in table.columns]
    if taken:
        raise UsageError(f"the input already has a column {taken[0]!r}, where the predictions would go; rename it")
    return table


def columns_as_trained(cfg: PredictConfig) -> PredictConfig:
    """A classifier's text columns: as given, else as the model was trained (its training_args.yaml), else text. A
    model trained on text pairs gets both texts or a UsageError, and one trained on single texts gets no pair: the
    other way round it would predict from half its input, or from an input it never saw."""
    trained = recorded_config(Path(cfg.model_name_or_path))
    named = lambda key: trained[key] if isinstance(trained.get(key), str) else None  # noqa: E731
    embedded = trained and not (trained.get("train_file") or trained.get("dataset_name"))  # its texts: `review`
    text = cfg.text_column or named("text_column") or (EMBEDDED_TEXT_COLUMN if embedded else "text")
    if cfg.text_pair_column and trained and named("text_pair_column") is None:
        raise UsageError(
            f"{cfg.model_name_or_path} was trained on single texts (its {CONFIG_FILE} names no text_pair_column); "
            "drop --text_pair_column"
        )
    pair = cfg.text_pair_column or named("text_pair_column")
    if pair == text:  # one flag given, the other as trained: the model read one column twice, without a word
        as_trained = "" if cfg.text_column and cfg.text_pair_column else f" (one of them as {CONFIG_FILE} records it)"
        raise UsageError(
            f"--text_column and --text_pair_column both name the column {text!r}{as_trained}: each role takes its own "
            "column; give the other one too"
        )
    if pair and not cfg.input_file:
        raise UsageError(
            f"{cfg.model_name_or_path} was trained on text pairs (--text_column {text} --text_pair_column {pair}): "
            "give an --input_file with both columns"
        )
    return dataclasses.replace(cfg, text_column=text, text_pair_column=pair)


def prompts_as_trained(model_folder: str) -> tuple[str, bool | None]:
    """A causal LM's prompt column and whether its prompts go through the chat template, as app/train.py trained it
    (its training_args.yaml): a model trained on plain text continues plain text, one trained on prompts or
    conversations gets the template (when its tokenizer has one). A model from elsewhere: text, and the template."""
    recorded = recorded_config(Path(model_folder))
    if not recorded:
        return "text", None
    sources = {key: recorded[key] for key in LM_DATA_KEYS if isinstance(recorded.get(key), str)}
    try:
        columns = lm_data.resolve_columns(TrainConfig(**sources))
    except UsageError:  # a training_args.yaml edited by hand: as a model from elsewhere
        return "text", None
    return columns.names.get("prompt", columns.names.get("text", "text")), columns.kind != "text"


def is_empty_cell(value) -> bool:
    """An empty cell of --input_file (pandas reads it as NaN or None): an empty text, as a blank line of stdin is."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def trained_lengths(cfg: PredictConfig, model_config, tokenizer) -> tuple[int, int, str]:
    """--max_length and --max_new_tokens, by default as the model was trained (its training_args.yaml, in a folder
    saved by app/train.py): longer inputs would be texts it never learned from. Else the model's limit and
    DEFAULT_NEW_TOKENS. Then where a --max_new_tokens not given here came from, for an error that names it."""
    args = Path(cfg.model_name_or_path) / CONFIG_FILE
    default = "" if cfg.max_new_tokens else " (predict.py's default)"
    if not args.is_file():
        max_length = cfg.max_length or max_positions(model_config, tokenizer)
        return max_length, cfg.max_new_tokens or default_new_tokens(model_config), default
    try:
        recorded = yaml.safe_load(args.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        if not cfg.max_length:  # else what it records is not needed
            raise UsageError(f"{args} cannot be read ({first_line(e)}); restore it, or pass --max_length") from None
        recorded = {}
    recorded = recorded if isinstance(recorded, dict) else {}
    trained = recorded.get("max_length")
    if not cfg.max_length and (not isinstance(trained, int) or isinstance(trained, bool) or trained < 1):
        raise UsageError(f"{args} gives no max_length of 1 or more (got {trained!r}); restore it, or pass --max_length")
    new_tokens = recorded.get("max_new_tokens")  # None: trained to the longest validation response, not recorded
    usable = isinstance(new_tokens, int) and not isinstance(new_tokens, bool) and new_tokens >= 1
    if usable and not cfg.max_new_tokens:  # the run's own: predict.py was not given it
        return (
            cfg.max_length or trained,
            new_tokens,
            f" (the training run's, from {args}; predict.py's flag overrides it)",
        )
    return cfg.max_length or trained, cfg.max_new_tokens or default_new_tokens(model_config), default


def default_new_tokens(model_config) -> int:
    """DEFAULT_NEW_TOKENS, or half the model's positions where it has fewer: a GPT-2 of 64 positions was refused
    the default, and the model card's command with it."""
    positions = position_table(model_config)
    return DEFAULT_NEW_TOKENS if positions is None else min(DEFAULT_NEW_TOKENS, positions // 2)


def predict_and_write(
    cfg: PredictConfig, texts: list[str], accelerator, policy: PrecisionPolicy, notes: list[str]
) -> int:
    say = (lambda line: print(line, file=sys.stderr)) if accelerator.is_main_process else (lambda line: None)
    defaulted = None  # a causal LM's prompt column that no flag named
    # ---- every check of the input, before any weights load or any line is printed ---------------------------------
    model_config = load_model_config(cfg.model_name_or_path)
    check_weight_files(cfg.model_name_or_path)
    task, _ = resolve_task(None, model_config)
    if task == "causal_lm":
        check_decoder(model_config)
        if cfg.text_pair_column:
            raise UsageError("--text_pair_column is for sentence-pair classifiers; this model is a causal LM")
        if cfg.text_column and cfg.prompt_column:  # else --text_column went unused without a word
            raise UsageError("--text_column and --prompt_column both name a causal LM's prompts; give one of them")
        trained_column, chat = prompts_as_trained(cfg.model_name_or_path)
        if not (cfg.prompt_column or cfg.text_column):  # named, so that a file without it is told which flag to give
            cfg = dataclasses.replace(cfg, prompt_column=trained_column)
            defaulted = trained_column
        text_columns = (cfg.prompt_column or cfg.text_column,)
        output_columns = TextGenerator.columns
    else:
        if not has_trained_head(model_config):
            raise UsageError(
                f"--model_name_or_path {cfg.model_name_or_path} has no trained classification head (architectures: "
                f"{', '.join(model_config.architectures or ['none'])}); give the output folder of app/train.py"
            )
        check_one_label_per_text(cfg.model_name_or_path, model_config)
        check_head_stored(cfg.model_name_or_path, model_config)
        if cfg.prompt_column:
            raise UsageError(
                "--prompt_column is for causal LMs; this model is a sequence classifier: use --text_column"
            )
        if cfg.max_new_tokens is not None:  # else ignored without a word
            raise UsageError("--max_new_tokens is for causal LMs; this model is a sequence classifier: drop it")
        named = cfg.text_column
        cfg = columns_as_trained(cfg)
        defaulted = None if named else cfg.text_column  # as trained, else `text`
        text_columns = (cfg.text_column, cfg.text_pair_column) if cfg.text_pair_column else (cfg.text_column,)
        output_columns = LabelPredictor.columns
    tokenizer = load_tokenizer(cfg.model_name_or_path, model_config)
    max_length, max_new_tokens, new_tokens_origin = trained_lengths(cfg, model_config, tokenizer)
    check_max_length(max_length, model_config, tokenizer, pair=len(text_columns) == 2)
    check_output_file(cfg.output_file, cfg.overwrite_output_file)  # before the input is read, which may be large
    table = read_input(cfg, texts, accelerator.num_processes, text_columns, output_columns, defaulted)
    inputs = [["" if is_empty_cell(value) else value for value in table[name]] for name in text_columns]
    if task == "causal_lm":
        TextGenerator.check_inputs(
            tokenizer, model_config, max_length, max_new_tokens, inputs[0], chat, new_tokens_origin
        )

    # ---- predict ----------------------------------------------------------------------------------------------------
    for line in (policy.describe(inference=True), *notes, *describe_backend(accelerator)):
        say(line)
    shared = (cfg.model_name_or_path, tokenizer, max_length, cfg.per_device_eval_batch_size, accelerator.device, say)
    predictor = TextGenerator(*shared, max_new_tokens, chat) if task == "causal_lm" else LabelPredictor(*shared)
    # Closed on a stop too, so that its line starts a line of its own.
    quiet = cfg.disable_tqdm or not accelerator.is_main_process
    with tqdm(total=len(table), unit=predictor.unit, disable=quiet) as bar:
        started = time.perf_counter()
        results = predictor.predict(accelerator, policy, inputs, lambda n: advance(bar, n, accelerator.num_processes))
        seconds = time.perf_counter() - started
    raise_if_signalled()  # here and as the file is renamed into place: a signal Python swallowed writes nothing
    check_finite(predictor.non_finite if task == "causal_lm" else non_finite_rows(results), len(table), policy)
    if predictor.cut_note:  # as training says what it cut: the predictions are of what was kept
        say(f"note: {predictor.cut_note}")
    say(
        f"{predictor.done} {counted(len(table), predictor.unit)} in {seconds:.1f} s: "
        f"{len(table) / seconds:.1f} {predictor.unit}s/s "
        f"({policy.label}, {counted(accelerator.num_processes, 'process')}, "
        f"batches of {cfg.per_device_eval_batch_size})"
    )
    if cfg.compare_fp32:
        fp32 = PrecisionPolicy("no", policy.device_type, "--compare_fp32", "the reference")
        reference = predictor.predict(accelerator, fp32, inputs, lambda done: raise_if_signalled())
        say(predictor.compare(policy.label, results, reference))

    # ---- write --------------------------------------------------------------------------------------------------
    if accelerator.is_main_process:
        for column, values in predictor.columns_of(results).items():
            table[column] = values
        write_table(table, cfg.output_file, before_replacing=raise_if_signalled)
        if cfg.output_file:
            say(f"predictions written to {cfg.output_file}")
    return 0


def advance(bar: tqdm, done: int, num_processes: int) -> None:
    """Move the bar on by `done` texts of the main process's share, times the process count, up to the total: the
    shares differ by a text where the count does not divide, and the main process's, the largest, overshot it. After
    each batch: a signal that Python swallowed stops the run here."""
    bar.update(min(done * num_processes, bar.total - bar.n))
    raise_if_signalled()


def non_finite_rows(probabilities: torch.Tensor) -> int:
    """A classifier's rows whose probabilities are NaN (softmax of NaN or inf logits)."""
    return int((~torch.isfinite(probabilities)).any(-1).sum())


def check_finite(bad: int, rows: int, policy: PrecisionPolicy) -> None:
    """Predictions from NaN or inf logits are garbage (NaN's argmax is token 0: NUL bytes, replacement characters)
    written as if they were answers: stop with exit code 3 and write nothing."""
    if not bad:
        return
    fix = {
        "fp16": "the model's activations overflow fp16 (as when its training fell back to bf16); pass "
        "--mixed_precision bf16 or no",
        "bf16": "pass --mixed_precision no",
        "no": "the model gives them in fp32 too: its weights hold NaN or inf values",
    }[policy.mode]
    raise TrainingHalted(
        f"error: {bad} of {counted(rows, 'prediction')} came from NaN or inf logits in {policy.label}, so none was "
        f"written: {fix}",
        NUMERIC_FAULT_EXIT_CODE,
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt: predict.py unwinds (a partial --output_file is removed) and
    says one line, where the signal's default would end it at once, silently, a partial file left."""


# The signal received, kept as well as raised: a raise in a __del__ (as the model loads) was printed and dropped by
# Python, and the run went on to write its file and exit 0; none is made there, and `raise_if_signalled` raises it.
_received: list[int] = []


def _on_signal(signum: int, frame) -> None:
    if _received:
        # One stop, raised once: a signal more (Ctrl-C pressed again, a launcher passing one on) raised in the stop's
        # unwinding, which it cut short (its line, the partial file's removal), or in a finalizer, with a traceback.
        return
    _received.append(signum)
    if not in_a_finalizer(frame):  # there Python prints the raise and drops it; the next check raises it
        raise_if_signalled()


def in_a_finalizer(frame) -> bool:
    """Whether the frame runs inside a __del__, where an exception is printed ("Exception ignored in") and dropped."""
    # walk_stack(None) would walk from here instead
    return frame is not None and any(outer.f_code.co_name == "__del__" for outer, _ in traceback.walk_stack(frame))


def raise_if_signalled() -> None:
    """SIGTERM as Terminated, SIGINT as KeyboardInterrupt, where one came: where it lands, and again at each check."""
    if _received:
        raise Terminated if _received[0] == signal.SIGTERM else KeyboardInterrupt


def main(argv: list[str] | None = None, process_ends: bool = False) -> int:
    """The predictions, in this process; the exit code. `process_ends`: the process exits once it returns
    (app/predict.py run as a program), so that a signal from then on is ignored, not given back to the handlers it
    found."""
    _received.clear()  # of an earlier call in this process
    previous = {signum: signal.signal(signum, _on_signal) for signum in HANDLED}
    try:
        code = exit_code_of(lambda: _main(argv))
        if code == 0:  # a signal since the last check, whose raise was not (as the bar's __del__ ran), stops it too
            raise_if_signalled()
        # Given back in the try too: a first signal that comes before they are is the stop's, said in its line.
        give_back(previous, ignore=process_ends)
        return code
    except KeyboardInterrupt as interrupt:  # before the model loads, or as the processes part
        halt = interrupted(interrupt)
        say_why(halt)
        return halt.exit_code
    finally:
        give_back(previous, ignore=process_ends)


def interrupted(interrupt: KeyboardInterrupt, ask_the_others: bool = False) -> TrainingHalted:
    """A signal's stop, one line, not a traceback. A bug that a signal cut short while it unwound (torchrun's SIGTERM
    once another process ended of the same bug) keeps its traceback: the signal's line would hide it. An exception
    that a library handles itself is no bug: a Ctrl-C that landed in pandas' `except KeyError` as the predictions'
    column was added gave a traceback. `ask_the_others`: said by the first process left to be stopped (the main
    process may be gone), not by the main process alone."""
    cause = interrupt.__context__
    stops = (UsageError, TrainingHalted, KeyboardInterrupt)
    if (
        cause is not None
        and not isinstance(cause, stops)
        and reached_the_app(cause)
        and not another_process_ended(cause)
    ):
        raise interrupt
    code = 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)
    return TrainingHalted(interrupted_line(interrupt), code, first_to_find_a_process_gone() if ask_the_others else None)


def interrupted_line(interrupt: KeyboardInterrupt) -> str:
    if not isinstance(interrupt, Terminated):
        return "stopped by SIGINT (Ctrl-C); an --output_file is written whole or not at all"
    why = (
        " (the launcher sends it to every process on a stop, or once one of them has ended)"
        if launched_world_size() > 1
        else ""
    )
    return f"stopped by SIGTERM{why}; an --output_file is written whole or not at all"


def _main(argv: list[str] | None) -> int:
    cfg, texts = parse_args(argv)
    show_library_notices(cfg.verbose)
    show_progress_bars(not cfg.disable_tqdm)
    policy, notes = resolve_precision(False, cfg.mixed_precision, device_type(), launcher_choice())
    accelerator = connect_accelerator()
    try:
        with said_in_one_line_when_another_process_ends(lambda: another_process_ended_line(cfg.output_file)):
            try:
                return predict_and_write(cfg, texts, accelerator, policy, notes)
            except KeyboardInterrupt as interrupt:  # torchrun's SIGTERM to each process left, when rank 0 may be gone
                raise interrupted(interrupt, ask_the_others=True) from None
            except Exception:
                # Whatever stops the run, from its start: torchrun's SIGTERM once a process is gone would cut it short.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                raise
    except (UsageError, TrainingHalted) as halt:
        say_why(halt)  # before the process group ends: torchrun stops rank 0 once another rank has exited
        raise
    finally:
        end_accelerator(accelerator)


def another_process_ended_line(output_file: str | None) -> str:
    """The predictions are written after the last collective: a process lost before then leaves nothing written."""
    where = f" to --output_file {output_file}" if output_file else ""
    return (
        f"stopped: another process of this run ended (killed or crashed), so this one stops too: nothing was written"
        f"{where}; run the same command again"
    )


if __name__ == "__main__":
    ready_std_streams()
    exit_process(main(process_ends=True))
