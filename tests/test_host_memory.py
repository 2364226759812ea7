"""Large freed blocks stay with the process (app/host/memory.py): a step's reallocation faults no page in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from app.host.memory import keep_freed_memory
from tests.conftest import ROOT

# 64 MiB, above glibc's largest automatic mmap threshold (32 MiB): 16,384 pages of 4 KiB to fault in on each new map.
FAULTS_PER_BLOCK = """
import resource, sys, torch
from app.host.memory import keep_freed_memory

def faults_per_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(16 << 20)  # allocated, written, freed: a step's gradient
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

faults_per_block()  # the first block of either kind faults in wherever it comes from
plain = faults_per_block()
kept = keep_freed_memory()
for _ in range(4):  # the heap settles: the first freed blocks sit below small objects allocated after them
    faults_per_block()
print(plain, kept, faults_per_block())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_BLOCK], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    plain, kept, after = out.stdout.split()
    assert kept == "True"
    assert float(plain) > 10_000, "each 64 MiB block should have been a fresh map"
    assert float(after) < 500, "the freed block should have been reused"


@pytest.mark.parametrize("tunable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"])
def test_the_users_malloc_tunables_win(monkeypatch, tunable):
    monkeypatch.setenv(tunable, "glibc.malloc.mmap_threshold=65536" if tunable == "GLIBC_TUNABLES" else "65536")
    assert keep_freed_memory() is False
