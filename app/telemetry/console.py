"""What the libraries print on the console besides the app's own lines: their routine notices stay out of it unless
--verbose asks for them. What matters in them the app says itself, once: which weights a checkpoint lacked and were
made at random, such as a new classification head (app/inputs/model.py, load_weights).

The notices, each picked by its logger and the function that logs it, not by its wording:
- transformers' load report: a table after a from_pretrained that had to create or drop weights;
- Accelerate's "Removed shared tensor ... while saving": at every checkpoint of a model with tied weights (SmolLM2's
  embeddings and LM head are one tensor, saved once and tied again when loaded), a note that asks to look for a
  warning at reload which never comes;
- transformers' FutureWarning that `is_gradient_checkpointing` is deprecated, raised when peft probes that attribute
  each time it puts adapters on a model (a library's call, not the user's).
"""

from __future__ import annotations

import logging
import re
import warnings

ROUTINE_NOTICES = {
    ("transformers.modeling_utils", "log_state_dict_report"),
    ("accelerate.utils.other", "clean_state_dict_for_safetensors"),
}


class RoutineNotices(logging.Filter):
    """Drops the records of ROUTINE_NOTICES; a filter on the logger that makes a record, so nothing downstream sees
    it (neither a handler of the library's nor one of the root logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.name, record.funcName) not in ROUTINE_NOTICES


# Python warnings, by category and the start of their message (what warnings.filterwarnings matches).
ROUTINE_WARNINGS = ((FutureWarning, re.escape("`is_gradient_checkpointing` is deprecated")),)

_ROUTINE = RoutineNotices()


def show_library_notices(verbose: bool) -> None:
    """Keep the libraries' routine notices out of this process's console, or with `verbose` let them through. Each
    entry point calls it once with its flag; calling it again (tests run several entries in one process) replaces
    the earlier choice."""
    for name in {logger for logger, _ in ROUTINE_NOTICES}:
        logger = logging.getLogger(name)
        if verbose:
            logger.removeFilter(_ROUTINE)
        else:
            logger.addFilter(_ROUTINE)  # a no-op when it is there already
    for category, message in ROUTINE_WARNINGS:  # the newer filter goes first and wins; "default" is Python's own
        warnings.filterwarnings("default" if verbose else "ignore", message=message, category=category)


def show_progress_bars(show: bool) -> None:
    """transformers' weight-loading bar and datasets' tokenizing bars follow --disable_tqdm, as the app's own bars
    do (a log file gets none). Each entry point calls it once (tests run several entries in one process); the other
    ranks of a launch hide them anyway (host/runtime.py)."""
    import datasets
    from transformers.utils import logging as transformers_logging

    (transformers_logging.enable_progress_bar if show else transformers_logging.disable_progress_bar)()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
