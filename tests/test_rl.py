"""Tests of aligner.rl against naive pure-Python references and hand-worked cases.

The references below loop over rows and tokens with plain Python floats (float64) and are
written independently of the vectorised code (e.g. GAE as an explicit discounted sum over
the compressed response rather than the backward recursion).
"""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from aligner.rl import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    aggregate,
    apply_missing_eos_penalty,
    clip_scores,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    gather_logprobs,
    global_masked_mean,
    global_masked_var,
    global_whiten,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    policy_loss,
    response_mask,
    sequence_logprobs,
    shaped_rewards,
    value_loss,
    whiten,
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


def naive_aggregate(x, mask, mode):
    if mode == "token_mean":
        return naive_mean(x, mask)
    row_means = []
    for xr, mr in zip(x, mask):
        vals = [xv for xv, mv in zip(xr, mr) if mv]
        if vals:
            row_means.append(sum(vals) / len(vals))
    return sum(row_means) / len(row_means) if row_means else 0.0


def naive_policy_loss(lp, old, adv, mask, lo, hi, dual, mode):
    per_tok, clipped, dual_hits, kl2, ratios = [], [], [], [], []
    for lr, orow, ar, mr in zip(lp, old, adv, mask):
        prow, crow, drow, krow, rrow = [], [], [], [], []
        for a_lp, o_lp, a, _m in zip(lr, orow, ar, mr):
            ratio = math.exp(a_lp - o_lp)
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
            loss = max(l1, l2)
            crow.append(1.0 if l2 > l1 else 0.0)
            hit = 0.0
            if dual is not None and a < 0 and loss > -dual * a:
                loss = -dual * a
                hit = 1.0
            prow.append(loss)
            drow.append(hit)
            krow.append(0.5 * (a_lp - o_lp) ** 2)
            rrow.append(ratio)
        per_tok.append(prow)
        clipped.append(crow)
        dual_hits.append(drow)
        kl2.append(krow)
        ratios.append(rrow)
    stats = {
        "clipfrac": naive_mean(clipped, mask),
        "approxkl": naive_mean(kl2, mask),
        "ratio_mean": naive_mean(ratios, mask),
        "ratio_var": naive_var(ratios, mask, unbiased=False),
    }
    if dual is not None:
        stats["dual_clipfrac"] = naive_mean(dual_hits, mask)
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


# ---------------------------------------------------------------------------------------
# Masks and masked statistics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
def test_response_mask_matches_naive(seed, b, s):
    mask, naive = ragged_batch(seed, b, s)
    assert mask.shape == (b, s - 1)
    assert mask.dtype == torch.float32
    assert mask.tolist() == naive


def test_response_mask_hand_worked():
    # prompt 3, length 6 in s=8: response tokens are 3,4,5, emitted by transitions 2,3,4
    # prompt 2, length 2: no response -> all zero; prompt 1, length 8: transitions 0..6
    m = response_mask(torch.tensor([6, 2, 8]), torch.tensor([3, 2, 1]), 8)
    assert m.tolist() == [
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
def test_masked_stats_match_naive(seed, b, s):
    mask, nmask = ragged_batch(seed, b, s)
    x = with_garbage(rand(seed, b, s - 1, scale=3.0) + 1.5, mask)
    xl = x.tolist()
    close(masked_sum(x, mask), sum(naive_flat(xl, nmask)), atol=1e-4)
    close(masked_mean(x, mask), naive_mean(xl, nmask))
    close(masked_mean(x, mask, dim=-1), [naive_mean([r], [m]) for r, m in zip(xl, nmask)])
    close(
        masked_mean(x, mask, dim=0),
        [naive_mean([[c] for c in col], [[m] for m in mcol]) for col, mcol in zip(zip(*xl), zip(*nmask))],
    )
    for unbiased in (True, False):
        close(masked_var(x, mask, unbiased=unbiased), naive_var(xl, nmask, unbiased), atol=1e-4)
    for shift in (True, False):
        close(whiten(x, mask, shift_mean=shift), naive_whiten(xl, nmask, shift), atol=1e-4)
    # group=None versions are the local ones
    assert torch.equal(global_masked_mean(x, mask), masked_mean(x, mask))
    assert torch.equal(global_masked_var(x, mask), masked_var(x, mask))
    assert torch.equal(global_whiten(x, mask), whiten(x, mask))


def test_masked_stats_bool_mask_and_nan_padding():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, -float("inf")]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    # mean over {1, 3, 5} = 3; unbiased var = (4 + 0 + 4) / 2 = 4
    close(masked_mean(x, mask), 3.0)
    close(masked_var(x, mask), 4.0)
    w = whiten(x, mask)
    finite(w)
    close(w, [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], atol=1e-6)


