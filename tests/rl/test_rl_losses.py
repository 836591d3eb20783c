"""Tests of aligner.rl.losses (the clipped policy and value losses, their aggregation, explained
variance) against the naive references of _rl_naive.py and hand-worked cases; and a batch cut
into parts: each part's loss over the whole batch's normaliser and the parts' statistics as sums
add up to the whole batch's (against a naive loop over the parts)."""

from __future__ import annotations

import pytest
import torch
from _rl_naive import (
    SEEDS,
    SHAPES,
    close,
    finite,
    naive_aggregate,
    naive_policy_loss,
    naive_value_loss,
    naive_var,
    ragged_batch,
    rand,
    with_garbage,
)

from aligner.rl import (
    aggregate,
    explained_variance,
    loss_normaliser,
    policy_loss,
    policy_stat_sums,
    policy_stats_from_sums,
    value_loss,
)

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
    "lo,hi,dual,agg,tis",
    [
        (0.2, None, None, "token_mean", None),
        (0.2, 0.28, None, "seq_mean_token_mean", None),
        (0.1, 0.3, 3.0, "token_mean", None),
        (0.2, None, 1.5, "seq_mean_token_mean", None),
        (0.2, None, None, "token_mean", 1.5),
        (0.1, 0.3, 3.0, "seq_mean_token_mean", 2.0),
    ],
)
def test_policy_loss_matches_naive(seed, b, s, lo, hi, dual, agg, tis):
    mask, nmask = ragged_batch(seed, b, s)
    old = rand(seed, b, s - 1) - 2.0
    logp = old + rand(seed + 1, b, s - 1, scale=0.5)
    adv = rand(seed + 2, b, s - 1, scale=1.5)
    behaviour = old + rand(seed + 3, b, s - 1, scale=0.7)  # weights from about 0.5 to 2
    kw = {} if tis is None else {"behaviour_logp": behaviour, "tis_cap": tis}
    loss, stats = policy_loss(logp, old, adv, mask, lo, hi, dual, agg, **kw)
    n_loss, n_stats = naive_policy_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        nmask,
        lo,
        lo if hi is None else hi,
        dual,
        agg,
        behaviour.tolist(),
        tis,
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


def test_tis_hand_worked():
    # Two tokens, ratio 1 (logp = old), A = +1 and -1, eps 0.2, cap 2:
    #   a: old - behaviour = log 3 -> w = min(3, 2) = 2 (truncated); term -1 * 2 = -2
    #   b: old - behaviour = log 0.5 -> w = 0.5;                     term +1 * 0.5 = 0.5
    # loss = (-2 + 0.5) / 2 = -0.75; weight mean 1.25; truncated 1/2
    old = torch.zeros(1, 2)
    behaviour = -torch.log(torch.tensor([[3.0, 0.5]]))
    logp = old.clone().requires_grad_()
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, behaviour_logp=behaviour, tis_cap=2.0)
    close(loss, -0.75)
    close(stats["tis_weight_mean"], 1.25)
    close(stats["tis_truncfrac"], 0.5)
    loss.backward()
    # the weight is a constant: d/dlogp (-A * w * ratio) = -A * w * ratio / 2 tokens
    close(logp.grad, [[-1.0, 0.25]])
    # the engine agreeing with the training forward: weight 1, today's loss to the bit
    plain, _ = policy_loss(logp.detach(), old, adv, torch.ones(1, 2), 0.2)
    same, s1 = policy_loss(logp.detach(), old, adv, torch.ones(1, 2), 0.2, behaviour_logp=old, tis_cap=2.0)
    assert torch.equal(plain, same) and s1["tis_weight_mean"].item() == 1.0
    with pytest.raises(ValueError, match="tis_cap must be >= 1"):
        policy_loss(old, old, adv, torch.ones(1, 2), behaviour_logp=old, tis_cap=0.5)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        policy_loss(old, old, adv, torch.ones(1, 2), tis_cap=2.0)


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


# ---------------------------------------------------------------------------------------
# A batch in parts: the global normaliser and summed statistics
# ---------------------------------------------------------------------------------------


def naive_part_losses(x, mask, parts, mode):
    """Each part's (a list of row indices) loss over the whole batch's count, by loops: the sum of
    its per-token terms (token_mean) or of its rows' token means (seq_mean_token_mean), over the
    whole batch's tokens or rows with a token."""
    rows = [[v for v, m in zip(xr, mr) if m] for xr, mr in zip(x, mask)]
    if mode == "token_mean":
        count = sum(len(r) for r in rows)
        per_row = [sum(r) for r in rows]
    else:
        count = sum(1 for r in rows if r)
        per_row = [sum(r) / len(r) if r else 0.0 for r in rows]
    return [sum(per_row[i] for i in part) / count if count else 0.0 for part in parts]


