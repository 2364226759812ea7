"""Bad input: one line on stderr that names the problem and the fix, exit code 2, no traceback, nothing touched.

The table runs the real main() in this process (fast); two cases also run as subprocesses to show the process exit
code and stderr as a user sees them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

from app.telemetry import tags
from tests import tb
from tests.conftest import data_flags, force_bf16_probe, python_app, run_app


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root, with a checksum for files."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, review_files):
    """Earlier work that must survive every bad run: a finished run with a checkpoint, and its TensorBoard folder."""
    old_out = tmp_path / "old_run"
    (old_out / "checkpoints" / "step-10").mkdir(parents=True)
    (old_out / "checkpoints" / "step-10" / "trainer_state.json").write_text('{"state": {}}')
    (old_out / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "events.out.tfevents.1.host").write_bytes(b"events")
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def both_files(train: Path, validation: Path) -> list:
    """The flags of a run on these training and validation files."""
    return ["--train_file", train, "--validation_file", validation]


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def checkpoint(path: Path) -> Path:
    """A checkpoint folder as the app writes it, its record of its files included (storage/integrity.py)."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "checkpoint_files.json").write_text('{"files": {}}')
    return path


def fixed_head_model(path: Path, tiny_model_dir: Path) -> Path:
    """A model whose classification head is trained for 2 labels, saved like a fine-tuned checkpoint."""
    config = BertConfig.from_pretrained(tiny_model_dir, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def without_tokenizer(path: Path, model: Path) -> Path:
    """`model`'s config and weights alone, as a copy made without the tokenizer's files."""
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, path / name)
    return path


def with_other_shapes(path: Path, model: Path) -> Path:
    """`model` whose config.json gives its feed-forward layers another width than its weights have."""
    shutil.copytree(model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] + 8}))
    return path


def with_fewer_embeddings(path: Path, model: Path) -> Path:
    """`model`'s tokenizer on a model of 1,000 token embeddings: another model's tokenizer, as a copy can mix them."""
    BertModel(BertConfig.from_pretrained(model, vocab_size=1000)).save_pretrained(path)
    AutoTokenizer.from_pretrained(model).save_pretrained(path)
    return path