def test_whiten_hand_worked():
    # x = [1, 2, 3, (100 masked)]: mean 2, unbiased var ((-1)^2 + 0 + 1^2) / 2 = 1
    # whitened = (x - 2) / sqrt(1 + 1e-8) = [-1, 0, 1], masked -> 0
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    close(whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]], atol=1e-6)
    # without the mean shift the mean (2) is added back: [1, 2, 3, 0]
    close(whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], atol=1e-6)
    # a second row changes the statistics: {1,2,3,5}: mean 2.75,
    # var = (3.0625 + 0.5625 + 0.0625 + 5.0625) / 3 = 8.75 / 3
    x2 = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, 0.0, 0.0, 0.0]])
    m2 = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    sd = math.sqrt(8.75 / 3)
    close(whiten(x2, m2), [[-1.75 / sd, -0.75 / sd, 0.25 / sd, 0.0], [2.25 / sd, 0.0, 0.0, 0.0]])


def test_masked_stats_all_masked_and_single_token():
    x = torch.randn(2, 4)
    none = torch.zeros(2, 4)
    for val in (
        masked_sum(x, none),
        masked_mean(x, none),
        masked_var(x, none),
        masked_var(x, none, unbiased=False),
    ):
        assert val.item() == 0.0
    assert torch.equal(masked_mean(x, none, dim=-1), torch.zeros(2))
    assert torch.equal(whiten(x, none), torch.zeros(2, 4))
    one = torch.zeros(2, 4)
    one[1, 2] = 1.0
    close(masked_mean(x, one), x[1, 2].item())
    assert masked_var(x, one).item() == 0.0  # Bessel undefined for n=1 -> 0, not inf/NaN
    assert masked_var(x, one, unbiased=False).item() == 0.0
    w = whiten(x, one)
    finite(w)
    assert torch.equal(w, torch.zeros(2, 4))


def test_masked_mean_all_masked_has_finite_gradient():
    x = torch.randn(3, 5, requires_grad=True)
    masked_mean(x, torch.zeros(3, 5)).backward()
    finite(x.grad)
    assert torch.equal(x.grad, torch.zeros(3, 5))


# ---------------------------------------------------------------------------------------
# Log-probs and entropy
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_and_entropy_match_naive(seed, temperature):
    b, s, v = 2, 5, 9
    logits = rand(seed, b, s, v, scale=2.5)
    tokens = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed + 100))
    ll, tl = logits.tolist(), tokens.tolist()
    close(gather_logprobs(logits, tokens, temperature), naive_logprobs(ll, tl, temperature))
    close(entropy_from_logits(logits, temperature), naive_entropy(ll, temperature))
    # sequence_logprobs shifts: logits at t predict token t+1
    shifted = naive_logprobs([row[:-1] for row in ll], [row[1:] for row in tl], temperature)
    close(sequence_logprobs(logits, tokens, temperature), shifted)


def test_logprobs_bf16_input_computed_in_float32():
    logits = rand(3, 2, 4, 33, scale=4.0).bfloat16()
    tokens = torch.randint(0, 33, (2, 4), generator=torch.Generator().manual_seed(3))
    ref = naive_logprobs(logits.float().tolist(), tokens.tolist())
    out = gather_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    close(out, ref)
    assert entropy_from_logits(logits).dtype == torch.float32


