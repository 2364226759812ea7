"""The ways a run ends early, each with its exit code, and the words of the lines that say so (first_line, counted).

`train.py` turns these into one line on stderr and the exit code; anything else is a bug and keeps its traceback.
"""

import os
import re
import traceback


class UsageError(Exception):
    """Bad input (flag, file, column, label, config). Raised before heavy work; exit code 2."""

    exit_code = 2


class TrainingHalted(Exception):
    """Training stopped on purpose: a numeric fault, a collapsed loss scale or a signal. `says`: whether this process
    says the line, where not the main process alone does (cli.say_why); None for the main process's rule."""

    def __init__(self, message: str, exit_code: int, says: bool | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.says = says


NUMERIC_FAULT_EXIT_CODE = 3


class ProcessLost(TrainingHalted):
    """Another process of the run ended (killed, crashed) and a collective with it failed: no checkpoint can be written
    without it. Said by the first process left to find it gone (`says`), since the main process may be the one gone.
    Exit code 1. `before_training`: it ended while the run loaded, so nothing was trained, and the folders this run
    created go, as after bad input."""

    def __init__(self, message: str, before_training: bool = False, says: bool = True):
        super().__init__(message, exit_code=1, says=says)
        self.before_training = before_training


class DiskFull(TrainingHalted):
    """A checkpoint or the final model did not fit on the disk; the previous checkpoint is intact. Exit code 4."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=4)


def first_line(error: BaseException) -> str:
    """The first line of an error's message, for a one-line report; its type name when the message is empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


APP_FOLDER = os.path.dirname(os.path.realpath(__file__))


def reached_the_app(error: BaseException) -> bool:
    """Whether an exception was raised in the app's own code or has come up into it, as a bug does on its way out. One
    that a library raises and handles itself (pandas' KeyError as it adds a column) has not."""
    frames = traceback.walk_tb(error.__traceback__)
    return any(os.path.realpath(frame.f_code.co_filename).startswith(APP_FOLDER + os.sep) for frame, _ in frames)


def counted(n: float, noun: str) -> str:
    """A count and its noun, in the plural unless the count is 1: "1 optimizer step", "4 optimizer steps", "0.5
    epochs", "2 processes"."""
    return f"{f'{n:g}' if isinstance(n, float) else n} {plural(n, noun)}"


def plural(n: float, noun: str) -> str:
    """The noun for `n` of it: -es after s or x (processes), else -s (epochs; "batch" would want a rule of its own)."""
    return noun if n == 1 else noun + ("es" if noun.endswith(("s", "x")) else "s")


# The flags whose values a --config YAML set, not the command line, and the file: app/config.parse_config sets them.
_config_sources: dict[str, str] = {}
# Of those, the paths it gave relative (flag -> path): read from the working directory, not from the file's folder.
_relative_paths: dict[str, str] = {}


def set_config_sources(sources: dict[str, str], relative_paths: dict[str, str] | None = None) -> None:
    _config_sources.clear()
    _config_sources.update(sources)
    _relative_paths.clear()
    _relative_paths.update(relative_paths or {})


def with_sources(line: str) -> str:
    """A line that names flags a --config file set says so: the user did not type them. A relative path of the file
    that is not found is said to be read from the working directory: a file beside the YAML is not found by it."""
    named = [name for name in _config_sources if re.search(rf"--{name}\b", line)]
    if not named:
        return line
    files = sorted({_config_sources[name] for name in named})
    flags = ", ".join(f"--{name}" for name in named)
    unfound = any(name in _relative_paths and not os.path.exists(_relative_paths[name]) for name in named)
    where = f", whose relative paths are read from the working directory ({os.getcwd()})" if unfound else ""
    return f"{line} ({flags}: from --config {', '.join(files)}{where}; a flag on the command line overrides it)"
