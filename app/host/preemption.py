"""Preemption: SIGTERM and SIGINT ask the run to stop; the ranks agree, checkpoint and exit with 128 + signal.

The handler only sets a flag. The loop reads it after every micro-step and asks the ranks to agree once per
optimizer step (a checkpoint must hold whole optimizer steps), on a CPU process group so that the check never waits
on the GPU. Repeated signals change nothing: launchers such as torchrun forward a signal the workers already got,
and that must not cut the checkpoint short. SIGKILL stops a run at once.
"""

from __future__ import annotations

import signal

from app.host.runtime import HostCollective

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, host: HostCollective):
        self.signum = 0
        self.host = host
        self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}

    def _handle(self, signum: int, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The signal that any rank received (0 if none). Collective when there are several processes."""
        return self.host.max(self.signum)

    def exit_code(self, signum: int) -> int:
        return 128 + signum

    def restore(self) -> None:
        """Put the previous handlers back; safe to call more than once."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