def cut_short(path: Path, model: Path) -> Path:
    """A copy of `model` whose weights file a full disk or an interrupted copy cut short."""
    shutil.copytree(model, path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    return path


def cases(ws: Path, model: Path, files: dict[str, Path]):
    """(name, extra args, env, expected words in the message). The base args are a valid run."""
    csv_dir = ws / "data"
    csv_dir.mkdir(exist_ok=True)
    (csv_dir / "folder.csv").mkdir(exist_ok=True)  # a folder, named as a file
    return [
        (
            "unknown flag",
            ["--learning_rat", "1e-4"],
            {},
            "unknown flag '--learning_rat'; did you mean --learning_rate?",
        ),
        ("HF Trainer's --fp16", ["--fp16"], {}, "unknown flag '--fp16'; use --mixed_precision fp16, or --amp"),
        ("HF Trainer's --deepspeed", ["--deepspeed", "ds.json"], {}, "drop it: DeepSpeed comes from the launcher's"),
        (
            "a launcher's --local-rank",  # "see --help", and --deepspeed was "did you mean --seed?"
            ["--local-rank=0"],
            {},
            "unknown flag '--local-rank=0'; drop it: launch with accelerate launch or torchrun",
        ),
        (
            "trl's --completion_only_loss",  # "see --help": it is what prompt/response pairs do here
            ["--completion_only_loss", "true"],
            {},
            "unknown flag '--completion_only_loss'; drop it: prompt/response pairs",
        ),
        ("trl's --eos_token", ["--eos_token", "<|im_end|>"], {}, "drop it: the end token is the tokenizer's eos_token"),
        (
            "trl's --use_dora",  # it was "did you mean --use_rslora?", another method
            ["--use_peft", "--use_dora"],
            {},
            "unknown flag '--use_dora'; drop it: DoRA is not supported here",
        ),
        (
            "HF Trainer's bf16 in a yaml",
            ["--config", write(csv_dir / "hf.yaml", "bf16: true\n")],
            {},
            "unknown key 'bf16' (use --mixed_precision bf16; --mixed_precision no for fp32); its keys are the flag",
        ),
        ("malformed yaml", ["--config", write(csv_dir / "bad.yaml", "learning_rate: [1, 2\n")], {}, "not valid YAML"),
        (
            "unknown yaml key",
            ["--config", write(csv_dir / "key.yaml", "learning_rat: 0.001\n")],
            {},
            "unknown key 'learning_rat' (did you mean --learning_rate?)",
        ),
        (
            "a yaml key that yaml reads as a boolean",  # YAML 1.1: on, off, yes, no
            ["--config", write(csv_dir / "on.yaml", "on: true\n")],
            {},
            "unknown key True (see python app/train.py --help for the flags)",
        ),
        (
            "wrong yaml type",
            ["--config", write(csv_dir / "type.yaml", "learning_rate: fast\n")],
            {},
            "learning_rate must be a number",
        ),
        (
            "a yaml that is not utf-8",  # a UnicodeDecodeError traceback
            ["--config", write_bytes(csv_dir / "latin1.yaml", b"max_steps: 2\n# caf\xe9\n")],
            {},
            "latin1.yaml is not UTF-8 text (byte 19, counted from 1); save it as UTF-8",
        ),
        (
            "a yaml key written twice",  # yaml keeps the last one without a word
            ["--config", write(csv_dir / "twice.yaml", "learning_rate: 1.0e-4\nseed: 3\nlearning_rate: 3.0e-5\n")],
            {},
            "twice.yaml is not valid YAML at line 3: key 'learning_rate' is written twice; keep one",
        ),
        (
            "two yamls",  # argparse keeps the last one without a word
            ["--config", write(csv_dir / "one.yaml", "seed: 3\n"), "--config=" + str(csv_dir / "hf.yaml")],
            {},
            "--config is given more than once; pass one YAML, and the flags that differ on the command line",
        ),
        ("wrong flag type", ["--per_device_train_batch_size", "two"], {}, "invalid int value: 'two'"),
        ("infinite learning rate", ["--learning_rate", "inf"], {}, "--learning_rate must be a finite number, got inf"),
        ("NaN clipping norm", ["--max_grad_norm", "nan"], {}, "--max_grad_norm must be a finite number, got nan"),
        ("infinite epochs", ["--num_train_epochs", "inf"], {}, "--num_train_epochs must be a finite number, got inf"),
        (
            "NaN learning rate in yaml",
            ["--config", write(csv_dir / "nan.yaml", "learning_rate: .nan\n")],
            {},
            "--learning_rate must be a finite number, got nan",
        ),
        ("batch size 0", ["--per_device_train_batch_size", "0"], {}, "--per_device_train_batch_size must be 1 or more"),
        (
            "a loss scale beyond float32",  # crashed at the first backward
            ["--init_loss_scale", "1e40"],
            {},
            "--init_loss_scale must be at most 3.403e+38 (float32's largest), got 1e+40",
        ),
        (
            "a first loss scale below the alarm's",  # exit 0, every fp16 gradient 0, nothing learned, no alarm
            ["--amp", "--init_loss_scale", "0.5"],
            {},
            "--init_loss_scale 0.5 is below --min_loss_scale 1, the scale the alarm takes for a collapse: an fp16 run "
            "would start collapsed, its gradients underflowing without an alarm; raise --init_loss_scale or lower "
            "--min_loss_scale",
        ),
        (
            "a run name that is a path",  # wrote outside --logdir; outputs/.. with --overwrite_output_dir, into the cwd
            ["--run_name", ".."],
            {},
            "--run_name '..' must be a plain name, without / or .. or control characters: it names the run's folder in "
            "--logdir",
        ),
        (
            "one column in two roles",  # the model read the answer
            ["--text_column", "label", "--label_column", "label"],
            {},
            "--text_column and --label_column both name the column 'label': each role takes its own column",
        ),
        ("padding to 0", ["--pad_to_multiple_of", "0"], {}, "--pad_to_multiple_of must be 1 or more"),
        ("unknown fallback", ["--on_scale_collapse", "retry"], {}, "invalid choice: 'retry'"),
        ("missing model", ["--model_name_or_path", ws / "no_such_model"], {}, "no_such_model: no such folder"),
        (
            "weights cut short",  # a traceback once the run's folders were written (with --overwrite_output_dir, its
            # old checkpoints deleted)
            ["--model_name_or_path", cut_short(ws / "cut_short", model)],
            {},
            f"{ws / 'cut_short' / 'model.safetensors'} cannot be read (Error while deserializing header: invalid "
            "header length): the file is damaged or cut short; copy or save it again",
        ),
        (
            "a checkpoint as the model",  # what HF Trainer's checkpoint-N folders are; here they hold no config
            ["--model_name_or_path", checkpoint(ws / "ck_run" / "checkpoints" / "step-3")],
            {},
            f"--model_name_or_path {ws / 'ck_run' / 'checkpoints' / 'step-3'} is a training checkpoint, which holds "
            f"what a resume needs but no model config: give the run's output folder ({ws / 'ck_run'}) once its run has "
            "ended",
        ),
        (
            "a model copied without its tokenizer",  # transformers would build one of 5 special tokens: all [UNK]
            ["--model_name_or_path", without_tokenizer(ws / "copied", model)],
            {},
            f"--model_name_or_path {ws / 'copied'}: its tokenizer has 5 tokens for the model's 30522 token "
            "embeddings: the tokenizer's files (tokenizer.json, or vocab.txt, vocab.json, tokenizer.model) are missing",
        ),
        (
            "a tokenizer with more tokens than the model has embeddings",  # an IndexError in the first step
            ["--model_name_or_path", with_fewer_embeddings(ws / "fewer", model)],
            {},
            f"--model_name_or_path {ws / 'fewer'}: its tokenizer's vocabulary has 30522 tokens, more than the model's "
            "1000 token embeddings, so ids from 1000 on have none",
        ),
        ("missing data file", ["--train_file", ws / "missing.csv"], {}, "missing.csv: no such file"),
        (
            "a folder named as a data file",  # it was "no such file"
            ["--train_file", csv_dir / "folder.csv"],
            {},
            f"--train_file {csv_dir / 'folder.csv'}: a folder, not a file; a folder of data files goes with "
            "--dataset_name",
        ),
        (
            "unreadable data file",
            both_files(write(csv_dir / "broken.parquet", "not parquet"), write(csv_dir / "v.parquet", "not parquet")),
            {},
            "cannot read",
        ),
        (
            "a csv line with a field too many, in the validation file",
            ["--validation_file", write(csv_dir / "extra.csv", "text,label\na,0\nb,1\nc,1,oops\n")],
            {},
            f"cannot read {csv_dir / 'extra.csv'}: Error tokenizing data. C error: Expected 2 fields in line 4, saw 3",
        ),
        (
            "a json lines file with a broken line",
            both_files(
                write(csv_dir / "t.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n'),
                write(csv_dir / "broken.jsonl", '{"text": "a", "label": 0}\n{"text": oops}\n'),
            ),
            {},
            f"cannot read {csv_dir / 'broken.jsonl'}: line 2 is not valid JSON (Expecting value at column 10)",
        ),
        (
            "a latin-1 csv",
            ["--train_file", write_bytes(csv_dir / "latin.csv", b"text,label\na,0\ncaf\xe9,1\n")],
            {},
            f"cannot read {csv_dir / 'latin.csv'}: it is not UTF-8 text: line 3 holds the byte 0xe9; save it as UTF-8",
        ),
        (
            "an int label column with an empty cell",
            both_files(
                write(csv_dir / "gap.csv", "text,label\na,0\nb,\nc,1\n"),
                write(csv_dir / "gapv.csv", "text,label\nd,1\n"),
            ),
            {},
            "label column 'label' is empty in row 2 of the train data",
        ),
        (
            "missing text column",
            ["--text_column", "body"],
            {},
            "--text_column 'body' is not in the train data; its columns are: text, label",
        ),
        ("missing label column", ["--label_column", "stars"], {}, "--label_column 'stars' is not in the train data"),
        (
            "float labels",
            both_files(
                write(csv_dir / "f.csv", "text,label\ngood,0.5\nbad,1.5\n"),
                write(csv_dir / "fv.csv", "text,label\nok,0.5\n"),
            ),
            {},
            "must hold only ints or only strings; found float 0.5: a float target is regression, which this app "
            "does not train",
        ),
        (
            "a text with an unquoted comma",  # its tail became a class of its own, " has a stray comma", silently
            both_files(
                write(csv_dir / "comma.csv", "text,label\ngood stuff,pos\nawful,neg\nthis one, has a stray comma\n"),
                write(csv_dir / "commav.csv", "text,label\nfine,pos\n"),
            ),
            {},
            "label ' has a stray comma' in row 3 of the train data (rows counted from 1, after the header) has spaces "
            "around it, which would make it a class of its own: remove the spaces, and quote texts that hold commas",
        ),
        (
            "labels with a space after some of them",  # "pos " and "pos": two classes
            both_files(
                write(csv_dir / "pos_space.csv", "text,label\na,pos\nb,neg\nc,pos \nd,neg\ne,pos \n"),
                write(csv_dir / "pos_spacev.csv", "text,label\nf,pos\n"),
            ),
            {},
            "label 'pos ' in row 3 of the train data (rows counted from 1, after the header) has spaces around it "
            "(and 1 more row), which",
        ),
        (
            "ints and strings in one label column",  # a JSON file keeps both (datasets' Json feature)
            both_files(
                write(csv_dir / "mixed.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n'),
                write(csv_dir / "mixedv.jsonl", '{"text": "c", "label": 1}\n'),
            ),
            {},
            "label column 'label' mixes ints and strings: 1 in row 1 and 'pos' in row 2 of the train data (rows "
            "counted from 1, after the header); write every label as a string, or every one as an int 0..N-1",
        ),
        (
            "class ids written as floats",
            both_files(
                write(csv_dir / "ids.csv", "text,label\ngood,1.0\nbad,0.0\n"),
                write(csv_dir / "idsv.csv", "text,label\nok,1.0\n"),
            ),
            {},
            "must hold only ints or only strings; found float 1.0: write class ids as ints (1, not 1.0)",
        ),
        (
            "a csv file separated by tabs",
            ["--train_file", write(csv_dir / "tabs.csv", "text\tlabel\ngood, really\t1\nbad\t0\n")],
            {},
            f"cannot read {csv_dir / 'tabs.csv'}: its rows have more fields than its header (the header holds tabs: a "
            ".csv file is read with commas",
        ),
        (
            "a csv file separated by tabs, its texts holding commas",  # pandas' own error, which named no separator
            ["--train_file", write(csv_dir / "tabs2.csv", "text\tlabel\ngood, really\t1\nbad, so, bad\t0\n")],
            {},
            f"cannot read {csv_dir / 'tabs2.csv'}: the header holds tabs, not commas (Error tokenizing data. C error: "
            "Expected 2 fields in line 3, saw 3); a .csv file is read with commas between its columns; save it "
            "comma-separated, or as .jsonl",
        ),
        (
            "a csv header with a space after its comma",
            ["--train_file", write(csv_dir / "spaced.csv", "text, label\ngood, 1\nbad, 0\n")],
            {},
            "--label_column 'label' is not in the train data; its columns are: text,  label (' label' has spaces "
            "around its name: remove them from the header, or pass --label_column ' label')",
        ),
        (
            "a csv file whose texts hold commas without quotes",  # pandas would cut each text's start off, silently
            [
                "--validation_file",
                write(csv_dir / "commas.csv", "text,label\ngreat, would buy again,1\nstale, bland,0\n"),
            ],
            {},
            f"cannot read {csv_dir / 'commas.csv'}: its rows have more fields than its header (1 more), so the first "
            "field of each row was cut off as a row label: texts with commas but no quotes, or a comma at the end of "
            "every row, do that; quote the fields that hold commas",
        ),
        (
            "label out of range",
            [
                "--model_name_or_path",
                fixed_head_model(ws / "fixed_head", model),
                "--train_file",
                write(csv_dir / "r.csv", "text,label\na,0\nb,1\nc,2\n"),
                "--validation_file",
                write(csv_dir / "rv.csv", "text,label\na,0\n"),
            ],
            {},
            "label 2 in 'label' is out of range for the model's 2 labels",
        ),
        (
            "empty train split",
            ["--train_file", write(csv_dir / "e.csv", "text,label\n")],
            {},
            "has no rows, so the train split is empty",
        ),
        ("max_length too long", ["--max_length", "4096"], {}, "--max_length 4096 is beyond the model's 128 positions"),
        (
            "padding past the model's positions",  # a traceback in the first forward, after the run's files were made
            ["--max_length", "64", "--pad_to_multiple_of", "256"],
            {},
            "--pad_to_multiple_of 256 pads texts of --max_length 64 to 256 tokens, beyond the model's 128 positions; "
            "use a multiple that 64 rounds up to 128 or less",
        ),
        (
            "resume without checkpoint",
            ["--resume_from_checkpoint", "latest", "--output_dir", ws / "fresh"],
            {},
            "no checkpoint in",
        ),
        (
            "logdir not writable",
            ["--logdir", ws / "old_run" / "model.safetensors" / "runs"],
            {},
            "is a file, not a folder",
        ),
        ("a LoRA flag without --use_peft", ["--lora_r", "8"], {}, "--lora_r applies to adapters only; add --use_peft"),
        ("LoRA rank 0", ["--use_peft", "--lora_r", "0"], {}, "--lora_r must be 1 or more, got 0"),
        (
            "a LoRA target the model does not have",
            ["--use_peft", "--lora_target_modules", "q_proj"],
            {},
            "--lora_target_modules 'q_proj' matches no layer that LoRA can adapt; the model's are named",
        ),
        (
            "the new classification head as a LoRA target",
            ["--use_peft", "--lora_target_modules", "query", "classifier"],
            {},
            "--lora_target_modules 'classifier' names classifier, which trains in full",
        ),
        (
            "a float16 base without autocast",
            ["--use_peft", "--dtype", "float16", "--mixed_precision", "no"],
            {},
            "--dtype float16 needs fp16 (--amp) autocast to compute in, but this run computes in fp32 without autocast",
        ),
        (
            "a bfloat16 base under fp16 autocast",
            ["--use_peft", "--dtype", "bfloat16", "--amp"],
            {},
            "--dtype bfloat16 needs bf16 autocast to compute in, but this run computes in fp16 autocast",
        ),
        (
            "adapters on a float16 base under FSDP1",
            ["--use_peft", "--amp"],
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"},
            "adapters on a float16 base cannot run under FSDP1",
        ),
        (
            "a half-precision base for a full fine-tune",
            ["--dtype", "float16"],
            {},
            "--dtype float16 without --use_peft: a full fine-tune trains every weight",
        ),
        (
            "output dir in use",
            ["--output_dir", ws / "old_run"],
            {},
            "is not empty; pass --resume_from_checkpoint latest",
        ),
        ("tensorboard run in use", ["--run_name", "old"], {}, "already exists and would mix two runs"),
        ("negative seed", ["--seed", "-1"], {}, "--seed must be between 0 and 4294967295 (2**32 - 1), got -1"),
        (
            "seed beyond 32 bits",
            ["--seed", "99999999999999"],
            {},
            "--seed must be between 0 and 4294967295 (2**32 - 1), got 99999999999999",
        ),
        (
            "a train file without the label column",
            ["--train_file", write(csv_dir / "unlabelled.csv", "text\na\nb\n")],
            {},
            "--label_column 'label' is not in the train data; its columns are: text",
        ),
        (
            "a validation file without the label column",
            ["--validation_file", write(csv_dir / "unlabelled_v.csv", "text\na\nb\n")],
            {},
            "--label_column 'label' is not in the validation data; its columns are: text",
        ),
        (
            "an empty text cell",
            ["--validation_file", write(csv_dir / "blank.csv", "text,label\na,great\n,other\n")],
            {},
            "column 'text' is empty in row 2 of the validation data (rows counted from 1, after the header)",
        ),
        (
            "a text cell of spaces alone",
            ["--validation_file", write(csv_dir / "spaces.csv", 'text,label\na,great\n"  ",other\n')],
            {},
            "column 'text' is empty in row 2 of the validation data (rows counted from 1, after the header)",
        ),
        ("fp16 under deepspeed", ["--amp"], {"ACCELERATE_USE_DEEPSPEED": "true"}, "refused, not delegated"),
        (  # Accelerate divided every loss by it, without a word: --max_grad_norm clipped at 4x the norm asked for
            "the launcher's accumulation",
            [],
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 (from the launch config or the environment) is not read here: "
            "the app accumulates by its own --gradient_accumulation_steps, 1; make the two equal",
        ),
        # "$UNSET": the embedded model trained in place of the one meant, a run went to the default folders
        *(
            (f"an empty --{flag}", [f"--{flag}", ""], {}, f"--{flag} is empty; give a value, or leave the flag out")
            for flag in ("model_name_or_path", "output_dir", "logdir", "resume_from_checkpoint", "dataset_name")
        ),
        ("a blank --run_name", ["--run_name", " "], {}, "--run_name is empty; give a value"),  # a folder named " "
        # Folders named with a newline, from a script's variable
        ("a --run_name with a newline", ["--run_name", "a\nb"], {}, "must be a plain name, without / or .. or control"),
        # argparse read -1e-5 as a flag: "expected one argument"
        ("a negative learning rate", ["--learning_rate", "-1e-5"], {}, "--learning_rate must be above 0, got -1e-05"),
        (  # ignored without a word: the given validation file was the validation data
            "a held-out share with a validation file",
            ["--validation_split_percentage", "30"],
            {},
            "--validation_split_percentage holds rows out of the training data where no validation data is given; "
            "with --validation_file, drop it",
        ),
        # "unknown flag 'train.csv'"
        (
            "a file where a flag goes",
            ["--seed", "1", "train.csv"],
            {},
            "unexpected argument 'train.csv': app/train.py takes flags",
        ),
        ("an empty --config", ["--config", ""], {}, "--config is empty; give a YAML file, or leave the flag out"),
        (
            "weights of other shapes than the config",  # transformers' size-mismatch traceback, folders left behind
            ["--model_name_or_path", with_other_shapes(ws / "other_shapes", model)],
            {},
            "other_shapes: its weight files hold tensors of other shapes than its config.json gives",
        ),
        (
            "a column named twice",  # pandas read the second as text.1, and the run took the first without a word
            ["--train_file", write(csv_dir / "twice.csv", "text,text,label\na,b,great\nc,d,other\n")],
            {},
            "twice.csv names the column 'text' twice in its header; rename one of them",
        ),
        (
            "a max_length the special tokens fill",  # the tokenizer cut nothing, every text went whole
            ["--max_length", "2"],
            {},
            "--max_length 2 leaves no room for text: the tokenizer adds 2 special tokens to each text; use "
            "--max_length 3 or more",
        ),
        (
            "a threshold without early stopping",  # ignored without a word
            ["--early_stopping_threshold", "0.5"],
            {},
            "--early_stopping_threshold applies to --early_stopping_patience; add it, or drop",
        ),
    ]


@pytest.mark.slow
def test_every_bad_input_gives_one_line_and_exit_2(workspace, tiny_model_dir, review_files, capfd, monkeypatch):
    base = [
        *data_flags(tiny_model_dir, review_files),
        "--output_dir",
        workspace / "new_out",
        "--logdir",
        workspace / "runs",
        "--run_name",
        "new",
        "--max_steps",
        "1",
        "--disable_tqdm",
    ]
    table = cases(workspace, tiny_model_dir, review_files)
    before = snapshot(workspace)
    capfd.readouterr()  # what building the table printed
    for name, extra, env, expected in table:
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            code = run_app([*base, *extra])
        out, err = capfd.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, f"{name}: exit {code}\n{err[-3000:]}"
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}: stderr was\n{err}"
        assert expected in lines[0], f"{name}: {lines[0]}"
        assert snapshot(workspace) == before, f"{name}: files changed"
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--no_such_flag"], "error: unknown flag '--no_such_flag'"),
        (["--label_column", "stars"], "error: --label_column 'stars' is not in the train data"),
    ],
)
def test_bad_input_as_a_user_sees_it(tmp_path, quick_args, extra, expected):
    result = python_app(tmp_path, [*quick_args, *extra])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith(expected), result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_a_rank_left_in_the_shell_does_not_silence_a_process_alone(quick_args, monkeypatch, capfd):
    # RANK=1 from an earlier job's shell: exit 2 with nothing said, as if this were rank 1 of several.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_app([*quick_args, "--learning_rate", "0"]) == 2
    assert capfd.readouterr().err.startswith("error: --learning_rate must be")


