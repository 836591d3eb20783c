"""Advantage estimators ([GAE]).

Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import torch

__all__ = ["compute_gae"]

Tensor = torch.Tensor


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
