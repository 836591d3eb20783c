"""The generation layout: which ranks generate together, tensor parallel over how many.

Training runs the policy at TP x PP per data-parallel replica; generation runs the whole model
at a tensor-parallel size ``g`` of its own (``generation.tensor_parallel_size``; default the
training TP). ``g`` must divide the replica's model-parallel size ``TP x PP``: the replica's
model-parallel group (Megatron's ``get_model_parallel_group()``, its ranks in order) is cut
into consecutive chunks of ``g`` ranks, and each chunk is one generation TP group. Every
generation group of a replica generates the same prompts with the same seed (seeded by the
data-parallel rank only), so every group draws the same tokens; the replica's first rank's
output is then broadcast over the replica (:meth:`GenerationLayout.share`), so that every rank
of it continues the step with exactly the same tensors.

When ``PP == 1`` and ``g == TP`` the generation groups are the training TP groups and the
engine may generate with the training module's own tensors (zero-copy); any other layout needs
an engine that owns its weights (:class:`aligner.generation.weights.OwnedWeights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner.distributed import ParallelState, all_gather_json, comm_device
from aligner.generation.engine import GenerationOutput
from aligner.models.config import ModelConfig
from aligner.models.layout import ParallelLayout

__all__ = ["GenerationLayout", "broadcast_output", "generation_tp_problems"]

KEY = "generation.tensor_parallel_size"


def broadcast_output(out: GenerationOutput | None, group: Any, device: torch.device) -> GenerationOutput:
    """Group rank 0's ``out`` on every member of ``group`` (the others pass None or their own),
    returned on ``device``. Collective over ``group``."""
    dev = comm_device()
    src = dist.get_global_rank(group, 0)
    mine = dist.get_rank() == src
    shape = torch.tensor(list(out.tokens.shape) if mine else [0, 0], dtype=torch.int64, device=dev)
    dist.broadcast(shape, src=src, group=group)
    b, s = (int(x) for x in shape.tolist())
    parts = [
        (None if out is None else out.tokens, (b, s), torch.int64),
        (None if out is None else out.lengths, (b,), torch.int64),
        (None if out is None else out.prompt_lengths, (b,), torch.int64),
        (None if out is None else out.logprobs, (b, s - 1), torch.float32),
        (None if out is None else out.ended, (b,), torch.uint8),
    ]
    got = []
    for t, shp, dtype in parts:
        buf = (
            t.to(device=dev, dtype=dtype).contiguous() if mine else torch.empty(shp, dtype=dtype, device=dev)
        )
        dist.broadcast(buf, src=src, group=group)
        got.append(buf.to(device))
    tokens, lengths, plen, logprobs, ended = got
    return GenerationOutput(tokens, lengths, plen, logprobs, ended.bool())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def generation_tp_problems(
    size: Any,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    model: ModelConfig | None = None,
    key: str = KEY,
) -> list[str]:
    """What is wrong with a generation tensor-parallel ``size`` (None: the training TP) for a
    policy trained at ``tensor_parallel_size`` x ``pipeline_parallel_size``, and for ``model``'s
    heads, query groups and MLP width when given; each message names the field (``key``), the
    value and what is expected."""
    if size is None:
        return []
    mp = tensor_parallel_size * pipeline_parallel_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return [f"{key}={size!r}: expected a positive integer dividing tensor x pipeline parallel size {mp}"]
    if mp % size:
        return [
            f"{key}={size}: expected a divisor of the actor's model-parallel size "
            f"(tensor_model_parallel_size {tensor_parallel_size} x pipeline_model_parallel_size "
            f"{pipeline_parallel_size} = {mp}): one of {_divisors(mp)}, or null for the training TP"
        ]
    out = []
    if model is not None and size > 1:
        for what, n in (
            ("num_attention_heads", model.num_attention_heads),
            ("num_query_groups", model.kv_heads),
            ("ffn_hidden_size", model.ffn_size),
        ):
            if n % size:
                out.append(f"{key}={size}: expected a divisor of the model's {what} ({n})")
    return out


@dataclass(frozen=True)
class GenerationLayout:
    """This rank's generation group: ``size`` ranks that hold one tensor-parallel copy of the
    whole model and generate together."""

    size: int
    """Generation tensor-parallel size ``g``."""
    rank: int
    """This rank's index in its generation group (which shard of each tensor it holds)."""
    group: Any
    """The generation TP group (None when ``size`` is 1)."""
    replica_group: Any
    """The model-parallel group of this data-parallel replica (None in a world of one): every
    rank of it generates the same tokens."""
    train_tp: int = 1
    train_pp: int = 1
    dp_rank: int = 0

    @property
    def same_as_training(self) -> bool:
        """The generation groups are the training TP groups: the training module can generate
        with its own tensors."""
        return self.train_pp == 1 and self.size == self.train_tp

    @property
    def groups_per_replica(self) -> int:
        """How many generation groups of this replica decode the same prompts."""
        if self.replica_group is None:
            return 1
        return dist.get_world_size(self.replica_group) // self.size

    def share(self, out: GenerationOutput) -> GenerationOutput:
        """The replica's first rank's ``out`` on every rank of the replica, when more than one
        generation group decoded it. The groups draw the same tokens by construction (the same
        weights, prompts and seed); the broadcast makes that a guarantee, so that no kernel's
        nondeterminism can give two pipeline stages of one replica different rollouts."""
        if self.groups_per_replica == 1:
            return out
        return broadcast_output(out, self.replica_group, out.tokens.device)

    def parallel_layout(self) -> ParallelLayout:
        """The :class:`ParallelLayout` that shards a full tensor for this generation rank."""
        return ParallelLayout(tp=self.size, tp_rank=self.rank, tp_group=self.group)

    @classmethod
    def create(
        cls, parallel_state: ParallelState | None, tensor_parallel_size: int | None = None
    ) -> GenerationLayout:
        """The generation layout of this rank for a generation TP size (None: the training
        TP). ``parallel_state`` None: Megatron's parallel state when it is initialised, else a
        single process.

        Collective over the world when it needs generation groups other than the training TP
        groups (every rank calls it with the same size): the replicas' model-parallel ranks
        are gathered and every group is created on every rank, in the same order.
        """
        ps = parallel_state if parallel_state is not None else ParallelState.from_megatron(comm_device())
        if ps is None:  # a single process without Megatron's parallel state
            problems = generation_tp_problems(tensor_parallel_size, 1, 1)
            if problems:
                raise ValueError(problems[0])
            return cls(size=1, rank=0, group=None, replica_group=None)
        tp, pp = ps.tp_size, ps.pp_size
        g = tp if tensor_parallel_size is None else tensor_parallel_size
        problems = generation_tp_problems(g, tp, pp)
        if problems:
            raise ValueError(problems[0])
        common = dict(train_tp=tp, train_pp=pp, dp_rank=ps.dp_rank)
        if pp == 1 and g == tp:
            group = ps.tp_group if tp > 1 else None
            return cls(size=g, rank=ps.tp_rank, group=group, replica_group=group, **common)
        replica = ps.group("mp")
        if replica is None:
            raise ValueError(
                "the parallel state has no model-parallel group: make it with aligner.distributed.initialize"
            )
        ranks = dist.get_process_group_ranks(replica)
        if len(ranks) != tp * pp:
            raise ValueError(
                f"Megatron's model-parallel group has {len(ranks)} ranks, but the parallel state says "
                f"TP {tp} x PP {pp}: initialise both with aligner.distributed.initialize"
            )
        me = dist.get_rank()
        if g == 1:
            return cls(size=1, rank=0, group=None, replica_group=replica, **common)
        if g == tp * pp:
            return cls(size=g, rank=dist.get_rank(replica), group=replica, replica_group=replica, **common)
        mine = None
        for chunk in _chunks(_all_replicas(ranks), g):
            group = dist.new_group(chunk)  # collective over the world: every rank, same order
            if me in chunk:
                mine = group
        assert mine is not None
        return cls(size=g, rank=dist.get_rank(mine), group=mine, replica_group=replica, **common)


def _all_replicas(ranks: list[int]) -> list[list[int]]:
    """Every replica's model-parallel ranks (this rank's are ``ranks``), in the order of their
    first rank, the same list on every rank."""
    seen: dict[tuple[int, ...], None] = {}
    for p in all_gather_json(ranks):
        seen.setdefault(tuple(p), None)
    return sorted((list(r) for r in seen), key=lambda r: r[0])


def _chunks(replicas: list[list[int]], g: int) -> list[list[int]]:
    """Each replica's ranks cut into consecutive chunks of ``g``."""
    return [r[i : i + g] for r in replicas for i in range(0, len(r), g)]
