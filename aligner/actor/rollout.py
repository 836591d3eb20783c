"""What one PPO step hands on: the rollout the policy update trains on, and the record of the step
that its metrics are computed from.

Both hold this data-parallel rank's rows: ``b`` prompts, padded length ``s``; per-token tensors
are ``[b, s-1]`` (docs/design.md, "Tensor conventions"). Metrics average over every
data-parallel rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner import rl
from aligner.distributed import ParallelState, comm_device
from aligner.generation.engine import GenerationOutput
from aligner.histograms import Histogram, distributions
from aligner.wire.protocol import TrainResult

__all__ = [
    "GroupFilter",
    "Rollout",
    "StepRecord",
    "cat_generations",
    "fill_by_rounds",
    "global_mean",
    "informative_groups",
]


@dataclass
class Rollout:
    """This data-parallel rank's experience for one step (``b`` prompts, padded length ``s``)."""

    tokens: torch.Tensor
    """[b, s] int64 prompt + response, right-padded."""
    lengths: torch.Tensor
    """[b] int64."""
    prompt_lengths: torch.Tensor
    """[b] int64."""
    mask: torch.Tensor
    """[b, s-1] float32 loss mask: the response mask, without the responses that never ended
    under ``ppo.overlong_filtering``."""
    old_logprobs: torch.Tensor
    """[b, s-1] float32 policy log-probs from the training forward before any update."""
    values: torch.Tensor
    """[b, s-1] float32 critic values at rollout time (unused by critic-free estimators)."""
    advantages: torch.Tensor
    """[b, s-1] float32 (whitened when configured)."""
    returns: torch.Tensor
    """[b, s-1] float32 value targets (critic-free: REINFORCE++'s returns-to-go, else zeros)."""
    start: int = 0
    """First position whose logits any loss term reads (:func:`aligner.rl.loss_start`)."""
    behaviour_logprobs: torch.Tensor | None = None
    """[b, s-1] float32 the generation engine's log-probs of the rollout, for ``ppo.tis_cap``
    (None without it)."""


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``scores [b]`` (groups: contiguous blocks of ``group_size`` rows) -> ``[b / group_size]``
    bool: True for the groups whose scores are not all equal. A group of equal scores carries no
    signal under GRPO and RLOO (its advantages are its samples' KL differences alone): DAPO's
    dynamic sampling drops it. The scores are the server's, before any shaping, as in DAPO."""
    g = scores.reshape(-1, group_size)
    return (g != g[:, :1]).any(dim=1)


def cat_generations(parts: list[GenerationOutput], pad_id: int) -> GenerationOutput:
    """The rows of several generation outputs as one, right padded to the longest ``s`` (tokens
    with ``pad_id``, log-probs with 0)."""
    s = max(g.tokens.shape[1] for g in parts)

    def pad(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return GenerationOutput(
        tokens=torch.cat([pad(g.tokens, s, pad_id) for g in parts]),
        lengths=torch.cat([g.lengths for g in parts]),
        prompt_lengths=torch.cat([g.prompt_lengths for g in parts]),
        logprobs=torch.cat([pad(g.logprobs, s - 1, 0.0) for g in parts]),
        ended=torch.cat([g.ended for g in parts]),
    )


def _rows(gen: GenerationOutput, idx: torch.Tensor) -> GenerationOutput:
    """Rows ``idx`` of ``gen`` (trimmed to their longest sample)."""
    lengths = gen.lengths[idx]
    s = int(lengths.max()) if idx.numel() else 1
    return GenerationOutput(
        tokens=gen.tokens[idx, :s],
        lengths=lengths,
        prompt_lengths=gen.prompt_lengths[idx],
        logprobs=gen.logprobs[idx, : s - 1],
        ended=gen.ended[idx],
    )


class GroupFilter:
    """DAPO's dynamic sampling on one rank: fills a batch of ``capacity`` rows with informative
    groups (:func:`informative_groups`) over generation rounds.

    Each round's output is :meth:`add`-ed with the server's values and scores; its informative
    groups are kept in order until the batch is full (the rest of them are dropped), its
    groups of equal scores are set aside. :meth:`batch` returns the kept rows, filled up, when
    the rounds ran out before the batch was full, with the set-aside groups (in the order they
    came): every rank ends with ``capacity`` rows, whole groups of ``group_size``."""

    def __init__(self, capacity: int, group_size: int, pad_id: int) -> None:
        if capacity % group_size:
            raise ValueError(f"capacity {capacity} is not a whole number of groups of {group_size}")
        self.capacity, self.group_size, self.pad_id = capacity, group_size, pad_id
        self.kept: list[tuple[GenerationOutput, torch.Tensor, torch.Tensor]] = []
        self.spare: list[tuple[GenerationOutput, torch.Tensor, torch.Tensor]] = []
        self.rows = 0
        """Rows kept so far."""
        self.filtered = 0
        """Groups of equal scores seen so far (set aside, used only to fill up)."""

    @property
    def missing(self) -> int:
        """Rows the batch still lacks."""
        return self.capacity - self.rows

    def add(self, gen: GenerationOutput, values: torch.Tensor, scores: torch.Tensor) -> None:
        """One round: ``gen`` (``b`` rows, whole groups), its ``values [b, s-1]`` and ``scores [b]``."""
        n = self.group_size
        good = informative_groups(scores, n)
        self.filtered += int((~good).sum())
        offsets = torch.arange(n, device=scores.device)
        for groups, into in (
            (good.nonzero().flatten(), self.kept),
            ((~good).nonzero().flatten(), self.spare),
        ):
            if into is self.kept:
                groups = groups[: self.missing // n]
                self.rows += groups.numel() * n
            if groups.numel():
                idx = (groups.unsqueeze(1) * n + offsets).reshape(-1)
                part = _rows(gen, idx)
                into.append((part, values[idx, : part.tokens.shape[1] - 1], scores[idx]))

    def batch(self) -> tuple[GenerationOutput, torch.Tensor, torch.Tensor]:
        """``(gen, values [capacity, s-1], scores [capacity])``: the kept rows, then set-aside
        groups up to ``capacity`` rows when the kept ones are fewer."""
        parts, need = list(self.kept), self.missing
        for gen, values, scores in self.spare:
            if need <= 0:
                break
            take = min(need, scores.numel())
            part = _rows(gen, torch.arange(take, device=scores.device))
            parts.append((part, values[:take, : part.tokens.shape[1] - 1], scores[:take]))
            need -= take
        if need > 0:
            raise ValueError(f"dynamic sampling: {self.capacity - need} rows for a batch of {self.capacity}")
        s = max(g.tokens.shape[1] for g, _, _ in parts)
        values = torch.cat([torch.nn.functional.pad(v, (0, s - 1 - v.shape[1])) for _, v, _ in parts])
        return (
            cat_generations([g for g, _, _ in parts], self.pad_id),
            values,
            torch.cat([x for _, _, x in parts]),
        )


def fill_by_rounds(
    fill: GroupFilter,
    one_round: Callable[[int], tuple[GenerationOutput, torch.Tensor, torch.Tensor]],
    max_rounds: int,
    state: ParallelState,
) -> tuple[GenerationOutput, torch.Tensor, torch.Tensor, dict[str, float]]:
    """DAPO's dynamic sampling over generation rounds: ``one_round(n)`` (``n`` from 1) draws a
    step's prompts, generates and scores them (``gen``, its ``values [b, s-1]`` and ``scores
    [b]``), and ``fill`` keeps the groups whose scores differ, until every rank's batch is full or
    ``max_rounds`` ran out (then it is filled up with groups of equal scores). Every rank runs the
    same rounds (one all-reduce each), so the prompt order stays one. Returns the batch ``(gen,
    values, scores)`` and the metrics ``rollout/filtered_groups`` (groups of equal scores met, over
    every rank and round) and ``rollout/generation_rounds``."""
    rounds = 0
    while True:
        rounds += 1
        fill.add(*one_round(rounds))
        missing = torch.tensor([fill.missing], dtype=torch.int64)
        if state.world_size > 1:  # every rank goes on while any rank's batch is short
            missing = missing.to(comm_device())
            dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        if int(missing.item()) == 0 or rounds >= max_rounds:
            break
    filtered = torch.tensor([float(fill.filtered)])
    if state.dp_size > 1:
        filtered = filtered.to(comm_device())
        dist.all_reduce(filtered, group=state.dp_group)
    gen, values, scores = fill.batch()
    stats = {
        "rollout/filtered_groups": float(filtered.item()),
        "rollout/generation_rounds": float(rounds),
    }
    return gen, values, scores, stats


def global_mean(x: torch.Tensor, mask: torch.Tensor | None, group: Any = None) -> torch.Tensor:
    """Mean of ``x`` over every data-parallel rank's elements (those of ``mask`` when given)."""
    return rl.global_masked_mean(x, torch.ones_like(x) if mask is None else mask, group=group)


@dataclass
class StepRecord:
    """What one step produced that its metrics are computed from."""

    gen: GenerationOutput
    """The engine's output: tokens, lengths, its own log-probs ``[b, s-1]``, ``ended [b]``."""
    mask: torch.Tensor
    """[b, s-1] float32 response mask."""
    scores: torch.Tensor
    """[b] float32 the server's scores, before any penalty, clipping or normalisation."""
    kl: torch.Tensor
    """[b, s-1] float32 per-token KL estimate of policy vs reference (0 outside the mask)."""
    non_score: torch.Tensor
    """[b, s-1] float32 the KL penalty part of the shaped rewards."""
    entropy: torch.Tensor
    """[b, s-1] float32 entropy of the sampling distribution."""
    old_logprobs: torch.Tensor
    """[b, s-1] float32 the training forward's log-probs of the rollout."""
    values: torch.Tensor
    """[b, s-1] float32 critic values at rollout time."""
    returns: torch.Tensor
    """[b, s-1] float32 value targets."""
    kl_coef: float
    """The KL coefficient (beta) the rewards were shaped with."""
    lr: float
    """The policy's learning rate after the step's updates."""
    policy_stats: dict[str, float]
    """``loss/policy`` and ``policy/*``, averaged over the step's minibatches."""
    critic_stats: TrainResult | None
    """The critic's result for the previous step's batch (``loss``, ``grad_norm``), if any."""
    timers: dict[str, float]
    """``timers/<part>`` seconds."""
    critic_free: bool = False
    """No critic in this run (``ppo.advantage``): no critic metrics."""
    loss_mask: torch.Tensor | None = None
    """[b, s-1] the loss mask when ``ppo.overlong_filtering`` made one (``rollout/overlong_filtered``:
    the fraction of responses it left out), else None."""
    advantages: torch.Tensor | None = None
    """[b, s-1] float32 the advantages the policy trained on (``critic/advantages/*``), if given."""
    episode: int | None = None
    """Samples trained on since the run began, this step's included (``train/episode``)."""
    histogram_bins: int = 0
    """Buckets of the step's histograms (:meth:`summary`); 0: none this step."""

    def metrics(self, dp_group: Any = None) -> dict[str, float]:
        """The step's metrics, averaged over every data-parallel rank (collective over
        ``dp_group``: call on every rank)."""
        return self.summary(dp_group)[0]

    def distributions(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """What the step's distributions are of (verl's names): ``critic/score`` (the server's
        scores), ``response_length`` (tokens), and over the response tokens
        ``critic/advantages`` and, with a critic, ``critic/returns`` and ``critic/values``."""
        gen = self.gen
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
            "critic/score": (self.scores, None),
            "response_length": ((gen.lengths - gen.prompt_lengths).float(), None),
        }
        if self.advantages is not None:
            out["critic/advantages"] = (self.advantages, self.mask)
        if not self.critic_free:
            out["critic/returns"] = (self.returns, self.mask)
            out["critic/values"] = (self.values, self.mask)
        return out

    def summary(self, dp_group: Any = None) -> tuple[dict[str, float], dict[str, Histogram]]:
        """:meth:`metrics`, and the histograms of :meth:`distributions` over every data-parallel
        rank when ``histogram_bins`` > 0 (collective over ``dp_group``: call on every rank)."""
        row = lambda x: global_mean(x, None, dp_group)  # noqa: E731 - per-sample means over all DP rows
        gen, mask = self.gen, self.mask
        resp_len = (gen.lengths - gen.prompt_lengths).float()
        diff = (gen.logprobs - self.old_logprobs).abs() * mask
        gen_mismatch = diff.max()
        n_tokens = resp_len.sum()
        if dp_group is not None:
            dist.all_reduce(gen_mismatch, op=dist.ReduceOp.MAX, group=dp_group)
            dist.all_reduce(n_tokens, group=dp_group)
        m = {
            "objective/scores": float(row(self.scores)),
            "objective/kl": float(row(self.kl.sum(1))),
            "objective/non_score_reward": float(row(self.non_score.sum(1))),
            "objective/kl_coef": float(self.kl_coef),
            "rollout/entropy": float(global_mean(self.entropy, mask, dp_group)),
            "rollout/ended_fraction": float(row(gen.ended.float())),
            "rollout/logprob_mismatch_max": float(gen_mismatch),
            "rollout/logprob_mismatch_mean": float(global_mean(diff, mask, dp_group)),
            "lr": float(self.lr),
            **self.policy_stats,
            **self.timers,
        }
        if self.episode is not None:
            m["train/episode"] = float(self.episode)
        m["throughput/tokens_per_s"] = float(n_tokens) / max(self.timers["timers/generate"], 1e-9)
        if not self.critic_free:
            # over every data-parallel rank's rows, not this rank's alone
            m["critic/vf_explained_var"] = float(
                rl.explained_variance(self.values, self.returns, mask, dp_group)
            )
        if self.loss_mask is not None:
            dropped = (self.loss_mask.sum(1) == 0) & (mask.sum(1) > 0)
            m["rollout/overlong_filtered"] = float(row(dropped.float()))
        if self.critic_stats is not None:  # the server's update of the previous step's batch
            m.update(self.critic_stats.metrics())
        scalars, hists = distributions(self.distributions(), dp_group, self.histogram_bins)
        m.update(scalars)
        return m, hists