@pytest.mark.parametrize("spelling", ["1", "yes", "true"])
def test_every_spelling_of_the_deepspeed_flag_refuses_amp(tmp_path, quick_args, spelling, monkeypatch, capfd):
    """One parser (Accelerate's parse_flag_from_env) for ACCELERATE_USE_DEEPSPEED, so "1" and "yes" count as "true".

    Only the refusal is checked: what Accelerate does with the flag past it depends on whether deepspeed is installed.
    """
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", spelling)
    code, said = run_app([*quick_args, "--amp"]), capfd.readouterr().err
    assert code == 2, said[-2000:]
    assert said.strip().count("\n") == 0, said
    assert said.startswith("error: fp16 under a DeepSpeed launch config is refused"), said
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_bf16_under_deepspeed_is_refused_for_what_deepspeed_owns_there(tmp_path, quick_args, monkeypatch, capfd):
    # It gave fp16's reason (the loss scaled twice) and advice ("set fp16 in DeepSpeed's own config") for bf16.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert run_app([*quick_args, "--mixed_precision", "bf16"]) == 2
    said = capfd.readouterr().err
    assert said.startswith(
        "error: bf16 under a DeepSpeed launch config is refused, not delegated: DeepSpeed's engine "
        "owns the model's precision"
    ), said
    assert "set bf16 in DeepSpeed's own config and pass --mixed_precision no" in said and "twice" not in said


