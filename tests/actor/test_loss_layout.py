"""One loss at any layout: a PPO update on a fixed rollout (``tests/_loss_layout.py``: 8 rows with
responses of 1 to 16 tokens, one of them left out of the loss mask, fixed old log-probs and
advantages, an entropy bonus, 2 epochs of one minibatch) applies the same gradients, ends with
the same weights and reports the same statistics whatever the micro-batch size, the
data-parallel, tensor-parallel and pipeline-parallel sizes, for both ``ppo.loss_agg`` modes
(fp32 on the CPU): ``token_mean`` is the mean over every response token of the global
minibatch, ``seq_mean_token_mean`` the mean over its sequences of their token means.

Tolerances and what they catch (measured): the layouts differ from the one-process, one
micro-batch reference by at most 1.6e-6 of the largest gradient element (TP=2; the others
~5e-7: float rounding of other matrix shapes and summation orders), checked against 1e-5. The update as it was before the
global normaliser (each micro-batch's own mean loss divided by the number of micro-batches)
differs from it by 0.083 of the largest gradient element (``token_mean``) and 0.155
(``seq_mean_token_mean``: the micro-batch holding the empty row weighs its one sequence as two)
at micro-batch 2, so the checks would fail it by four orders of magnitude.

Packed micro-batches (``ppo.max_tokens_per_micro_batch``) give the same update and rollout
log-probs as padded ones, to the same tolerances.

And the first minibatch's invariants: the rollout's log-probs are the training forward's, so the
first ratio is exactly 1 and the approximate KL exactly 0 (where the two forwards run the same
shapes, or Megatron's forward; the fused forward of a micro-batch cut to its longest row rounds
~1e-7 apart, :func:`test_the_fused_forward_of_cut_micro_batches_rounds_apart`).
"""

from __future__ import annotations

import _loss_layout as L  # noqa: N812
import pytest
import torch
from _torchrun import run_worker

GRAD_TOL = 1e-5
"""Largest gradient difference, relative to the largest gradient element."""
WEIGHT_TOL = 1e-4
"""Largest weight difference after the two AdamW steps of 2e-3 (absolute). Adam divides each
gradient element by its own running magnitude, so an element whose two gradients nearly cancel
carries their rounding into its step almost whole: TP=2 measured 1.03e-5 on one machine (AVX-512
kernels; gradients 1.7e-6 apart, as above) and under 1e-5 on another. A wrong loss moves the
gradients by 0.08 of their largest element, which the gradient check catches."""
STAT_TOL = 1e-5
"""Largest statistic difference, relative to the larger of 1 and the statistic."""


def _check(d: dict[str, float], what: str) -> None:
    assert d["steps"] == 1.0 and d["stat_keys"] == 1.0, (what, d)
    assert d["grads"] < GRAD_TOL, (what, d)
    assert d["weights"] < WEIGHT_TOL, (what, d)
    assert d["stats"] < STAT_TOL, (what, d)


@pytest.fixture(scope="module")
def one_process():
    from aligner import distributed

    state = distributed.initialize(distributed.ParallelConfig(), seed=L.SEED)
    weights = L.canonical_weights(L.model_cfg())
    yield state, weights, L.rollout_inputs(L.initial_logprobs(weights))
    distributed.destroy()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_the_micro_batch_size_changes_no_gradient(one_process, agg):
    state, weights, inputs = one_process
    ref = L.run_update(L.Layout(micro=8, agg=agg), state, weights, inputs)
    assert len(ref.grads) == 2 and len(ref.minibatch_stats) == 2
    assert {
        "loss/policy",
        "policy/clipfrac",
        "policy/approxkl",
        "policy/ratio_mean",
        "policy/entropy",
    } <= set(ref.stats)
    for micro in (1, 2, 4):
        _check(
            L.differences(L.run_update(L.Layout(micro=micro, agg=agg), state, weights, inputs), ref), micro
        )
    # The check above fails the per-micro-batch mean by far: the update is not the same.
    old = L.old_style_grads(weights, inputs, 2, agg)
    scale = max(float(g.abs().max()) for g in ref.grads[0].values())
    off = max(float((old[k] - g).abs().max()) for k, g in ref.grads[0].items()) / scale
    assert off > 1000 * GRAD_TOL, off


