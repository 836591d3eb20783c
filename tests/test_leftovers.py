"""The leftover-process check of tests/conftest.py finds what a module left running, through
every exec and a new session, and kills it; it leaves alone what carries another mark."""

from __future__ import annotations

import os
import subprocess
import sys

import _leftovers
import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

SLEEPER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)",
]


def test_a_left_process_and_its_child_are_found_and_killed():
    mark = _leftovers.new_mark("demo")
    other = _leftovers.new_mark("other")
    mine = subprocess.Popen(SLEEPER, env={**os.environ, _leftovers.MARK: mark}, start_new_session=True)
    theirs = subprocess.Popen(SLEEPER, env={**os.environ, _leftovers.MARK: other}, start_new_session=True)
    try:
        for _ in range(100):  # the grandchild starts a moment later
            if len(_leftovers.marked(mark)) == 2:
                break
            subprocess.run(["sleep", "0.1"])
        found = _leftovers.marked(mark)
        assert len(found) == 2 and mine.pid in found
        killed = _leftovers.reap(mark, grace_s=0.5)
        assert set(killed) == set(found)
        mine.wait(10)
        for _ in range(100):  # a SIGKILLed process is gone once the kernel has run its exit
            if not _leftovers.marked(mark):
                break
            subprocess.run(["sleep", "0.1"])
        assert _leftovers.marked(mark) == {}
        assert theirs.pid in _leftovers.marked(other) and theirs.poll() is None
    finally:
        _leftovers.reap(mark, grace_s=0)
        _leftovers.reap(other, grace_s=0)
        theirs.wait(10)
