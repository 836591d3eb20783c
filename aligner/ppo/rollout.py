"""What one PPO step hands on: the rollout the policy update trains on, and the record of the step
that its metrics are computed from.

Both hold this data-parallel rank's rows: ``b`` prompts, padded length ``s``; per-token tensors
are ``[b, s-1]`` (docs/design.md, "Tensor conventions"). Metrics average over every
data-parallel rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner import rl
from aligner.generation.engine import GenerationOutput

__all__ = ["Rollout", "StepRecord", "global_mean"]


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
    """[b, s-1] float32 response mask."""
    old_logprobs: torch.Tensor
    """[b, s-1] float32 policy log-probs from the training forward before any update."""
    values: torch.Tensor
    """[b, s-1] float32 critic values at rollout time."""
    advantages: torch.Tensor
    """[b, s-1] float32 (whitened when configured)."""
    returns: torch.Tensor
    """[b, s-1] float32 value targets."""
    start: int = 0
    """First position whose logits any loss term reads (:func:`aligner.rl.loss_start`)."""


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
    critic_stats: dict[str, Any] | None
    """The critic's result for the previous step's batch (``loss``, ``grad_norm``), if any."""
    timers: dict[str, float]
    """``timers/<part>`` seconds."""

    def metrics(self, dp_group: Any = None) -> dict[str, float]:
        """The step's metrics, averaged over every data-parallel rank (collective over
        ``dp_group``: call on every rank)."""
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
            "objective/entropy": float(global_mean(self.entropy, mask, dp_group)),
            "objective/kl_coef": float(self.kl_coef),
            "critic/explained_variance": float(rl.explained_variance(self.values, self.returns, mask)),
            "rollout/response_length": float(row(resp_len)),
            "rollout/ended_fraction": float(row(gen.ended.float())),
            "rollout/logprob_mismatch_max": float(gen_mismatch),
            "rollout/logprob_mismatch_mean": float(global_mean(diff, mask, dp_group)),
            "lr": float(self.lr),
            **self.policy_stats,
            **self.timers,
        }
        m["throughput/tokens_per_s"] = float(n_tokens) / max(self.timers["timers/generate"], 1e-9)
        if self.critic_stats is not None:
            m["loss/value"] = float(self.critic_stats["loss"])
            m["critic/grad_norm"] = float(self.critic_stats["grad_norm"])
        return m
