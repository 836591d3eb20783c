"""Step 5 of a PPO step: from the server's scores and values and the log-probs of the rollout to
KL-shaped per-token rewards, advantages and returns (``ppo.advantage``).

A function of tensors and the run's ``ppo`` settings, with the score normaliser's state and the
data-parallel group as its only other inputs: the trainer calls it once per step, and the
device test (``tests/actor/test_actor_devices.py``) runs it with every input on a device that is
not the CPU, so that a tensor made on the wrong device fails there. All numbers come from
:mod:`aligner.rl`.

Shapes: ``b`` this data-parallel rank's samples, ``s`` padded length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aligner import rl
from aligner.actor.config import PPOConfig

__all__ = ["Shaped", "advantages_for", "shape_and_estimate", "shape_scores"]


@dataclass
class Shaped:
    """What step 5 made of a rollout."""

    scores: torch.Tensor
    """``[b]`` the scores as the rewards use them (penalties, clipping, normalisation)."""
    kl: torch.Tensor
    """``[b, s-1]`` per-token KL estimate of policy vs reference (0 outside the mask)."""
    rewards: torch.Tensor
    """``[b, s-1]`` KL-shaped per-token rewards (the score on each response's last token)."""
    non_score: torch.Tensor
    """``[b, s-1]`` the KL penalty part of ``rewards``."""
    loss_mask: torch.Tensor
    """``[b, s-1]`` the tokens the policy loss covers (the mask, without overlong responses
    under ``ppo.overlong_filtering``)."""
    advantages: torch.Tensor
    """``[b, s-1]``."""
    returns: torch.Tensor
    """``[b, s-1]`` the critic's targets (zeros for GRPO and RLOO)."""


def shape_and_estimate(
    p: PPOConfig,
    *,
    max_new_tokens: int,
    raw_scores: torch.Tensor,
    values: torch.Tensor,
    ended: torch.Tensor,
    response_lengths: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    beta: float,
    score_moments: rl.RunningMoments,
    group: Any = None,
) -> Shaped:
    """The server's ``raw_scores [b]`` and ``values [b, s-1]``, the rollout's response ``mask``,
    ``ended [b]`` and ``response_lengths [b]``, and the policy's and the reference's log-probs
    ``[b, s-1]`` -> :class:`Shaped`, with the KL coefficient ``beta``. Updates ``score_moments``
    under ``ppo.normalize_scores``; ``group``: the data-parallel group (None: this rank alone)."""
    scores = shape_scores(p, max_new_tokens, raw_scores, ended, response_lengths, score_moments, group)
    kl = rl.kl_penalty(old_logprobs, ref_logprobs, p.kl_estimator) * mask
    rewards, non_score = rl.shaped_rewards(scores, kl, mask, beta)
    # The tokens the policy loss covers: without the responses cut off (overlong filtering).
    loss_mask = rl.overlong_filter(mask, ended) if p.overlong_filtering else mask
    advantages, returns = advantages_for(p, rewards, values, mask, loss_mask, group)
    return Shaped(scores, kl, rewards, non_score, loss_mask, advantages, returns)


def shape_scores(
    p: PPOConfig,
    max_new_tokens: int,
    scores: torch.Tensor,
    ended: torch.Tensor,
    response_lengths: torch.Tensor,
    moments: rl.RunningMoments,
    group: Any = None,
) -> torch.Tensor:
    """The server's scores ``[b]`` as the rewards use them: the missing-EOS penalty, the soft
    overlong penalty (``ppo.overlong_buffer``), clipping, and the running normalisation
    (whose statistics this updates)."""
    scores = rl.apply_missing_eos_penalty(scores, ended, p.missing_eos_penalty)
    if p.overlong_buffer:
        scores = scores + rl.overlong_penalty(
            response_lengths, max_new_tokens, p.overlong_buffer, p.overlong_penalty
        )
    scores = rl.clip_scores(scores, p.score_clip)
    if p.normalize_scores:
        moments.update(scores, group=group)
        scores = moments.normalize(scores)
    return scores


def advantages_for(
    p: PPOConfig,
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[b, s-1]`` per ``ppo.advantage`` from the KL-shaped
    ``rewards``: GAE on the critic's ``values`` over the response ``mask`` (whitened over
    ``loss_mask``: the tokens the loss covers); critic-free, over ``loss_mask``: GRPO and RLOO
    within each group of ``samples_per_prompt`` adjacent rows, REINFORCE++ on token-level returns
    whitened over every data-parallel rank (``group``). Returns are the critic's targets (GAE),
    REINFORCE++'s returns-to-go, or zeros (GRPO, RLOO).

    GRPO and RLOO compare each row's sequence reward, its score plus its KL penalty
    (``-beta`` times its summed KL). Under GRPO's std normalisation a group of equal scores
    gets its samples' KL differences at unit size: within such a group the penalty pulls
    toward the reference at full strength, whatever beta is. Measured on 3-digit copy
    (tests/actor/test_group_estimators.py): this form reaches a 5-step mean of 0.8 by step 41;
    normalising the scores alone and adding the KL penalty centred at beta's scale reached 0.64
    in 50 steps, and the scores alone 0.43 (each group's samples collapse onto one response).
    """
    if p.advantage == "gae":
        advantages, returns = rl.compute_gae(rewards, values, mask, p.gamma, p.lam, p.value_lam)
        if p.whiten_advantages:
            advantages = rl.global_whiten(advantages, loss_mask, shift_mean=True, group=group)
        return advantages, returns
    if p.advantage == "reinforce_pp":
        return rl.reinforce_pp_advantages(rewards, loss_mask, p.gamma, group=group)
    sequence = rewards.sum(1)  # score - beta * KL over the response (rewards are 0 off the mask)
    if p.advantage == "grpo":
        advantages = rl.grpo_advantages(sequence, loss_mask, p.samples_per_prompt, p.grpo_std_norm)
    else:
        advantages = rl.rloo_advantages(sequence, loss_mask, p.samples_per_prompt)
    return advantages, torch.zeros_like(advantages)
