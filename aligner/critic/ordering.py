"""critic_infer after critic_train: the critic step an infer's values must come from, and the
bounded wait for it (docs/design.md, "Wire protocol" and "The server's replicas and its batching").

Every data-parallel rank of an actor sends its own ``critic_infer``, but only one of them sends
``critic_train``; so an infer of step N+1 from another rank may reach the server before the train
of step N is applied. Each infer therefore names ``after_step``: the critic step its values must
come from (the step of the last critic_train its run sent, or of the load it had the server do).
:class:`StepGate` holds the rule, on rank 0 under the service's lock (where the critic step is
known: rank 0 applies every train and load before its peers follow, so every replica holds the
step rank 0 holds whenever a forward is broadcast):

- the server holds the step asked (or the request asks for
  :data:`~aligner.wire.protocol.ANY_CRITIC_STEP`): the forward runs at once, in the same hold of
  the lock as the check, so no train slips in between;
- it holds an earlier step: the train of the step asked has not been applied yet. The request
  waits on a condition of the service's lock, which is released while it waits (the train, on
  PyTriton's critic_train thread, takes the lock and applies the step), woken whenever a train is
  applied, a checkpoint is loaded or the service closes; after ``server.infer_wait_s`` it fails
  with :class:`StepWaitError`, naming both steps and the wait;
- it holds a later step: the values of the step asked are gone (the server has applied a train
  past it), and values of another step would differ from the other ranks' values of the same
  step. Refused with a :class:`~aligner.wire.protocol.ProtocolError` on ``after_step`` naming
  both steps: a caller that lost track of its own trains, or a second writer.

Requests Triton merged into one execution may ask different steps: each is computed as soon as
the server holds its step (the ready ones first), so each gets the values of its own step; the
execution answers when the last is computed or has failed, so a ready request merged with a
waiting one waits at most ``server.infer_wait_s``. While one execution waits, Triton queues the
next critic_infer requests (one execution of a model at a time); waiting holds nothing beyond the
execution's own checked requests, each within the ``limits`` and ``server.max_batch_size``.

Before any of that, a request that names the server instance its caller works with
(``instance_id``) is checked against this process's: a server that was restarted between two
requests (the client's channel reconnects without a failed request) holds an older step, and
the request would wait for a train that never comes. It is refused at once instead
(:func:`other_instances`), fenced, alone: the requests merged with it go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from aligner.critic.errors import CriticServiceError, ServiceClosedError
from aligner.critic.security import RefusalLog
from aligner.wire.protocol import ANY_CRITIC_STEP, INFER, InferRequest, OtherInstanceError, ProtocolError

__all__ = ["StepGate", "StepWaitError", "step_passed", "other_instances"]

log = logging.getLogger("aligner.critic")
_refusals = RefusalLog(log)  # a peer sends what it likes: one line a minute, counted


def other_instances(requests: Sequence[InferRequest], instance_id: str) -> list[Exception | None]:
    """Per request: its refusal when it names another server instance than ``instance_id`` (this
    process's), else None (it names this one, or none)."""
    out: list[Exception | None] = []
    for r in requests:
        if r.instance_id is None or r.instance_id == instance_id:
            out.append(None)
            continue
        out.append(OtherInstanceError(INFER, r.instance_id, instance_id))
        _refusals.refused(INFER, out[-1])
    return out


class StepWaitError(CriticServiceError):
    """The critic step a critic_infer asked for was not applied within ``server.infer_wait_s``."""

    def __init__(self, asked: int, held: int, waited_s: float, wait_s: float) -> None:
        self.asked, self.held, self.waited_s = int(asked), int(held), float(waited_s)
        super().__init__(
            f"{INFER} needs critic step {self.asked} applied; the server holds critic step {self.held} "
            f"after waiting {self.waited_s:.1f} s (server.infer_wait_s={wait_s:g}): the critic_train of "
            f"step {self.asked} has not arrived or is still running (a longer one needs a larger "
            "server.infer_wait_s), or the server was restarted or rolled back since it was sent"
        )


def step_passed(asked: int, held: int) -> ProtocolError:
    """The refusal of a critic_infer that asks for critic step ``asked`` when the server holds the
    later step ``held``."""
    return ProtocolError(
        INFER,
        "after_step",
        f"the critic step this server holds ({held}), a later one (it waits for its train), or "
        f"{ANY_CRITIC_STEP} for any",
        f"after_step={asked}: the server has applied critic steps past it and holds critic step "
        f"{held}, so the values of critic step {asked} are gone (a caller that lost track of its own "
        "critic_train requests, or another writer training this server?)",
    )


class StepGate:
    """The wait of critic_infer requests for their critic step, on rank 0.

    Args:
        lock: the service's lock (held by every caller of :meth:`serve` and :meth:`moved`).
        wait_s: how long a request waits for its step (``server.infer_wait_s``).
    """

    def __init__(self, lock: threading.Lock, wait_s: float) -> None:
        self._changed = threading.Condition(lock)
        self.wait_s = float(wait_s)
        self.waiting = 0
        """Requests waiting for their step now."""
        self.waited = 0
        """Requests that waited for their step (served, or failed after the wait) since start-up."""
        self.waited_s = 0.0
        """Seconds those requests waited, together."""
        self.timed_out = 0
        """Requests that failed with :class:`StepWaitError`."""
        self.passed = 0
        """Requests refused because the server held a later step."""

    def moved(self) -> None:
        """The critic step held changed (a train applied, a checkpoint loaded) or the service is
        closing: every waiting request looks again. The caller holds the lock."""
        self._changed.notify_all()

    def serve(
        self,
        asked: Mapping[int, int],
        held: Callable[[], int],
        run: Callable[[int], None],
        closed: Callable[[], bool],
    ) -> dict[int, Exception]:
        """Run ``run(i)`` for each request ``i`` of ``asked`` (request -> the critic step it asks
        for) while the server holds that step (``held()``), each as soon as it does; the caller
        holds the lock, which is released only while waiting.

        Returns:
            request -> its error, for the requests not run: :class:`StepWaitError` (the step did
            not come within :attr:`wait_s`) or the refusal of :func:`step_passed`.

        Raises:
            ServiceClosedError: the service closed while requests waited.
        """
        errors: dict[int, Exception] = {}
        todo = dict(asked)
        start = time.monotonic()
        counted = 0  # of this call's requests in `waiting`
        try:
            while True:
                now = held()
                later = {}
                for i, step in todo.items():
                    if step == ANY_CRITIC_STEP or step == now:
                        run(i)
                    elif step < now:
                        errors[i] = step_passed(step, now)
                        self.passed += 1
                    else:
                        later[i] = step
                todo = later
                if not todo:
                    return errors
                left = start + self.wait_s - time.monotonic()
                if left <= 0:
                    for i, step in todo.items():
                        errors[i] = StepWaitError(step, now, time.monotonic() - start, self.wait_s)
                    self.timed_out += len(todo)
                    return errors
                if not counted:
                    self.waited += len(todo)
                self.waiting += len(todo) - counted
                counted = len(todo)
                self._changed.wait(left)
                if closed():
                    raise ServiceClosedError()
        finally:
            if counted:
                self.waiting -= counted
                self.waited_s += time.monotonic() - start

    def stats(self) -> dict[str, float | int]:
        """What ``server_info`` shows of the waits (``extra``'s ``infer_after_step``)."""
        return {
            "infer_wait_s": self.wait_s,
            "waiting": self.waiting,
            "waited": self.waited,
            "waited_s": round(self.waited_s, 3),
            "timed_out": self.timed_out,
            "refused_passed": self.passed,
        }
