"""Run app/train.py and SIGKILL it at an exact point of checkpointing, as a crash or an OOM killer would.

python tests/workers/kill_during_checkpoint.py published N <train.py flags>   # right after checkpoint N is in place
python tests/workers/kill_during_checkpoint.py staged N <train.py flags>      # mid-write: state saved, not published
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator  # noqa: E402

from app import checkpoint  # noqa: E402
from app.train import main  # noqa: E402


def die_after_call(owner, name: str, nth: int) -> None:
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapper)


point, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
die_after_call(
    checkpoint.Checkpoints if point == "published" else Accelerator,
    "save" if point == "published" else "save_state",
    nth,
)
sys.exit(main(argv))
