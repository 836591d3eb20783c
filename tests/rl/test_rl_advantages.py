"""Tests of aligner.rl.advantages (GAE, GRPO, RLOO, REINFORCE++) against the naive references of
_rl_naive.py and hand-worked cases."""

from __future__ import annotations

import pytest
import torch
from _rl_naive import (
    SEEDS,
    SHAPES,
    close,
    finite,
    naive_gae,
    naive_grpo,
    naive_returns,
    naive_returns_to_go,
    naive_rloo,
    naive_whiten,
    ragged_batch,
    rand,
    with_garbage,
)

from aligner.rl import (
    compute_gae,
    group_score_std,
    grpo_advantages,
    reinforce_pp_advantages,
    returns_to_go,
    rloo_advantages,
)

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
# Critic-free estimators: groups are contiguous blocks of n rows
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,n", [(4, 2), (12, 4), (9, 3)])
def test_group_estimators_match_naive(seed, b, n):
    s = 9
    mask, nmask = ragged_batch(seed, b, s)
    scores = rand(seed, b)
    sl = scores.tolist()
    for std_norm in (True, False):
        close(
            grpo_advantages(scores, mask, n, std_norm=std_norm), naive_grpo(sl, n, nmask, std_norm), atol=1e-4
        )
    close(rloo_advantages(scores, mask, n), naive_rloo(sl, n, nmask), atol=1e-5)
    # RLOO is GRPO without the division, scaled by n / (n - 1)
    close(rloo_advantages(scores, mask, n), grpo_advantages(scores, mask, n, std_norm=False) * n / (n - 1))
    stds = [torch.tensor(sl[g : g + n]).double().std().item() for g in range(0, b, n)]
    assert group_score_std(scores, n).item() == pytest.approx(sum(stds) / len(stds), rel=1e-5)


def test_group_estimators_hand_worked():
    # Two groups of 3: [1, 0, 0.5] (mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5) and
    # [2, 2, 2] (all equal: nothing to learn, advantages 0 whichever estimator).
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    mask = torch.tensor([[0.0, 1.0, 1.0]] * 5 + [[0.0, 1.0, 0.0]])
    # GRPO: (r - 0.5) / (0.5 + 1e-6); Dr. GRPO: r - 0.5
    d = 0.5 + 1e-6
    close(
        grpo_advantages(scores, mask, 3),
        [[0, 0.5 / d, 0.5 / d], [0, -0.5 / d, -0.5 / d], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    )
    close(
        grpo_advantages(scores, mask, 3, std_norm=False),
        [[0, 0.5, 0.5], [0, -0.5, -0.5], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    )
    # RLOO: 1 - (0 + 0.5) / 2 = 0.75; 0 - (1 + 0.5) / 2 = -0.75; 0.5 - (1 + 0) / 2 = 0
    close(
        rloo_advantages(scores, mask, 3),
        [[0, 0.75, 0.75], [0, -0.75, -0.75], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    )
    assert group_score_std(scores, 3).item() == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert group_score_std(scores, 1).item() == 0.0


def test_group_estimators_refuse_bad_groups():
    mask = torch.ones(6, 3)
    with pytest.raises(ValueError, match="6 scores do not split into groups of group_size=4"):
        grpo_advantages(torch.zeros(6), mask, 4)
    with pytest.raises(ValueError, match=r"rloo_advantages: group_size=1: expected an integer >= 2"):
        rloo_advantages(torch.zeros(6), mask, 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_naive(seed, b, s, gamma):
    mask, nmask = ragged_batch(seed, b, s)
    rewards = with_garbage(rand(seed, b, s - 1), mask)
    g = returns_to_go(rewards, mask, gamma)
    ng = naive_returns_to_go(rewards.tolist(), nmask, gamma)
    close(g, ng, atol=1e-4)
    # returns-to-go are GAE's advantages with zero values and lambda 1
    close(g, compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0].tolist(), atol=1e-5)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma)
    assert torch.equal(ret, g)
    close(adv, naive_whiten(ng, nmask), atol=1e-3)


def test_reinforce_pp_hand_worked():
    # Row 0: response transitions 1, 2 with rewards -1 (the KL penalty) and 2 (score 2 at the last
    # token); row 1: one transition with reward 3. gamma 1: G = [1, 2] and [3]; the global baseline
    # is their mean 2 and their unbiased std is 1, so A = [-1, 0] and [1]. The 50/60/70 never leak.
    rewards = torch.tensor([[50.0, -1.0, 2.0, 60.0], [70.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    close(ret, [[0, 1, 2, 0], [0, 3, 0, 0]])
    close(adv, [[0, -1, 0, 0], [0, 1, 0, 0]], atol=1e-6)
    # gamma 0.5: G = [-1 + 0.5 * 2, 2] = [0, 2] and [3]
    _, ret_half = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(ret_half, [[0, 0, 2, 0], [0, 3, 0, 0]])
