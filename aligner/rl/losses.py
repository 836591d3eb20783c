"""The clipped policy loss ([PPO], dual-clip, clip-higher, truncated importance sampling), the
clipped value loss, their aggregation over tokens and sequences, and explained variance.

A loss over a batch cut into parts (micro-batches, data-parallel ranks) is the loss of the whole
batch when each part's loss is its terms' sum divided by the whole batch's count
(:func:`loss_normaliser` summed over the parts, the ``normaliser`` argument of
:func:`aggregate` and the losses) and the parts' gradients are summed; likewise the policy
loss's statistics add up over parts as sums (:func:`policy_stat_sums`,
:func:`policy_stats_from_sums`).

Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aligner.rl.stats import LOG_RATIO_CLAMP, global_masked_var, masked_mean, masked_sum, masked_var, safe_div

__all__ = [
    "AGG_MODES",
    "aggregate",
    "explained_variance",
    "loss_normaliser",
    "policy_loss",
    "policy_stat_sums",
    "policy_stats_from_sums",
    "value_loss",
]

Tensor = torch.Tensor

#: Allowed ``mode`` values of :func:`aggregate` (and of the ``agg`` argument of the losses).
AGG_MODES = ("token_mean", "seq_mean_token_mean")


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; allowed modes: {', '.join(AGG_MODES)}")


def loss_normaliser(mask: Tensor, mode: str) -> Tensor:
    """What :func:`aggregate` divides by: the response tokens of ``mask [b, s-1]``
    (``"token_mean"``) or its rows with at least one (``"seq_mean_token_mean"``), as a 0-dim
    float32 tensor. Counts add up: summed over the parts of a batch (micro-batches, data-parallel
    ranks) it is the whole batch's normaliser."""
    _check_mode(mode)
    m = mask.float()
    if mode == "token_mean":
        return m.sum()
    return (m != 0).any(dim=-1).float().sum()


