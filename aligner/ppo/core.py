"""Numerical core of PPO for language models, as pure functions.

Everything here takes plain tensors and floats and returns tensors: no configs, no global
state. Collectives appear only in functions that take an explicit ``group`` argument (a
``torch.distributed`` process group, or ``None`` meaning "no reduction", in which case the
function is exactly its single-process counterpart).

Shape notation used in the docstrings: ``b`` batch, ``s`` padded sequence length, ``v``
vocabulary (the local shard under tensor parallelism).

Tensor conventions (fixed for the project)
------------------------------------------
A sample is prompt + response tokens, right-padded to ``s``. Per-token arrays (log-probs,
reference log-probs, values, rewards, advantages, returns, mask) have length ``s-1``:
element ``t`` describes the transition that emits token ``t+1`` (the log-prob of token
``t+1`` given tokens ``0..t``; the value of the state ``0..t``). The response mask is 1 for
``t`` in ``[prompt_len-1, length-1)`` and 0 elsewhere. A sample's score is added at its last
response transition (``length-2``); every response transition gets ``-beta * kl_t``.

All arithmetic is float32 (inputs are cast with ``.float()``, since logits are often bf16).
Masks may be bool or float; they are treated as 0/1 weights.

References
----------
- [PPO] Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation".
- [Ziegler] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
  (per-token KL penalty, adaptive KL controller).
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case Study on
  TL;DR Summarization" (masked whitening, score at the EOS token, missing-EOS penalty,
  value clipping, approxkl statistic, running reward normalisation).
- [KL-blog] J. Schulman 2020, "Approximating KL Divergence" (k1 / k3 estimators).
- [Dual-clip] Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning" (dual-clip PPO).
- [DAPO] Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
  (decoupled, asymmetric "clip-higher" range).
- [VAPO] Yue et al. 2025, "VAPO" / NeMo-RL (separate GAE lambda for the value targets).
- [Megatron] Shoeybi et al. 2019, "Megatron-LM" (vocab-parallel softmax / cross entropy).
- [Chan] Chan, Golub, LeVeque 1979, "Updating Formulae and a Pairwise Algorithm for
  Computing Sample Variances" (parallel merge of running moments).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "aggregate",
    "apply_missing_eos_penalty",
    "clip_scores",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "gather_logprobs",
    "global_masked_mean",
    "global_masked_var",
    "global_whiten",
    "kl_penalty",
    "loss_start",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "policy_loss",
    "response_mask",
    "sequence_logprobs",
    "shaped_rewards",
    "value_loss",
    "whiten",
]

Tensor = torch.Tensor

#: Allowed ``kind`` values of :func:`kl_penalty`.
KL_KINDS = ("k1", "abs", "k3")
#: Allowed ``mode`` values of :func:`aggregate` (and of the ``agg`` argument of the losses).
AGG_MODES = ("token_mean", "seq_mean_token_mean")

# exp(20) ~ 4.9e8 is comfortably finite in float32 (overflow is at ~exp(88.7)); any
# log-ratio beyond +-20 means the two distributions have nothing in common on that token and
# the exact magnitude carries no useful signal, only a risk of inf/NaN.
_LOG_RATIO_CLAMP = 20.0


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


def _all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum ``x`` over ``group`` (identity when ``group`` is None); differentiable."""
    if group is None:
        return x
    return _AllReduceSumIdentityGrad.apply(x, group)


