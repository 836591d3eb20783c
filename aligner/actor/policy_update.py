"""The policy update of one PPO step (docs/design.md, "Roles and data flow", step 7): PPO epochs x
minibatches of clipped-surrogate updates of the policy on the step's rollout. The twin of the
server's value update (:mod:`aligner.critic.value_update`).

Each epoch goes over this data-parallel rank's rows in an order of its own
(:meth:`PolicyUpdate.epoch_orders`: whole groups of ``ppo.samples_per_prompt`` rows stay
together), cut into minibatches of ``ppo.mini_batch_size / DP`` rows. Each minibatch is one
optimizer step: the loss (:func:`aligner.rl.policy_loss`, minus the entropy bonus) accumulated
over micro-batches of ``ppo.micro_batch_size`` rows (under PP > 1 through Megatron's pipeline
schedule, :mod:`aligner.actor.pipeline`), the fp32 master gradients summed over the data-parallel
ranks, their norm clipped to ``optim.grad_clip`` (a non-finite norm skips the step, on every rank
alike), then one step of the learning-rate schedule. With ``optim.use_distributed_optimizer``
each data-parallel rank steps its slice of the masters and the ranks all-gather the weights
(:class:`aligner.precision.ShardedAdamW`): the same calls here, the same numbers. The first pass may be the rollout's log-prob forward
(:meth:`PolicyUpdate.first_forward`, ``ppo.reuse_rollout_forward``), which changes no number.

Shapes: ``b`` this data-parallel rank's rows, ``s`` padded length, ``v`` vocabulary shard.
"""

from __future__ import annotations

from typing import Any

import torch

from aligner import rl
from aligner.actor.config import ActorConfig
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.pipeline import PipelineSchedule, allreduce_tied_embedding_grads
from aligner.actor.rollout import Rollout
from aligner.distributed import ParallelState

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
        )
        """Whether :meth:`first_forward` may give the rollout its log-probs (``ppo.reuse_rollout_forward``)."""

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
        self, r: Rollout, orders: list[torch.Tensor], handoff: list[FirstPass]
    ) -> dict[str, float]:
        """PPO epochs over ``orders`` (one row permutation per epoch); ``handoff``: empty, or the
        first pass's ``(logits, logprobs)`` from :meth:`first_forward` (taken out of the list,
        so that nothing keeps them once the first minibatch is done). Returns ``loss/policy``,
        ``policy/*`` and ``policy/grad_norm``, averaged over the minibatches."""
        first = handoff.pop() if handoff else None
        p = self.ppo
        b = r.tokens.shape[0]
        per_rank_mini = p.mini_batch_size // self.state.dp_size
        n_micro = per_rank_mini // p.micro_batch_size
        sums: dict[str, float] = {}
        count = 0
        self.policy.train()
        for order in orders:
            for start in range(0, b, per_rank_mini):
                stats = self._minibatch_step(r, order[start : start + per_rank_mini], n_micro, first)
                first = None
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _minibatch_step(
        self, r: Rollout, idx: torch.Tensor, n_micro: int, first: FirstPass | None = None
    ) -> dict[str, float]:
        """One optimizer step on the rollout rows ``idx``, accumulated over ``n_micro`` micro-batches."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            acc = self._pipeline_backward(r, idx)
        else:
            acc = {}
            for micro in idx.chunk(n_micro):
                if first is not None:  # this pass's forward was run for the rollout log-probs
                    (logits, logp), first = first, None
                else:
                    logits = self.logprobs.logits(self.policy, r.tokens[micro], r.start)
                    logp = None
                loss, stats = self._micro_loss(r, micro, logits, logp)
                (loss / n_micro).backward()
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + float(v) / n_micro
        self.optimizer.allreduce_grads(self._dp_group, self.state.dp_size)  # fp32 master grads
        acc["policy/grad_norm"] = self.optimizer.clip_grad_norm(
            self.grad_clip,
            self._tp_group,
            self.state.tp_size,
            self.state.tp_rank,
            pp_group=self.state.pp_group if self.state.pp_size > 1 else None,
        )
        # Skipped (and counted in grad_norm as inf/nan) on a non-finite norm; sharded, it
        # all-gathers the weights (every DP rank steps here: the norm is the same on all).
        self.optimizer.step()
        self.scheduler.step()
        return acc

    def _micro_loss(
        self, r: Rollout, micro: torch.Tensor, logits: torch.Tensor, logp: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate (minus the entropy bonus) of the rollout rows ``micro`` from
        their ``logits [m, s - start, v]`` (``logp`` when already computed), and its statistics."""
        p = self.ppo
        mask = r.mask[micro]
        if logp is None:
            logp = self.logprobs.sequence_logprobs(logits, r.tokens[micro], r.start)
        loss, stats = rl.policy_loss(
            logp,
            r.old_logprobs[micro],
            r.advantages[micro],
            mask,
            clip_eps_low=p.clip_eps,
            clip_eps_high=p.clip_eps_high,
            dual_clip=p.dual_clip,
            agg=p.loss_agg,
        )
        if p.entropy_coef > 0:
            ent = self.logprobs.entropy(logits, r.start)
            loss = loss - p.entropy_coef * rl.aggregate(ent, mask, p.loss_agg)
        out = {"loss/policy": loss.detach()}
        out.update({f"policy/{k}": v for k, v in stats.items()})
        return loss, out

    def _pipeline_backward(self, r: Rollout, idx: torch.Tensor) -> dict[str, float]:
        """Forward and backward of the rows ``idx`` through the pipeline schedule (the last stage
        computes each micro-batch's loss); the statistics reach every stage."""

        def loss_fn(logits: torch.Tensor, rows: torch.Tensor):
            return self._micro_loss(r, idx[rows], logits)

        stats = self.pipeline.train(self.policy, r.tokens[idx], self.ppo.micro_batch_size, loss_fn, r.start)
        allreduce_tied_embedding_grads(self.policy, self.state, self.optimizer)
        return stats
