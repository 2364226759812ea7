"""Whether the Hugging Face Hub can be reached, asked once, before the first hub name is looked up.

On an air-gapped machine every lookup of a name that is not a local folder (a typo in a folder's name, or a hub id
not in the cache) waits through huggingface_hub's retries: 25 s for a model's config, minutes for a model's files.
One connection attempt to the hub's host, with a short timeout, tells the same thing at once; the process then runs
in huggingface_hub's offline mode, where a name that is not cached fails without waiting (transformers' and datasets'
own errors then say so). Behind a proxy the attempt would not say anything about the hub, so it is not made.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def before_looking_up(name: str) -> None:
    """Call before a name is looked up by transformers or datasets: a local path needs no hub."""
    if not Path(name).exists():
        _offline_unless_the_hub_answers()


def out_of_reach() -> str | None:
    """Why this process does not ask the hub (for an error about a name it did not find), or None if it does."""
    import datasets.config
    from huggingface_hub import constants

    if not (constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE):
        return None
    return _offline_unless_the_hub_answers() or "offline mode: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set"


@functools.cache
def _offline_unless_the_hub_answers() -> str | None:
    """The hub's address if it did not answer, and the process was put in offline mode; else None."""
    import datasets.config
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXIES):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        constants.HF_HUB_OFFLINE = True  # what transformers and huggingface_hub ask at each lookup
        datasets.config.HF_HUB_OFFLINE = True
        return f"{endpoint.hostname}:{port} did not answer"
    return None
