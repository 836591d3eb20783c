"""Advantage estimators: GAE with a critic ([GAE]), and the critic-free ones: GRPO ([GRPO],
[Dr-GRPO]), RLOO ([RLOO]) and REINFORCE++ ([REINFORCE++]).

Groups. GRPO and RLOO compare the samples of one prompt with each other: a batch of ``b`` rows
holds ``b / n`` groups of ``n`` samples (``ppo.samples_per_prompt``), each group **a contiguous
block of n rows** (rows ``g*n .. g*n+n-1`` are the samples of prompt ``g``), which is how the
actor's prompt sampler lays a step out. Their inputs are sequence-level rewards ``[b]``; their
advantages are broadcast over each row's response tokens, 0 off the mask.

Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aligner.rl.stats import global_whiten

__all__ = [
    "ESTIMATORS",
    "CRITIC_FREE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "compute_gae",
    "grpo_advantages",
    "group_score_std",
    "reinforce_pp_advantages",
    "returns_to_go",
    "rloo_advantages",
]

Tensor = torch.Tensor

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
"""What ``ppo.advantage`` may name."""
CRITIC_FREE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
"""The estimators that need no critic (no values, no critic training)."""
GROUP_ESTIMATORS = ("grpo", "rloo")
"""The estimators that compare the samples of one prompt (``samples_per_prompt >= 2``)."""

GRPO_EPS = 1e-6
"""Added to a group's standard deviation before dividing by it (a group whose scores are all
equal then gets advantages 0, not NaN)."""


# ---------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    value_lam: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation [GAE] over the response transitions only.

    ``delta_t = r_t + gamma * V_next - V_t``; ``A_t = delta_t + gamma * lam * A_next``,
    where "next" is the next *masked* position: the backward walk carries ``V_next`` and
    ``A_next`` unchanged through positions with mask 0, so neither padding after the
    response nor the prompt before it (nor any hole) leaks in. The value after the last
    response transition is 0 (the episode ends there).

    Returns are the value targets ``GAE(value_lam) + V``. A separate ``value_lam`` (e.g.
    1.0, i.e. Monte-Carlo returns, with a smaller ``lam`` for the policy) follows
    NeMo-RL / [VAPO]; None uses ``lam``.

    Vectorised over the batch; the loop is over time only. No gradient (these are targets).

    Args:
        rewards: ``[b, s-1]`` per-token rewards (see :func:`shaped_rewards`).
        values: ``[b, s-1]`` value estimates from rollout time.
        mask: ``[b, s-1]`` response mask.
        gamma: discount.
        lam: GAE lambda for the advantages.
        value_lam: GAE lambda for the returns, or None for ``lam``.

    Returns:
        ``(advantages, returns)``, both ``[b, s-1]`` float32, 0 where ``mask`` is 0.
    """
    r = rewards.float()
    v = values.float()
    on = mask.float() != 0
    n_rows, n_steps = r.shape
    if n_steps == 0:
        return torch.zeros_like(r), torch.zeros_like(r)
    separate = value_lam is not None and value_lam != lam
    ret_lam = lam if value_lam is None else value_lam

    zeros = r.new_zeros(n_rows)
    next_value = zeros
    next_adv = zeros
    next_ret_adv = zeros
    adv_cols: list[Tensor] = [zeros] * n_steps
    ret_adv_cols: list[Tensor] = [zeros] * n_steps
    for t in reversed(range(n_steps)):
        on_t = on[:, t]
        # Off-mask entries (NaN values of padding, say) are computed but never selected.
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        adv_cols[t] = torch.where(on_t, adv_t, zeros)
        next_adv = torch.where(on_t, adv_t, next_adv)
        if separate:
            ret_adv_t = delta + gamma * ret_lam * next_ret_adv
            ret_adv_cols[t] = torch.where(on_t, ret_adv_t, zeros)
            next_ret_adv = torch.where(on_t, ret_adv_t, next_ret_adv)
        next_value = torch.where(on_t, v[:, t], next_value)

    advantages = torch.stack(adv_cols, dim=1)
    ret_adv = torch.stack(ret_adv_cols, dim=1) if separate else advantages
    returns = torch.where(on, ret_adv + torch.where(on, v, torch.zeros_like(v)), torch.zeros_like(v))
    return advantages, returns


# ---------------------------------------------------------------------------------------
# Critic-free estimators
# ---------------------------------------------------------------------------------------


