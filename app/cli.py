"""What the two entry points (train.py, predict.py) share: flag help, a parser whose errors are one line, the
wrapper that turns the app's errors into exit codes, and the process's end."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import difflib
import functools
import os
import re
import sys
import threading
import time
import typing
from dataclasses import field
from pathlib import Path
from typing import Callable, TypeVar

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from app.errors import DiskFull, TrainingHalted, UsageError, with_sources
from app.host.device import launched_world_size

T = TypeVar("T")


def flag(help_text: str, **extra) -> typing.Any:
    """A dataclass field that is also a command-line flag, with its help text."""
    return field(metadata={"help": help_text}, **extra)


def as_utf8(argument: str) -> str:
    """A command-line word as the UTF-8 it is: under a locale that is not (LC_ALL=C without Python's UTF-8 mode)
    Python hands UTF-8 bytes over as lone surrogates, "café" as "caf\\udcc3\\udca9": a column of that name was not
    found, a text was refused as not UTF-8, and a model card that quoted the command could not be written. Bytes that
    are no UTF-8 stay as they came, for the lines that refuse them."""
    try:
        return os.fsencode(argument).decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):  # encode: a str of this process's own, not from argv
        return argument


class OneLineParser(HfArgumentParser):
    """HfArgumentParser (dataclass fields -> flags) that reports a bad flag as one line and the app's exit code 2,
    where argparse would print a usage block and exit by itself."""

    def __init__(self, dataclass_type, script: str, description: str):
        super().__init__(dataclass_type, allow_abbrev=False, description=description)
        self.script = script

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{message.rstrip('.')}; see python {self.script} --help")  # transformers' end in "."

    def parse_known_args(self, args=None, namespace=None):
        """As argparse, with a negative number after a flag that takes a value as that value: argparse reads `-1e-5`
        as a flag, and `--learning_rate -1e-5` got "expected one argument" instead of the check of its value."""
        args = [as_utf8(str(arg)) for arg in (sys.argv[1:] if args is None else args)]
        end = args.index("--") if "--" in args else len(args)  # after "--", words alone
        for i in range(end - 1):
            action = self._option_string_actions.get(args[i])
            if action is not None and action.nargs is None and _NEGATIVE.match(args[i + 1]):
                args[i], args[i + 1] = f"{args[i]}={args[i + 1]}", None
        return super().parse_known_args([arg for arg in args if arg is not None], namespace)

    def texts_after_switches(self, args: list[str]) -> list[str]:
        """For a script that takes words after its flags (predict.py's texts): a switch (`--disable_tqdm`) takes the
        word after it as its value when it reads as a yes or a no (`False`, as HF's flags take it), else that word is
        a text. UsageError where a yes or a no is followed by more words: its value, or the first text ("No" was
        taken for false, and its row was gone)."""
        switches = {f"--{name}" for name in self.switch_names()}
        end = args.index("--") if "--" in args else len(args)
        read = []
        for i, word in enumerate(args):
            read.append(word)
            if i + 1 >= end or word not in switches or args[i + 1].startswith("-"):
                continue
            after = args[i + 1]
            try:
                string_to_bool(after)
            except argparse.ArgumentTypeError:
                read.append("true")  # not a yes or a no: a text, and the switch on
                continue
            if i + 2 < end and not args[i + 2].startswith("-"):
                raise UsageError(
                    f"{after!r} after {word} could be its value or a text: write {word}={after.lower()} for its "
                    "value, or give the texts before the flags, or after --"
                )
        return read

    def flag_names(self) -> list[str]:
        return [option.lstrip("-") for action in self._actions for option in action.option_strings]

    def switch_names(self) -> set[str]:
        """The flags that take an optional yes or no (`--amp`, `--amp false`), without dashes."""
        return {
            option.lstrip("-")
            for action in self._actions
            if action.nargs == "?" and action.const is True
            for option in action.option_strings
        }


_NEGATIVE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")  # -1, -0.5, -1e-5, -.5


# What HF TrainingArguments and trl (and common shorthands) call a flag that this app names or covers another way:
# what to do here instead.
_EVALUATE = "use --eval_steps N: an evaluation every N optimizer steps (0: only at the end)"
_ON_CPU = "use accelerate launch --cpu app/train.py, or a CPU config from accelerate_configs/"
_FULL_EVAL = "drop it: evaluation and app/predict.py run under the autocast of --mixed_precision, as training does"
_QUANTIZED = "drop it: quantized bases do not train here; --use_peft --dtype bfloat16 keeps the base in half precision"
OTHER_NAMES = {
    "fp16": "use --mixed_precision fp16, or --amp; --mixed_precision no for fp32",
    "bf16": "use --mixed_precision bf16; --mixed_precision no for fp32",
    "fp16_full_eval": _FULL_EVAL,
    "bf16_full_eval": _FULL_EVAL,
    "debug": "drop it: the fp16 pre-flight (with --amp) and the overflow report name the module that overflows, as "
    "HF's underflow_overflow does (docs/fp16-troubleshooting.md)",
    "tf32": "drop it: TF32 for fp32 matmuls on a GPU is torch's setting, left as torch has it (a training run's "
    "TensorBoard run/tf32 says which)",
    "half_precision_backend": "drop it: the app drives autocast itself, and in training the loss scaler "
    "(--mixed_precision)",
    "eval_strategy": _EVALUATE,
    "evaluation_strategy": _EVALUATE,
    "save_strategy": "use --save_steps N: a checkpoint every N optimizer steps (0: only on a signal)",
    "logging_strategy": "use --logging_steps N",
    "logging_dir": "use --logdir, the TensorBoard folder that holds a folder per run",
    "report_to": "drop it: TensorBoard event files are always written, under --logdir",
    "per_gpu_train_batch_size": "use --per_device_train_batch_size",
    "per_gpu_eval_batch_size": "use --per_device_eval_batch_size",
    "warmup_steps": "use --warmup_ratio, a fraction of the optimizer steps",
    "lr_scheduler_type": "drop it: the schedule is HF's default, linear warmup (--warmup_ratio) then linear decay to 0",
    "optim": "drop it: the optimizer is fused AdamW, HF's default",
    "use_cpu": _ON_CPU,
    "no_cuda": _ON_CPU,
    "max_seq_length": "use --max_length",
    "dataset_text_field": "use --text_column",
    "torch_dtype": "use --dtype, the frozen base's dtype under --use_peft",
    "load_in_4bit": _QUANTIZED,
    "load_in_8bit": _QUANTIZED,
    "push_to_hub": "drop it: the model is saved to --output_dir; upload that folder with `hf upload`",
    # trl's ModelConfig and peft's LoraConfig, beside the names taken as they are (--use_peft, --lora_r, ...)
    "use_dora": "drop it: DoRA is not supported here; --use_peft trains LoRA adapters (--use_rslora: rank-stabilized)",
    "lora_bias": "drop it: adapters train no biases here; --lora_modules_to_save trains whole modules in full",
    "lora_task_type": "drop it: the adapters' task type follows the model's task (--task)",
    "model_revision": "drop it: a hub model loads at its main revision; download another with `hf download` and "
    "pass its folder",
    "trust_remote_code": "drop it: models that need their own code from the hub do not load here",
    "attn_implementation": "drop it: models load with transformers' default attention (sdpa where the model has it)",
    "lr": "use --learning_rate",
    "epochs": "use --num_train_epochs",
    "batch_size": "use --per_device_train_batch_size",
    "deepspeed": "drop it: DeepSpeed comes from the launcher's config (accelerate config, or accelerate launch "
    "--config_file), and refuses this app's AMP (docs/distributed.md)",
    "save_only_model": "drop it: checkpoints hold what an exact resume needs; --output_dir gets the model alone",
    "eval_accumulation_steps": "drop it: evaluation gathers each batch's results as it goes",
    "local_rank": "drop it: launch with accelerate launch or torchrun, which give each process its rank in its "
    "environment",
    # trl's SFTConfig, for what the data's format decides here
    "completion_only_loss": "drop it: prompt/response pairs (--prompt_column, --response_column) always train on the "
    "responses alone",
    "assistant_only_loss": "drop it: conversations (--messages_column) always train on the assistant turns alone",
    "eos_token": "drop it: the end token is the tokenizer's eos_token; set it in the model folder's "
    "tokenizer_config.json",
    "dataset_num_proc": "drop it: the data is tokenized in one process, and datasets caches it for the next run",
    "packing_strategy": "drop it: --packing joins the documents into one stream cut into blocks of --max_length",
    # HF Trainer's and the accelerate examples' names whose nearest flag here means something else
    "max_train_steps": "use --max_steps (--max_train_samples counts examples, not steps)",
    "num_warmup_steps": "use --warmup_ratio, a fraction of the optimizer steps",
    "checkpointing_steps": "use --save_steps N: a checkpoint every N optimizer steps (--gradient_checkpointing "
    "recomputes activations)",
    "with_tracking": "drop it: TensorBoard event files are always written, under --logdir",
    "do_train": "drop it: app/train.py always trains, then evaluates on the validation data",
    "do_eval": "drop it: app/train.py always evaluates, every --eval_steps and at the end",
    "do_predict": "use app/predict.py with the output folder",
    "group_by_length": "use --train_sampling_strategy group_by_length (transformers 5's name for it)",
    "tokenizer_name": "drop it: the tokenizer is the one in --model_name_or_path's folder",
    "cache_dir": "drop it: models and datasets are cached where Hugging Face caches them (HF_HOME)",
    "overwrite_cache": "drop it: the tokenized data is cached by the data's and the tokenizer's contents, so a change "
    "tokenizes again",
    "preprocessing_num_workers": "drop it: the data is tokenized in one process, and datasets caches it for the next "
    "run",
    "dataloader_num_workers": "drop it: the data is tokenized once, before training; batches come from memory",
    "data_seed": "drop it: --seed sets the data order too",
    "save_safetensors": "drop it: models are always saved as safetensors",
    "remove_unused_columns": "drop it: only the columns the task's --*_column flags name are read",
    # Lightning's Trainer
    "max_epochs": "use --num_train_epochs",
    "accumulate_grad_batches": "use --gradient_accumulation_steps",
    "gradient_clip_val": "use --max_grad_norm",
    "gradient_clipping": "use --max_grad_norm",
    "enable_checkpointing": "use --save_steps N: a checkpoint every N optimizer steps (0: only on a signal)",
    "every_n_train_steps": "use --save_steps N: a checkpoint every N optimizer steps",
    "limit_train_batches": "use --max_steps, or --max_train_samples for fewer examples",
    "precision": "use --mixed_precision fp16, bf16 or no",
    "devices": "processes are accelerate launch's: accelerate launch --num_processes N app/train.py",
    "strategy": "the backend is accelerate launch's: accelerate launch --config_file accelerate_configs/... "
    "app/train.py",
    # accelerate launch's own flags, given after the script, are found by `launcher_flag`
    **dict.fromkeys(
        ("config_file", "compute_environment", "distributed_type"),
        "an accelerate launch config goes to the launcher: accelerate launch --config_file FILE app/train.py; "
        "--config takes this app's flags as YAML keys",
    ),
}


# The names of OTHER_NAMES whose advice holds for predict.py as it stands: it names no flag that predict.py lacks,
# and nothing only a training does.
SAID_TO_PREDICT_TOO = (
    *("fp16_full_eval", "bf16_full_eval", "tf32", "half_precision_backend", "precision"),
    *("per_gpu_eval_batch_size", "max_seq_length", "local_rank"),
    *("trust_remote_code", "attn_implementation", "model_revision", "cache_dir", "tokenizer_name"),
)

# predict.py's flags for what HF's prediction scripts and pipelines (and train.py's flags) call otherwise.
PREDICT_OTHER_NAMES = {
    **{name: OTHER_NAMES[name] for name in SAID_TO_PREDICT_TOO},
    "fp16": "use --mixed_precision fp16",
    "bf16": "use --mixed_precision bf16",
    "amp": "use --mixed_precision fp16",
    "no_amp": "use --mixed_precision no",  # train.py's `--amp false`
    "batch_size": "use --per_device_eval_batch_size",
    "model": "use --model_name_or_path",
    "output_dir": "use --output_file, a .csv or .jsonl file",
    "deepspeed": "drop it: predict.py runs the model as it is, on one process or under accelerate launch",
    "use_cpu": "use accelerate launch --cpu app/predict.py",
    "no_cuda": "use accelerate launch --cpu app/predict.py",
    "debug": "drop it: predict.py refuses predictions from NaN or inf logits, and --compare_fp32 says how far its "
    "precision's predictions are from fp32's",  # not accelerate launch's --debug, which the fallback would name
    "gradient_clipping": "drop it: predict.py trains nothing",  # not accelerate launch's DeepSpeed setting
    "config_file": "an accelerate launch config goes to the launcher: accelerate launch --config_file FILE "
    "app/predict.py",
}


# Flags that name a file or folder, of either script.
PATH_FLAGS = (
    *("model_name_or_path", "dataset_name", "train_file", "validation_file", "output_dir", "logdir"),
    *("resume_from_checkpoint", "input_file", "output_file"),
)


def expand_home(cfg: T) -> T:
    """`~/runs` in a path flag as the user's home, as HF's TrainingArguments reads output_dir: a shell expands it in
    `--output_dir ~/x` but not in `--output_dir=~/x` or a YAML, where a folder named `~` was made in the working one."""
    home = {
        name: os.path.expanduser(value)
        for name in PATH_FLAGS
        if isinstance(value := getattr(cfg, name, None), str) and value.startswith("~")
    }
    return dataclasses.replace(cfg, **home) if home else cfg


def check_names_this_locale_can_write(cfg=None, config: str | None = None, working_directory: bool = False) -> None:
    """Under a locale whose file names are ASCII (LC_ALL=C without Python's UTF-8 mode) a path or run name that is not
    cannot be used as given: Python cannot encode it (a --config file's name, a path in one), and TensorBoard's writer
    and the run's records refuse the bytes Python holds for a working directory's. One line before any work, not a
    traceback at the first write or once the model is trained (its card).

    Args:
        cfg: a config whose path flags and run name are checked.
        config: the --config file given, checked before it is read.
        working_directory: check it too (training, which records its paths absolute).
    """
    if sys.getfilesystemencoding() != "ascii":
        return
    locale = (
        "this locale's file names are (LC_ALL=C without Python's UTF-8 mode); run with PYTHONUTF8=1 or LC_ALL=C.UTF-8"
    )
    if working_directory and not (cwd := os.getcwd()).isascii():
        raise UsageError(f"the working directory {_as_typed(cwd)!r} is not ASCII, and {locale}, or from ASCII folders")
    named = {"config": config, **{name: getattr(cfg, name, None) for name in (*PATH_FLAGS, "run_name")}}
    for name, value in named.items():
        if isinstance(value, str) and not value.isascii():
            raise UsageError(f"--{name} {_as_typed(value)!r} is not ASCII, and {locale}, or give an ASCII name")
        # Recorded as it resolves: an ASCII link to a folder that is not ASCII would be recorded as bytes, unreadable.
        if name in RECORDED_ABSOLUTE and isinstance(value, str) and not (resolved := absolute_if_here(value)).isascii():
            raise UsageError(
                f"--{name} {value} leads to {_as_typed(resolved)!r}, which is not ASCII, and {locale}, or give a "
                "path that resolves to ASCII"
            )


def _as_typed(name: str) -> str:
    """A name as the user typed it, where Python holds its bytes as surrogates."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


# The path flags of a training that it reads from: what training_args.yaml records absolute. Not --logdir: like
# --output_dir, where a copy's new run writes, under its own working directory (a resume finds the run's own curves
# from its checkpoint: storage/folders.resumed_logdir).
RECORDED_ABSOLUTE = ("model_name_or_path", "dataset_name", "train_file", "validation_file")


def absolute_if_here(value: str) -> str:
    """A relative path to a file or folder that exists here, made absolute: read from another working directory, it
    would name another one, or none. Anything else (a hub id, an absolute path) as given."""
    path = Path(value)
    return str(path.resolve()) if not path.is_absolute() and path.exists() else value


def local_paths_absolute(cfg: T) -> T:
    """`cfg` with its RECORDED_ABSOLUTE paths that are local made absolute, as absolute_if_here does."""
    local = {
        name: absolute_if_here(value) for name in RECORDED_ABSOLUTE if isinstance(value := getattr(cfg, name), str)
    }
    return dataclasses.replace(cfg, **local)


A_FLAG = object()  # unknown_flag_advice's `yaml_value` for a name given on the command line


def unknown_flag_advice(
    name: str,
    known: typing.Iterable[str],
    script: str,
    other_names: dict[str, str] = OTHER_NAMES,
    switches: typing.Collection[str] = (),
    yaml_value: object = A_FLAG,
) -> str:
    """What to say of a flag or --config key that is not one of `known` (flag names without dashes): this app's way
    for an HF or trl flag (`other_names`: train.py's), a switch's `--no_` form (HF's for a switch that is on by
    default), a flag of accelerate launch, else the nearest flag, else where the flags are listed. `yaml_value`: the
    value of a --config key `name`, where it is one."""
    bare = name.removeprefix("--").partition("=")[0]
    if (underscored := bare.replace("-", "_")) in other_names:  # --local-rank, as torch's launchers spell it
        return other_names[underscored]
    if underscored.startswith("no_") and underscored[3:] in switches:  # "did you mean --amp?" would switch it on
        return switched_off_advice(underscored[3:], yaml_value)
    if launcher_flag(underscored):
        return f"a flag of accelerate launch: give it before {script} (accelerate launch --num_processes 2 {script})"
    nearest = difflib.get_close_matches(bare, list(known), n=1)
    return f"did you mean --{nearest[0]}?" if nearest else f"see python {script} --help for the flags"


def switched_off_advice(switch: str, yaml_value: object = A_FLAG) -> str:
    """HF's `--no_amp` is `--amp false` here; as a --config key, `no_amp: true` is `amp: false` (and `no_amp: false`
    is `amp: true`), written as a key is."""
    if yaml_value is A_FLAG:
        return f"use --{switch} false"
    if not isinstance(yaml_value, bool):  # `no_amp: 0`, or empty: which was meant is not clear
        return f"use {switch}: true or false"
    return f"use {switch}: {'true' if yaml_value is False else 'false'}"


@functools.cache
def launcher_flag(name: str) -> bool:
    """Whether `name` (underscored, no dashes) is a flag of `accelerate launch`, read from its own parser. Not its
    one-letter aliases, nor --log_dir, which given after the script more likely means this app's --logdir."""
    from accelerate.commands.launch import launch_command_parser

    names = {o.lstrip("-").replace("-", "_") for a in launch_command_parser()._actions for o in a.option_strings}
    return len(name) > 1 and name != "log_dir" and name in names


def exit_code_of(main_body: Callable[[], int]) -> int:
    """Run an entry point's body; a UsageError or TrainingHalted becomes one line on stderr and its exit code.

    Anything else is a bug and keeps its traceback.
    """
    try:
        return main_body()
    except (UsageError, TrainingHalted) as halt:
        say_why(halt)
        return halt.exit_code


QUIET_RANKS_WAIT_S = 2.0  # what a rank that does not say why waits for rank 0 to say it


def say_why(halt: UsageError | TrainingHalted) -> None:
    """The one line of a stop, on stderr, once. Every rank stops alike; rank 0 says why, or, when another process is
    gone (it may be rank 0), the first rank left to find it (TrainingHalted.says). Said before the process group ends:
    once one rank exits, torchrun stops the others, and rank 0 could be stopped before its line."""
    if getattr(halt, "said", False):
        return
    halt.said = True
    alone = launched_world_size() == 1  # a RANK left over in the shell: this process is the only one
    # A process lost, or a signal to each process: said by the first process left to find it.
    says = halt.says if isinstance(halt, TrainingHalted) else None
    if says if says is not None else alone or os.environ.get("RANK", "0") == "0":
        line = str(halt)
        if isinstance(halt, UsageError):  # with the --config file that set a flag it names, which was not typed
            line = f"error: {with_sources(line)}"
        elif isinstance(halt, DiskFull):
            line = f"error: {line}"
        print(line, file=sys.stderr)
    elif isinstance(halt, UsageError):
        # Bad input stops every rank alike, often before they share a process group: the first rank to exit ends the
        # launch, and rank 0 was at times stopped before its line (1 launch in 10). The others give it time to say it.
        time.sleep(QUIET_RANKS_WAIT_S)


class OutputPastItsReader:
    """A standard stream that outlives its reader. Once the other end of its pipe is closed (`| head`, a pager quit
    early), what the process still writes goes to /dev/null and the run carries on, as under nohup. Without it the
    first print after the reader left raises BrokenPipeError, and a training run dies with a traceback, its last
    steps unsaved."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._past_the_reader(self._stream.write, text)

    def flush(self) -> None:
        self._past_the_reader(self._stream.flush)

    def _past_the_reader(self, operation: Callable, *args):
        try:
            return operation(*args)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # the same descriptor, now with no reader to lose
            os.close(devnull)
            return operation(*args)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def ready_std_streams() -> None:
    """Stdout and stderr of an entry run as a program: in UTF-8, as the app's files are, whatever the locale (under
    LC_ALL=C without Python's UTF-8 mode they were ASCII, and predict.py's CSV of a "café" on stdout stopped with a
    traceback once every prediction was made); and past their readers (`python app/train.py ... | head`): see
    OutputPastItsReader."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(encoding="utf-8", errors=stream.errors)  # stderr's backslashreplace kept
    sys.stdout, sys.stderr = OutputPastItsReader(sys.stdout), OutputPastItsReader(sys.stderr)


def exit_process(code: int) -> typing.NoReturn:
    """End the process with `code` once everything it wrote is out, without the interpreter's teardown.

    As the interpreter would: threading's own shutdown (which first tells the workers of thread pools to stop, as
    the pool of torch.compile's kernel builds, then waits for non-daemon threads), the atexit handlers (logging's
    flush among them), stdout and stderr flushed. Then leave at once: tearing down torch, transformers and datasets
    module by module costs about 1 s of CPU at the end of every run (4.6 s against 5.7 s for a whole tiny run), and
    every file of the run was closed before main() returned.
    """
    threading._shutdown()  # what the interpreter calls at exit; joining the threads alone waits on idle pool workers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream, or a reader gone from a process without ready_std_streams()
            pass
    os._exit(code)
