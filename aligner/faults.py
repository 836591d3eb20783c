"""Fault points, for tests: a crash of either role at a chosen moment, on demand.

An environment variable ``<point>@<N>`` makes the process SIGKILL itself (and every process it
started) when it reaches ``point`` at step ``N``; unset, nothing happens. Each role has its own
variable and points:

- the critic server, :data:`SERVER` (``ALIGNER_SERVER_FAULT_AT``): ``infer@N`` while computing a
  critic_infer when it holds critic step N; ``train@N`` during the critic_train of step id N, after
  the backward, before the optimizer step; ``save@N`` during the critic_save of step N, after its
  shard files are written and before the folder is committed. The server checks the setting at
  start (:meth:`Faults.parse`), so a malformed one is an error there, never silently ignored;
- the actor, :data:`ACTOR` (``ALIGNER_FAULT_AT``): ``mid_step`` after the generation of step N,
  before its critic_train is sent; the others at the named moment of the save of step N. The step
  may be left out (``before_commit``): the point then fires at its first step;
- a rollout worker, :data:`WORKER` (``ALIGNER_ROLLOUT_FAULT_AT``): ``generate@N`` once it has
  the prompts of step N, before it generates them; ``weights@N`` once it is told version N
  follows, before it receives any of it (a worker lost during a push).

How the tests show that a role that dies anywhere resumes exactly, and that a server never comes
back with a critic the actor would take for its own (docs/design.md, "Wire protocol" and
"Checkpoints").
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Faults", "SERVER", "ACTOR", "WORKER"]


@dataclass(frozen=True)
class Faults:
    """One role's fault points and the variable that arms them."""

    env: str
    points: tuple[str, ...]
    step_required: bool = True

    def parse(self, value: str | None) -> tuple[str, int | None] | None:
        """``(point, N)`` of a ``<point>@<N>`` setting (N None for a bare point, where allowed),
        None when unset or empty.

        Raises:
            ValueError: naming the variable, when the setting is not one of :attr:`points`
                with a step.
        """
        if not value:
            return None
        point, sep, at = value.partition("@")
        step, ok = None, point in self.points
        if sep or self.step_required:  # a step is given, or must be
            try:
                step = int(at)
            except ValueError:
                ok = False
        if not ok:
            expected = "<point>@<step>" if self.step_required else "<point>[@<step>]"
            raise ValueError(
                f"{self.env}={value!r}: expected {expected} with a point in {list(self.points)}, "
                f"e.g. {self.points[0]}@3"
            )
        return point, step

    def hit(self, point: str, step: int) -> None:
        """SIGKILL this process and its descendants if ``$<env>`` names ``point`` at ``step`` (or
        at any step when it names none). A setting that does not parse never fires here."""
        try:
            fault = self.parse(os.environ.get(self.env))
        except ValueError:
            return
        if fault is None or fault[0] != point or (fault[1] is not None and fault[1] != int(step)):
            return
        # Children first (Triton and its stubs, an engine's workers): left alive, they would hold
        # the ports and devices a restarted process needs, as they never would after a real crash
        # of the container.
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)


SERVER = Faults("ALIGNER_SERVER_FAULT_AT", ("infer", "train", "save"))
WORKER = Faults("ALIGNER_ROLLOUT_FAULT_AT", ("generate", "weights"))
ACTOR = Faults(
    "ALIGNER_FAULT_AT",
    (
        "mid_step",
        "before_critic_save",
        "after_critic_save",
        "mid_actor_write",
        "before_commit",
        "after_commit",
    ),
    step_required=False,
)


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