def test_logprobs_entropy_hand_worked():
    # logits [0, log 3] -> p = [1/4, 3/4]
    # log p(token 0) = log 0.25 = -1.386294; log p(token 1) = log 0.75 = -0.287682
    # H = -(0.25 log 0.25 + 0.75 log 0.75) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(gather_logprobs(logits, torch.tensor([[0, 1]])), [[-1.3862944, -0.2876821]])
    close(entropy_from_logits(logits), [[0.5623351, 0.5623351]])
    # temperature 2 halves the logits: [0, log 3 / 2] -> p = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    p0 = 1.0 / (1.0 + math.sqrt(3.0))
    close(gather_logprobs(logits, torch.tensor([[0, 0]]), temperature=2.0), [[math.log(p0)] * 2])


def test_logprob_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 6, (2, 3), generator=g)
    weights = torch.randn(2, 3, generator=g)
    a = logits.clone().float().requires_grad_()
    (gather_logprobs(a, tokens, 0.8) * weights).sum().backward()
    b = logits.clone().float().requires_grad_()
    ref = torch.log_softmax(b / 0.8, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    # entropy gradient too: d/dz of H = -sum p log p
    c = logits.clone().float().requires_grad_()
    (entropy_from_logits(c) * weights).sum().backward()
    d = logits.clone().float().requires_grad_()
    lp = torch.log_softmax(d, -1)
    (-(lp.exp() * lp).sum(-1) * weights).sum().backward()
    torch.testing.assert_close(c.grad, d.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [1e4, 1e5])
def test_huge_logits_no_nan(scale):
    logits = rand(11, 2, 4, 17, scale=scale)
    logits[0, 0] = scale  # ties at the max
    logits[1, 1, 3] = -float("inf")  # a masked-out vocabulary entry
    tokens = torch.randint(0, 17, (2, 4), generator=torch.Generator().manual_seed(1))
    tokens[1, 1] = 0
    x = logits.clone().requires_grad_()
    lp = gather_logprobs(x, tokens, temperature=0.9)
    ent = entropy_from_logits(x, temperature=0.9)
    seq = sequence_logprobs(x, tokens)
    finite(lp, ent, seq)
    (lp.sum() + ent.sum() + seq.sum()).backward()
    finite(x.grad)
    ref = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp.detach().double(), ref, rtol=1e-6, atol=1e-2)
    assert (ent >= -1e-4).all()
    # a tie of k maximal logits far above the rest has entropy log k
    close(ent[0, 0].detach(), math.log(17.0), atol=1e-5)


def test_bad_temperature_raises():
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)


# ---------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "abs", "k3"])
def test_kl_penalty_matches_naive(seed, kind):
    lp = rand(seed, 3, 6) - 2.0
    ref = lp + rand(seed + 50, 3, 6, scale=0.7)
    expected = [[naive_kl(a, r, kind) for a, r in zip(ar, rr)] for ar, rr in zip(lp.tolist(), ref.tolist())]
    close(kl_penalty(lp, ref, kind), expected)


def test_kl_penalty_hand_worked():
    # p = 0.5, p_ref = 0.25: k1 = log 2 = 0.693147; abs the same;
    # k3: logr = log(0.25/0.5) = -log 2, exp(logr) = 0.5, k3 = 0.5 - 1 + 0.693147 = 0.193147
    # p = 0.25, p_ref = 0.5: k1 = -0.693147; abs = 0.693147;
    # k3: logr = log 2, k3 = 2 - 1 - 0.693147 = 0.306853
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    close(kl_penalty(lp, ref, "k1"), [[0.6931472, -0.6931472]])
    close(kl_penalty(lp, ref, "abs"), [[0.6931472, 0.6931472]])
    close(kl_penalty(lp, ref, "k3"), [[0.1931472, 0.3068528]])


