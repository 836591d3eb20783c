"""Generation in a layout of its own: an engine that owns its weights at a generation
tensor-parallel size ``g`` and a dtype of its own, refitted through the weight stream.

In one process: owned weights at TP=1 generate exactly what the training module's own tensors
generate (fp32, every architecture the lean path handles; and a bf16 engine from an fp32 policy
against a bf16 policy holding the same rounded weights), a refit moves the weights, and the
layout and config errors name their field. In two gloo processes (one launch,
``tests/_layout_workers.py``): train at PP=2 / generate at TP=1, train at TP=2 / generate at
TP=1, train at TP=1 x PP=2 / generate at TP=2, each against a TP=1 zero-copy engine on the same
weights, before and after a policy update; and a Qwen3-style model (q/k norms, heads of their
own width, llama3-scaled RoPE) trained at TP=1 x PP=2 and generated at TP=2. TP=2 x PP=2
training with generation groups of 2 and 1 runs in ``tests/generation/test_weight_stream.py``'s
four-process launch.

Tolerances: fp32 greedy tokens are equal and log-probs agree to 1e-5 (at ``g`` = 1 they are
bit-equal, the same ops on the same tensors; at ``g`` = 2 the row-parallel all-reduces add the
partial sums in another order, about 1e-6). A bf16 engine is compared with a bf16 policy holding
the same rounded weights at the same ``g`` = 1: equal tokens, bit-equal log-probs (rounding
each fp32 weight to bf16 is what building the bf16 policy does too).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.multiprocessing as mp
from _layout_workers import generation_worker

from aligner import distributed
from aligner.generation import NativeEngine, SamplingParams
from aligner.generation.config import GenerationConfig
from aligner.generation.layout import GenerationLayout, generation_tp_problems
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_policy, load_state_dict_strict, tensor_state_dict

warnings.filterwarnings("ignore", category=UserWarning)

MAX_LEN = 48
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [3, 3, 3, 3, 13]]
GREEDY = SamplingParams(max_new_tokens=16, greedy=True)
ARCHS = {
    "gqa": dict(num_query_groups=2),
    "mqa_qkv_bias": dict(num_query_groups=1, add_qkv_bias=True),
    "gpt2_like": dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding="learned_absolute",
        add_bias_linear=True,
        tie_embeddings=True,
    ),
    # Qwen3-style heads (32 wide, q/k norms) with llama3-scaled RoPE past its original context.
    "qwen3_llama3_rope": dict(
        num_query_groups=2,
        kv_channels=32,
        qk_layernorm=True,
        rope_scaling="llama3",
        rope_original_max_position=8,
    ),
}


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=14, max_seq_len=MAX_LEN)
    return ModelConfig(**{**base, "init_method_std": 0.2, **kw})


@pytest.fixture(scope="module")
def ps():
    state = distributed.initialize(distributed.ParallelConfig(), seed=1234)
    yield state
    distributed.destroy()


def _engine(model, ps, **kw):
    return NativeEngine(model, pad_id=0, eos_id=1, max_seq_len=MAX_LEN, parallel_state=ps, **kw)


def _policy(seed: int, dtype=torch.float32, **arch):
    torch.manual_seed(seed)
    model = build_policy(_cfg(**arch), params_dtype=dtype).eval()
    with torch.no_grad():  # q/k norm weights away from 1, so a misplaced one shows
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _copy(model, dtype):
    """A second policy of ``model``'s architecture holding its weights cast to ``dtype``."""
    other = build_policy(model.aligner_config, params_dtype=dtype).eval()
    load_state_dict_strict(other, tensor_state_dict(model))
    return other


def _assert_same(a, b, atol=0.0):
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ended, b.ended)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_owned_weights_generate_what_the_module_generates(ps, arch):
    m = _policy(3, **ARCHS[arch])
    shared = _engine(m, ps)
    owned = _engine(m, ps, weights="owned")
    assert not shared.owns_weights and owned.owns_weights
    _assert_same(owned.generate(PROMPTS, GREEDY), shared.generate(PROMPTS, GREEDY))
    sampled = SamplingParams(max_new_tokens=16, top_p=0.9, seed=5)
    _assert_same(owned.generate(PROMPTS, sampled), shared.generate(PROMPTS, sampled))
    cost = owned.last_refit
    n_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert cost.owned and cost.bytes == cost.stream_bytes == n_bytes and cost.mbytes == n_bytes / 1e6
    assert shared.last_refit.bytes == 0 and not shared.last_refit.owned


