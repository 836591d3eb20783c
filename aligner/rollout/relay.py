"""A rollout worker of several processes (``rollout.tensor_parallel_size`` = g > 1, started by
torchrun): its rank 0, the *lead*, is the worker the trainer sees. It alone joins the trainer's
channels and receives the pushed versions; over the worker's own world (torchrun's, gloo on CPU,
NCCL on GPUs) it relays to its tensor-parallel peers what they act on:

- each command they take part in (``generate`` with its prompts, ``weights``, ``exit``), as one
  message (:func:`aligner.peer_group.encode_message`: JSON and named tensors, nothing pickled);
- each version it accepted, once verified whole (checksums, manifest, names and shapes against
  the architecture): the tensors' names, dtypes and shapes first, then each full tensor in turn,
  of which every rank keeps its own shard (:func:`aligner.models.layout.load_megatron_tensors`).
  A version the lead refused is never relayed: nothing is swapped anywhere.

A peer holds one full tensor at a time besides its shard of the model; the lead holds the
version it received, as a worker of one process does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aligner.generation.weight_push import PUSHED_DTYPES, WeightReceiver, check_fits, receive_into
from aligner.models.layout import load_megatron_tensors
from aligner.peer_group import check_message_size, decode_message, encode_message

__all__ = ["Relay"]


class Relay:
    """The worker's world, seen from one of its ranks (``src``: the lead's rank, 0)."""

    def __init__(self, device: torch.device, src: int = 0) -> None:
        self.device, self.src = device, src
        self.rank = dist.get_rank()

    @property
    def lead(self) -> bool:
        return self.rank == self.src

    def message(
        self, meta: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The lead's ``meta`` and ``tensors`` on every rank (the lead passes them, the peers
        nothing); collective over the worker's world."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        payload = None
        if self.lead:
            payload = encode_message(meta or {}, tensors)
            n[0] = payload.numel()
        dist.broadcast(n, src=self.src)
        size = int(n.item())
        check_message_size(size, f"the worker's relay, from rank {self.src}")
        buf = (
            payload.to(self.device)
            if payload is not None
            else torch.empty(size, dtype=torch.uint8, device=self.device)
        )
        dist.broadcast(buf, src=self.src)
        if self.lead:
            return meta or {}, tensors or {}
        return decode_message(buf)

    def receive_into(self, receiver: WeightReceiver, policy: nn.Module) -> int:
        """On the lead: receive the next version from the trainer and verify all of it (the
        buckets, then the names and shapes against ``policy``), then relay it and load this
        rank's shards (:func:`~aligner.generation.weight_push.receive_into`). Raises
        ``WeightPushError`` before relaying anything when the version is refused (the peers are
        still waiting for a command)."""
        return receive_into(receiver, policy, apply=self._relay_and_load)

    def _relay_and_load(self, policy: nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
        check_fits(policy, tensors)
        listing = {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors}
        self.message({"op": "weights", "tensors": listing})
        self.load(policy, listing, dict(tensors))

    def load(
        self, policy: nn.Module, listing: dict[str, list], held: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Every rank's shards of the relayed version (``listing``: name -> [dtype, shape]; the
        lead passes the tensors it ``held``); collective, in the order the loader asks for them."""

        def get(name: str) -> torch.Tensor:
            dtype, shape = listing[name]
            if held is not None:
                t = held[name].to(self.device).contiguous()
            else:
                t = torch.empty(shape, dtype=PUSHED_DTYPES[dtype], device=self.device)
            dist.broadcast(t, src=self.src)
            return t

        load_megatron_tensors(policy, None, get)
