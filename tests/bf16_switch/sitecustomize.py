"""Tests only: in a child process, force the app's bf16 probe as tests/conftest.py does in the test process.

tests/conftest.py's clean_env puts this folder first on PYTHONPATH when AMP_TRAINER_TEST_BF16 is 0 or 1, so Python
runs this file at start-up, before the app's code. The app itself has no hook for it.
"""

import os

if os.environ.get("AMP_TRAINER_TEST_BF16") in ("0", "1"):
    import app.amp.policy

    _NATIVE = os.environ["AMP_TRAINER_TEST_BF16"] == "1"
    app.amp.policy.cpu_has_native_bf16 = lambda: _NATIVE
