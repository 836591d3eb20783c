"""The actor's log-prob forwards in their other shapes: under pipeline parallelism, Megatron's
pipeline schedule computes the same log-probs, entropies, loss statistics and gradients as the
unpipelined forward on the same weights (``tests/workers/pp_schedule.py``, two processes over
gloo); and micro-batches cut to their longest row give the full-width values."""

from __future__ import annotations

import pytest
from _torchrun import run_worker


@pytest.mark.multiprocess
def test_pipeline_schedule_equals_the_unpipelined_forward_and_backward():
    results = run_worker("pp_schedule.py")
    for rank, result in enumerate(results):
        # trainable_last_n_layers counts the model's layers, not a stage's, and freezes both
        # copies of a tied embedding.
        assert result.pop("frozen") == {"freeze_ok": 1.0}, rank
        for case, d in result.items():
            where = f"rank {rank}, {case} embedding"
            # bf16: the model computes in bf16 (PP=1's reference in fp32); the optimizer's fp32
            # masters hold the gradients, and the tied embedding's two copies get the same sum.
            tol = 0.05 if case.endswith("bf16") else 1e-6
            # Every stage's log-probs and entropies are the last stage's, equal to PP=1's.
            assert d["logprobs"] < tol and d["entropy"] < tol, where
            assert d["stat_keys_equal"] == 1.0 and d["stats"] < tol, where
            # Each stage's gradients are PP=1's for its tensors (the tied embedding's copy on the
            # last stage included), and every one of them received some.
            assert d["grads"] < tol * max(1.0, d["grad_scale"]), where
            assert d["all_grads_nonzero"] == 1.0, where
            if case.startswith("tied"):
                assert d["tied_copies_equal"] == 1.0, where
            assert d["grad_tensors"] >= 7, where


@pytest.fixture(scope="module")
def one_process():
    from aligner import distributed

    state = distributed.initialize(distributed.ParallelConfig(), seed=3)
    yield state
    distributed.destroy()


@pytest.mark.parametrize("forward", ["megatron", "fused"])
def test_micro_batches_cut_to_their_longest_row_give_the_same_logprobs(one_process, forward):
    """Rows of different lengths, right-padded: each micro-batch run only up to its longest row
    gives the real positions' log-probs and entropies of the full-width forward, and 0 after."""
    import torch

    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.models import gpt
    from aligner.models.config import ModelConfig
    from aligner.models.forward import set_forward

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, max_seq_len=16)
    torch.manual_seed(0)
    model = gpt.build_policy(cfg)
    set_forward(model, forward)
    lengths = torch.tensor([12, 11, 7, 5, 4, 4])  # sorted, as a balanced share is
    tokens = torch.randint(1, 16, (6, 12))
    for i, n in enumerate(lengths.tolist()):
        tokens[i, n:] = 0
    lp = PolicyLogprobs(temperature=0.9)
    full, full_ent = lp.no_grad(model, tokens, 2, with_entropy=True, start=2)
    cut, cut_ent = lp.no_grad(model, tokens, 2, with_entropy=True, start=2, lengths=lengths)
    assert cut.shape == full.shape and cut_ent.shape == full_ent.shape
    for i, n in enumerate(lengths.tolist()):
        width = max(int(lengths[i - i % 2 : i - i % 2 + 2].max()), 3) - 1  # its micro-batch's
        assert torch.allclose(cut[i, : n - 1], full[i, : n - 1], atol=1e-5, rtol=0), i
        assert torch.allclose(cut_ent[i, : n - 1], full_ent[i, : n - 1], atol=1e-5, rtol=0), i
        assert (cut[i, width:] == 0).all() and (cut_ent[i, width:] == 0).all(), i
