"""Preemption: SIGTERM and SIGINT ask the run to stop; the ranks agree, checkpoint and exit with 128 + signal.

The handler only sets a flag. The loop reads it after every micro-step and asks the ranks to agree once per
optimizer step (a checkpoint must hold whole optimizer steps), on a CPU process group so that the check never waits
on the GPU. Repeated signals change nothing: launchers such as torchrun forward a signal the workers already got,
and that must not cut the checkpoint short. SIGKILL stops a run at once. The first signal is acknowledged at once on
the main process: a step on a slow CPU can take minutes, and a silent run looks hung.
"""

from __future__ import annotations

import contextlib
import os
import signal

from accelerate.utils import compare_versions

from app.host.runtime import HostCollective

HANDLED = (signal.SIGTERM, signal.SIGINT)
ACKNOWLEDGED = "stopping after the step or save in progress, then checkpointing (SIGKILL would stop at once)"
# Before the first step there is nothing to checkpoint, and a process of the run lost while it loads leaves no way to.
ACKNOWLEDGED_WHILE_LOADING = "stopping before training starts, nothing trained yet (SIGKILL would stop at once)"
# Once training has ended there is no step left to stop after: the saves and the final evaluation run to their end.
ACKNOWLEDGED_AFTER_TRAINING = "letting the final save and evaluation finish, then stopping (SIGKILL would stop at once)"
LAUNCHER_GRACE_S = 5  # accelerate launch's, with one process


def killed_after_grace() -> bool:
    """Whether this is the one process of `accelerate launch` 1.16 or later, which passes a SIGTERM or Ctrl-C on as
    SIGTERM and kills the process 5 s later, whatever it is doing (torchrun's agent, for several processes, waits 30 s).

    That launcher, alone of accelerate's, sets ACCELERATE_USE_CPU (which users export too, so its dynamo settings as
    well) and no rank; under its mpirun path accelerate's own set-up has written LOCAL_RANK by the time this runs."""
    launched = all(name in os.environ for name in ("ACCELERATE_USE_CPU", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"))
    if not launched or "LOCAL_RANK" in os.environ:
        return False
    return compare_versions("accelerate", ">=", "1.16.0")


class StopRequest:
    def __init__(self, host: HostCollective, announce: bool = True, loading: bool = False):
        self.signum = 0
        self.host = host
        self.announce = announce  # the main process only: one line per run, not one per rank
        self.killed_after_grace = killed_after_grace()
        self.acknowledged = ACKNOWLEDGED_WHILE_LOADING if loading else ACKNOWLEDGED  # until training_starts()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}

    @classmethod
    def for_run(cls, accelerator, loading: bool = False) -> StopRequest:
        """The run's handler: collective over its processes, acknowledged by the main one. `loading`: installed
        before the run loads, so acknowledged as stopping before training starts until training_starts()."""
        return cls(HostCollective(accelerator.num_processes), announce=accelerator.is_main_process, loading=loading)

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            return
        # Kept before anything that calls out: a second signal's handler can run inside this one (Ctrl-C pressed
        # twice), and it acknowledged the stop a second time while the first still wrote its line.
        self.signum = signum
        if self.announce:
            # os.write, not print: the handler may have interrupted a print to the same stream.
            line = f"{signal.Signals(signum).name} received: {self.acknowledged}"
            if self.killed_after_grace:
                line += (  # its own handler of a second Ctrl-C kills the process tree without waiting
                    f"; if it came through accelerate launch, that kills this process {LAUNCHER_GRACE_S} s after it, "
                    "or at once on a second Ctrl-C"
                )
            with contextlib.suppress(OSError):  # a reader that went away must not turn the signal into a crash
                os.write(2, f"{line}\n".encode())

    def agreed(self) -> int:
        """The signal that any rank received (0 if none). Collective when there are several processes."""
        return self.host.max(self.signum)

    def exit_code(self, signum: int) -> int:
        return 128 + signum

    def training_line(self) -> str:
        """The line printed once training starts, with the launcher's limit where it has one."""
        line = "training: SIGTERM or Ctrl-C saves a checkpoint, then stops"
        if self.killed_after_grace:
            line += (
                f"; accelerate launch kills this process {LAUNCHER_GRACE_S} s after passing a signal on, so for a step "
                f"and save that take longer, signal this process alone: kill -TERM {os.getpid()}"
            )
        return line

    def training_starts(self) -> None:
        """Called before the last check for a signal that came while loading: one from here on is caught by the loop
        after a step, which it checkpoints."""
        self.acknowledged = ACKNOWLEDGED

    def training_ended(self) -> None:
        """From here on a signal stops the run after the final save and evaluation, which are let finish."""
        self.acknowledged = ACKNOWLEDGED_AFTER_TRAINING

    def ending(self) -> None:
        """The run ends now without a checkpoint (another process is gone): a signal from here on is not acknowledged,
        since the acknowledgment promises one."""
        self.announce = False

    def restore(self, ignore: bool = False) -> None:
        """Put the previous handlers back; safe to call more than once. `ignore`: see give_back."""
        give_back(self._previous, ignore)


def give_back(previous: dict, ignore: bool = False) -> None:
    """Put the handlers a run found back (signal number: handler). `ignore`: ignore the signals instead, where the
    process ends with the run: given back to Python's handler, a Ctrl-C more was a KeyboardInterrupt in the process's
    end (a finalizer, atexit) and a traceback after the stop's one line."""
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_IGN if ignore else handler)
