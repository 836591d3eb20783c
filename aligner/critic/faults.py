"""Fault points of the critic server, for tests: a crash at a chosen moment, on demand.

``ALIGNER_SERVER_FAULT_AT=<point>@<N>`` makes the server SIGKILL itself (and the Triton processes
it started) at one of :data:`FAULT_POINTS`:

- ``infer@N``: while computing a critic_infer when it holds critic step N;
- ``train@N``: during the critic_train of step id N, after the backward, before the optimizer step;
- ``save@N``: during the critic_save of step N, after its shard files are written and before the
  folder is committed.

How the tests show that a server that dies anywhere never comes back with a critic the actor
would take for its own (docs/design.md, "Wire protocol"). Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["FAULT_ENV", "FAULT_POINTS", "parse_fault", "fault_point"]

FAULT_ENV = "ALIGNER_SERVER_FAULT_AT"
FAULT_POINTS = ("infer", "train", "save")


def parse_fault(value: str | None) -> tuple[str, int] | None:
    """``(point, N)`` of a ``<point>@<N>`` setting, None when unset or empty.

    Raises:
        ValueError: naming the variable, when the setting is not one of :data:`FAULT_POINTS`
            with a step.
    """
    if not value:
        return None
    point, _, at = value.partition("@")
    try:
        step = int(at)
    except ValueError:
        step = None
    if point not in FAULT_POINTS or step is None:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected <point>@<step> with a point in {list(FAULT_POINTS)}, "
            "e.g. train@3"
        )
    return point, step


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process and its descendants if ``$ALIGNER_SERVER_FAULT_AT`` is ``point@step``.

    The server checks the setting at start (:func:`parse_fault`), so a malformed one never gets
    here silently."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    try:
        fault = parse_fault(want)
    except ValueError:
        return
    if fault == (point, int(step)):
        # Triton and its Python-backend stubs first: left alive, they would hold the ports a
        # restarted server needs, as they never would after a real crash of the container.
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """The pids of every process below ``root`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