def test_kl_k3_extreme_is_finite():
    lp = torch.tensor([[0.0, -1e4, -50.0, -1e30]], requires_grad=True)
    ref = torch.tensor([[-1e4, 0.0, -50.0, 0.0]])
    k3 = kl_penalty(lp, ref, "k3")
    finite(k3)
    # logr clamped to -20: e^-20 - 1 + 20; to +20: e^20 - 1 - 20
    close(k3.detach(), [[math.exp(-20) + 19.0, math.exp(20) - 21.0, 0.0, math.exp(20) - 21.0]], rtol=1e-6)
    k3.sum().backward()
    finite(lp.grad)
    assert (k3 >= 0).all()


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match=r"'k2'.*k1, abs, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k2")


# ---------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
def test_shaped_rewards_match_naive(seed, b, s):
    mask, nmask = ragged_batch(seed, b, s)
    scores = rand(seed, b, scale=2.0)
    kl = with_garbage(rand(seed + 1, b, s - 1).abs(), mask)
    rewards, non_score = shaped_rewards(scores, kl, mask, beta=0.05)
    n_r, n_ns = naive_shaped(scores.tolist(), kl.tolist(), nmask, 0.05)
    close(rewards, n_r)
    close(non_score, n_ns)


def test_shaped_rewards_hand_worked():
    # row 0: response transitions 1, 2; beta 0.5: non-score = [0, -0.05, -0.1, 0]
    #        score 2.0 at the last response transition (2): rewards = [0, -0.05, 1.9, 0]
    # row 1: no response -> no penalty, no score
    # row 2: one-token response at transition 3: -0.5 * 0.2 + (-1.0) = -1.1
    scores = torch.tensor([2.0, 5.0, -1.0])
    kl = torch.tensor([[9.0, 0.1, 0.2, 9.0], [0.5, 0.5, 0.5, 0.5], [9.0, 9.0, 9.0, 0.2]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    rewards, non_score = shaped_rewards(scores, kl, mask, beta=0.5)
    close(rewards, [[0.0, -0.05, 1.9, 0.0], [0.0] * 4, [0.0, 0.0, 0.0, -1.1]])
    close(non_score, [[0.0, -0.05, -0.1, 0.0], [0.0] * 4, [0.0, 0.0, 0.0, -0.1]])


def test_missing_eos_penalty_and_clip():
    scores = torch.tensor([1.0, -3.0, 0.5])
    ended = torch.tensor([True, False, False])
    close(apply_missing_eos_penalty(scores, ended, -1.0), [1.0, -4.0, -0.5])
    off = apply_missing_eos_penalty(scores, ended, None)
    close(off, [1.0, -3.0, 0.5])
    assert off.data_ptr() != scores.data_ptr()
    close(scores, [1.0, -3.0, 0.5])  # input untouched
    close(clip_scores(scores, 2.0), [1.0, -2.0, 0.5])
    close(clip_scores(scores, None), [1.0, -3.0, 0.5])
    with pytest.raises(ValueError):
        clip_scores(scores, 0.0)


# ---------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 0.0), (0.99, 1.0)])
def test_gae_matches_naive(seed, b, s, gamma, lam):
    mask, nmask = ragged_batch(seed, b, s)
    rewards = with_garbage(rand(seed, b, s - 1), mask)
    values = with_garbage(rand(seed + 7, b, s - 1), mask)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    rl, vl = rewards.tolist(), values.tolist()
    close(adv, naive_gae(rl, vl, nmask, gamma, lam), atol=1e-4)
    close(ret, naive_returns(rl, vl, nmask, gamma, lam), atol=1e-4)
    # separate lambda for the value targets (advantages unchanged)
    adv2, ret2 = compute_gae(rewards, values, mask, gamma, lam, value_lam=1.0)
    assert torch.equal(adv2, adv)
    close(ret2, naive_returns(rl, vl, nmask, gamma, 1.0), atol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_special_lambdas(seed):
    b, s, gamma = 4, 9, 0.9
    mask, nmask = ragged_batch(seed, b, s)
    r, v = rand(seed, b, s - 1), rand(seed + 3, b, s - 1)
    rl, vl = r.tolist(), v.tolist()
    # lam = 0: A_t = delta_t = r_t + gamma V_next - V_t (one-step TD)
    adv0, _ = compute_gae(r, v, mask, gamma, 0.0)
    expected = []
    for rr, vr, mr in zip(rl, vl, nmask):
        idx = [t for t, m in enumerate(mr) if m]
        row = [0.0] * (s - 1)
        for j, t in enumerate(idx):
            nxt = vr[idx[j + 1]] if j + 1 < len(idx) else 0.0
            row[t] = rr[t] + gamma * nxt - vr[t]
        expected.append(row)
    close(adv0, expected)
    # lam = 1: returns are Monte-Carlo discounted reward sums, independent of the values
    _, ret1 = compute_gae(r, v, mask, gamma, 1.0)
    _, ret1b = compute_gae(r, v * 3.0 + 1.0, mask, gamma, 1.0)
    mc = []
    for rr, mr in zip(rl, nmask):
        idx = [t for t, m in enumerate(mr) if m]
        row = [0.0] * (s - 1)
        for j, t in enumerate(idx):
            row[t] = sum(gamma**k * rr[idx[j + k]] for k in range(len(idx) - j))
        mc.append(row)
    close(ret1, mc, atol=1e-5)
    close(ret1b, mc, atol=1e-5)


def test_gae_hand_worked():
    # mask [0, 1, 1, 0]: prompt transition 0, response transitions 1, 2, padding 3.
    # rewards [9, 0.5, 2.0, 7] and values [5, 1.0, 0.5, 100]: the 9/7/5/100 must not leak.
    # gamma 0.9, lam 0.8, terminal value 0:
    #   t=2: delta = 2.0 + 0.9*0 - 0.5 = 1.5;           A = 1.5;                 R = 1.5 + 0.5 = 2.0
    #   t=1: delta = 0.5 + 0.9*0.5 - 1.0 = -0.05;       A = -0.05 + 0.72*1.5 = 1.03;  R = 2.03
    rewards = torch.tensor([[9.0, 0.5, 2.0, 7.0]])
    values = torch.tensor([[5.0, 1.0, 0.5, 100.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.0, 1.03, 1.5, 0.0]])
    close(ret, [[0.0, 2.03, 2.0, 0.0]])
    # value_lam = 1: return advantage at t=1 is -0.05 + 0.9*1.0*1.5 = 1.3, R = 2.3,
    # which is the Monte-Carlo return 0.5 + 0.9 * 2.0
    adv_v, ret_v = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, value_lam=1.0)
    close(adv_v, [[0.0, 1.03, 1.5, 0.0]])
    close(ret_v, [[0.0, 2.3, 2.0, 0.0]])


def test_gae_one_token_and_empty_rows():
    # one-token response: A = score - V; empty row: all zero
    rewards = torch.tensor([[0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 1.25, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    close(adv, [[0.0, 1.75, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[0.0, 3.0, 0.0], [0.0, 0.0, 0.0]])


def test_gae_ignores_nan_padding_and_has_no_grad():
    rewards = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]])
    values = torch.tensor([[float("inf"), 0.5, 0.5, float("nan")]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    finite(adv, ret)
    # t=2: A = 2 - 0.5 = 1.5; t=1: delta = 1 + 0.5 - 0.5 = 1, A = 2.5; R = [3, 2]
    close(adv, [[0.0, 2.5, 1.5, 0.0]])
    close(ret, [[0.0, 3.0, 2.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_aggregate_matches_naive(seed, b, s, agg):
    mask, nmask = ragged_batch(seed, b, s)
    x = with_garbage(rand(seed, b, s - 1), mask)
    close(aggregate(x, mask, agg), naive_aggregate(x.tolist(), nmask, agg))


def test_aggregate_hand_worked_and_errors():
    # row 0 tokens {1, 3}, row 1 token {8}, row 2 none
    # token_mean = (1 + 3 + 8) / 3 = 4; seq_mean_token_mean = (2 + 8) / 2 = 5
    x = torch.tensor([[1.0, 3.0, 7.0], [8.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(aggregate(x, mask, "token_mean"), 4.0)
    close(aggregate(x, mask, "seq_mean_token_mean"), 5.0)
    assert aggregate(x, torch.zeros(3, 3), "seq_mean_token_mean").item() == 0.0
    with pytest.raises(ValueError, match="'token_sum'"):
        aggregate(x, mask, "token_sum")
    with pytest.raises(ValueError, match="'bogus'"):
        policy_loss(x, x, x, mask, agg="bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        value_loss(x, x, x, mask, agg="bogus")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize(
    "lo,hi,dual,agg",
    [
        (0.2, None, None, "token_mean"),
        (0.2, 0.28, None, "seq_mean_token_mean"),
        (0.1, 0.3, 3.0, "token_mean"),
        (0.2, None, 1.5, "seq_mean_token_mean"),
    ],
)
def test_policy_loss_matches_naive(seed, b, s, lo, hi, dual, agg):
    mask, nmask = ragged_batch(seed, b, s)
    old = rand(seed, b, s - 1) - 2.0
    logp = old + rand(seed + 1, b, s - 1, scale=0.5)
    adv = rand(seed + 2, b, s - 1, scale=1.5)
    loss, stats = policy_loss(logp, old, adv, mask, lo, hi, dual, agg)
    n_loss, n_stats = naive_policy_loss(
        logp.tolist(), old.tolist(), adv.tolist(), nmask, lo, lo if hi is None else hi, dual, agg
    )
    close(loss, n_loss)
    assert set(stats) == set(n_stats)
    for key, val in n_stats.items():
        assert stats[key].dim() == 0 and not stats[key].requires_grad
        close(stats[key], val, atol=1e-5)


def test_policy_loss_hand_worked():
    # eps 0.2, three tokens:
    #   a: ratio 1.5, A=+1: -1.5 vs clipped -1.2 -> max = -1.2 (clipped term active)
    #   b: ratio 0.5, A=+2: -1.0 vs clipped -1.6 -> max = -1.0 (unclipped)
    #   c: ratio 1.0, A=-1:  1.0 vs clipped  1.0 ->  1.0
    # loss = (-1.2 - 1.0 + 1.0) / 3 = -0.4; clipfrac = 1/3
    # approxkl = 0.5 * (log(1.5)^2 + log(0.5)^2 + 0) / 3
    #          = 0.5 * (0.164402 + 0.480453) / 3 = 0.107476
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    adv = torch.tensor([[1.0, 2.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps_low=0.2)
    close(loss, -0.4)
    close(stats["clipfrac"], 1 / 3)
    close(stats["approxkl"], 0.1074759)
    close(stats["ratio_mean"], 1.0)
    close(stats["ratio_var"], 1 / 6)  # population var of {1.5, 0.5, 1.0}: (0.25+0.25+0)/3
    assert "dual_clipfrac" not in stats
    # clip-higher: ratio 1.25 with A=+1 is clipped at 1.2 when symmetric, not at 1 + 0.28
    lp2 = torch.log(torch.tensor([[1.25]]))
    sym, _ = policy_loss(lp2, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    asym, _ = policy_loss(lp2, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    close(sym, -1.2)
    close(asym, -1.25)
    # dual clip, c = 3: ratio 5 with A=-1: max(5, 1.2) = 5, bounded by -c*A = 3
    lp3 = torch.log(torch.tensor([[5.0, 5.0]]))
    adv3 = torch.tensor([[-1.0, 1.0]])  # the positive-advantage token is untouched: max(-5, -1.2) = -1.2
    loss3, stats3 = policy_loss(lp3, torch.zeros(1, 2), adv3, torch.ones(1, 2), 0.2, dual_clip=3.0)
    close(loss3, (3.0 - 1.2) / 2)
    close(stats3["dual_clipfrac"], 0.5)
    close(stats3["clipfrac"], 0.5)  # only the A>0 token has its clipped term larger


def test_policy_loss_gradient_and_masking():
    # gradient flows only through unclipped, unmasked tokens: d/dlogp (-A * ratio) = -A * ratio
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.1, 1.5, 0.9, 1.0]])).requires_grad_()
    adv = torch.tensor([[2.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logp, old, adv, mask, 0.2)
    loss.backward()
    # token 0 unclipped: -2 * 1.1 / 3; token 1 clipped: 0; token 2 unclipped: 1 * 0.9 / 3; 3 masked
    close(logp.grad, [[-2.2 / 3, 0.0, 0.3, 0.0]])


def test_policy_loss_extreme_and_empty():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[300.0, -300.0, 0.0], [float("nan"), 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, dual_clip=3.0)
    finite(loss, *stats.values())
    loss.backward()
    finite(logp.grad)
    empty_loss, empty_stats = policy_loss(logp.detach(), old, adv, torch.zeros(2, 3))
    assert empty_loss.item() == 0.0
    assert all(v.item() == 0.0 for v in empty_stats.values())
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(old, old, adv, mask, dual_clip=1.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("eps,agg", [(0.2, "token_mean"), (None, "token_mean"), (0.1, "seq_mean_token_mean")])
def test_value_loss_matches_naive(seed, b, s, eps, agg):
    mask, nmask = ragged_batch(seed, b, s)
    old = rand(seed, b, s - 1)
    values = old + rand(seed + 1, b, s - 1, scale=0.3)
    returns = rand(seed + 2, b, s - 1)
    loss, stats = value_loss(values, old, returns, mask, eps, agg)
    n_loss, n_clip = naive_value_loss(values.tolist(), old.tolist(), returns.tolist(), nmask, eps, agg)
    close(loss, n_loss)
    close(stats["value_clipfrac"], n_clip)


def test_value_loss_hand_worked():
    # token 0: v=1.5, old=1.0, R=2.0, eps 0.2: unclipped (1.5-2)^2 = 0.25,
    #          clipped v = 1.2 -> (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32 (clipped active)
    # token 1: v=0.9, old=1.0, R=0.0: within the clip range -> 0.5 * 0.81 = 0.405
    # token_mean = (0.32 + 0.405) / 2 = 0.3625, clipfrac 1/2; unclipped: (0.125 + 0.405) / 2 = 0.265
    v = torch.tensor([[1.5, 0.9, 42.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]])
    ret = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = value_loss(v, old, ret, mask, clip_eps=0.2)
    close(loss, 0.3625)
    close(stats["value_clipfrac"], 0.5)
    loss.backward()
    # clipped token gets no gradient; token 1: d/dv 0.5 (v-R)^2 / 2 = 0.9 / 2
    close(v.grad, [[0.0, 0.45, 0.0]])
    loss_u, stats_u = value_loss(v, old, ret, mask, clip_eps=None)
    close(loss_u, 0.265)
    assert stats_u["value_clipfrac"].item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_explained_variance(seed):
    b, s = 4, 8
    mask, nmask = ragged_batch(seed + 10, b, s)
    returns = with_garbage(rand(seed, b, s - 1), mask)
    values = with_garbage(returns + rand(seed + 1, b, s - 1, scale=0.5), mask)
    rl, vl = returns.tolist(), values.tolist()
    diff = [[r - v for r, v in zip(rr, vr)] for rr, vr in zip(rl, vl)]
    var_r = naive_var(rl, nmask, unbiased=False)
    expected = 1.0 - naive_var(diff, nmask, unbiased=False) / var_r if var_r > 0 else 0.0
    close(explained_variance(values, returns, mask), expected, atol=1e-4)
    # hand-worked: perfect critic -> 1; constant critic at the mean -> 0;
    # returns [1, 3], values [0, 0]: var(R)=1, var(R-V)=1 -> 0; values [2, 2] -> also 0
    m = torch.ones(1, 2)
    r = torch.tensor([[1.0, 3.0]])
    close(explained_variance(r, r, m), 1.0)
    close(explained_variance(torch.full((1, 2), 2.0), r, m), 0.0)
    # values [3, 1]: R - V = [-2, 2], var 4 -> 1 - 4/1 = -3
    close(explained_variance(torch.tensor([[3.0, 1.0]]), r, m), -3.0)
    # var(R) == 0 (constant, single token, or empty) -> 0 by convention, never NaN
    close(explained_variance(torch.zeros(1, 2), torch.ones(1, 2), m), 0.0)
    close(explained_variance(r, r, torch.zeros(1, 2)), 0.0)


# ---------------------------------------------------------------------------------------
# Running moments and KL controllers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_running_moments_match_naive_and_roundtrip(seed):
    rng = random.Random(seed)
    batches = [torch.tensor([rng.gauss(3.0, 2.0) for _ in range(rng.randint(1, 9))]) for _ in range(6)]
    rm = RunningMoments()
    assert rm.count == 0 and rm.std == 1.0 and rm.mean == 0.0
    seen: list[float] = []
    for i, batch in enumerate(batches):
        vals = batch.tolist()
        bm, bs = rm.update(batch)
        seen += vals
        assert bm == pytest.approx(statistics.fmean(vals), rel=1e-9, abs=1e-12)
        assert bs == pytest.approx(statistics.stdev(vals) if len(vals) > 1 else 0.0, rel=1e-9, abs=1e-12)
        assert rm.count == len(seen)
        assert rm.mean == pytest.approx(statistics.fmean(seen), rel=1e-9)
        if len(seen) > 1:
            assert rm.std == pytest.approx(statistics.stdev(seen), rel=1e-9)
        if i == 2:
            restored = RunningMoments()
            restored.load_state_dict(json.loads(json.dumps(rm.state_dict())))
    assert restored.state_dict() != rm.state_dict()
    for batch in batches[3:]:
        restored.update(batch)
    assert restored.state_dict() == rm.state_dict()
    x = torch.tensor([0.0, 1.0, -2.0])
    close(
        rm.normalize(x), [(v - statistics.fmean(seen)) / (statistics.stdev(seen) + 1e-8) for v in x.tolist()]
    )
    close(rm.normalize(x, shift_mean=False), [v / (statistics.stdev(seen) + 1e-8) for v in x.tolist()])


def test_running_moments_empty_batch_is_noop():
    rm = RunningMoments()
    rm.update(torch.tensor([1.0, 2.0]))
    before = rm.state_dict()
    assert rm.update(torch.tensor([])) == (0.0, 0.0)
    assert rm.state_dict() == before


def test_adaptive_kl_controller_hand_worked_and_roundtrip():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9: 9/6 - 1 = 0.5, clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512 -> 0.100512
    ctl.update(9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    # KL 6.6: 6.6/6 - 1 = 0.1 (inside the band); mult = 1 + 0.1 * 256 / 10000 = 1.00256
    ctl.update(6.6, n_steps=256)
    assert ctl.value == pytest.approx(0.100512 * 1.00256, rel=1e-12)
    # KL 3: 3/6 - 1 = -0.5 -> -0.2; mult = 1 - 0.00512 = 0.99488
    ctl.update(3.0, n_steps=256)
    expected = 0.100512 * 1.00256 * 0.99488
    assert ctl.value == pytest.approx(expected, rel=1e-12)

    blob = json.dumps(ctl.state_dict())
    other = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1.0)
    other.load_state_dict(json.loads(blob))
    for kl in (0.0, 5.0, 12.0, 6.1):
        ctl.update(kl, 64)
        other.update(kl, 64)
        assert other.value == ctl.value
    # independent naive recursion over the whole history
    v = 0.1
    for kl, n in [(9.0, 256), (6.6, 256), (3.0, 256), (0.0, 64), (5.0, 64), (12.0, 64), (6.1, 64)]:
        v *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * n / 10000
    assert ctl.value == pytest.approx(v, rel=1e-12)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=1.0)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 512)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert other.value == 0.05
