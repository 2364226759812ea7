"""The ways a run ends early, each with its exit code.

`train.py` turns these into one line on stderr and the exit code; anything else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """Bad input (flag, file, column, label, config). Raised before heavy work; exit code 2."""

    exit_code = 2


class TrainingHalted(Exception):
    """Training stopped on purpose: a numeric fault, a collapsed loss scale or a signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


NUMERIC_FAULT_EXIT_CODE = 3


class DiskFull(TrainingHalted):
    """A checkpoint or the final model did not fit on the disk; the previous checkpoint is intact. Exit code 4."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=4)


def first_line(error: BaseException) -> str:
    """The first line of an error's message, for a one-line report; its type name when the message is empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
