"""Tests of aligner.rl.stats (masks, masked statistics and whitening) against the naive references of _rl_naive.py and
hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch
from _rl_naive import (
    SEEDS,
    SHAPES,
    close,
    finite,
    naive_flat,
    naive_mean,
    naive_var,
    naive_whiten,
    ragged_batch,
    rand,
    with_garbage,
)

from aligner.rl import (
    global_masked_mean,
    global_masked_var,
    global_whiten,
    masked_mean,
    masked_sum,
    masked_var,
    response_mask,
    whiten,
)

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
