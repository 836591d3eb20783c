"""Which rollout workers are in a trainer's run (:class:`~aligner.actor.rollout_workers.RolloutWorkers`
is one): the listeners on their channels, a worker lost (the run stops, or the others go on in
channels of a new epoch and take over what it owed), a worker that asks to join the run under way
(admitted in place of one the run lost), and the errors that name them (docs/design.md,
"Rollout workers").

Every method here runs on the trainer's rank 0, on the state :class:`RolloutWorkers` keeps: the
workers in the run (``alive``, in channel order), the current channels (``links``) and earlier
ones (``retired``), the inbox the listeners fill, the shares asked for (``asked``) and the
version last pushed (``pushed``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from aligner.generation.remote import RolloutLinks
from aligner.peer_group import recv_message, send_message

__all__ = ["RolloutWorkerError", "WorkerMembership", "differences"]


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed, went away, or did not answer in time: the run stops."""


def differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: trainer <ours>, worker <theirs>`` for every (nested) key whose values differ."""
    out = []
    for k, v in ours.items():
        w = theirs.get(k) if isinstance(theirs, dict) else None
        if isinstance(v, dict) and isinstance(w, dict):
            out += differences(v, w, f"{prefix}{k}.")
        elif v != w:
            out.append(f"{prefix}{k}: trainer {v!r}, worker {w!r}")
    return out


class WorkerMembership:
    """The membership half of :class:`~aligner.actor.rollout_workers.RolloutWorkers` (a mixin: it
    uses that class's state and its ``_finish``, ``_use``, ``_send_ask`` and ``_accept``)."""

    def _listen_all(self) -> None:
        """A listener thread for every worker on the current channels."""
        for g, w in enumerate(self.alive, start=1):
            t = threading.Thread(
                target=self._listen,
                args=(w, self.links, g),
                name=f"rollout-{w}.{self.links.epoch}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def _rank(self, w: int) -> int:
        """Worker ``w``'s rank in the current channels."""
        return self.alive.index(w) + 1

    def _await_gone(self, w: int) -> None:
        """Worker ``w`` failed a send: wait for its listener to see it go (what it sent before
        comes first), at most ``rollout.timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while w in self.alive:
            try:
                got = self._inbox.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise RolloutWorkerError(
                    f"rollout worker {w} cannot be reached and did not go away"
                ) from None
            self._accept(*got)

    def _lose(self, w: int, why: str) -> None:
        """Worker ``w`` went away: the run stops (``rollout.on_worker_loss=stop``, or when it was
        the last), or the others meet again in channels of a new epoch and what ``w`` owed is
        asked of them, from the newest version they hold (the version it was asked at for k = 0:
        the same rollouts; for k >= 1 a batch it owed from an older one comes back less stale)."""
        if self._closing or w not in self.alive:
            return
        # A push in flight first: if it met the loss, its error is the run's (as without overlap);
        # if it went through, the regroup may replace its channels (its asks sent again may have
        # met the loss and regrouped already).
        self._finish()
        if w not in self.alive:
            return
        if self.on_loss != "continue" or len(self.alive) == 1:
            last = " and it was the last one" if self.on_loss == "continue" else ""
            raise RolloutWorkerError(f"rollout worker {w} {why}{last}")
        owed = sorted(key for key, (_, owner) in self.asked.items() if owner == w)
        left = [other for other in self.alive if other != w]
        print(
            f"rollout: worker {w} {why}; going on with worker(s) {left} "
            f"(rollout.on_worker_loss=continue), asking them for {len(owed)} share(s) it owed",
            flush=True,
        )
        self._regroup(left, {}, f"regrouping after worker {w} was lost")
        self.regenerated += len(owed)
        for key in owed:
            self._send_ask(key, self.pushed)

    def _admit(self) -> bool:
        """Workers that asked to join since the last look, each in place of one the run lost
        (rank 0, at a push): they and the others meet in channels of a new epoch. True when any
        joined: the others then forget their version, and the push goes to all of them."""
        requests = self.joins.new()
        if not requests:
            return False
        self._poll()  # the losses seen so far come first
        members, joining = set(self.alive), {}
        for ticket, req in requests:
            w = req.get("rank")
            differ = differences(self.identity, req.get("identity") or {})
            why = None
            if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= self.n:
                why = f"worker rank {w!r} is not one of 1..rollout.workers ({self.n})"
            elif w in members:
                why = f"worker {w} is in the run"
            elif differ:
                why = f"it serves something else than this trainer's policy: {'; '.join(differ)}"
            if why is not None:
                self.joins.answer(ticket, {"refused": why})
                print(f"rollout: refused a worker asking to join as worker {w!r}: {why}", flush=True)
                continue
            members.add(w)
            joining[w] = ticket
        if not joining:
            return False
        stayed = list(self.alive)
        self._regroup(sorted(members), joining, f"admitting worker(s) {sorted(joining)}")
        with self._reaching("resetting the workers' versions for the newcomers"):
            for other in stayed:
                send_message(self.links.commands, self._rank(other), {"op": "reset"})
        print(f"rollout: worker(s) {sorted(joining)} joined; {len(self.alive)} worker(s)", flush=True)
        return True

    def _regroup(self, members: list[int], joining: dict[int, int], what: str) -> None:
        """Move the run to channels of a new epoch among ``members`` (worker ids, in channel
        order): the workers that stay are told on the current channels (``regroup``), each of
        ``joining`` (worker -> its request's ticket) in the answer to its request."""
        epoch = self.links.epoch + 1
        ranks = {w: i for i, w in enumerate(members, start=1)}
        with self._reaching(what):
            for w in self.alive:
                if w in ranks:
                    meta = {"op": "regroup", "epoch": epoch, "rank": ranks[w], "workers": len(members)}
                    send_message(self.links.commands, self._rank(w), meta)
            for w, ticket in joining.items():
                self.joins.answer(ticket, {"epoch": epoch, "rank": ranks[w], "workers": len(members)})
            self.retired.append(self.links)  # kept: a group is not torn down under a peer that died
            self.alive = list(members)
            self._use(
                RolloutLinks(
                    self.rcfg, 0, self.backend, epoch=epoch, workers=len(members), store=self.links.store
                )
            )
        self._listen_all()

    @contextlib.contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """A worker that went away (a send or the push failed) stops the run, with what came from
        the workers first (a worker's own error says more than the broken connection)."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, RolloutWorkerError):
                raise
            said = self._said()
            during = " (a worker lost during a push or a regroup stops the run whatever rollout.on_worker_loss says)"
            during = during if self.on_loss == "continue" else ""
            raise RolloutWorkerError(f"{what} failed: a rollout worker went away ({e}){said}{during}") from e

    def _said(self) -> str:
        """What the workers sent that was not a rollout, as a suffix for an error."""
        notes = []
        while True:
            try:
                w, meta, _ = self._inbox.get(timeout=1.0)
            except queue.Empty:
                return "".join(f"; worker {w}: {m}" for w, m in notes)
            if meta.get("op") != "rollout":
                notes.append((w, meta.get("message", meta)))

    def _listen(self, w: int, links: RolloutLinks, rank: int) -> None:
        """Worker ``w``'s messages on ``links`` (where it is ``rank``) into the inbox, until it
        goes away or moves to the channels of a new epoch."""
        while True:
            try:
                meta, tensors = recv_message(links.rollouts, rank)
            except RuntimeError as e:
                if not self._closing:
                    self._inbox.put((w, {"op": "gone", "message": f"went away ({e})"}, {}))
                return
            if meta.get("op") == "regrouped":
                return
            self._inbox.put((w, meta, tensors))
