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
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

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
    operation's header and its arrays.
    """

    def __init__(self, state: ParallelState, lock: threading.Lock) -> None:
        self.state = state
        self._lock = lock
        self._stopped = False
        self._last_op = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        if state.rank == 0 and state.world_size > 1:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="critic-peer-heartbeat", daemon=True
            )
            self._heartbeat.start()

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
        self.broadcast(Op.STOP)

    def _heartbeat_loop(self) -> None:
        while not self._stopped:
            time.sleep(1.0)
            if time.monotonic() - self._last_op < HEARTBEAT_S:
                continue
            with self._lock:
                if self._stopped:
                    return
                self.broadcast(Op.PING)
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
                return
            arrays = tuple(
                self._bcast(torch.empty(shape, dtype=dt)).numpy() for shape, dt in _array_specs(op, b, s)
            )
            yield Received(op, step, arrays)

    # -- both -----------------------------------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send ``t`` to global rank ``dst``."""
        dist.send(t.detach().contiguous().to(comm_device()), dst=dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a ``shape``/``dtype`` tensor from global rank ``src``; on the CPU."""
        t = torch.empty(shape, dtype=dtype, device=comm_device())
        dist.recv(t, src=src)
        return t.cpu()

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 (every rank passes a tensor of the same shape); CPU result."""
        t = t.contiguous().to(comm_device())
        dist.broadcast(t, src=0)
        return t.cpu()