def test_bf16_engine_from_an_fp32_policy_equals_a_bf16_policy(ps):
    m = _policy(4, num_query_groups=2)
    bf16 = _engine(m, ps, dtype="bf16")
    assert bf16.owns_weights and bf16.last_refit.bytes == sum(p.numel() * 2 for p in m.parameters())
    reference = _engine(_copy(m, torch.bfloat16), ps)
    assert not reference.owns_weights
    _assert_same(bf16.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
    # The same dtype as the policy's and the training layout: zero-copy.
    assert not _engine(m, ps, dtype=torch.float32).owns_weights


def test_refit_moves_the_weights_into_the_engine(ps):
    """After an update in place the owned engine generates the old weights until its refit,
    then the new ones; a refit that copied nothing would fail the last comparison."""
    m = _policy(6, num_query_groups=2)
    engine = _engine(m, ps, weights="owned")
    before = engine.generate(PROMPTS, GREEDY)
    with torch.no_grad():  # an optimizer step, in place
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    reference = _engine(m, ps).generate(PROMPTS, GREEDY)
    assert not torch.equal(before.tokens, reference.tokens)
    _assert_same(engine.generate(PROMPTS, GREEDY), before)  # not refitted yet
    engine.refit(m)
    _assert_same(engine.generate(PROMPTS, GREEDY), reference)
    # A policy cast to bf16 in place (mixed precision): dtype=None follows the policy's.
    m.to(torch.bfloat16)
    engine.refit(m)
    assert engine._owned.dtype == torch.bfloat16 and engine.last_refit.bytes == engine._owned.nbytes


def test_errors_name_the_field(ps):
    m = _policy(7)
    with pytest.raises(
        ValueError, match=r"generation.tensor_parallel_size=2: expected a divisor .* = 1\): one of \[1\]"
    ):
        _engine(m, ps, generation_tp=2)
    with pytest.raises(
        ValueError, match=r"backend='megatron' generates with the training module .* use backend"
    ):
        _engine(m, ps, backend="megatron", weights="owned")
    with pytest.raises(
        ValueError, match=r"weights='shared': .* dtype torch.bfloat16 vs the policy's torch.float32"
    ):
        _engine(m, ps, weights="shared", dtype="bf16")
    with pytest.raises(ValueError, match=r"weights='copy': expected one of"):
        _engine(m, ps, weights="copy")
    with pytest.raises(ValueError, match=r"dtype='fp16': expected one of \['bf16', 'fp32'\]"):
        _engine(m, ps, dtype="fp16")
    with pytest.raises(ValueError, match=r"owns its weights .* cannot run this model"):
        reward = build_policy(_cfg())
        reward.aligner_head = "reward"
        _engine(reward, ps, weights="owned")
    assert GenerationLayout.create(ps, 1).same_as_training


def test_generation_tp_problems():
    assert generation_tp_problems(None, 2, 2) == []
    assert generation_tp_problems(4, 2, 2) == []
    (msg,) = generation_tp_problems(3, 2, 2)
    assert msg.startswith(
        "generation.tensor_parallel_size=3: expected a divisor of the actor's model-parallel"
    )
    assert "tensor_model_parallel_size 2 x pipeline_model_parallel_size 2 = 4): one of [1, 2, 4]" in msg
    (msg,) = generation_tp_problems(0, 1, 1)
    assert "generation.tensor_parallel_size=0: expected a positive integer" in msg
    model = _cfg(num_query_groups=1)
    assert generation_tp_problems(2, 1, 2, model) == [
        "generation.tensor_parallel_size=2: expected a divisor of the model's num_query_groups (1)"
    ]


def test_generation_config_checks_its_layout():
    from aligner.distributed import ParallelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert GenerationConfig(tensor_parallel_size=4).layout_problems(parallel) == []
    assert GenerationConfig().layout_problems(parallel) == []
    (msg,) = GenerationConfig(tensor_parallel_size=3).layout_problems(parallel)
    assert msg.startswith("generation.tensor_parallel_size=3: expected a divisor")
    (msg,) = GenerationConfig(dtype="fp16").problems()
    assert msg == "generation.dtype='fp16': expected one of ['bf16', 'fp32'], or null for the policy's dtype"


@pytest.mark.multiprocess
def test_generation_in_layouts_other_than_training():
    mp.spawn(generation_worker, args=(2, distributed.free_port()), nprocs=2, join=True)
