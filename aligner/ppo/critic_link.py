"""The critic/reward server seen from the actor's ranks (docs/design.md, "Roles and data flow",
steps 3 and 6).

- ``critic_infer``: tensor-parallel rank 0 of each group sends its data-parallel rows and
  broadcasts the values and scores to the other ranks of its group (they hold the same rows).
- ``critic_train``: every data-parallel rank's rows are gathered (padded to a common length) and
  global rank 0 sends them once per step; the step does not wait for the answer. The one update
  in flight, and the result of the last one until the step that reports it, are kept here.

Shapes: ``b`` this rank's rows, ``s`` padded length.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from aligner.critic.handle import CriticHandle
from aligner.distributed import ParallelState

__all__ = ["CriticLink"]


class CriticLink:
    """One run's connection to the critic, on every rank (only some ranks send)."""

    def __init__(self, critic: CriticHandle, state: ParallelState, pad_id: int) -> None:
        self.critic, self.state, self.pad_id = critic, state, pad_id
        self.pending: Future | None = None
        """The ``critic_train`` request in flight (global rank 0 only)."""
        self.completed: dict[str, Any] | None = None
        """The result of the last finished ``critic_train``, until a step reports it."""

    # -- critic_infer ------------------------------------------------------------------------------

    def infer(
        self, tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor
    ) -> Future | None:
        """Send ``tokens [b, s]`` (``lengths``, ``prompt_lengths [b]``) for values and scores
        without waiting; None on the ranks that do not send."""
        if self.state.tp_rank != 0:
            return None
        return self.critic.infer(tokens, lengths, prompt_lengths)

    def result(self, future: Future | None, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Values ``[b, s-1]`` and scores ``[b]`` (float32) of the batch of ``shape`` ``[b, s]``
        that :meth:`infer` sent, on every rank of the tensor-parallel group."""
        b, s = shape
        if future is not None:
            values_np, rewards_np = future.result()
            values = torch.as_tensor(values_np, dtype=torch.float32).reshape(b, s - 1)
            scores = torch.as_tensor(rewards_np, dtype=torch.float32).reshape(b)
        else:
            values, scores = torch.empty(b, s - 1), torch.empty(b)
        if self.state.tp_size > 1:
            from megatron.core import parallel_state as mpu

            src = mpu.get_tensor_model_parallel_src_rank()
            dist.broadcast(values, src, group=self.state.tp_group)
            dist.broadcast(scores, src, group=self.state.tp_group)
        return values, scores

    # -- critic_train ------------------------------------------------------------------------------

    def train(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        returns: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        step_id: int,
    ) -> Future | None:
        """Send the critic's training batch for ``step_id`` (every rank's rows: ``tokens [b, s]``,
        ``lengths [b]``, ``returns``, ``values``, ``mask [b, s-1]``) without waiting; call on
        every rank after :meth:`wait`. Returns the request in flight (None off rank 0)."""
        if self.pending is not None:
            raise RuntimeError("critic_train while the previous one is in flight: wait() first")
        if self.state.dp_size > 1:
            tokens, lengths, returns, values, mask = self._gather_dp(tokens, lengths, returns, values, mask)
        if self.state.rank == 0:
            self.pending = self.critic.train(tokens, lengths, returns, values, mask, step_id)
        return self.pending

    def wait(self) -> None:
        """Wait for the ``critic_train`` in flight; its result is kept in :attr:`completed` until
        :meth:`take_completed` (``loss/value`` is the critic's loss on the previous step's batch)."""
        if self.pending is not None:
            self.completed = self.pending.result()
            self.pending = None

    def take_completed(self) -> dict[str, Any] | None:
        """The last finished update's result, once (None when there is none to report)."""
        done, self.completed = self.completed, None
        return done

    def _gather_dp(self, *rows: torch.Tensor) -> list[torch.Tensor]:
        """Concatenate every DP rank's rows (``tokens`` first, then its per-row tensors, padded to
        a common length) on all ranks."""
        group = self.state.dp_group
        s = torch.tensor([rows[0].shape[1]])
        dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        pad = int(s) - rows[0].shape[1]
        tokens, lengths, *per_token = rows
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad), value=self.pad_id)
            per_token = [torch.nn.functional.pad(x, (0, pad)) for x in per_token]
        out = []
        for x in (tokens, lengths, *per_token):
            parts = [torch.empty_like(x) for _ in range(self.state.dp_size)]
            dist.all_gather(parts, x.contiguous(), group=group)
            out.append(torch.cat(parts))
        return out