def _all_reduce_max(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Element-wise max of ``x`` over ``group``; the result carries no gradient."""
    out = x.detach()
    if group is None:
        return out
    out = out.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
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
    from there on (``gpt.policy_logits(..., start)``, ``gpt.token_values(..., start)``).
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
    return _safe_div(masked_sum(x, mask, dim), count)


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
    reduced = _all_reduce_sum(torch.stack([total, count]), group)
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
    return _safe_div(total, count)


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
    mean = _safe_div(total, count)
    sq_dev, _ = _global_sum_and_count((x.float() - mean) ** 2, mask, group)
    var = _safe_div(sq_dev, count)
    if unbiased:
        bessel = _safe_div(count, count - 1)
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
    m = _all_reduce_max(_local_max(z), group)
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
    parts = _all_reduce_sum(parts, group)
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
    parts = _all_reduce_sum(parts, group)
    total = parts[..., 0]
    return torch.log(total) - parts[..., 1] / total


# ---------------------------------------------------------------------------------------
# KL estimators and rewards
# ---------------------------------------------------------------------------------------


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi ([KL-blog]).

    - ``"k1"``: ``logp - ref_logp``; unbiased, high variance, can be negative per token.
    - ``"abs"``: ``|k1|``; biased, non-negative.
    - ``"k3"``: ``exp(logr) - 1 - logr`` with ``logr = ref_logp - logp``; unbiased,
      non-negative, low variance. ``logr`` is clamped to ``[-20, 20]`` first because
      ``exp`` overflows float32 near 88.7, so a token that the reference finds vastly more
      likely would give an inf penalty (and NaN gradients); the clamp bounds one token's
      penalty at ~4.9e8 while leaving every realistic value unchanged.

    Args:
        logp: ``[b, s-1]`` log-probs of the sampled tokens under the policy.
        ref_logp: ``[b, s-1]`` log-probs of the same tokens under the reference model.
        kind: one of :data:`KL_KINDS`.

    Returns:
        ``[b, s-1]`` float32.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; allowed kinds: {', '.join(KL_KINDS)}")
    k1 = logp.float() - ref_logp.float()
    if kind == "k1":
        return k1
    if kind == "abs":
        return k1.abs()
    logr = (-k1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.expm1(logr) - logr


def shaped_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per-token rewards: a KL penalty on every response token plus the score at the end.

    ``r_t = -beta * kl_t`` on response transitions ([Ziegler] eq. 2, applied per token),
    and the sample's score is added at the last transition where ``mask == 1`` (the one
    emitting the final response token, [N+]). Rows without any response transition get
    no score (and no penalty).

    Args:
        scores: ``[b]`` reward-model scores.
        kl: ``[b, s-1]`` per-token KL estimates (see :func:`kl_penalty`).
        mask: ``[b, s-1]`` response mask.
        beta: KL coefficient.

    Returns:
        ``(rewards, non_score_reward)``, both ``[b, s-1]`` float32 and 0 off the mask;
        ``non_score_reward`` is the KL part alone (for logging).
    """
    mask = mask.float()
    on = mask != 0
    non_score = torch.where(on, -beta * kl.float() * mask, torch.zeros_like(mask))
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(on, positions, torch.full_like(positions, -1)).amax(dim=-1)  # [b]
    at_last = positions.unsqueeze(0) == last.unsqueeze(1)  # all False where last == -1
    rewards = torch.where(at_last, non_score + scores.float().unsqueeze(1), non_score)
    return rewards, non_score


def apply_missing_eos_penalty(scores: Tensor, ended: Tensor, penalty: float | None) -> Tensor:
    """Add ``penalty`` to the score of samples that never emitted end-of-sequence.

    Truncated responses are otherwise scored as if complete, which rewards rambling until
    the length limit ([N+] detail "EOS trick"). ``penalty`` is usually negative (e.g. -1).

    Args:
        scores: ``[b]``.
        ended: ``[b]`` bool, True where the response contains EOS.
        penalty: value added to unfinished samples; None disables.

    Returns:
        ``[b]`` float32 (a new tensor; ``scores`` is not modified).
    """
    scores = scores.float()
    if penalty is None:
        return scores.clone()
    return torch.where(ended.bool(), scores, scores + float(penalty))


def clip_scores(scores: Tensor, clip: float | None) -> Tensor:
    """Clamp scores to ``[-clip, clip]``; None disables.

    Args:
        scores: ``[b]``.

    Returns:
        ``[b]`` float32 (a new tensor).
    """
    scores = scores.float()
    if clip is None:
        return scores.clone()
    if not clip > 0:
        raise ValueError(f"score clip must be > 0 or None, got {clip!r}")
    return scores.clamp(-clip, clip)


class RunningMoments:
    """Running mean and standard deviation of scalar scores across steps.

    Used to normalise reward-model scores over the run rather than per batch ([N+] reward
    normalisation). Batches are merged with the parallel update of [Chan]: keep the
    count ``n``, mean and sum of squared deviations ``M2``; merging a batch with
    ``(n_b, mean_b, M2_b)`` gives ``M2 += M2_b + delta^2 n n_b / (n + n_b)``. State is kept
    in Python floats (float64), so long runs do not accumulate float32 error, and is
    directly JSON-serialisable.
    """

    def __init__(self) -> None:
        self._mean = 0.0
        self._m2 = 0.0
        self._count = 0

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def var(self) -> float:
        """Unbiased variance of everything seen so far (0 before two samples)."""
        return self._m2 / (self._count - 1) if self._count > 1 else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation; 1.0 before two samples have been seen.

        The spread of fewer than two samples is undefined; 1.0 makes :meth:`normalize` a
        pure shift until it is.
        """
        return math.sqrt(self.var) if self._count > 1 else 1.0

    @property
    def count(self) -> int:
        return self._count

    @torch.no_grad()
    def update(self, x: Tensor, group: dist.ProcessGroup | None = None) -> tuple[float, float]:
        """Merge a batch of scores.

        Args:
            x: ``[b]`` (any shape; flattened) local batch.
            group: data-parallel group to merge over (every rank must call this), or None.
                The statistics then equal those of the concatenation of all ranks' batches.

        Returns:
            ``(batch_mean, batch_std)`` of the (global) batch as floats; ``batch_std`` is
            unbiased, 0 for a batch of one. An empty batch leaves the state unchanged and
            returns ``(0.0, 0.0)``.
        """
        xs = x.detach().reshape(-1).double()
        stats = torch.stack([xs.new_tensor(float(xs.numel())), xs.sum()])
        if group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        n_b = int(round(stats[0].item()))
        if n_b == 0:
            return 0.0, 0.0
        mean_b = stats[1].item() / n_b
        m2 = ((xs - mean_b) ** 2).sum()
        if group is not None:
            dist.all_reduce(m2, op=dist.ReduceOp.SUM, group=group)
        m2_b = m2.item()

        delta = mean_b - self._mean
        total = self._count + n_b
        self._mean += delta * n_b / total
        self._m2 += m2_b + delta * delta * self._count * n_b / total
        self._count = total
        return mean_b, (math.sqrt(m2_b / (n_b - 1)) if n_b > 1 else 0.0)

    def normalize(self, x: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
        """``(x - mean) / (std + eps)`` (or ``x / (std + eps)`` without ``shift_mean``).

        Args:
            x: any shape, e.g. ``[b]``.

        Returns:
            Same shape, float32.
        """
        x = x.float()
        if shift_mean:
            x = x - self._mean
        return x / (self.std + eps)

    def state_dict(self) -> dict[str, float | int]:
        return {"mean": float(self._mean), "m2": float(self._m2), "count": int(self._count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mean = float(state["mean"])
        self._m2 = float(state["m2"])
        self._count = int(state["count"])


# ---------------------------------------------------------------------------------------
# KL controllers ([Ziegler] section 2.2)
# ---------------------------------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient ``beta``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so the trainer can treat both controllers alike."""

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of [Ziegler] eq. (2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta *= 1 + e * n_steps / horizon``, where
    ``n_steps`` is the number of samples (episodes) consumed since the last update. The
    clip bounds how fast ``beta`` can move on a noisy KL estimate.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"KL target must be > 0, got {target!r}")
        if not horizon > 0:
            raise ValueError(f"KL horizon must be > 0, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Value, target and horizon; loading restores all three."""
        return {"value": float(self.value), "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


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
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
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
    ev = 1.0 - _safe_div(var_err, var_ret)
    return torch.where(var_ret > 0, ev, torch.zeros_like(ev))