def aggregate(x: Tensor, mask: Tensor, mode: str, normaliser: Tensor | float | None = None) -> Tensor:
    """Reduce per-token values to a scalar.

    - ``"token_mean"``: mean over all response tokens of the batch (every token weighs the
      same; long responses weigh more): the masked sum over the number of masked tokens.
    - ``"seq_mean_token_mean"``: mean over sequences of each sequence's token mean (every
      sequence weighs the same): the sum of the row means over the number of rows with a
      response token (rows without one are left out).

    ``normaliser`` replaces the count divided by (default :func:`loss_normaliser` of ``mask``):
    given the count of a whole batch of which ``x`` is one part, the parts' results add up to
    the whole batch's. Both return 0 for an all-masked batch or a normaliser of 0. An entropy
    bonus is ``aggregate(entropy, mask, mode, normaliser)``.

    Args:
        x: ``[b, s-1]``.
        mask: ``[b, s-1]``.
        mode: one of :data:`AGG_MODES`.
        normaliser: the count to divide by (0-dim tensor or number), or None.

    Returns:
        0-dim float32 tensor.
    """
    _check_mode(mode)
    if mode == "token_mean":
        total = masked_sum(x, mask)
    else:
        total = masked_mean(x, mask, dim=-1).sum()  # rows without a token have mean 0
    if normaliser is None:
        normaliser = loss_normaliser(mask, mode)
    return safe_div(total, torch.as_tensor(normaliser, dtype=torch.float32, device=total.device))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    normaliser: Tensor | float | None = None,
    behaviour_logp: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss ([PPO] eq. 7), negated for minimisation.

    ``ratio = exp(logp - old_logp)``; per token
    ``L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``, the pessimistic
    bound. A larger ``eps_high`` than ``eps_low`` is DAPO's "clip-higher" [DAPO], which keeps
    low-probability tokens able to grow. With ``dual_clip = c > 1``, tokens with ``A < 0``
    are additionally bounded: ``L = min(L, -c * A)`` [Dual-clip], so a huge ratio on a
    negative-advantage token cannot produce an unbounded loss.

    With ``tis_cap = C`` (truncated importance sampling [TIS]), each token's term is weighted by
    ``w = min(exp(old_logp - behaviour_logp), C)``, detached: ``behaviour_logp`` are the
    log-probs of the policy that sampled the token (the generation engine's), ``old_logp`` those
    the ratio is taken against (the training forward's, the proximal policy of decoupled PPO
    [Decoupled]). It corrects the loss for the gap between the two, whether rounding (another
    kernel, another precision) or age (a rollout generated by an older version); ``w`` is 1
    where they agree.

    The log-ratio is clamped to ``[-20, 20]`` before ``exp`` (as verl does): beyond that
    the ratio would be far outside any clip range anyway, and exp could overflow to inf.

    Stats (detached 0-dim float32, token means over the mask regardless of ``agg``):

    - ``clipfrac``: fraction of tokens where the clipped term is the active (larger) one.
    - ``approxkl``: ``mean(0.5 * (logp - old_logp)^2)``, the estimator TRL logs (it is
      [KL-blog]'s k2; low variance, non-negative, close to KL for nearby policies).
    - ``ratio_mean`` / ``ratio_var``: mean and population variance of the ratio.
    - ``dual_clipfrac`` (only with ``dual_clip``): fraction of tokens bounded by ``-c * A``.
    - ``tis_weight_mean`` / ``tis_truncfrac`` (only with ``tis_cap``): the mean weight ``w``
      and the fraction of tokens whose weight was truncated at ``C``.

    Over a batch cut into parts: :func:`policy_stat_sums` of each part's statistics add up to
    the whole batch's (:func:`policy_stats_from_sums`).

    Args:
        logp: ``[b, s-1]`` log-probs under the current policy (with grad).
        old_logp: ``[b, s-1]`` log-probs at rollout time.
        advantages: ``[b, s-1]``.
        mask: ``[b, s-1]`` response mask.
        clip_eps_low: lower clip range (ratio >= 1 - eps_low).
        clip_eps_high: upper clip range (ratio <= 1 + eps_high); None = ``clip_eps_low``.
        dual_clip: dual-clip constant ``c > 1``, or None.
        agg: aggregation mode, see :func:`aggregate`.
        normaliser: the count the loss divides by (:func:`aggregate`); None: this batch's.
        behaviour_logp: ``[b, s-1]`` log-probs of the sampling policy, with ``tis_cap``.
        tis_cap: the truncation ``C >= 1`` of the importance weight, or None (no weight).

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
    if tis_cap is not None and not tis_cap >= 1:
        raise ValueError(f"tis_cap must be >= 1 or None, got {tis_cap!r}")
    if tis_cap is not None and behaviour_logp is None:
        raise ValueError("tis_cap needs behaviour_logp, the sampling policy's log-probs")
    _check_mode(agg)

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

    if tis_cap is not None:
        with torch.no_grad():
            gap = old_logp.float() - behaviour_logp.float()
            raw = torch.exp(gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            weight = raw.clamp(max=tis_cap)
            stats["tis_weight_mean"] = masked_mean(weight, mask)
            stats["tis_truncfrac"] = masked_mean((raw > tis_cap).float(), mask)
        pg = pg * weight

    return aggregate(pg, mask, agg, normaliser), stats


def policy_stat_sums(stats: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """One batch's statistics of :func:`policy_loss` (token means over ``mask``; any other token
    mean over the same mask, an entropy say, alike) as float64 sums that add up over the parts
    of a larger batch: ``tokens`` (the mask's count), each token mean times it, and in place of
    ``ratio_var`` the sum of squared deviations of the ratio from 1, ``ratio_sqdev`` (from 1,
    not from 0, so that a small variance survives the subtraction that recovers it).
    :func:`policy_stats_from_sums` of the parts' summed sums gives the whole batch's statistics."""
    n = mask.detach().float().sum().double()
    out = {"tokens": n}
    for key, value in stats.items():
        if key != "ratio_var":
            out[key] = value.detach().double() * n
    if "ratio_var" in stats:
        dev = stats["ratio_mean"].detach().double() - 1.0
        out["ratio_sqdev"] = (stats["ratio_var"].detach().double() + dev * dev) * n
    return out


def policy_stats_from_sums(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """The statistics (token means; ``ratio_var`` the population variance) of the batch whose
    parts' :func:`policy_stat_sums` were summed into ``sums`` (element-wise: each value may hold
    several batches' sums side by side). 0 where the batch has no token."""
    n = sums["tokens"]
    out = {k: safe_div(v, n) for k, v in sums.items() if k not in ("tokens", "ratio_sqdev")}
    if "ratio_sqdev" in sums:
        dev = out["ratio_mean"] - 1.0
        out["ratio_var"] = torch.where(n > 0, safe_div(sums["ratio_sqdev"], n) - dev * dev, 0.0).clamp_min(
            0.0
        )
    return out


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    agg: str = "token_mean",
    normaliser: Tensor | float | None = None,
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
        normaliser: the count the loss divides by (:func:`aggregate`); None: this batch's.

    Returns:
        ``(loss, {"value_clipfrac": ...})``; ``value_clipfrac`` (detached 0-dim, token mean)
        is the fraction of tokens where the clipped term is the larger one (0 unclipped).
    """
    _check_mode(agg)
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
        # V itself inside the range (old + (V - old) may round away from V, and a token would then
        # count as clipped for a difference of one ulp), the bound outside it.
        v_clipped = torch.clamp(v, min=old - clip_eps, max=old + clip_eps)
        vf_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(vf_unclipped, vf_clipped)
        with torch.no_grad():
            clipfrac = masked_mean((vf_clipped > vf_unclipped).float(), mask)
    return aggregate(per_token, mask, agg, normaliser), {"value_clipfrac": clipfrac}


@torch.no_grad()
def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked positions (of every rank of ``group``, a
    process group; None: this batch alone).

    1 is a perfect critic, 0 is no better than a constant, negative is worse than a
    constant. When ``Var(R) == 0`` (including an all-masked or single-token batch) the
    ratio is undefined and 0 is returned, so that logging never sees NaN. Population
    variances (Bessel's factor cancels in the ratio).

    Args:
        values: ``[b, s-1]``.
        returns: ``[b, s-1]``.
        mask: ``[b, s-1]``.
        group: a ``torch.distributed`` process group (collective over it), or None.

    Returns:
        0-dim float32 tensor, the same on every rank of ``group``.
    """
    ret = returns.float()
    var_ret = global_masked_var(ret, mask, unbiased=False, group=group)
    var_err = global_masked_var(ret - values.float(), mask, unbiased=False, group=group)
    ev = 1.0 - safe_div(var_err, var_ret)
    return torch.where(var_ret > 0, ev, torch.zeros_like(ev))
