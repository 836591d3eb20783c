"""Whether every rank of a critic server is alive, and what the server does when one is not.

A rank that hangs (stopped, stuck holding the GIL, its node frozen or swapping) does not die, so
torchrun sees nothing: rank 0 waits for it in the next collective until the collective timeout
(``parallel.timeout_s``), every actor waits on rank 0, and a request that arrives meanwhile
queues behind the lock. So every rank beats: a thread of its own adds 1 to the rank's counter in
the process group's store every few seconds, whatever the rank's main thread does, and reads the
others' counters. A counter that has not moved for ``parallel.peer_timeout_s`` names a hung rank.
The store is the rendezvous store (torchrun's agent, or rank 0's), so no collective is needed,
and nothing has to be agreed on at shutdown: a rank that stops beating is one that has stopped
watching too.

What a finding leads to (:meth:`aligner.critic.peers.PeerLink.fail`):

- **rank 0** kills Triton (:func:`end_server`), so the actors' connections end at once (their
  retries find the restarted server and take it as a restart,
  :class:`~aligner.wire.errors.CriticRestartedError`: a roll-back), and exits 1 without saving:
  its peers may be mid-step;
- **any other rank** exits 1 at once (it holds nothing a restart needs);

and torchrun then stops the rest (SIGKILL reaches a stopped process) and exits non-zero, for the
supervisor (a Kubernetes restart policy, a SLURM requeue, a loop) to start the server again from
its last checkpoint. A collective of the server's main group that fails (a peer gone, or one that
waited ``parallel.timeout_s``) is taken the same way (:func:`fatal_collective`): after it, the
ranks no longer agree on what they hold.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from aligner.critic.host import descendants

__all__ = ["PeerWatch", "beat_interval", "end_server", "exit_now", "fatal_collective"]

log = logging.getLogger(__name__)

_PREFIX = "aligner/critic/liveness"


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: often enough that a hung rank is named within ``timeout_s`` plus one
    beat, seldom enough to cost nothing (at most every 5 s)."""
    return max(0.05, min(5.0, timeout_s / 4))


def fatal_collective(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (or store call) of torch.distributed: a peer gone,
    or a wait past the group's timeout, after which the ranks no longer agree."""
    return isinstance(exc, dist.DistError)


class PeerWatch:
    """Every rank's beat, and its watch on the others' (one daemon thread per rank).

    Args:
        rank, world_size: this rank and the server's world.
        timeout_s: ``parallel.peer_timeout_s``.
        on_lost: called once, from the watch thread, with what was found (a sentence naming the
            rank and how long it has been silent); then the watch ends.
        store: where the counters live (default: the default process group's store).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_lost: Callable[[str], None],
        store: dist.Store | None = None,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.beat_s = beat_interval(timeout_s)
        self._on_lost = on_lost
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(_PREFIX, base)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="critic-peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and watching (a clean shutdown; the others stop watching as they leave)."""
        self._stopped.set()

    def _run(self) -> None:
        last = time.monotonic()
        seen = {r: (-1, last) for r in range(self.world_size) if r != self.rank}
        while not self._stopped.wait(self.beat_s):
            try:
                self._store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                # This rank itself did not run for a while (it was the one stopped, or the whole
                # machine was): the others' silence is not theirs to answer for, so they get a new
                # window rather than the blame.
                paused, last = now - last > self.timeout_s / 2, now
                for r, (count, _) in seen.items():
                    c = self._store.add(f"beat/{r}", 0)  # a read that never blocks
                    if c != count or paused:
                        seen[r] = (c, now)
                silent = {r: now - since for r, (_, since) in seen.items() if now - since > self.timeout_s}
            except Exception as e:  # the store's host (torchrun's agent, or rank 0) is gone or hung
                if not self._stopped.is_set():
                    self._lose(f"the process group's store stopped answering: {type(e).__name__}: {e}")
                return
            if silent and not self._stopped.is_set():
                named = ", ".join(f"rank {r} ({s:.1f} s)" for r, s in sorted(silent.items()))
                self._lose(
                    f"critic server rank {self.rank}: no sign of life from {named}, past "
                    f"parallel.peer_timeout_s={self.timeout_s:g}: a hung rank"
                )
                return

    def _lose(self, what: str) -> None:
        self._stopped.set()
        self._on_lost(what)


def end_server(what: str) -> NoReturn:
    """Rank 0's end after :attr:`PeerLink.lost`: SIGKILL its descendants (Triton and its
    Python-backend stubs: a graceful stop would wait for the request blocked in a collective), so
    that every client's connection ends at once, then :func:`exit_now`. Nothing is saved: the
    peers may be mid-step."""
    log.error("%s: killing Triton", what)
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    exit_now(what)


def exit_now(what: str, code: int = 1) -> NoReturn:
    """Log ``what``, flush the logs and leave at once (a rank whose peers are hung or gone: its
    main thread may be blocked in a collective that never returns)."""
    log.error("%s; exiting (%d) so that the server is restarted from its last checkpoint", what, code)
    logging.shutdown()
    os._exit(code)