@pytest.mark.multiprocess
def test_data_tensor_and_pipeline_parallel_updates_are_the_one_process_update():
    """DP=2 (micro-batches 2 and 4 on each rank), TP=2 and PP=2 (micro-batch 2), and packed
    micro-batches at DP=2 and TP=2 (at PP=2 the budget leaves the row counts as they are)
    against the one-process update with one micro-batch (``tests/workers/loss_layout.py``,
    two processes over gloo): gradients, weights and every statistic (the statistics are the
    global minibatch's: both DP ranks' rows, not rank 0's)."""
    report = run_worker("loss_layout.py")
    assert len(report) == 14, sorted(report)
    for what, d in report.items():
        _check(d, what)


@pytest.mark.parametrize(
    "forward, reuse, micro",
    [("fused", True, 8), ("megatron", False, 2), ("megatron", False, 8), ("fused", False, 8)],
)
def test_the_first_ratio_is_one_and_the_first_kl_zero(one_process, forward, reuse, micro):
    """The rollout's log-probs as the trainer takes them (the first PPO forward's with
    ``ppo.reuse_rollout_forward``, else the no-grad forward in micro-batches cut to their
    longest row) are the training forward's, bit for bit: the first minibatch of the first epoch
    has ratio 1 and approximate KL 0 exactly, and nothing clipped. The next one moved."""
    state, weights, _ = one_process
    lay = L.Layout(micro=micro, reuse=reuse, forward=forward)
    model, update = L.build_update(lay, state, weights, L.Result())
    assert update.reuse_rollout_forward is reuse
    r = L.rollout_of(L.rollout_inputs(torch.zeros(L.ROWS, L.SEQ - 1)))
    orders = update.epoch_orders(1, L.ROWS)
    handoff = []
    if reuse:
        first, r.old_logprobs, _ = update.first_forward(r.tokens, orders[0], r.start)
        handoff.append(first)
    else:
        r.old_logprobs, _ = update.logprobs.no_grad(
            model, r.tokens, micro, with_entropy=True, start=r.start, lengths=r.lengths
        )
    update.train_step(r, orders, handoff)
    first, second = update.minibatch_stats
    assert first["policy/ratio_mean"] == 1.0 and first["policy/ratio_var"] == 0.0, first
    assert first["policy/approxkl"] == 0.0 and first["policy/clipfrac"] == 0.0, first
    assert second["policy/approxkl"] > 0.0


def test_the_fused_forward_of_cut_micro_batches_rounds_apart(one_process):
    """Where the invariant above is not exact: the fused forward of a micro-batch cut to its
    longest row rounds differently from the full-width training forward, so without
    ``reuse_rollout_forward`` and with micro-batches narrower than the batch the first ratio is 1
    only to float rounding (measured: approximate KL ~6e-14, ratio mean 1 - 4e-8)."""
    state, weights, _ = one_process
    lay = L.Layout(micro=2, forward="fused")
    model, update = L.build_update(lay, state, weights, L.Result())
    r = L.rollout_of(L.rollout_inputs(torch.zeros(L.ROWS, L.SEQ - 1)))
    r.old_logprobs, _ = update.logprobs.no_grad(model, r.tokens, 2, start=r.start, lengths=r.lengths)
    orders = update.epoch_orders(1, L.ROWS)
    update.train_step(r, orders, [])
    first = update.minibatch_stats[0]
    assert abs(first["policy/ratio_mean"] - 1.0) < 1e-6 and first["policy/approxkl"] < 1e-10, first
    assert first["policy/clipfrac"] == 0.0, first


