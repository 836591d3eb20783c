"""Masks and masked statistics, local and over a process group, and the two reductions the
other RL modules build on.

Every function takes plain tensors; ``group`` is a ``torch.distributed`` process group, or
``None`` for "no reduction" (the function is then exactly its single-process counterpart).
Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "LOG_RATIO_CLAMP",
    "all_reduce_max",
    "all_reduce_sum",
    "global_masked_mean",
    "global_masked_var",
    "global_whiten",
    "loss_start",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "response_mask",
    "safe_div",
    "whiten",
]

Tensor = torch.Tensor

# exp(20) ~ 4.9e8 is comfortably finite in float32 (overflow is at ~exp(88.7)); any
# log-ratio beyond +-20 means the two distributions have nothing in common on that token and
# the exact magnitude carries no useful signal, only a risk of inf/NaN.
LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """All-reduce (SUM) in forward, identity in backward.

    This is Megatron's "reduce from model-parallel region" operator: every rank ends up
    with the same reduced value and computes the same downstream loss, so the gradient of
    that loss with respect to the rank's *local* contribution is exactly the incoming
    gradient (no second reduction, which would multiply it by the world size).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum ``x`` over ``group`` (identity when ``group`` is None); differentiable."""
    if group is None:
        return x
    return _AllReduceSumIdentityGrad.apply(x, group)


def all_reduce_max(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Element-wise max of ``x`` over ``group``; the result carries no gradient."""
    out = x.detach()
    if group is None:
        return out
    out = out.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0 (an empty mask has mean 0, not NaN)."""
    den_safe = den.clamp_min(torch.finfo(den.dtype).tiny)
    return torch.where(den > 0, num / den_safe, torch.zeros_like(num))


# ---------------------------------------------------------------------------------------
# Masks and masked statistics
# ---------------------------------------------------------------------------------------


def response_mask(lengths: Tensor, prompt_lengths: Tensor, seq_len: int) -> Tensor:
    """Mask of the response transitions.

    Args:
        lengths: ``[b]`` total (prompt + response) token count of each sample.
        prompt_lengths: ``[b]`` prompt token count of each sample.
        seq_len: padded length ``s``.

    Returns:
        ``[b, s-1]`` float32, 1 for ``t`` in ``[prompt_len-1, length-1)`` (the transitions
        that emit response tokens), 0 elsewhere.
    """
    t = torch.arange(seq_len - 1, device=lengths.device)
    start = (prompt_lengths.long() - 1).unsqueeze(1)
    end = (lengths.long() - 1).unsqueeze(1)
    return ((t.unsqueeze(0) >= start) & (t.unsqueeze(0) < end)).float()


def loss_start(mask: Tensor) -> int:
    """``mask [b, s-1]`` -> the first transition any row's mask covers (0 when none does).

    Outputs before it feed no loss, KL or metric, so the forwards compute the last layer only
    from there on (``forward.policy_logits(..., start)``, ``forward.token_values(..., start)``).
    """
    cols = mask.detach().any(0).nonzero()
    return int(cols[0, 0]) if cols.numel() else 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x * mask``.

    Masked-out positions are selected away with ``torch.where`` rather than multiplied by
    zero, so garbage there (NaN/inf log-probs of padding, say) cannot leak into the result.

    Args:
        x: any shape, e.g. ``[b, s-1]``.
        mask: same shape as ``x`` (bool or 0/1 float).
        dim: reduce over this dim only; None reduces everything to a 0-dim tensor.
    """
    x = x.float()
    mask = mask.float()
    prod = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set.

    Args:
        x: any shape, e.g. ``[b, s-1]``.
        mask: same shape as ``x``.
        dim: as in :func:`masked_sum` (``dim=-1`` on ``[b, s-1]`` gives per-row means ``[b]``).
    """
    count = mask.float().sum() if dim is None else mask.float().sum(dim)
    return safe_div(masked_sum(x, mask, dim), count)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked positions, as a 0-dim tensor.

    Two-pass (mean first, then mean squared deviation) for numerical stability. With
    ``unbiased`` Bessel's correction ``n / (n - 1)`` is applied; it is undefined for fewer
    than two elements, where 0 is returned instead of inf/NaN.

    Args:
        x: any shape, e.g. ``[b, s-1]``.
        mask: same shape as ``x``.
    """
    return global_masked_var(x, mask, unbiased=unbiased, group=None)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening: ``(x - mean) / sqrt(var + eps)`` with statistics over the mask only.

    Padding must not enter the statistics ([N+] detail: "whitening uses the response
    mask"); masked positions of the output are set to 0. With ``shift_mean=False`` the
    mean is added back, i.e. only the scale is normalised (TRL uses this for rewards).

    Args:
        x: ``[b, s-1]`` (any shape works).
        mask: same shape as ``x``.

    Returns:
        Same shape as ``x``, float32.
    """
    return global_whiten(x, mask, shift_mean=shift_mean, eps=eps, group=None)


def _global_sum_and_count(x: Tensor, mask: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Masked sum and mask count, each summed over ``group`` in a single collective."""
    total = masked_sum(x, mask)
    count = mask.float().sum()
    if group is None:
        return total, count
    reduced = all_reduce_sum(torch.stack([total, count]), group)
    return reduced[0], reduced[1]


def global_masked_mean(x: Tensor, mask: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """:func:`masked_mean` over the union of the batches of all ranks in ``group``.

    Sums and counts are all-reduced (SUM), so the result equals the single-process result
    on the concatenated batch even when ranks hold different numbers of tokens (averaging
    per-rank means would not). ``group=None`` is the local :func:`masked_mean`.

    Gradients follow Megatron's convention: the all-reduce is the identity in backward,
    i.e. each rank gets the gradient of the global statistic w.r.t. its own elements.

    Args:
        x: ``[b, s-1]`` local batch (any shape works).
        mask: same shape as ``x``.

    Returns:
        0-dim float32 tensor, identical on all ranks.
    """
    total, count = _global_sum_and_count(x, mask, group)
    return safe_div(total, count)


def global_masked_var(
    x: Tensor, mask: Tensor, unbiased: bool = True, group: dist.ProcessGroup | None = None
) -> Tensor:
    """:func:`masked_var` over the union of the batches of all ranks in ``group``.

    Two collectives (global mean, then global sum of squared deviations) rather than one
    over ``(sum, sum of squares)``: the latter is a catastrophic cancellation when the mean
    is large compared to the spread.

    Args:
        x: ``[b, s-1]`` local batch (any shape works).
        mask: same shape as ``x``.

    Returns:
        0-dim float32 tensor, identical on all ranks.
    """
    total, count = _global_sum_and_count(x, mask, group)
    mean = safe_div(total, count)
    sq_dev, _ = _global_sum_and_count((x.float() - mean) ** 2, mask, group)
    var = safe_div(sq_dev, count)
    if unbiased:
        bessel = safe_div(count, count - 1)
        var = torch.where(count > 1, var * bessel, torch.zeros_like(var))
    return var


def global_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """:func:`whiten` with mean and variance taken over all ranks in ``group``.

    Whitening advantages per data-parallel rank would give each rank a different scale
    for the same advantage; the statistics must be global to match a single-process run.

    Args:
        x: ``[b, s-1]`` local batch (any shape works).
        mask: same shape as ``x``.

    Returns:
        Same shape as ``x``, float32, 0 at masked positions.
    """
    x = x.float()
    mean = global_masked_mean(x, mask, group=group)
    var = global_masked_var(x, mask, unbiased=True, group=group)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.float() != 0, out, torch.zeros_like(out))
