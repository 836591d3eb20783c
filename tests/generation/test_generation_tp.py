"""NativeEngine under tensor parallelism: two gloo processes on the CPU.

Each worker first builds the policy at TP=1 (a data-parallel world of two) and records its
greedy generations and full logits, then re-initialises Megatron at TP=2, builds the policy
with the same seed and checks: the TP=2 logits equal the TP=1 ones (models built from one
seed are TP-invariant because ``use_cpu_initialization`` initialises the full weight and
slices it), greedy generation at TP=2 equals TP=1 token for token (both backends, also on a
ragged batch whose rows stop at different steps), the lean backend's ragged loop equals
Megatron's teacher-forced one (greedy and sampled), and both TP ranks return identical outputs,
also when sampling (seeded or not). An assertion in a
worker makes ``torch.multiprocessing.spawn`` raise, which fails the test.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aligner import distributed

pytestmark = pytest.mark.multiprocess
WORLD = 2
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [3, 3, 3, 3, 13]]
# Very mixed lengths (a ragged batch), some long enough to run into max_seq_len (48).
MIXED = [[2 + (i * 7 + j) % 12 for j in range(n)] for i, n in enumerate([1, 17, 5, 40, 9, 3, 30, 12, 2, 38])]


def _cfg():
    from aligner.models.config import ModelConfig

    # 14 tokens: no vocabulary padding at TP=1 or TP=2, so both layouts initialise the same
    # full embedding; GQA (4 heads, 2 groups) puts one query group on each rank.
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=14,
        max_seq_len=48,
        init_method_std=0.2,
    )


def _all_same(t: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _generate_all(model, ps):
    from aligner.generation import NativeEngine, SamplingParams

    out = {}
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    for backend in ("lean", "megatron"):
        engine = NativeEngine(model, pad_id=0, eos_id=1, max_seq_len=48, parallel_state=ps, backend=backend)
        out[backend] = engine.generate(PROMPTS, greedy)
        # Stop tokens end some responses early: rows leave the batch at different steps.
        stops = (6,)
        out[f"mixed_{backend}"] = engine.generate(
            MIXED, SamplingParams(max_new_tokens=16, greedy=True, stop_token_ids=stops)
        )
        out[f"mixed_sampled_{backend}"] = engine.generate(
            MIXED, SamplingParams(max_new_tokens=16, seed=5, stop_token_ids=stops)
        )
    engine = NativeEngine(model, pad_id=0, eos_id=1, max_seq_len=48, parallel_state=ps)
    out["seeded"] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_p=0.9, seed=7))
    # Unseeded: each rank's torch generator is desynchronised on purpose; TP rank 0's seed wins.
    torch.manual_seed(1000 + dist.get_rank())
    out["unseeded"] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_k=5))
    return out


def _worker(rank: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu

    from aligner.models.gpt import build_policy

    try:
        tokens = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
        # TP=1 (two data-parallel ranks).
        ps1 = distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=1), seed=77)
        m1 = build_policy(_cfg()).eval()
        with torch.no_grad():
            logits1 = m1(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None).float()
        ref = _generate_all(m1, ps1)
        del m1
        mpu.destroy_model_parallel()

        # TP=2, same seed.
        ps2 = distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=2), seed=77)
        assert ps2.tp_size == 2 and ps2.dp_size == 1
        m2 = build_policy(_cfg()).eval()
        with torch.no_grad():
            logits2 = m2(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None, runtime_gather_output=True)
        torch.testing.assert_close(
            logits2.float(),
            logits1,
            atol=1e-5,
            rtol=1e-5,
            msg="TP=2 model differs from the TP=1 model of the same seed",
        )
        got = _generate_all(m2, ps2)
        for backend in ("lean", "megatron", "mixed_lean", "mixed_megatron"):
            a, b = got[backend], ref[backend]
            assert torch.equal(a.tokens, b.tokens), (backend, a.tokens, b.tokens)
            assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ended, b.ended)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        # The ragged lean loop and Megatron's teacher-forced one agree, greedy and sampled.
        for kind in ("mixed_", "mixed_sampled_"):
            a, b = got[kind + "lean"], got[kind + "megatron"]
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.ended, b.ended), kind
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        n = got["mixed_lean"].response_lengths
        assert got["mixed_lean"].ended.any() and (n == 16).any() and (got["mixed_lean"].lengths == 48).any()
        for out in got.values():
            for t in (out.tokens, out.lengths, out.logprobs, out.ended.long()):
                assert _all_same(t, ps2.tp_group), "TP ranks returned different outputs"
        assert (got["unseeded"].tokens != got["seeded"].tokens).any()
    finally:
        distributed.destroy()


def test_tp2_greedy_equals_tp1_and_ranks_agree():
    mp.spawn(_worker, args=(distributed.free_port(),), nprocs=WORLD, join=True)