# -- packed micro-batches (ppo.max_tokens_per_micro_batch) ------------------------------------


@pytest.mark.parametrize("forward", ["megatron", "fused"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_the_packed_update_is_the_padded_update(one_process, forward, agg):
    """Micro-batches of consecutive rows under a token budget, packed without padding: the
    same gradients, weights and statistics as one padded micro-batch of every row."""
    state, weights, inputs = one_process
    ref = L.run_update(L.Layout(micro=8, agg=agg, forward=forward), state, weights, inputs)
    for budget in (L.BUDGET, 1, 1000):  # a few rows each; one row each; every row in one
        lay = L.Layout(micro=2, agg=agg, forward=forward, max_tokens=budget)
        _check(L.differences(L.run_update(lay, state, weights, inputs), ref), lay)


@pytest.mark.parametrize("forward", ["megatron", "fused"])
def test_packed_rollout_logprobs_are_the_padded_ones(one_process, forward):
    """The no-grad forward of the rollout and the reference, packed: the padded log-probs and
    entropies at every real transition, 0 past each row's last one; and the packed update's
    first ratio is 1 to float rounding."""
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.models import gpt
    from aligner.models.forward import set_forward
    from aligner.models.layout import load_megatron_tensors

    _, weights, _ = one_process
    cfg = L.model_cfg()
    model = gpt.build_policy(cfg)
    load_megatron_tensors(model, cfg, weights.__getitem__)
    set_forward(model, forward)
    tokens, lengths, _, mask = L.tokens_and_mask()
    lp = PolicyLogprobs(temperature=0.7)
    want, want_ent = lp.no_grad(model, tokens, 8, with_entropy=True, start=1)
    for budget in (L.BUDGET, 1):
        got, got_ent = lp.no_grad(
            model, tokens, 8, with_entropy=True, start=1, lengths=lengths, max_tokens=budget
        )
        real = torch.zeros_like(mask, dtype=torch.bool)
        for i, n in enumerate(lengths.tolist()):
            real[i, 1 : n - 1] = True
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_ent[real], want_ent[real], atol=1e-5, rtol=0)
        assert (got[~real] == 0).all() and (got_ent[~real] == 0).all()
    # Packed rollout log-probs, then the packed update: its first ratio is 1 to rounding.
    state, _, _ = one_process
    lay = L.Layout(micro=2, forward=forward, max_tokens=L.BUDGET)
    model, update = L.build_update(lay, state, weights, L.Result())
    r = L.rollout_of(L.rollout_inputs(torch.zeros(L.ROWS, L.SEQ - 1)))
    r.old_logprobs, _ = update.logprobs.no_grad(
        model, r.tokens, 2, start=r.start, lengths=r.lengths, max_tokens=L.BUDGET
    )
    update.train_step(r, update.epoch_orders(1, L.ROWS), [])
    first = update.minibatch_stats[0]
    assert abs(first["policy/ratio_mean"] - 1.0) < 1e-6 and first["policy/approxkl"] < 1e-10, first


def test_the_token_budget_is_checked_and_turns_the_rollout_forward_reuse_off(one_process):
    from aligner.actor.config import PPOConfig

    for bad in (0, -3, True, 2.5):
        p = PPOConfig(max_tokens_per_micro_batch=bad)
        assert any("ppo.max_tokens_per_micro_batch" in x for x in p.problems()), bad
    for good in (None, 1, 4096):
        assert not any("max_tokens" in x for x in PPOConfig(max_tokens_per_micro_batch=good).problems())
    # Packed, the first PPO pass is no longer one micro-batch of every row: no reuse.
    state, weights, _ = one_process
    for budget, reused in ((None, True), (L.BUDGET, False)):
        lay = L.Layout(micro=8, forward="fused", reuse=True, max_tokens=budget)
        _, update = L.build_update(lay, state, weights, L.Result())
        assert update.reuse_rollout_forward is reused and update.max_tokens == budget


# -- padded micro-batches cut to their longest row ---------------------------------------------


@pytest.mark.parametrize("forward", ["megatron", "fused"])
@pytest.mark.parametrize("micro", [1, 2])
def test_a_padded_micro_batch_runs_its_forward_on_its_longest_row(one_process, monkeypatch, forward, micro):
    """Each padded micro-batch's training forward runs only up to its longest row (one row each
    at micro-batch 1: exactly the rows' lengths; never under ``start + 1``), and applies the same
    gradients, weights and statistics as the same micro-batches run at the rollout's full width."""
    from aligner.actor.policy_update import PolicyUpdate
    from aligner.models import forward as fwd

    state, weights, inputs = one_process
    lay = L.Layout(micro=micro, forward=forward)
    widths: list[int] = []
    logits = fwd.policy_logits

    def recorded(model, tokens, start=0):
        widths.append(tokens.shape[1])
        return logits(model, tokens, start)

    monkeypatch.setattr(fwd, "policy_logits", recorded)
    cut = L.run_update(lay, state, weights, inputs)
    start = int(L.rollout_of(inputs).start)
    lengths = [max(n, start + 1) for n in L.LENGTHS]
    if micro == 1:
        assert sorted(widths) == sorted(lengths * lay.epochs), widths
    assert len(widths) == lay.epochs * L.ROWS // micro and min(widths) < L.SEQ, widths

    # The same micro-batches at the rollout's full width.
    micro_batches = PolicyUpdate._micro_batches

    def uncut(self, r, idx, lengths):
        return [(m, packed, r.tokens.shape[1]) for m, packed, _ in micro_batches(self, r, idx, lengths)]

    monkeypatch.setattr(PolicyUpdate, "_micro_batches", uncut)
    widths.clear()
    full = L.run_update(lay, state, weights, inputs)
    assert set(widths) == {L.SEQ}
    _check(L.differences(cut, full), lay)


def test_truncated_importance_sampling_weighs_the_update_at_any_layout(one_process):
    """``ppo.tis_cap``: with the engine's log-probs equal to the training forward's every weight
    is 1 and the update is the plain one, bit for bit; with them apart (a fixed noise: weights
    of about 0.6 to 1.7, some truncated at 1.2) the update moves, and is still the same at any
    micro-batch size, packed or padded."""
    state, weights, inputs = one_process
    plain = L.run_update(L.Layout(micro=8), state, weights, inputs)
    agree = L.run_update(
        L.Layout(micro=8, tis_cap=1.2),
        state,
        weights,
        {**inputs, "behaviour_logprobs": inputs["old_logprobs"]},
    )
    for a, b in zip(agree.grads, plain.grads):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert agree.minibatch_stats[0]["policy/tis_weight_mean"] == 1.0
    assert agree.minibatch_stats[0]["policy/tis_truncfrac"] == 0.0

    g = torch.Generator().manual_seed(L.SEED + 2)
    gap = 0.25 * torch.randn(inputs["old_logprobs"].shape, generator=g)
    apart = {**inputs, "behaviour_logprobs": inputs["old_logprobs"] - gap}
    ref = L.run_update(L.Layout(micro=8, tis_cap=1.2), state, weights, apart)
    first = ref.minibatch_stats[0]
    assert 0.0 < first["policy/tis_truncfrac"] < 0.5 and 0.8 < first["policy/tis_weight_mean"] < 1.1, first
    moved = max(float((ref.grads[0][k] - plain.grads[0][k]).abs().max()) for k in plain.grads[0])
    assert moved > 1000 * GRAD_TOL, moved
    for lay in (L.Layout(micro=2, tis_cap=1.2), L.Layout(micro=1, tis_cap=1.2, max_tokens=L.BUDGET)):
        _check(L.differences(L.run_update(lay, state, weights, apart), ref), str(lay))