@pytest.mark.parametrize(
    "flags, asked",
    [([], "auto, as no precision was asked for"), (["--mixed_precision", "auto"], "--mixed_precision auto")],
    ids=["nothing asked", "--mixed_precision auto"],
)
def test_what_auto_picked_under_deepspeed_is_refused_as_auto_s_pick(quick_args, monkeypatch, capfd, flags, asked):
    # It read "bf16 under a DeepSpeed launch config is refused", as if bf16 had been asked for.
    force_bf16_probe(monkeypatch, True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert run_app([*quick_args, *flags]) == 2
    said = capfd.readouterr().err
    assert said.startswith(
        f"error: bf16 (picked for this cpu by {asked}) under a DeepSpeed launch config is refused"
    ), said
    assert said.strip().count("\n") == 0 and "pass --mixed_precision no" in said, said


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--label_column", "stars"], "error: --label_column 'stars' is not in the train data"),
        (["--max_steps", "3"], "stopped by signal 15 at optimizer step 1; resume from "),
    ],
    ids=["bad input", "a signal"],
)
def test_the_line_that_says_why_a_run_stopped_comes_before_its_process_group_ends(
    tmp_path, quick_args, monkeypatch, capsys, extra, line
):
    # Under torchrun, once one rank exits the agent stops the others: a line said after the teardown can be lost.
    import app.train

    said_by_then = []
    end = app.train.end_accelerator

    def ending(accelerator):
        said_by_then.append(capsys.readouterr().err)
        end(accelerator)

    monkeypatch.setattr(app.train, "end_accelerator", ending)
    if "--max_steps" in extra:  # a real SIGTERM during the first step, as a scheduler sends it
        from app.wiring import Training

        loss = Training.loss

        def loss_then_sigterm(training, batch):
            signal.raise_signal(signal.SIGTERM)
            return loss(training, batch)

        monkeypatch.setattr(Training, "loss", loss_then_sigterm)
    assert run_app([*quick_args, *extra]) == (2 if "--label_column" in extra else 143)
    assert len(said_by_then) == 1 and line in said_by_then[0], said_by_then


