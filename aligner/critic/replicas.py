"""The data-parallel replicas of a critic server: which rank is which, how a batch's rows are
split between the replicas, and how their values come back to rank 0.

Under ``torchrun --nproc_per_node TP*DP -m aligner.critic.server
parallel.tensor_model_parallel_size=TP parallel.data_parallel_size=DP`` the world is DP replicas
of the critic, each a TP group holding the whole critic in TP shards. One PyTriton front end, on
global rank 0, serves them all: one address, one exactly-once ledger, one run token, so a client
sees nothing of the replicas. Rank 0 broadcasts every operation to every rank
(:mod:`aligner.critic.peers`); each replica then takes its own rows (:func:`row_slices`):

- ``critic_infer``: replica ``r`` runs the forward of its contiguous slice of the (merged)
  batch, and its TP rank 0 sends the values (and reward-model scores) to global rank 0, which
  puts them back in row order (:meth:`Replicas.forward`); a reward model that reads text gets
  a second forward of its own tokenizer's ids, split the same way (:meth:`Replicas.score`);
- ``critic_train``: each replica computes the gradients of its share of every minibatch, and
  the gradients are summed over the replicas weighted by their share of the minibatch's loss
  (:class:`~aligner.critic.value_update.ValueUpdate`), so every replica takes the step the whole
  minibatch gives at DP=1 and the replicas stay identical;
- save and load: the replicas hold the same weights and optimizer state, so replica 0's TP
  shards are the checkpoint (:mod:`aligner.critic.checkpointing`), and a checkpoint loads at
  any data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from aligner.critic.peers import PeerLink
from aligner.distributed import ParallelState, comm_device

__all__ = ["Layout", "Replicas", "RowForward", "row_slices"]


def row_slices(b: int, replicas: int) -> list[slice]:
    """``replicas`` contiguous slices of ``b`` rows, the first ``b % replicas`` one row longer
    (``torch.tensor_split``'s cut): replica ``r`` takes ``rows[row_slices(b, n)[r]]``; a
    replica gets no rows when ``b < replicas``."""
    base, extra = divmod(b, replicas)
    out, start = [], 0
    for r in range(replicas):
        n = base + (1 if r < extra else 0)
        out.append(slice(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Layout:
    """Every global rank's place: its TP rank and its replica (DP rank).

    Attributes:
        tp_rank: by global rank.
        dp_rank: by global rank.
    """

    tp_rank: tuple[int, ...]
    dp_rank: tuple[int, ...]

    @classmethod
    def gather(cls, state: ParallelState) -> Layout:
        """Every rank's (TP rank, DP rank), from all ranks (collective: every rank calls it)."""
        if state.world_size == 1:
            return cls((0,), (0,))
        mine = torch.tensor([state.tp_rank, state.dp_rank], dtype=torch.int64, device=comm_device())
        parts = [torch.empty_like(mine) for _ in range(state.world_size)]
        dist.all_gather(parts, mine)
        pairs = [tuple(int(x) for x in p.cpu()) for p in parts]
        return cls(tuple(t for t, _ in pairs), tuple(d for _, d in pairs))

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        """The global rank of TP rank ``tp_rank`` of replica ``dp_rank``."""
        for g, (t, d) in enumerate(zip(self.tp_rank, self.dp_rank)):
            if (t, d) == (tp_rank, dp_rank):
                return g
        raise ValueError(f"no rank holds TP rank {tp_rank} of replica {dp_rank}")


class RowForward(Protocol):
    """What a replica runs on its rows: :class:`~aligner.critic.value_update.ValueUpdate` (which
    splits a train's rows itself, with :func:`row_slices`)."""

    scores_with_values: bool
    """Whether :meth:`forward` returns reward-model scores with the values."""

    def forward(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]: ...

    def score(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray: ...

    def drop_kept(self) -> None: ...


class Replicas:
    """This rank's part of a data-parallel inference, and rank 0's gathering of the others'.

    Args:
        state: this rank's place.
        layout: every rank's place (:meth:`Layout.gather`).
        peers: the line to the other ranks (point-to-point sends).
        update: this rank's forward (:meth:`~aligner.critic.value_update.ValueUpdate.forward`:
            ``(tokens [n, s], lengths [n]) -> (values [n, s-1] float32, reward-model scores [n]
            or None)``).
    """

    def __init__(self, state: ParallelState, layout: Layout, peers: PeerLink, update: RowForward) -> None:
        self.state = state
        self.layout = layout
        self.peers = peers
        self.update = update
        self.has_scores = update.scores_with_values
        self.size = state.dp_size

    def forward(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Values ``[b, s-1]`` float32 and reward-model scores ``[b]`` (or None) of the whole
        batch ``tokens [b, s]``, ``lengths [b]`` on global rank 0; None on every other rank.

        Every rank calls it with the whole batch (as rank 0 broadcast it); each replica runs
        its own rows, and each replica's TP rank 0 sends them to rank 0."""
        if self.size == 1:
            return self.update.forward(tokens, lengths)
        b, s = tokens.shape
        slices = row_slices(b, self.size)
        mine = slices[self.state.dp_rank]
        part = None
        if mine.stop > mine.start:
            part = self.update.forward(tokens[mine], lengths[mine])
        else:  # nothing to run; what an earlier forward kept is no longer the latest infer
            self.update.drop_kept()
        if self.state.rank != 0:
            if part is not None and self.state.tp_rank == 0:
                values, scores = part
                self.peers.send(torch.from_numpy(np.ascontiguousarray(values, np.float32)), 0)
                if self.has_scores:
                    self.peers.send(torch.from_numpy(np.ascontiguousarray(scores, np.float32)), 0)
            return None
        assert part is not None  # replica 0 always has rows: the first slices are the longest
        values, scores = [part[0]], [part[1]]
        for r, sl in enumerate(slices[1:], start=1):
            n = sl.stop - sl.start
            if n == 0:
                continue
            src = self.layout.rank(r, 0)
            values.append(self.peers.recv((n, s - 1), torch.float32, src).numpy())
            if self.has_scores:
                scores.append(self.peers.recv((n,), torch.float32, src).numpy())
        # [b, s-1] in row order, [b] or None
        return np.concatenate(values), (np.concatenate(scores) if self.has_scores else None)

    def score(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
        """The reward model's scores ``[b]`` float32 of ``tokens [b, s]`` (its own tokenizer's
        ids), ``lengths [b]``, on global rank 0; None on every other rank.

        Split like :meth:`forward`: every rank calls it with the whole batch, each replica scores
        its contiguous slice of the rows, and each replica's TP rank 0 sends its scores to rank 0."""
        if self.size == 1:
            return self.update.score(tokens, lengths)
        slices = row_slices(tokens.shape[0], self.size)
        mine = slices[self.state.dp_rank]
        part = self.update.score(tokens[mine], lengths[mine]) if mine.stop > mine.start else None
        if self.state.rank != 0:
            if part is not None and self.state.tp_rank == 0:
                self.peers.send(torch.from_numpy(np.ascontiguousarray(part, np.float32)), 0)
            return None
        assert part is not None  # replica 0 always has rows: the first slices are the longest
        scores = [part]
        for r, sl in enumerate(slices[1:], start=1):
            n = sl.stop - sl.start
            if n:
                scores.append(self.peers.recv((n,), torch.float32, self.layout.rank(r, 0)).numpy())
        return np.concatenate(scores)  # [b] in row order
