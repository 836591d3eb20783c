"""Tests of aligner.rl.logprobs (log-probabilities and entropy from logits) against the naive references of _rl_naive.py and
hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch
from _rl_naive import (
    SEEDS,
    close,
    finite,
    naive_entropy,
    naive_logprobs,
    rand,
)

from aligner.rl import (
    entropy_from_logits,
    gather_logprobs,
    sequence_logprobs,
)

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
