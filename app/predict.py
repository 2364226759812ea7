"""Predict with a fine-tuned classifier: a label and its probability for each new text, in the input's order.

    python app/predict.py --model_name_or_path outputs/RUN --input_file reviews.csv --output_file predicted.csv
    python app/predict.py "Great coffee, will buy again." "Stale and bitter." --model_name_or_path outputs/RUN
    cat reviews.txt | python app/predict.py --model_name_or_path outputs/RUN            # one text per line
    python app/predict.py --model_name_or_path outputs/RUN --input_file reviews.csv --mixed_precision bf16 \\
        --compare_fp32                                                 # what bf16 costs against fp32
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml app/predict.py --model_name_or_path outputs/RUN \\
        --input_file reviews.csv --output_file predicted.csv           # the input split over 2 processes

Results go to --output_file (.csv or .jsonl) or, without it, to stdout as CSV; reports and the progress bar go to
stderr. Texts on the command line come before the flags. Exit codes: 0 done, 2 bad input (one line on stderr,
nothing written).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python app/predict.py` from a checkout, without installing the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses
import gc
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import pandas as pd
import torch
import transformers
import yaml
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from app.amp.policy import PrecisionPolicy, launcher_choice, resolve_precision
from app.cli import OneLineParser, exit_code_of, flag
from app.data import read_data_file
from app.errors import UsageError
from app.model import has_trained_head, load_model_config, load_tokenizer, max_positions
from app.outputs import CONFIG_FILE
from app.reading import stdin_lines
from app.runtime import connect_accelerator, describe_backend, device_type

OUTPUT_TYPES = (".csv", ".jsonl")
LABEL_COLUMN, PROBABILITY_COLUMN = "predicted_label", "probability"


@dataclass
class PredictConfig:
    model_name_or_path: Optional[str] = flag(
        "A folder saved by app/train.py, or any sequence classifier (local folder or cached hub id).", default=None
    )
    input_file: Optional[str] = flag(
        "Texts to classify: .csv, .json, .jsonl or .parquet. Default: the texts given on the command line, or stdin.",
        default=None,
    )
    text_column: str = flag("Column of --input_file with the text.", default="text")
    text_pair_column: Optional[str] = flag("Optional second text column, for sentence-pair models.", default=None)
    output_file: Optional[str] = flag(
        "Where the predictions go: .csv or .jsonl, the input's columns plus predicted_label and probability. "
        "Default: CSV on stdout.",
        default=None,
    )
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
        "Predict again in fp32 and report how often the labels agree and the largest probability difference.",
        default=False,
    )
    disable_tqdm: bool = flag("Hide the progress bar.", default=False)

    def validate(self, texts: list[str]) -> None:
        if not self.model_name_or_path:
            raise UsageError("give --model_name_or_path: the output folder of a training run, or a sequence classifier")
        if self.input_file and texts:
            raise UsageError("give texts on the command line or --input_file, not both")
        if self.output_file and Path(self.output_file).suffix.lower() not in OUTPUT_TYPES:
            raise UsageError(f"--output_file {self.output_file}: unsupported type; use {' or '.join(OUTPUT_TYPES)}")
        for name in ("per_device_eval_batch_size", "max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name} must be 1 or more, got {getattr(self, name)}")


def parse_args(argv: list[str] | None) -> tuple[PredictConfig, list[str]]:
    parser = OneLineParser(PredictConfig, "app/predict.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("texts", nargs="*", help="Texts to classify (before the flags), if no --input_file.")
    namespace = parser.parse_args(argv)
    names = {f.name for f in dataclasses.fields(PredictConfig)}
    cfg = PredictConfig(**{k: v for k, v in vars(namespace).items() if k in names})
    cfg.validate(namespace.texts)
    return cfg, namespace.texts


def read_input(cfg: PredictConfig, texts: list[str], num_processes: int) -> pd.DataFrame:
    """The rows to predict, with their own columns; the text (and pair) columns checked."""
    if cfg.input_file:
        table = read_data_file(cfg.input_file, "--input_file").to_pandas()
    elif texts:
        table = pd.DataFrame({cfg.text_column: texts})
    elif sys.stdin.isatty():
        raise UsageError("nothing to predict: give texts, --input_file, or lines on stdin")
    elif num_processes > 1:
        raise UsageError("several processes cannot share stdin; pass --input_file")
    else:
        table = pd.DataFrame({cfg.text_column: stdin_lines(sys.stdin.buffer)})  # blank lines too: rows stay aligned
    for option, name in (("--text_column", cfg.text_column), ("--text_pair_column", cfg.text_pair_column)):
        if name is not None and name not in table.columns:
            raise UsageError(f"{option} {name!r} is not in the input; its columns are: {', '.join(table.columns)}")
        odd = [v for v in (table[name] if name is not None else ()) if not isinstance(v, str)]
        if odd:
            raise UsageError(f"column {name!r} holds {type(odd[0]).__name__} {odd[0]!r}; texts must be strings")
    if len(table) == 0:
        raise UsageError("the input has no texts to predict")
    taken = [c for c in (LABEL_COLUMN, PROBABILITY_COLUMN) if c in table.columns]
    if taken:
        raise UsageError(f"the input already has a column {taken[0]!r}, where the predictions would go; rename it")
    return table


def check_output_file(path: str | None) -> None:
    """Look, create nothing: the folder of --output_file must exist and be writable."""
    if path is None:
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--output_file {path}: no folder {folder}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or Path(path).is_dir():
        raise UsageError(f"--output_file {path} cannot be written")


def trained_max_length(model_path: str, model_config, tokenizer) -> int:
    """What the model saw in training: longer inputs at prediction would be texts it never learned from."""
    args = Path(model_path) / CONFIG_FILE
    trained = yaml.safe_load(args.read_text()).get("max_length") if args.is_file() else None
    return trained if isinstance(trained, int) else max_positions(model_config, tokenizer)


@torch.no_grad()
def predict_probabilities(accelerator, policy, model, tokenizer, table, cfg, max_length: int) -> torch.Tensor:
    """Class probabilities (fp32, on the CPU) of every row, in the input's order; each process predicts a share."""
    with accelerator.split_between_processes(list(range(len(table)))) as mine:
        texts = [table[cfg.text_column].iloc[mine]] + (
            [table[cfg.text_pair_column].iloc[mine]] if cfg.text_pair_column else []
        )
        encoded = tokenizer(*(list(t) for t in texts), truncation=True, max_length=max_length)
        # Longest first: texts of similar length share a batch (little padding), and a batch too big fails at once.
        order = sorted(range(len(mine)), key=lambda i: len(encoded["input_ids"][i]), reverse=True)
        collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=policy.pad_to_multiple_of)
        batch_size, found = cfg.per_device_eval_batch_size, []
        bar = tqdm(total=len(table), unit="text", disable=cfg.disable_tqdm or not accelerator.is_main_process)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = collate([{k: encoded[k][i] for k in encoded} for i in chunk]).to(accelerator.device)
            with policy.autocast():
                logits = model(**batch).logits
            found.extend(zip((mine[i] for i in chunk), logits.float().softmax(-1).cpu()))  # a host sync per batch
            bar.update(len(chunk) * accelerator.num_processes)
        bar.close()
    return torch.stack([probs for _, probs in sorted(gather_object(found), key=lambda pair: pair[0])])


