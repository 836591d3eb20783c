"""KL estimators, KL-shaped per-token rewards, score shaping, running reward moments and
the KL controllers ([Ziegler] section 2.2).

Shapes: ``b`` batch, ``s`` padded sequence length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from aligner.rl.stats import LOG_RATIO_CLAMP

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "apply_missing_eos_penalty",
    "clip_scores",
    "kl_penalty",
    "overlong_filter",
    "overlong_penalty",
    "shaped_rewards",
]

Tensor = torch.Tensor

#: Allowed ``kind`` values of :func:`kl_penalty`.
KL_KINDS = ("k1", "abs", "k3")


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
    logr = (-k1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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


def overlong_penalty(
    response_lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment ([DAPO] eq. 13), a length-aware penalty for the score.

    For a response of ``L`` tokens (end-of-sequence included) with ``M = max_new_tokens`` and
    a buffer of ``B`` tokens before the limit::

        0                          if L <= M - B
        (M - B - L) / B * penalty  if M - B < L <= M   (from 0 down to -penalty at L = M)
        -penalty                   if L > M

    so a response is punished gradually as it runs into the last ``B`` tokens, instead of only
    once it is cut off. ``B = 0`` turns it off (all zeros).

    Args:
        response_lengths: ``[b]`` response token counts.
        max_new_tokens: ``M``, the longest response.
        buffer: ``B``, in ``[0, M]``.
        penalty: the largest penalty (at ``L = M``); the values are <= 0 for ``penalty >= 0``.

    Returns:
        ``[b]`` float32, added to the scores by the caller.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 <= buffer <= max_new_tokens:
        raise ValueError(
            f"overlong buffer={buffer!r}: expected an integer in [0, max_new_tokens={max_new_tokens}]"
        )
    length = response_lengths.float()
    if buffer == 0:
        return torch.zeros_like(length)
    start = float(max_new_tokens - buffer)
    ramp = (start - length) / float(buffer) * float(penalty)
    out = torch.where(length <= start, torch.zeros_like(length), ramp)
    return torch.where(length > max_new_tokens, torch.full_like(length, -float(penalty)), out)


def overlong_filter(mask: Tensor, ended: Tensor) -> Tensor:
    """DAPO's overlong filtering ([DAPO] section 3.4): the loss mask without the responses that
    never ended (cut at the length limit without end-of-sequence), whose truncation would
    otherwise be punished (or rewarded) as if it were the policy's choice.

    Args:
        mask: ``[b, s-1]`` response mask.
        ended: ``[b]`` bool, True where the response ended (end-of-sequence or a stop string).

    Returns:
        ``[b, s-1]`` float32: ``mask`` with the rows of unfinished responses set to 0.
    """
    return mask.float() * ended.bool().float().unsqueeze(1)


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