def _parts(b: int, seed: int) -> list[list[int]]:
    """The rows ``0..b-1`` shuffled and cut into parts of uneven sizes (one may be empty)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(b, generator=g).tolist()
    cuts = sorted(torch.randint(0, b + 1, (2,), generator=g).tolist())
    return [order[: cuts[0]], order[cuts[0] : cuts[1]], order[cuts[1] :]]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_parts_over_the_global_normaliser_add_up_to_the_whole(seed, b, s, agg):
    mask, nmask = ragged_batch(seed, b, s)
    x = with_garbage(rand(seed, b, s - 1), mask)
    parts = _parts(b, seed)
    normaliser = sum(loss_normaliser(mask[p], agg) for p in parts)
    assert float(normaliser) == float(loss_normaliser(mask, agg))
    got = [aggregate(x[p], mask[p], agg, normaliser) for p in parts]
    for g, want in zip(got, naive_part_losses(x.tolist(), nmask, parts, agg)):
        close(g, want)
    close(sum(got), aggregate(x, mask, agg))
    close(sum(got), naive_aggregate(x.tolist(), nmask, agg))
    # The policy loss and its gradient likewise.
    old = rand(seed, b, s - 1) - 2.0
    logp = (old + rand(seed + 1, b, s - 1, scale=0.5)).requires_grad_()
    adv = rand(seed + 2, b, s - 1, scale=1.5)
    whole, whole_stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, agg)
    (want_grad,) = torch.autograd.grad(whole, logp)
    total, sums = 0.0, {}
    for p in parts:
        loss, stats = policy_loss(logp[p], old[p], adv[p], mask[p], 0.2, 0.28, 3.0, agg, normaliser)
        total = total + loss
        for k, v in policy_stat_sums(stats, mask[p]).items():
            sums[k] = sums.get(k, 0.0) + v
    close(total, whole)
    (grad,) = torch.autograd.grad(total, logp)
    close(grad, want_grad, atol=1e-6)
    merged = policy_stats_from_sums(sums)
    assert merged.keys() == whole_stats.keys()
    for k, v in whole_stats.items():
        close(merged[k].float(), v, atol=1e-6)
    # The value loss too.
    vl = [value_loss(x[p], old[p], adv[p], mask[p], 0.2, agg, normaliser)[0] for p in parts]
    close(sum(vl), value_loss(x, old, adv, mask, 0.2, agg)[0])


def test_global_normaliser_hand_worked():
    # row 0 tokens {1, 3}, row 1 token {8}, row 2 none; parts [row 0] and [rows 1, 2]
    x = torch.tensor([[1.0, 3.0, 7.0], [8.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(loss_normaliser(mask, "token_mean")) == 3.0
    assert float(loss_normaliser(mask, "seq_mean_token_mean")) == 2.0
    assert float(loss_normaliser(mask[1:], "seq_mean_token_mean")) == 1.0
    # token_mean over 3 tokens: (1 + 3) / 3 + 8 / 3 = 4
    close(aggregate(x[:1], mask[:1], "token_mean", 3.0), 4 / 3)
    close(aggregate(x[1:], mask[1:], "token_mean", torch.tensor(3.0)), 8 / 3)
    # seq_mean_token_mean over 2 rows: 2 / 2 + 8 / 2 = 5
    close(aggregate(x[:1], mask[:1], "seq_mean_token_mean", 2.0), 1.0)
    close(aggregate(x[1:], mask[1:], "seq_mean_token_mean", 2.0), 4.0)
    # What averaging the parts' own means gives instead (the per-micro-batch mean): (2 + 8) / 2
    # = 5, not the batch's token mean 4.
    close((aggregate(x[:1], mask[:1], "token_mean") + aggregate(x[1:], mask[1:], "token_mean")) / 2, 5.0)
    # A normaliser of 0 (no token anywhere) gives 0, not NaN.
    assert aggregate(x, torch.zeros(3, 3), "token_mean", 0.0).item() == 0.0
    # Statistics: ratios {1.5, 0.5} in one part and {1.0} in another merge to the batch's
    # mean 1 and population variance 1/6.
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.0, 2.0]]))
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    sums = {}
    for p in ([0], [1]):
        _, stats = policy_loss(logp[p], torch.zeros(1, 2), torch.ones(1, 2), m[p])
        for k, v in policy_stat_sums(stats, m[p]).items():
            sums[k] = sums.get(k, 0.0) + v
    merged = policy_stats_from_sums(sums)
    assert float(sums["tokens"]) == 3.0
    close(merged["ratio_mean"].float(), 1.0)
    close(merged["ratio_var"].float(), 1 / 6)
    # Several batches side by side (one of them empty): element-wise.
    both = {k: torch.stack([v, torch.zeros_like(v)]) for k, v in sums.items()}
    side = policy_stats_from_sums(both)
    close(side["ratio_var"].float(), [1 / 6, 0.0])
    assert side["clipfrac"][1].item() == 0.0


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


def test_value_clipfrac_counts_no_token_inside_the_range():
    """V inside [old - eps, old + eps] is not clipped, whatever rounding ``old + (V - old)`` does:
    V and old drawn apart (as a critic's two predictions are), that sum differs from V for 30% of
    the tokens here, and it counted 2.7% of them as clipped, one ulp apart. The gradient is the
    unclipped loss's."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 33, generator=g) * 0.1
    v = (torch.randn(64, 33, generator=g) * 0.1).requires_grad_(True)
    ret = torch.randn(64, 33, generator=g)
    mask = ((v.detach() - old).abs() < 0.2).float()  # the tokens inside the range
    assert 0.8 < mask.mean() < 0.9
    loss, stats = value_loss(v, old, ret, mask, clip_eps=0.2)
    assert stats["value_clipfrac"].item() == 0.0
    loss.backward()
    close(v.grad, (v.detach() - ret) * mask / mask.sum())


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