def write_table(table: pd.DataFrame, path: str | None) -> None:
    """CSV or JSON lines by extension, written to a temporary file and renamed: never a half-written file."""
    if path is None:
        table.to_csv(sys.stdout, index=False)
        return
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
    if Path(path).suffix.lower() == ".jsonl":
        table.to_json(tmp, orient="records", lines=True, force_ascii=False)
    else:
        table.to_csv(tmp, index=False)
    os.replace(tmp, path)


def run(cfg: PredictConfig, texts: list[str], accelerator, policy: PrecisionPolicy, notes: list[str]) -> int:
    say = (lambda line: print(line, file=sys.stderr)) if accelerator.is_main_process else (lambda line: None)
    # ---- every check of the input, before any weights load or any line is printed ---------------------------------
    model_config = load_model_config(cfg.model_name_or_path)
    if not has_trained_head(model_config):
        raise UsageError(
            f"--model_name_or_path {cfg.model_name_or_path} has no trained classification head (architectures: "
            f"{', '.join(model_config.architectures or ['none'])}); give the output folder of app/train.py"
        )
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    max_length = cfg.max_length or trained_max_length(cfg.model_name_or_path, model_config, tokenizer)
    table = read_input(cfg, texts, accelerator.num_processes)
    check_output_file(cfg.output_file)

    # ---- predict ----------------------------------------------------------------------------------------------------
    for line in (policy.describe(), *notes, *describe_backend(accelerator)):
        say(line)
    if cfg.disable_tqdm:
        transformers.utils.logging.disable_progress_bar()  # the weight-loading bar
    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name_or_path, dtype=torch.float32)
    model.to(accelerator.device).eval()
    started = time.perf_counter()
    probs = predict_probabilities(accelerator, policy, model, tokenizer, table, cfg, max_length)
    seconds = time.perf_counter() - started
    say(
        f"predicted {len(table)} texts in {seconds:.1f} s: {len(table) / seconds:.1f} examples/s "
        f"({policy.label}, {accelerator.num_processes} process(es), batches of {cfg.per_device_eval_batch_size})"
    )
    if cfg.compare_fp32:
        fp32 = PrecisionPolicy("no", policy.device_type, "--compare_fp32", "the reference")
        reference = predict_probabilities(accelerator, fp32, model, tokenizer, table, cfg, max_length)
        agree = (probs.argmax(-1) == reference.argmax(-1)).sum().item()
        say(
            f"compare_fp32: {policy.label} vs fp32 on {len(table)} texts: label agreement {agree / len(table)} "
            f"({agree}/{len(table)}), max probability difference {(probs - reference).abs().max().item():.3g}"
        )

    # ---- write --------------------------------------------------------------------------------------------------
    if accelerator.is_main_process:
        best, label_ids = probs.max(-1)
        table[LABEL_COLUMN] = [model.config.id2label[i] for i in label_ids.tolist()]
        table[PROBABILITY_COLUMN] = best.tolist()
        write_table(table, cfg.output_file)
        if cfg.output_file:
            say(f"predictions written to {cfg.output_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return exit_code_of(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg, texts = parse_args(argv)
    policy, notes = resolve_precision(False, cfg.mixed_precision, device_type(), launcher_choice())
    accelerator = connect_accelerator()
    try:
        return run(cfg, texts, accelerator, policy, notes)
    finally:
        gc.collect()  # before tearing down: gloo otherwise sometimes aborts at interpreter exit
        accelerator.end_training()


if __name__ == "__main__":
    sys.exit(main())
