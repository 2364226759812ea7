"""What the two entry points (train.py, predict.py) share: flag help, a parser whose errors are one line, and the
wrapper that turns the app's errors into exit codes."""

from __future__ import annotations

import os
import sys
import typing
from dataclasses import field
from typing import Callable

from transformers import HfArgumentParser

from app.errors import DiskFull, TrainingHalted, UsageError


def flag(help_text: str, **extra) -> typing.Any:
    """A dataclass field that is also a command-line flag, with its help text."""
    return field(metadata={"help": help_text}, **extra)


class OneLineParser(HfArgumentParser):
    """HfArgumentParser (dataclass fields -> flags) that reports a bad flag as one line and the app's exit code 2,
    where argparse would print a usage block and exit by itself."""

    def __init__(self, dataclass_type, script: str, description: str):
        super().__init__(dataclass_type, allow_abbrev=False, description=description)
        self.script = script

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{message}; see python {self.script} --help")


def exit_code_of(main_body: Callable[[], int]) -> int:
    """Run an entry point's body; a UsageError or TrainingHalted becomes one line on stderr and its exit code.

    Anything else is a bug and keeps its traceback.
    """
    try:
        return main_body()
    except (UsageError, TrainingHalted) as halt:
        if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one of them says why
            print(f"error: {halt}" if isinstance(halt, (UsageError, DiskFull)) else str(halt), file=sys.stderr)
        return halt.exit_code
