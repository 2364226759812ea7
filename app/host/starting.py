"""The seconds before a run's own signal handling, while the libraries import (torch, transformers: 2 to 3 s). A
Ctrl-C there was Python's KeyboardInterrupt traceback, a SIGTERM a silent end; nothing has started, nothing is
written. Imports nothing heavy, so that the entry scripts call it first."""

import os
import signal


def stop_at_once_while_starting() -> None:
    """Until the run's own handlers replace them: a stop is one line and the exit code a stop has (130, 143)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_at_once)


def _stop_at_once(signum: int, frame) -> None:
    if os.environ.get("RANK", "0") == "0":  # one line for a launch of several processes, signalled together
        name = signal.Signals(signum).name
        os.write(2, f"{name} received while starting: stopped before anything was read or written\n".encode())
    os._exit(128 + signum)
