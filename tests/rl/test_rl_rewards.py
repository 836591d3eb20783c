"""Tests of aligner.rl.rewards (KL estimators, shaped rewards, score shaping, running moments and KL controllers) against the naive references of _rl_naive.py and
hand-worked cases."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch
from _rl_naive import (
    SEEDS,
    SHAPES,
    close,
    finite,
    naive_kl,
    naive_shaped,
    ragged_batch,
    rand,
    with_garbage,
)

from aligner.rl import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    apply_missing_eos_penalty,
    clip_scores,
    kl_penalty,
    overlong_filter,
    overlong_penalty,
    shaped_rewards,
)

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


def test_soft_overlong_penalty_hand_worked_and_against_the_formula():
    # M = 8, B = 4: no penalty up to 4 tokens, then (4 - L) / 4 * penalty down to -penalty at 8.
    lengths = torch.tensor([1, 3, 4, 5, 6, 8])
    close(overlong_penalty(lengths, 8, 4), [0.0, 0.0, 0.0, -0.25, -0.5, -1.0])
    close(overlong_penalty(lengths, 8, 4, penalty=2.0), [0.0, 0.0, 0.0, -0.5, -1.0, -2.0])
    close(overlong_penalty(lengths, 8, 0), [0.0] * 6)  # B = 0: off
    close(overlong_penalty(torch.tensor([9]), 8, 4), [-1.0])  # past the limit: the whole penalty
    for m, b in ((8, 1), (8, 8), (16, 5)):
        ls = list(range(0, m + 1))
        want = [0.0 if n <= m - b else (m - b - n) / b * 1.5 for n in ls]
        close(overlong_penalty(torch.tensor(ls), m, b, 1.5), want)
    for bad in (-1, 9, 2.5):
        with pytest.raises(ValueError, match="expected an integer in \\[0, max_new_tokens=8\\]"):
            overlong_penalty(lengths, 8, bad)


def test_overlong_filter_drops_the_rows_that_never_ended():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    ended = torch.tensor([True, False, True])
    close(overlong_filter(mask, ended), [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    close(mask, [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # input untouched


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
