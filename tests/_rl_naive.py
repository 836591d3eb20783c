"""Naive pure-Python references of the RL maths, and the helpers the tests of aligner.rl share.

The references loop over rows and tokens with plain Python floats (float64) and are written
independently of the vectorised code (e.g. GAE as an explicit discounted sum over the
compressed response rather than the backward recursion).
"""

from __future__ import annotations

import math
import random

import torch

from aligner.rl import (
    response_mask,
)

SEEDS = [0, 1, 2]
SHAPES = [(1, 2), (3, 7), (6, 12)]  # (b, s)
GARBAGE = 1.0e6  # written into masked-out positions: must never show up in results


# ---------------------------------------------------------------------------------------
# Naive references (plain Python floats, loops)
# ---------------------------------------------------------------------------------------


def naive_mask(lengths, prompts, s):
    return [[1.0 if p - 1 <= t < n - 1 else 0.0 for t in range(s - 1)] for n, p in zip(lengths, prompts)]


def naive_flat(x, mask):
    return [xv for xr, mr in zip(x, mask) for xv, mv in zip(xr, mr) if mv]


def naive_mean(x, mask):
    vals = naive_flat(x, mask)
    return sum(vals) / len(vals) if vals else 0.0


def naive_var(x, mask, unbiased=True):
    vals = naive_flat(x, mask)
    n = len(vals)
    if n == 0 or (unbiased and n < 2):
        return 0.0
    mu = sum(vals) / n
    ss = sum((v - mu) ** 2 for v in vals)
    return ss / (n - 1) if unbiased else ss / n


def naive_whiten(x, mask, shift_mean=True, eps=1e-8):
    mu = naive_mean(x, mask)
    sd = math.sqrt(naive_var(x, mask, True) + eps)
    out = []
    for xr, mr in zip(x, mask):
        row = []
        for xv, mv in zip(xr, mr):
            if not mv:
                row.append(0.0)
            else:
                w = (xv - mu) / sd
                row.append(w if shift_mean else w + mu)
        out.append(row)
    return out


def naive_log_softmax_row(zs):
    mx = max(zs)
    lse = mx + math.log(sum(math.exp(z - mx) for z in zs))
    return [z - lse for z in zs]


def naive_logprobs(logits, targets, temperature=1.0):
    out = []
    for lrow, trow in zip(logits, targets):
        row = []
        for zs, tgt in zip(lrow, trow):
            row.append(naive_log_softmax_row([z / temperature for z in zs])[tgt])
        out.append(row)
    return out


def naive_entropy(logits, temperature=1.0):
    out = []
    for lrow in logits:
        row = []
        for zs in lrow:
            lps = naive_log_softmax_row([z / temperature for z in zs])
            row.append(-sum(math.exp(lp) * lp for lp in lps))
        out.append(row)
    return out


def naive_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    logr = min(max(ref - lp, -20.0), 20.0)
    return math.exp(logr) - 1.0 - logr


def naive_shaped(scores, kl, mask, beta):
    rewards, non_score = [], []
    for sc, kr, mr in zip(scores, kl, mask):
        ns = [(-beta * k if m else 0.0) for k, m in zip(kr, mr)]
        r = list(ns)
        last = None
        for t, m in enumerate(mr):
            if m:
                last = t
        if last is not None:
            r[last] += sc
        rewards.append(r)
        non_score.append(ns)
    return rewards, non_score


