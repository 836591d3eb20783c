"""The line from rank 0 of a critic server to its other ranks.

Under ``torchrun --nproc_per_node N ... parallel.tensor_model_parallel_size=TP
parallel.data_parallel_size=DP`` (N = TP x DP) every rank holds a TP shard of the critic (and of
the reward model), in one of DP replicas. Rank 0 owns PyTriton; before each operation it
broadcasts a fixed-size header (op code, batch, length, step) and then the request's arrays
over the default group (gloo on CPU, NCCL on GPUs) to every rank, and the others, waiting in
:meth:`PeerLink.operations`, run their part of the same forward, backward and optimiser step
(each replica its rows of it: :mod:`aligner.critic.replicas`). Requests are validated on rank 0
*before* anything is broadcast, so peers only ever see valid work.

Idle peers would hit the collective timeout, so rank 0 broadcasts a ping every
:data:`HEARTBEAT_S` seconds when nothing else happens. Checkpoint shards and the values of the
other replicas travel point to point (:meth:`PeerLink.send`, :meth:`PeerLink.recv`). In a world
of one nothing is sent.

A hung rank, or a collective that fails, ends the server (:mod:`aligner.critic.liveness`): every
rank beats and watches the others' beats (:class:`~aligner.critic.liveness.PeerWatch`); a peer
that finds a hung rank, or whose collective fails, exits at once; rank 0 records it
(:attr:`PeerLink.lost`), and the server's main loop kills Triton and exits (:func:`~aligner.critic.liveness.end_server`).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from aligner.critic.liveness import PeerWatch, exit_now, fatal_collective
from aligner.distributed import ParallelState, comm_device

__all__ = ["Op", "PeerLink", "Received", "HEARTBEAT_S"]

HEARTBEAT_S = 30.0
"""Seconds without an operation after which rank 0 pings its peers."""

_HEADER = 8  # int64 words: op, b, s, step, and room to grow


class Op(enum.IntEnum):
    """What rank 0 asks its peers to do (the header's first word)."""

    PING = 0
    STOP = 1
    INFER = 2
    TRAIN = 3
    SAVE = 4
    LOAD = 5
    SCORE = 6
    """The reward model's forward on its own tokenizer's ids (a reward model that reads text)."""


def _array_specs(op: Op, b: int, s: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The arrays that follow the header of ``op``, in order."""
    if op in (Op.INFER, Op.SCORE):  # tokens [b, s], lengths [b] (SCORE: the reward tokenizer's ids)
        return [((b, s), torch.int64), ((b,), torch.int64)]
    if op == Op.TRAIN:  # tokens, lengths, then returns, old_values, mask [b, s-1]
        return [((b, s), torch.int64), ((b,), torch.int64)] + [((b, s - 1), torch.float32)] * 3
    return []


@dataclass(frozen=True)
class Received:
    """One operation as a peer receives it.

    Attributes:
        op: what to do.
        step: the train, save or load step (0 otherwise).
        arrays: INFER: tokens ``[b, s]`` int64, lengths ``[b]`` int64; SCORE: the same of the
            reward tokenizer's ids; TRAIN: tokens and lengths, then returns, old_values, mask
            ``[b, s-1]`` float32; empty otherwise.
    """

    op: Op
    step: int
    arrays: tuple[np.ndarray, ...]


class PeerLink:
    """Rank 0's broadcasts to every other rank, and their side of them.

    ``lock`` is the service's: the heartbeat takes it, so a ping never falls between an
    operation's header and its arrays. ``peer_timeout_s``: ``parallel.peer_timeout_s`` (None: no
    watch, for tests that drive ranks by hand).
    """

    def __init__(
        self, state: ParallelState, lock: threading.Lock, peer_timeout_s: float | None = None
    ) -> None:
        self.state = state
        self._lock = lock
        self._stopped = False
        self._last_op = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        self._lost = threading.Event()
        self.lost_reason = ""
        """Rank 0: why the server must end (a hung rank, a failed collective); empty while all is well."""
        self._watch: PeerWatch | None = None
        if state.world_size > 1 and peer_timeout_s is not None:
            self._watch = PeerWatch(state.rank, state.world_size, peer_timeout_s, self.fail)
        if state.rank == 0 and state.world_size > 1:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="critic-peer-heartbeat", daemon=True
            )
            self._heartbeat.start()

    @property
    def lost(self) -> bool:
        """Rank 0: whether a rank was found hung or a collective failed (the server must end)."""
        return self._lost.is_set()

    def fail(self, what: str) -> None:
        """The ranks no longer agree, or one is hung: a peer exits at once (its main thread may
        never return from a collective); rank 0 records ``what`` for the server's main loop."""
        if self.state.rank != 0:
            exit_now(what)
        if not self._lost.is_set():
            self.lost_reason = what
            self._lost.set()

    # -- rank 0 ---------------------------------------------------------------------------------

    def broadcast(self, op: Op, *arrays: np.ndarray, step: int = 0) -> None:
        """Tell the peers to run ``op`` (rank 0, holding the lock); ``arrays`` as :class:`Received`
        lists them, ``b`` and ``s`` taken from the first."""
        if self.state.world_size == 1:
            return
        b, s = arrays[0].shape if arrays else (0, 0)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([int(op), b, s, step])
        self._bcast(header)
        for a in arrays:
            self._bcast(torch.from_numpy(np.ascontiguousarray(a)))

    def touch(self) -> None:
        """An operation just finished: the next ping is due :data:`HEARTBEAT_S` from now."""
        self._last_op = time.monotonic()

    def stop(self) -> None:
        """Release the peers (rank 0, holding the lock): they return from :meth:`operations`."""
        self._stopped = True
        if self._watch is not None:
            self._watch.stop()
        if not self.lost:
            self.broadcast(Op.STOP)

    def _heartbeat_loop(self) -> None:
        while not self._stopped:
            time.sleep(1.0)
            if time.monotonic() - self._last_op < HEARTBEAT_S:
                continue
            with self._lock:
                if self._stopped or self.lost:
                    return
                try:
                    self.broadcast(Op.PING)
                except Exception:  # recorded by _failing: the server's main loop ends it
                    return
                self.touch()

    # -- peers ----------------------------------------------------------------------------------

    def operations(self) -> Iterator[Received]:
        """The operations rank 0 broadcasts, until it stops (ranks > 0); pings are not yielded."""
        while True:
            header = self._bcast(torch.zeros(_HEADER, dtype=torch.int64))
            code, b, s, step = (int(x) for x in header[:4])
            op = Op(code)
            if op == Op.PING:
                continue
            if op == Op.STOP:
                if self._watch is not None:
                    self._watch.stop()
                return
            arrays = tuple(
                self._bcast(torch.empty(shape, dtype=dt)).numpy() for shape, dt in _array_specs(op, b, s)
            )
            yield Received(op, step, arrays)

    # -- both -----------------------------------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send ``t`` to global rank ``dst``."""
        with self._failing(f"a send to rank {dst}"):
            dist.send(t.detach().contiguous().to(comm_device()), dst=dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a ``shape``/``dtype`` tensor from global rank ``src``; on the CPU."""
        t = torch.empty(shape, dtype=dtype, device=comm_device())
        with self._failing(f"a receive from rank {src}"):
            dist.recv(t, src=src)
        return t.cpu()

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 (every rank passes a tensor of the same shape); CPU result."""
        t = t.contiguous().to(comm_device())
        with self._failing("a broadcast from rank 0"):
            dist.broadcast(t, src=0)
        return t.cpu()

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A failed collective (a peer gone, or a wait past ``parallel.timeout_s``) ends the server."""
        try:
            yield
        except Exception as e:
            if fatal_collective(e) and not self._stopped:
                self.fail(f"critic server rank {self.state.rank}: {what} failed: {type(e).__name__}: {e}")
            raise
