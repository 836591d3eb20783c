"""The clipped policy loss ([PPO], dual-clip, clip-higher), the clipped value loss, their
aggregation over tokens and sequences, and explained variance.

Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import torch

from aligner.rl.stats import LOG_RATIO_CLAMP, masked_mean, masked_var, safe_div

__all__ = ["AGG_MODES", "aggregate", "explained_variance", "policy_loss", "value_loss"]

Tensor = torch.Tensor

#: Allowed ``mode`` values of :func:`aggregate` (and of the ``agg`` argument of the losses).
AGG_MODES = ("token_mean", "seq_mean_token_mean")


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------


def aggregate(x: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce per-token values to a scalar.

    - ``"token_mean"``: mean over all response tokens of the batch (every token weighs the
      same; long responses weigh more).
    - ``"seq_mean_token_mean"``: mean over sequences of each sequence's token mean (every
      sequence weighs the same); rows without a response token are left out.

    Both return 0 for an all-masked batch. An entropy bonus is ``aggregate(entropy, mask,
    mode)``.

    Args:
        x: ``[b, s-1]``.
        mask: ``[b, s-1]``.
        mode: one of :data:`AGG_MODES`.

    Returns:
        0-dim float32 tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; allowed modes: {', '.join(AGG_MODES)}")
    if mode == "token_mean":
        return masked_mean(x, mask)
    per_row = masked_mean(x, mask, dim=-1)  # [b]
    has_tokens = (mask.float() != 0).any(dim=-1)
    return masked_mean(per_row, has_tokens)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss ([PPO] eq. 7), negated for minimisation.

    ``ratio = exp(logp - old_logp)``; per token
    ``L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``, the pessimistic
    bound. A larger ``eps_high`` than ``eps_low`` is DAPO's "clip-higher" [DAPO], which keeps
    low-probability tokens able to grow. With ``dual_clip = c > 1``, tokens with ``A < 0``
    are additionally bounded: ``L = min(L, -c * A)`` [Dual-clip], so a huge ratio on a
    negative-advantage token cannot produce an unbounded loss.

    The log-ratio is clamped to ``[-20, 20]`` before ``exp`` (as verl does): beyond that
    the ratio would be far outside any clip range anyway, and exp could overflow to inf.

    Stats (detached 0-dim float32, token means over the mask regardless of ``agg``):

    - ``clipfrac``: fraction of tokens where the clipped term is the active (larger) one.
    - ``approxkl``: ``mean(0.5 * (logp - old_logp)^2)``, the estimator TRL logs (it is
      [KL-blog]'s k2; low variance, non-negative, close to KL for nearby policies).
    - ``ratio_mean`` / ``ratio_var``: mean and population variance of the ratio.
    - ``dual_clipfrac`` (only with ``dual_clip``): fraction of tokens bounded by ``-c * A``.

    Args:
        logp: ``[b, s-1]`` log-probs under the current policy (with grad).
        old_logp: ``[b, s-1]`` log-probs at rollout time.
        advantages: ``[b, s-1]``.
        mask: ``[b, s-1]`` response mask.
        clip_eps_low: lower clip range (ratio >= 1 - eps_low).
        clip_eps_high: upper clip range (ratio <= 1 + eps_high); None = ``clip_eps_low``.
        dual_clip: dual-clip constant ``c > 1``, or None.
        agg: aggregation mode, see :func:`aggregate`.

    Returns:
        ``(loss, stats)``; ``loss`` is a 0-dim float32 tensor.
    """
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if not 0 <= clip_eps_low < 1:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {clip_eps_low!r}")
    if not clip_eps_high >= 0:
        raise ValueError(f"clip_eps_high must be >= 0, got {clip_eps_high!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {agg!r}; allowed modes: {', '.join(AGG_MODES)}")

    adv = advantages.float()
    log_ratio = logp.float() - old_logp.float()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask),
            "approxkl": masked_mean(0.5 * log_ratio.detach() ** 2, mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "ratio_var": masked_var(ratio.detach(), mask, unbiased=False),
        }

    if dual_clip is not None:
        pg_dual = -adv * dual_clip
        negative = adv < 0
        with torch.no_grad():
            stats["dual_clipfrac"] = masked_mean((negative & (pg > pg_dual)).float(), mask)
        pg = torch.where(negative, torch.minimum(pg, pg_dual), pg)

    return aggregate(pg, mask, agg), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    agg: str = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ([N+], as in OpenAI's baselines PPO2).

    ``L = 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``, pessimistic
    like the policy loss; ``clip_eps=None`` gives the plain ``0.5 * (V - R)^2``.

    Args:
        values: ``[b, s-1]`` current value predictions (with grad).
        old_values: ``[b, s-1]`` value predictions at rollout time.
        returns: ``[b, s-1]`` value targets (see :func:`compute_gae`).
        mask: ``[b, s-1]`` response mask.
        clip_eps: clip range, or None for no clipping.
        agg: aggregation mode, see :func:`aggregate`.

    Returns:
        ``(loss, {"value_clipfrac": ...})``; ``value_clipfrac`` (detached 0-dim, token mean)
        is the fraction of tokens where the clipped term is the larger one (0 unclipped).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {agg!r}; allowed modes: {', '.join(AGG_MODES)}")
    v = values.float()
    ret = returns.float()
    vf_unclipped = (v - ret) ** 2
    if clip_eps is None:
        per_token = 0.5 * vf_unclipped
        clipfrac = torch.zeros((), device=v.device)
    else:
        if not clip_eps > 0:
            raise ValueError(f"value clip_eps must be > 0 or None, got {clip_eps!r}")
        old = old_values.float()
        v_clipped = old + (v - old).clamp(-clip_eps, clip_eps)
        vf_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(vf_unclipped, vf_clipped)
        with torch.no_grad():
            clipfrac = masked_mean((vf_clipped > vf_unclipped).float(), mask)
    return aggregate(per_token, mask, agg), {"value_clipfrac": clipfrac}


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked positions.

    1 is a perfect critic, 0 is no better than a constant, negative is worse than a
    constant. When ``Var(R) == 0`` (including an all-masked or single-token batch) the
    ratio is undefined and 0 is returned, so that logging never sees NaN. Population
    variances (Bessel's factor cancels in the ratio).

    Args:
        values: ``[b, s-1]``.
        returns: ``[b, s-1]``.
        mask: ``[b, s-1]``.

    Returns:
        0-dim float32 tensor.
    """
    ret = returns.float()
    var_ret = masked_var(ret, mask, unbiased=False)
    var_err = masked_var(ret - values.float(), mask, unbiased=False)
    ev = 1.0 - safe_div(var_err, var_ret)
    return torch.where(var_ret > 0, ev, torch.zeros_like(ev))
