"""The policy update of one PPO step (docs/design.md, "Roles and data flow", step 7): PPO epochs x
minibatches of clipped-surrogate updates of the policy on the step's rollout. The twin of the
server's value update (:mod:`aligner.critic.value_update`).

Each epoch goes over this data-parallel rank's rows in an order of its own
(:meth:`PolicyUpdate.epoch_orders`: whole groups of ``ppo.samples_per_prompt`` rows stay
together), cut into minibatches of ``ppo.mini_batch_size / DP`` rows; the global minibatch is
every data-parallel rank's minibatch of the same number. Each minibatch is one optimizer step on
the loss of the global minibatch (:func:`aligner.rl.policy_loss`, minus the entropy bonus):
``ppo.loss_agg`` ``token_mean`` is the mean over every response token of the global minibatch,
``seq_mean_token_mean`` the mean over its every sequence of the sequence's token mean, whatever
the micro-batch size and the layout. So the minibatch's normaliser (its response tokens, or its
sequences, over every data-parallel rank: one all-reduce per step, of the masks, before any
forward) divides the sum of each micro-batch's per-token terms; each micro-batch of
``ppo.micro_batch_size`` rows (under PP > 1 through Megatron's pipeline schedule, told to take
the loss as it is: :mod:`aligner.actor.pipeline`) runs its backward, the fp32 master gradients
are summed over the data-parallel ranks, their norm clipped to ``optim.grad_clip`` (a non-finite
norm skips the step, on every rank alike), then one step of the learning-rate schedule. With
``optim.use_distributed_optimizer`` each data-parallel rank steps its slice of the masters and
the ranks all-gather the weights (:class:`aligner.precision.ShardedAdamW`): the same calls here,
the same numbers. The first pass may be the rollout's log-prob forward
(:meth:`PolicyUpdate.first_forward`, ``ppo.reuse_rollout_forward``), which changes no number.

A padded micro-batch runs only up to its longest row (the positions past it are padding in
every one of its rows, outside every mask, and right padding is never attended to by a real
position): its log-probs, masks and advantages are cut to that width, which changes no number
but float rounding. Not under PP > 1, whose schedule sends activations of one shape.

With ``ppo.max_tokens_per_micro_batch`` the micro-batches are packed (:mod:`aligner.models.packing`):
consecutive rows of the minibatch (in its order) of at most that many real tokens, laid end to
end without their padding. The loss being the global minibatch's whatever the cut, the step is
the padded one to float round-off. Under PP > 1 the micro-batches keep ``ppo.micro_batch_size``
rows (:mod:`aligner.actor.pipeline`: the schedule's stage-to-stage buffers have one shape).

The statistics (``loss/policy``, ``policy/*``) are the global minibatch's too: each rank's sums
(token-weighted; :func:`aligner.rl.policy_stat_sums`) added up over the ranks in one all-reduce
per step.

Shapes: ``b`` this data-parallel rank's rows, ``s`` padded length, ``v`` vocabulary shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from aligner import rl
from aligner.actor.config import ActorConfig
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.pipeline import PipelineSchedule, allreduce_tied_embedding_grads
from aligner.actor.rollout import Rollout
from aligner.distributed import ParallelState, comm_device
from aligner.models.packing import PackedRows, pack, plan_micro_batches

__all__ = ["FirstPass", "PolicyUpdate", "group_order"]

#: The first PPO pass's ``(logits [b, s - start, v], logprobs [b, s-1])``, with their graph.
FirstPass = tuple[torch.Tensor, torch.Tensor]


def group_order(b: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A random order of ``b`` rows that permutes whole groups (contiguous blocks of
    ``group_size`` rows), keeping each group's rows together and in order; ``group_size`` 1 is
    ``torch.randperm(b)``."""
    if group_size <= 1:
        return torch.randperm(b, generator=generator)
    if b % group_size:
        raise ValueError(f"{b} rows do not split into groups of {group_size}")
    groups = torch.randperm(b // group_size, generator=generator)
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


class PolicyUpdate:
    """The PPO update of ``policy`` (trained by ``optimizer``, its learning rate by ``scheduler``).

    Args:
        policy: the policy (this rank's tensor- and pipeline-parallel shard).
        optimizer: its mixed-precision AdamW, whole or sharded over the data-parallel ranks
            (:func:`aligner.actor.optimizer.make_policy_optimizer`).
        scheduler: the learning-rate schedule, stepped once per optimizer step.
        logprobs: log-probs and entropies over this rank's vocabulary shard.
        pipeline: Megatron's pipeline schedule under PP > 1, else None.
        cfg: the actor's configuration: ``ppo`` (epochs, minibatch and micro-batch sizes,
            clipping, entropy bonus, loss aggregation, group size), ``optim.grad_clip`` and
            ``seed`` (with the step id and the data-parallel rank, it seeds the epochs' orders).
        state: this rank's place (its TP, PP and DP groups).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        logprobs: PolicyLogprobs,
        pipeline: PipelineSchedule | None,
        cfg: ActorConfig,
        state: ParallelState,
    ) -> None:
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.logprobs, self.pipeline = logprobs, pipeline
        self.ppo, self.grad_clip, self.seed = cfg.ppo, cfg.optim.grad_clip, cfg.seed
        self.state = state
        self._tp_group = state.tp_group if state.tp_size > 1 else None
        self._dp_group = state.dp_group if state.dp_size > 1 else None
        p = cfg.ppo
        self.max_tokens = p.max_tokens_per_micro_batch if pipeline is None else None
        """Packed micro-batches' token budget (``ppo.max_tokens_per_micro_batch``); None: micro-batches
        of ``ppo.micro_batch_size`` rows (always under PP: the schedule's shapes are fixed)."""
        # The first PPO pass's forward doubles as the rollout log-prob forward when that pass is
        # one forward over the whole batch with the same weights, and the forward ignores
        # train/eval mode (the fused path: no dropout).
        per_rank = p.global_batch_size // state.dp_size
        self.reuse_rollout_forward = bool(
            p.reuse_rollout_forward
            and p.ppo_epochs >= 1
            and p.mini_batch_size // state.dp_size == per_rank
            and p.micro_batch_size == per_rank
            and getattr(policy, "aligner_fused", None) is not None
            and pipeline is None
            and p.max_tokens_per_micro_batch is None
        )
        """Whether :meth:`first_forward` may give the rollout its log-probs (``ppo.reuse_rollout_forward``)."""
        self.minibatch_stats: list[dict[str, float]] = []
        """The last :meth:`train_step`'s statistics, one dict per minibatch (global, as it returns them)."""

    def epoch_orders(self, step_id: int, b: int) -> list[torch.Tensor]:
        """Each PPO epoch's row order: the same on every rank of a TP group (seeded by step and
        DP rank); whole groups of ``ppo.samples_per_prompt`` rows stay together."""
        gen = torch.Generator().manual_seed(self.seed * 7919 + step_id * 31 + self.state.dp_rank)
        orders = [group_order(b, self.ppo.samples_per_prompt, gen) for _ in range(self.ppo.ppo_epochs)]
        return [x.to(self.state.device) for x in orders]  # drawn on the CPU (one stream anywhere)

    def first_forward(
        self, tokens: torch.Tensor, order: torch.Tensor, start: int = 0
    ) -> tuple[FirstPass, torch.Tensor, torch.Tensor]:
        """The first PPO pass's forward (one minibatch of one micro-batch: every row, in the
        first epoch's order), with gradients. Returns ``(logits, logprobs)`` for that pass and,
        detached and back in row order, the rollout's log-probs and entropy ``[b, s-1]``."""
        self.policy.train()
        rows = tokens[order]
        logits = self.logprobs.logits(self.policy, rows, start)
        logp = self.logprobs.sequence_logprobs(logits, rows, start)
        old_logprobs = torch.empty_like(logp, requires_grad=False)
        old_logprobs[order] = logp.detach()
        with torch.no_grad():
            ent = self.logprobs.entropy(logits.detach(), start)
        entropy = torch.empty_like(ent)
        entropy[order] = ent
        return (logits, logp), old_logprobs, entropy

    def train_step(
        self,
        r: Rollout,
        orders: list[torch.Tensor],
        handoff: list[FirstPass],
        before_update: Callable[[], Any] | None = None,
    ) -> dict[str, float]:
        """PPO epochs over ``orders`` (one row permutation per epoch); ``handoff``: empty, or the
        first pass's ``(logits, logprobs)`` from :meth:`first_forward` (taken out of the list,
        so that nothing keeps them once the first minibatch is done). Returns ``loss/policy``,
        ``policy/*`` and ``policy/grad_norm``, each the global minibatch's (every data-parallel
        rank's rows), averaged over the minibatches; :attr:`minibatch_stats` holds them per
        minibatch. Two collectives over the data-parallel group besides the gradients': the
        minibatches' loss normalisers before the first forward, their statistics after the last
        step. ``before_update()`` (on every rank) right before the first optimizer step: until
        then the weights are only read (by the weight push, overlapped with this)."""
        first = handoff.pop() if handoff else None
        b = r.tokens.shape[0]
        per_rank_mini = self.ppo.mini_batch_size // self.state.dp_size
        minibatches = [order[i : i + per_rank_mini] for order in orders for i in range(0, b, per_rank_mini)]
        normalisers = self._normalisers(r.mask, minibatches)
        # The rows' lengths on the host, read once: the micro-batches' widths, plans and packs
        # read them there (not under PP: its schedule cuts the micro-batches itself).
        lengths = r.lengths.detach().to("cpu", torch.int64) if self.pipeline is None else None
        sums, norms = [], []
        self.policy.train()
        for idx, normaliser in zip(minibatches, normalisers):
            stats, norm = self._minibatch_step(r, idx, normaliser, first, lengths, before_update)
            first = before_update = None
            sums.append(stats)
            norms.append(norm)
        self.minibatch_stats = self._global_stats(sums, norms)
        count = max(len(self.minibatch_stats), 1)
        keys = self.minibatch_stats[0].keys() if self.minibatch_stats else ()
        return {k: sum(m[k] for m in self.minibatch_stats) / count for k in keys}

    def _normalisers(self, mask: torch.Tensor, minibatches: list[torch.Tensor]) -> torch.Tensor:
        """Each global minibatch's loss normaliser ``[n]`` (:func:`aligner.rl.loss_normaliser`:
        its response tokens, or its rows with one, over every data-parallel rank's share of it),
        from the masks alone, in one all-reduce: known before any forward, so that each
        micro-batch's loss is its share of the global minibatch's."""
        if not minibatches:
            return torch.zeros(0, device=mask.device)
        counts = torch.stack([rl.loss_normaliser(mask[idx], self.ppo.loss_agg) for idx in minibatches])
        return self._dp_sum(counts)

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the data-parallel ranks (``x`` itself at DP=1)."""
        if self._dp_group is None:
            return x
        device = x.device
        x = x.to(comm_device(self._dp_group))
        dist.all_reduce(x, group=self._dp_group)
        return x.to(device)

    def _global_stats(self, sums: list[dict[str, Any]], norms: list[float]) -> list[dict[str, float]]:
        """Per minibatch, the statistics of every data-parallel rank's rows: the ranks' sums
        (:func:`aligner.rl.policy_stat_sums`, and the loss: each rank's share of it) added up in
        one all-reduce for the whole step, then made means (:func:`aligner.rl.policy_stats_from_sums`)."""
        if not sums:
            return []
        keys = sorted(sums[0])
        device = self.state.device
        table = torch.stack(
            [
                torch.stack([torch.as_tensor(s[k], dtype=torch.float64, device=device) for k in keys])
                for s in sums
            ]
        )  # [minibatches, keys]
        table = self._dp_sum(table)
        columns = dict(zip(keys, table.unbind(1)))
        loss = columns.pop("loss")
        stats = rl.policy_stats_from_sums(columns)
        names = ["loss/policy", *(f"policy/{k}" for k in stats)]
        values = torch.stack([loss, *stats.values()], 1).tolist()  # the step's one read to the host
        return [{**dict(zip(names, row)), "policy/grad_norm": norm} for row, norm in zip(values, norms)]

    def _minibatch_step(
        self,
        r: Rollout,
        idx: torch.Tensor,
        normaliser: torch.Tensor,
        first: FirstPass | None = None,
        lengths: torch.Tensor | None = None,
        before_update: Callable[[], Any] | None = None,
    ) -> tuple[dict[str, torch.Tensor], float]:
        """One optimizer step on the rollout rows ``idx`` (this rank's share of a global minibatch
        whose loss ``normaliser`` is given), accumulated over micro-batches of
        ``ppo.micro_batch_size`` rows (each cut to its longest row), or packed ones under the
        token budget (``lengths``: the rows' lengths on the host; None under PP). Returns this
        rank's sums of the minibatch's statistics and the gradient norm."""
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, Any] = {}
        if self.pipeline is not None:
            acc = self._pipeline_backward(r, idx, normaliser)
        else:
            for micro, packed, width in self._micro_batches(r, idx, lengths):
                if first is not None:  # this pass's forward was run for the rollout log-probs
                    (logits, logp), first = first, None
                    entropy = self._entropy_of(logits, r.start)
                else:
                    logp, entropy = self._forward(r, micro, packed, width)
                loss, stats = self._micro_loss(r, micro, normaliser, logp, entropy)
                loss.backward()  # the micro-batch's share of the global minibatch's loss
                for k, v in stats.items():
                    acc[k] = acc[k] + v if k in acc else v
        # Each rank's loss is its share of the global minibatch's: the gradients add up.
        self.optimizer.allreduce_grads(self._dp_group, self.state.dp_size, op="sum")  # fp32 master grads
        norm = self.optimizer.clip_grad_norm(
            self.grad_clip,
            self._tp_group,
            self.state.tp_size,
            self.state.tp_rank,
            pp_group=self.state.pp_group if self.state.pp_size > 1 else None,
        )
        if before_update is not None:
            before_update()
        # Skipped (and counted in grad_norm as inf/nan) on a non-finite norm; sharded, it
        # all-gathers the weights (every DP rank steps here: the norm is the same on all).
        self.optimizer.step()
        self.scheduler.step()
        return acc, norm

    def _micro_batches(
        self, r: Rollout, idx: torch.Tensor, lengths: torch.Tensor
    ) -> list[tuple[torch.Tensor, PackedRows | None, int]]:
        """The micro-batches of the rows ``idx`` (``lengths``: every rollout row's length, on the
        host): ``(rows, None, width)`` of ``ppo.micro_batch_size`` rows, ``width`` their longest
        row's length (at least ``r.start + 1``: the forward computes positions from ``start``),
        past which every one of them is padding; or, packed (``ppo.max_tokens_per_micro_batch``),
        ``(rows, their PackedRows, s)``: consecutive rows of ``idx`` of at most that many real
        tokens."""
        host, s = idx.cpu(), r.tokens.shape[1]
        if self.max_tokens is None:
            size = self.ppo.micro_batch_size
            return [
                (micro, None, min(max(int(lengths[rows].max()), r.start + 1), s))
                for rows, micro in zip(host.split(size), idx.split(size))
            ]
        out = []
        for part in plan_micro_batches(lengths[host], self.max_tokens):
            rows = host[part]
            micro = rows.to(idx.device)
            out.append((micro, pack(r.tokens[micro], lengths[rows]), s))
        return out

    def _forward(
        self, r: Rollout, micro: torch.Tensor, packed: PackedRows | None, width: int
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """The training forward of the rollout rows ``micro`` (``packed``: laid end to end; else
        padded, cut to ``width`` positions): their log-probs ``[m, w-1]`` and a function giving
        their entropy ``[m, w-1]`` (``w``: ``width`` padded, ``s`` packed)."""
        if packed is None:
            tokens = r.tokens[micro, :width]
            logits = self.logprobs.logits(self.policy, tokens, r.start)
            logp = self.logprobs.sequence_logprobs(logits, tokens, r.start)
            return logp, self._entropy_of(logits, r.start)
        s = r.tokens.shape[1]
        logits = self.logprobs.packed_logits(self.policy, packed, r.start)  # [1, T', v]
        logp = self.logprobs.packed_sequence_logprobs(logits, packed, s, r.start)
        return logp, lambda: self.logprobs.packed_entropy(logits, packed, s, r.start)

    def _entropy_of(self, logits: torch.Tensor, start: int) -> Callable[[], torch.Tensor]:
        """A function giving the entropy ``[m, s-1]`` of padded ``logits [m, s - start, v]``."""
        return lambda: self.logprobs.entropy(logits, start)

    def _micro_loss(
        self,
        r: Rollout,
        micro: torch.Tensor,
        normaliser: torch.Tensor,
        logp: torch.Tensor,
        entropy: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate (minus the entropy bonus) of the rollout rows ``micro`` from
        their log-probs ``logp [m, w-1]`` (and their ``entropy()``, computed only for a bonus;
        ``w`` <= ``s``: the rollout's tensors are cut to it, every position past it masked):
        its terms' sum over the global minibatch's ``normaliser``, so that the micro-batches'
        losses (and their gradients) add up to the global minibatch's. With it, the statistics
        as sums that add up likewise (:func:`aligner.rl.policy_stat_sums`; ``loss``: this loss)."""
        p = self.ppo
        w = logp.shape[1]
        mask = r.mask[micro, :w]
        loss, stats = rl.policy_loss(
            logp,
            r.old_logprobs[micro, :w],
            r.advantages[micro, :w],
            mask,
            clip_eps_low=p.clip_eps,
            clip_eps_high=p.clip_eps_high,
            dual_clip=p.dual_clip,
            agg=p.loss_agg,
            normaliser=normaliser,
            behaviour_logp=None if r.behaviour_logprobs is None else r.behaviour_logprobs[micro, :w],
            tis_cap=p.tis_cap,
        )
        if p.entropy_coef > 0:
            ent = entropy()
            loss = loss - p.entropy_coef * rl.aggregate(ent, mask, p.loss_agg, normaliser)
            stats["entropy"] = rl.masked_mean(ent.detach(), mask)
        out = rl.policy_stat_sums(stats, mask)
        out["loss"] = loss.detach().double()
        return loss, out

    def _pipeline_backward(self, r: Rollout, idx: torch.Tensor, normaliser: torch.Tensor) -> dict[str, float]:
        """Forward and backward of the rows ``idx`` through the pipeline schedule (the last stage
        computes each micro-batch's loss, already a share of the global minibatch's: the schedule
        sums them); the statistics' sums reach every stage."""

        def loss_fn(logits: torch.Tensor, rows: torch.Tensor):
            micro = idx[rows]
            logp = self.logprobs.sequence_logprobs(logits, r.tokens[micro], r.start)
            return self._micro_loss(r, micro, normaliser, logp, self._entropy_of(logits, r.start))

        stats = self.pipeline.train(
            self.policy, r.tokens[idx], self.ppo.micro_batch_size, loss_fn, r.start, reduce="sum"
        )
        allreduce_tied_embedding_grads(self.policy, self.state, self.optimizer)
        return stats
