"""Run app/train.py and SIGKILL it at an exact point of checkpointing, as a crash or an OOM killer would.

python tests/workers/kill_during_checkpoint.py published N <train.py flags>   # right after checkpoint N is in place
python tests/workers/kill_during_checkpoint.py staged N <train.py flags>      # mid-write: state saved, not published
python tests/workers/kill_during_checkpoint.py model 1 <train.py flags>       # final model written, not yet moved
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import transformers.modeling_utils  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from app.cli import exit_process  # noqa: E402
from app.storage import checkpoints as checkpoint  # noqa: E402
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


POINTS = {  # point: the call after whose Nth return the run dies
    "published": (checkpoint.Checkpoints, "save"),
    "staged": (Accelerator, "save_state"),
    "model": (transformers.modeling_utils, "safe_save_file"),  # the final model's weights written, not yet in place
}
point, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
die_after_call(*POINTS[point], nth)
exit_process(main(argv))  # as app/train.py ends
