"""One racer of test_claims' race between processes: wait at the barrier, then try to take the folder's lease.

Apart from the test module, so that each spawned racer imports app.storage.lease alone (a few milliseconds), not the
test module with torch and transformers (about 3 s of CPU each).
"""

from pathlib import Path

from app.storage.lease import Held, Lease


def take(folder: str, start) -> str:
    start.wait()
    try:
        Lease.take(Path(folder))
        return "won"
    except Held:
        return "held"
