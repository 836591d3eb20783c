"""No process outlives the test module that started it: every process a module starts (servers,
their Triton and Python-backend stubs, torchrun workers, actor runs) carries the module's mark
in its environment (``ALIGNER_TEST_MODULE``, inherited through every exec and fork), and once
the module's fixtures are torn down none may be left. Those that are, are killed and reported.

Linux only (it reads ``/proc``); elsewhere the check does nothing.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

MARK = "ALIGNER_TEST_MODULE"


def new_mark(module: str) -> str:
    """A mark unique to this run of ``module`` (two pytest sessions never share one)."""
    return f"{module}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def marked(mark: str) -> dict[int, str]:
    """The live processes (not zombies, not this one) whose environment carries ``mark``:
    pid -> their command line."""
    if not os.path.isdir("/proc"):
        return {}
    entry = f"{MARK}={mark}".encode()
    me, found = os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reap(mark: str, grace_s: float = 15.0) -> dict[int, str]:
    """Wait up to ``grace_s`` for the processes carrying ``mark`` to exit (a server's children
    follow it within seconds); SIGKILL those still there. Returns what had to be killed."""
    deadline = time.monotonic() + grace_s
    left = marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked(mark)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left
