"""Log-probabilities and entropy from logits, optionally vocab-parallel (tensor parallelism).

Shapes: ``b`` batch, ``s`` padded sequence length, ``v`` vocabulary (the local shard under TP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aligner.rl.stats import all_reduce_max, all_reduce_sum

__all__ = ["entropy_from_logits", "gather_logprobs", "sequence_logprobs"]

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------
# Log-probabilities and entropy, optionally vocab-parallel
# ---------------------------------------------------------------------------------------
#
# Under Megatron-style tensor parallelism each TP rank holds the logits of a contiguous
# vocabulary slice [vocab_start, vocab_start + v). Gathering the full vocabulary would cost
# b*s*V floats per rank; instead, as in Megatron's vocab-parallel cross entropy, only three
# [b, s] quantities are reduced: the max (for the stabilising shift), the sum of
# exp(z - max), and the target logit (or, for the entropy, sum exp(z - max) * (z - max)).
# The "_local_*" helpers below are the pure per-shard parts; the public functions combine
# them, with group=None meaning the shard is the whole vocabulary.


def _scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    """``[b, s, v]`` -> float32 logits divided by the sampling temperature."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    z = logits.float()
    if temperature != 1.0:
        # Same scaling as the sampler, so that the log-probs are those of the policy that
        # actually generated the tokens ([N+] detail on temperature).
        z = z / temperature
    return z


def _local_max(z: Tensor) -> Tensor:
    """``[b, s, v]`` -> ``[b, s]`` max over the local vocabulary shard, no gradient.

    The shift needs no gradient: log-sum-exp is invariant to it, so treating it as a
    constant still gives exact gradients.
    """
    return z.detach().amax(dim=-1)


def _global_shift(z: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``[b, s, v]`` -> ``[b, s]`` max over the full (possibly sharded) vocabulary."""
    m = all_reduce_max(_local_max(z), group)
    # A row whose logits are all -inf would make z - m NaN; any finite shift works there.
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _local_sum_exp(shifted: Tensor) -> Tensor:
    """``[b, s, v]`` logits minus the global max -> ``[b, s]`` local sum of exp.

    Every term is <= 1 and the shard holding the max contributes exactly 1, so the global
    sum is in ``[1, V]``: no overflow, and its log is finite.
    """
    return shifted.exp().sum(dim=-1)


def _local_target_logit(shifted: Tensor, targets: Tensor, vocab_start: int) -> Tensor:
    """``[b, s, v]`` (shifted) logits, ``[b, s]`` global token ids -> ``[b, s]``.

    The target's logit if the target lies in this shard's slice
    ``[vocab_start, vocab_start + v)``, else 0, so that a SUM over shards picks out the
    one owning shard.
    """
    v = shifted.shape[-1]
    local = targets.long() - vocab_start
    owned = (local >= 0) & (local < v)
    idx = torch.where(owned, local, torch.zeros_like(local))
    picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return torch.where(owned, picked, torch.zeros_like(picked))


def _local_sum_exp_times_logit(shifted: Tensor) -> Tensor:
    """``[b, s, v]`` logits minus the global max -> ``[b, s]`` local sum exp(z') * z'.

    Entries whose exp underflows to 0 (including -inf logits) contribute 0; selecting them
    out *before* the product keeps 0 * -inf from producing NaN in forward or backward.
    """
    e = shifted.exp()
    safe = torch.where(e > 0, shifted, torch.zeros_like(shifted))
    return (e * safe).sum(dim=-1)


def gather_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    With ``group`` set, ``logits`` is this rank's vocabulary shard and the softmax is over
    the full vocabulary, computed without gathering it: all-reduce MAX of the shard maxima,
    then one all-reduce SUM of (sum of exp, target logit). Differentiable; the gradient
    w.r.t. the local shard is the corresponding slice of the full-vocabulary gradient.

    ``log p = (z_target - m) - log(sum exp(z - m))`` is evaluated with the shift ``m``
    applied first, so logits of magnitude 1e4 give no inf/NaN.

    Args:
        logits: ``[b, s, v]`` (any float dtype; computed in float32).
        targets: ``[b, s]`` global token ids (must be valid ids even at padding).
        temperature: sampling temperature; logits are divided by it.
        group: tensor-parallel group over which the vocabulary is sharded, or None.
        vocab_start: first global token id of this rank's shard.

    Returns:
        ``[b, s]`` float32 log-probs.
    """
    z = _scaled_logits(logits, temperature)
    shifted = z - _global_shift(z, group).unsqueeze(-1)
    parts = torch.stack([_local_sum_exp(shifted), _local_target_logit(shifted, targets, vocab_start)], dim=-1)
    parts = all_reduce_sum(parts, group)
    return parts[..., 1] - torch.log(parts[..., 0])


def sequence_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> Tensor:
    """Per-transition log-probs of a token sequence: ``logits[:, t]`` predicts ``tokens[:, t+1]``.

    Args:
        logits: ``[b, s, v]`` model output for ``tokens`` (vocab shard under TP).
        tokens: ``[b, s]`` global token ids.
        temperature, group, vocab_start: as in :func:`gather_logprobs`.

    Returns:
        ``[b, s-1]`` float32; element ``t`` is ``log p(tokens[t+1] | tokens[:t+1])``.
    """
    return gather_logprobs(
        logits[:, :-1], tokens[:, 1:], temperature=temperature, group=group, vocab_start=vocab_start
    )


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    ``H = logsumexp(z) - sum p z = log S - sum(exp(z') z') / S`` with ``z' = z - m`` and
    ``S = sum exp(z')``: working with the shifted logits avoids subtracting two numbers of
    size |z| (1e4 logits would otherwise lose all precision). With ``group`` set, ``m`` is
    all-reduced (MAX) and ``S`` and ``sum exp(z') z'`` are all-reduced (SUM) in one call.

    Args:
        logits: ``[b, s, v]`` (vocab shard under TP).
        temperature: sampling temperature; logits are divided by it.
        group: tensor-parallel group over which the vocabulary is sharded, or None.

    Returns:
        ``[b, s]`` float32 entropies (nats).
    """
    z = _scaled_logits(logits, temperature)
    shifted = z - _global_shift(z, group).unsqueeze(-1)
    parts = torch.stack([_local_sum_exp(shifted), _local_sum_exp_times_logit(shifted)], dim=-1)
    parts = all_reduce_sum(parts, group)
    total = parts[..., 0]
    return torch.log(total) - parts[..., 1] / total