def naive_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_k (gamma*lam)^k delta_{t+k} over the response positions, written as a sum."""
    advs = []
    for rr, vr, mr in zip(rewards, values, mask):
        idx = [t for t, m in enumerate(mr) if m]
        vals = [vr[t] for t in idx] + [0.0]  # terminal value 0
        deltas = [rr[t] + gamma * vals[j + 1] - vals[j] for j, t in enumerate(idx)]
        adv = [0.0] * len(mr)
        for j, t in enumerate(idx):
            adv[t] = sum((gamma * lam) ** k * deltas[j + k] for k in range(len(idx) - j))
        advs.append(adv)
    return advs


def naive_returns(rewards, values, mask, gamma, lam):
    adv = naive_gae(rewards, values, mask, gamma, lam)
    return [[(a + v if m else 0.0) for a, v, m in zip(ar, vr, mr)] for ar, vr, mr in zip(adv, values, mask)]


def naive_grpo(scores, n, mask, std_norm=True, eps=1e-6):
    """Per row: (r - mean of its group) / (unbiased std of its group + eps), on its response tokens."""
    out = []
    for i, mr in enumerate(mask):
        g = scores[(i // n) * n : (i // n) * n + n]
        mu = sum(g) / n
        a = scores[i] - mu
        if std_norm:
            a /= math.sqrt(sum((x - mu) ** 2 for x in g) / (n - 1)) + eps
        out.append([a if m else 0.0 for m in mr])
    return out


def naive_rloo(scores, n, mask):
    """Per row: r minus the mean of the other n - 1 scores of its group."""
    out = []
    for i, mr in enumerate(mask):
        start = (i // n) * n
        others = [scores[j] for j in range(start, start + n) if j != i]
        a = scores[i] - sum(others) / len(others)
        out.append([a if m else 0.0 for m in mr])
    return out


def naive_returns_to_go(rewards, mask, gamma):
    """G_t = sum_k gamma^k r_{t+k} over the response positions at and after t, written as a sum."""
    out = []
    for rr, mr in zip(rewards, mask):
        idx = [t for t, m in enumerate(mr) if m]
        row = [0.0] * len(mr)
        for j, t in enumerate(idx):
            row[t] = sum(gamma**k * rr[idx[j + k]] for k in range(len(idx) - j))
        out.append(row)
    return out


def naive_aggregate(x, mask, mode):
    if mode == "token_mean":
        return naive_mean(x, mask)
    row_means = []
    for xr, mr in zip(x, mask):
        vals = [xv for xv, mv in zip(xr, mr) if mv]
        if vals:
            row_means.append(sum(vals) / len(vals))
    return sum(row_means) / len(row_means) if row_means else 0.0


def naive_policy_loss(lp, old, adv, mask, lo, hi, dual, mode, behaviour=None, tis_cap=None):
    per_tok, clipped, dual_hits, kl2, ratios, weights, truncs = [], [], [], [], [], [], []
    behaviour = old if behaviour is None else behaviour
    for lr, orow, ar, mr, brow in zip(lp, old, adv, mask, behaviour):
        prow, crow, drow, krow, rrow, wrow, trow = [], [], [], [], [], [], []
        for a_lp, o_lp, a, _m, b_lp in zip(lr, orow, ar, mr, brow):
            ratio = math.exp(a_lp - o_lp)
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
            loss = max(l1, l2)
            crow.append(1.0 if l2 > l1 else 0.0)
            hit = 0.0
            if dual is not None and a < 0 and loss > -dual * a:
                loss = -dual * a
                hit = 1.0
            if tis_cap is not None:
                w = math.exp(o_lp - b_lp)
                trow.append(1.0 if w > tis_cap else 0.0)
                w = min(w, tis_cap)
                wrow.append(w)
                loss *= w
            prow.append(loss)
            drow.append(hit)
            krow.append(0.5 * (a_lp - o_lp) ** 2)
            rrow.append(ratio)
        per_tok.append(prow)
        clipped.append(crow)
        dual_hits.append(drow)
        kl2.append(krow)
        ratios.append(rrow)
        weights.append(wrow)
        truncs.append(trow)
    stats = {
        "clipfrac": naive_mean(clipped, mask),
        "approxkl": naive_mean(kl2, mask),
        "ratio_mean": naive_mean(ratios, mask),
        "ratio_var": naive_var(ratios, mask, unbiased=False),
    }
    if dual is not None:
        stats["dual_clipfrac"] = naive_mean(dual_hits, mask)
    if tis_cap is not None:
        stats["tis_weight_mean"] = naive_mean(weights, mask)
        stats["tis_truncfrac"] = naive_mean(truncs, mask)
    return naive_aggregate(per_tok, mask, mode), stats


def naive_value_loss(v, old, ret, mask, eps, mode):
    per_tok, clipped = [], []
    for vr, orow, rr in zip(v, old, ret):
        prow, crow = [], []
        for a, o, r in zip(vr, orow, rr):
            l1 = (a - r) ** 2
            if eps is None:
                prow.append(0.5 * l1)
                crow.append(0.0)
            else:
                vc = min(max(a, o - eps), o + eps)
                l2 = (vc - r) ** 2
                prow.append(0.5 * max(l1, l2))
                crow.append(1.0 if l2 > l1 else 0.0)
        per_tok.append(prow)
        clipped.append(crow)
    return naive_aggregate(per_tok, mask, mode), naive_mean(clipped, mask)


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def ragged(seed, b, s):
    """Random prompt lengths and total lengths; some rows may have an empty response."""
    rng = random.Random(seed)
    prompts = [rng.randint(1, s - 1) for _ in range(b)]
    lengths = [rng.randint(p, s) for p in prompts]
    return lengths, prompts


def ragged_batch(seed, b, s):
    lengths, prompts = ragged(seed, b, s)
    mask = response_mask(torch.tensor(lengths), torch.tensor(prompts), s)
    return mask, naive_mask(lengths, prompts, s)


def rand(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def with_garbage(x, mask):
    """Fill masked-out positions with a huge value so that any leak is visible."""
    return torch.where(mask.bool(), x, torch.full_like(x, GARBAGE))


def close(actual, expected, atol=1e-5, rtol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


def finite(*ts):
    for t in ts:
        assert torch.isfinite(t).all(), t
