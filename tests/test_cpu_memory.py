"""CPU allocator tuning: after :func:`aligner.cpu_memory.tune_allocator`, a large tensor comes
from the heap (reused after it is freed) instead of a fresh mmap; without it, glibc maps it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import sys, torch
from aligner.cpu_memory import tune_allocator
if sys.argv[1] == "tune":
    print(tune_allocator("cpu"))
def big_maps():
    out = set()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo >= 48 << 20 and len(parts) < 6:  # anonymous, not [heap]
            out.add(parts[0])
    return out
before = big_maps()
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, above glibc's largest mmap threshold
print("mapped" if big_maps() - before else "heap")
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
@pytest.mark.parametrize("mode", ["tune", "default"])
def test_large_blocks_come_from_the_heap_once_tuned(mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    if mode == "tune":
        if out[0] != "tuned":
            pytest.skip(f"allocator not tunable here: {' '.join(out)}")
        assert out[-1] == "heap"
    else:
        assert out[-1] == "mapped"


def test_opt_out(monkeypatch):
    from aligner import cpu_memory

    monkeypatch.setattr(cpu_memory, "_done", None)
    monkeypatch.setenv("ALIGNER_CPU_MALLOC", "default")
    assert cpu_memory.tune_allocator("cpu").startswith("skipped")
    monkeypatch.delenv("ALIGNER_CPU_MALLOC")
    assert cpu_memory.tune_allocator("cuda").startswith("skipped")