@pytest.mark.parametrize(
    "kind, flags, expected",
    [
        (
            "mamba",  # a traceback from AutoModelForSequenceClassification, its folders left behind
            [],
            "error: model type mamba has no sequence-classification head in transformers "
            "(AutoModelForSequenceClassification); use a model that has one (or train it with --task causal_lm)\n",
        ),
        (
            "albert",  # transformers' refusal came after the weights had loaded
            ["--gradient_checkpointing"],
            "error: --gradient_checkpointing: AlbertForSequenceClassification does not support it in transformers; "
            "drop the flag, or lower --per_device_train_batch_size to save memory\n",
        ),
    ],
)
def test_an_architecture_that_cannot_do_what_is_asked_is_one_line_before_anything_is_written(
    tmp_path, tiny_model_dir, review_files, kind, flags, expected, capfd
):
    from transformers import AlbertConfig, AlbertModel, MambaConfig, MambaModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    small = {"vocab_size": tokenizer.vocab_size, "hidden_size": 32, "num_hidden_layers": 1}
    if kind == "mamba":
        model = MambaModel(MambaConfig(state_size=4, expand=2, **small))
    else:
        model = AlbertModel(AlbertConfig(num_attention_heads=2, intermediate_size=64, embedding_size=16, **small))
    model.save_pretrained(tmp_path / kind)
    tokenizer.save_pretrained(tmp_path / kind)
    args = [*data_flags(tmp_path / kind, review_files), "--task", "sequence_classification", *flags]
    capfd.readouterr()
    assert run_app([*args, "--output_dir", tmp_path / "out", "--logdir", tmp_path / "runs", "--max_steps", 1]) == 2
    assert capfd.readouterr().err == expected
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_the_launchers_accumulation_equal_to_the_apps_divides_no_loss(quick_args, tmp_path, monkeypatch):
    # The same number from a DeepSpeed launch config (or the environment) and the app's flag: Accelerate's backward
    # divided each loss by 2 on top of the loop's own weighting, and the gradients were half what they were.
    args = [*quick_args, "--mixed_precision", "no", "--max_steps", "2", "--eval_steps", "0", "--save_steps", "0"]
    args += ["--gradient_accumulation_steps", "2"]
    assert run_app([*args, "--run_name", "app"]) == 0
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    assert run_app([*args, "--run_name", "launcher", "--output_dir", tmp_path / "out2"]) == 0
    norms = [tb.scalars(tmp_path / "runs" / name)[tags.TRAIN_GRAD_NORM] for name in ("app", "launcher")]
    assert norms[0] == norms[1], norms