def _grouped(scores: Tensor, group_size: int, what: str, min_size: int = 1) -> Tensor:
    """``scores [b]`` as ``[b / n, n]`` float32 (each row one group: contiguous blocks of ``n``)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_size:
        raise ValueError(f"{what}: group_size={group_size!r}: expected an integer >= {min_size}")
    x = scores.detach().float().reshape(-1)
    if x.numel() % group_size:
        raise ValueError(
            f"{what}: {x.numel()} scores do not split into groups of group_size={group_size} "
            "(each prompt's samples are a contiguous block of group_size rows)"
        )
    return x.reshape(-1, group_size)


def _per_token(seq: Tensor, mask: Tensor) -> Tensor:
    """Sequence-level ``seq [b]`` on every response token of its row: ``[b, s-1]``, 0 off ``mask``."""
    on = mask.float() != 0
    seq = seq.to(on.device).reshape(-1, 1).expand(on.shape)
    return torch.where(on, seq, torch.zeros((), dtype=torch.float32, device=on.device))


@torch.no_grad()
def grpo_advantages(
    scores: Tensor, mask: Tensor, group_size: int, std_norm: bool = True, eps: float = GRPO_EPS
) -> Tensor:
    """Group-relative advantages [GRPO]: each sample's score against its group's.

    ``A_i = r_i - mean(group)``, divided by ``std(group) + eps`` with ``std_norm`` (GRPO; the
    standard deviation is the unbiased one, as ``torch.std``), not divided without it
    ([Dr-GRPO]: the division favours groups whose scores barely differ, too easy or too hard
    prompts). A group whose scores are all equal gets 0 either way: nothing to learn from it.
    The same value on every response token of the sample (outcome supervision).

    Args:
        scores: ``[b]`` sequence-level rewards; groups are contiguous blocks of ``group_size``
            rows (module docstring).
        mask: ``[b, s-1]`` response (loss) mask.
        group_size: samples per prompt ``n >= 2``.
        std_norm: divide by the group's standard deviation.
        eps: added to that standard deviation.

    Returns:
        ``[b, s-1]`` float32, 0 where ``mask`` is 0.
    """
    g = _grouped(scores, group_size, "grpo_advantages", min_size=2)
    adv = g - g.mean(dim=1, keepdim=True)
    if std_norm:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return _per_token(adv.reshape(-1), mask)


@torch.no_grad()
def rloo_advantages(scores: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out [RLOO]: ``A_i = r_i - mean_{j != i} r_j`` over the sample's group.

    Each sample's baseline is the mean score of the other ``n - 1`` samples of its prompt, so
    it does not depend on the sample itself (an unbiased estimate). Equal to
    ``n / (n - 1) * (r_i - mean(group))``. The same value on every response token.

    Args:
        scores: ``[b]`` sequence-level rewards; groups are contiguous blocks of ``group_size``.
        mask: ``[b, s-1]`` response (loss) mask.
        group_size: samples per prompt ``n >= 2``.

    Returns:
        ``[b, s-1]`` float32, 0 where ``mask`` is 0.
    """
    g = _grouped(scores, group_size, "rloo_advantages", min_size=2)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return _per_token((g - others).reshape(-1), mask)


@torch.no_grad()
def group_score_std(scores: Tensor, group_size: int) -> Tensor:
    """The mean over groups of each group's (unbiased) score standard deviation: how much the
    samples of one prompt differ, i.e. how much a group estimator has to learn from
    (``rollout/group_score_std``). 0-dim float32; 0 for groups of one.

    Args:
        scores: ``[b]``; groups are contiguous blocks of ``group_size`` rows.
    """
    g = _grouped(scores, group_size, "group_score_std")
    if group_size < 2:
        return torch.zeros((), dtype=torch.float32)
    return g.std(dim=1).mean()


@torch.no_grad()
def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Discounted returns-to-go over the response transitions: ``G_t = r_t + gamma * G_next``,
    where "next" is the next masked position (holes and padding are skipped, as in
    :func:`compute_gae`), and ``G`` after the last response transition is 0.

    Args:
        rewards: ``[b, s-1]`` per-token rewards (:func:`shaped_rewards`).
        mask: ``[b, s-1]`` response mask.
        gamma: discount.

    Returns:
        ``[b, s-1]`` float32, 0 where ``mask`` is 0.
    """
    r = rewards.float()
    on = mask.float() != 0
    n_rows, n_steps = r.shape
    zeros = r.new_zeros(n_rows)
    running = zeros
    cols: list[Tensor] = [zeros] * n_steps
    for t in reversed(range(n_steps)):
        g_t = r[:, t] + gamma * running  # off-mask values (NaN padding) are never selected
        cols[t] = torch.where(on[:, t], g_t, zeros)
        running = torch.where(on[:, t], g_t, running)
    return torch.stack(cols, dim=1) if n_steps else torch.zeros_like(r)


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    gamma: float,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ [REINFORCE++]: token-level returns-to-go of the KL-shaped rewards, with the
    global batch's mean as the baseline, whitened over the global batch.

    ``G = returns_to_go(rewards, mask, gamma)``; ``A = (G - mean(G)) / sqrt(var(G) + eps)``
    with the mean and (unbiased) variance over every response token of every data-parallel
    rank in ``group`` (:func:`global_whiten`), so DP ranks share one baseline and one scale.

    Args:
        rewards: ``[b, s-1]`` per-token rewards: ``-beta * kl_t`` on every response token and
            the score at the last one (:func:`shaped_rewards`).
        mask: ``[b, s-1]`` response (loss) mask: the tokens the statistics and the loss cover.
        gamma: discount of the returns.
        group: the data-parallel group (None: this batch alone).
        eps: added to the variance.

    Returns:
        ``(advantages, returns)``, both ``[b, s-1]`` float32 and 0 where ``mask`` is 0.
    """
    returns = returns_to_go(rewards, mask, gamma)
    return global_whiten(returns, mask, shift_mean=True, eps=eps, group=group), returns
