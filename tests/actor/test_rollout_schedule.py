"""The rollout workers' schedules (:mod:`aligner.actor.rollout_schedule`) against a naive
simulation and hand-worked cases: which batch a step takes, which shares are past the bound,
which worker is asked, and the staleness per response token of a batch with swaps."""

from __future__ import annotations

import itertools
import random

import pytest

from aligner.actor.rollout_schedule import choose, fixed_worker, least_loaded, token_staleness


def test_the_fixed_schedule_deals_shares_round_robin():
    alive = [1, 2, 3]
    # d = 2: asks 1, 2, 3 -> shares (1,0) (1,1) (2,0) (2,1) (3,0) (3,1) on workers 1 2 3 1 2 3
    got = [fixed_worker((a, r), 2, alive) for a in (1, 2, 3) for r in (0, 1)]
    assert got == [1, 2, 3, 1, 2, 3]
    assert [fixed_worker((a, 0), 1, [2, 5]) for a in range(1, 5)] == [2, 5, 2, 5]


def test_the_least_loaded_worker_is_asked_ties_in_the_fixed_order():
    alive = [1, 2, 3]
    assert least_loaded((1, 0), 1, alive, []) == 1
    assert least_loaded((2, 0), 1, alive, []) == 2  # all idle: the fixed schedule's worker
    assert least_loaded((2, 0), 1, alive, [2, 2, 3]) == 1
    assert least_loaded((3, 0), 1, alive, [1, 2]) == 3
    assert least_loaded((1, 0), 1, alive, [1, 9, 9]) == 2  # a worker no longer alive counts for none


def test_choose_by_hand():
    # step 5, k = 1: versions >= 3 are within the bound
    versions = {(4, 0): 3, (5, 0): 4, (3, 0): 2}
    assert choose(5, 1, [3, 4, 5], 1, versions) == (4, [(3, 0)])
    # ask 4 is not whole at d = 2 (rank 1 missing): ask 5 is taken
    versions = {(4, 0): 3, (5, 0): 4, (5, 1): 4}
    assert choose(5, 1, [4, 5], 2, versions) == (5, [])
    # a whole ask with one share past the bound is not taken; nothing whole: None
    versions = {(4, 0): 3, (4, 1): 2}
    assert choose(5, 1, [4, 5], 2, versions) == (None, [(4, 1)])
    assert choose(1, 0, [1], 1, {}) == (None, [])
    assert choose(1, 0, [1], 1, {(1, 0): 0}) == (1, [])


def _naive_choose(step, k, asks, dp, versions):
    ok = {key for key, v in versions.items() if step - 1 - v <= k}
    whole = [a for a in asks if all((a, r) in ok for r in range(dp))]
    stale = sorted(set(versions) - ok)
    return (min(whole) if whole else None), stale


@pytest.mark.parametrize("seed", range(5))
def test_choose_is_the_naive_rule_on_random_states(seed):
    rng = random.Random(seed)
    for _ in range(300):
        step, k, dp = rng.randint(1, 9), rng.randint(0, 3), rng.randint(1, 3)
        asks = rng.sample(range(1, 12), rng.randint(0, 5))
        versions = {
            (a, r): rng.randint(0, step - 1)
            for a, r in itertools.product(asks, range(dp))
            if rng.random() < 0.7
        }
        assert choose(step, k, asks, dp, versions) == _naive_choose(step, k, asks, dp, versions)


def _naive_token_staleness(step, version, swaps, lengths):
    per_token = []
    for L in lengths:
        for t in range(L):
            v = version
            for k, w in swaps:
                if t >= k:
                    v = w
            per_token.append(step - 1 - v)
    if not per_token:
        return 0.0, 0.0
    swapped = sum(1 for L in lengths for t in range(L) if swaps and t >= swaps[0][0])
    return sum(per_token) / len(per_token), swapped / len(per_token)


def test_token_staleness_by_hand_and_against_the_naive_count():
    # step 6 trains version 5; rows of 4 and 2 tokens from version 3, version 5 from token 2 on:
    # row 1: 2, 2, 0, 0; row 2: 2, 2 -> mean 8 / 6; swapped 2 / 6
    assert token_staleness(6, 3, [[2, 5]], [4, 2]) == pytest.approx((8 / 6, 2 / 6))
    assert token_staleness(3, 2, [], [3, 1]) == (0.0, 0.0)
    assert token_staleness(3, 1, [], [0, 0]) == (0.0, 0.0)
    rng = random.Random(0)
    for _ in range(200):
        step = rng.randint(2, 9)
        version = rng.randint(0, step - 2)
        ks = sorted(rng.sample(range(1, 8), rng.randint(0, 3)))
        vs = sorted(rng.sample(range(version + 1, step + 3), len(ks)))
        swaps = [[k, v] for k, v in zip(ks, vs)]
        lengths = [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]
        got = token_staleness(step, version, swaps, lengths)
        assert got == pytest.approx(_naive_token_staleness(step, version, swaps, lengths))
