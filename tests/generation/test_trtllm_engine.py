"""The TensorRT-LLM engine's requests and outputs, against the test double of TensorRT-LLM's
LLM API (tests/_trtllm_fakes.py), and the real engine.

Requests: the per-request seed, ``SamplingParams`` and ``LLM`` arguments by their documented
names and types, one explicit request per prompt. Outputs: the mapping onto ``GenerationOutput``'s
conventions, hand-worked and end to end through the double, outputs that break them, stop strings.
The package boundary, configuration and container recipe are in test_trtllm_config.py, the refit
and memory in test_trtllm_refit.py.

The test marked ``gpu`` runs the real engine where ``tensorrt_llm`` and CUDA are present.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re

import pytest
import torch
from _trtllm_fakes import (
    PROMPTS,
    SMALL,
    TOK,
    CompletionOutput,
    FakeKvCacheConfig,
    FakeLLM,
    FakeSamplingParams,
    Logprob,
    RequestOutput,
    _engine,
    _fake_gpu,  # noqa: F401  (an autouse fixture)
    _world,  # noqa: F401  (an autouse fixture)
)

from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.trtllm import TrtllmConfig, TrtllmEngine
from aligner.generation.trtllm.outputs import Completion, completions_to_output, read_completion
from aligner.generation.trtllm.requests import llm_kwargs, request_seed, sampling_kwargs
from aligner.models import forward, gpt
from aligner.models.config import ModelConfig

# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def test_request_seed_is_the_documented_hash_reproducible_and_distinct():
    def by_hand(seed, dp, i):
        d = hashlib.blake2b(f"aligner.trtllm:{seed}:{dp}:{i}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little") & (2**63 - 1)

    grid = [(s, d, i) for s in (0, 1, 100_003) for d in range(4) for i in range(64)]
    seeds = [request_seed(*k) for k in grid]
    assert seeds == [by_hand(*k) for k in grid]
    assert seeds == [request_seed(*k) for k in grid]  # reproducible
    assert len(set(seeds)) == len(grid)  # distinct per step seed, rank and prompt
    assert all(0 <= s < 2**63 for s in seeds)
    # neighbouring triples are unrelated, not shifted copies of each other
    assert request_seed(1, 0, 0) - request_seed(0, 0, 0) != request_seed(2, 0, 0) - request_seed(1, 0, 0)


@pytest.mark.parametrize(
    "sampling, top_k, top_p",
    [
        (SamplingParams(max_new_tokens=5, temperature=0.7, stop_token_ids=(9, 4)), 0, 1.0),
        (SamplingParams(max_new_tokens=5, top_k=3, top_p=0.8), 3, 0.8),
        (SamplingParams(max_new_tokens=5, greedy=True, top_k=3, top_p=0.8, temperature=2), 1, 1.0),
    ],
)
def test_sampling_kwargs_map_every_field_explicitly(sampling, top_k, top_p):
    kw = sampling_kwargs(sampling, seed=123, max_tokens=4, eos_id=0, pad_id=13, banned_ids=[13])
    sp = FakeSamplingParams(**kw)  # documented names and types
    assert sp.max_tokens == 4  # never TensorRT-LLM's default of 32
    assert sp.stop_token_ids == sorted({0, *sampling.stop_token_ids})  # eos first among the stops
    assert sp.end_id == -1 and sp.include_stop_str_in_output is True  # the stop token is kept
    assert sp.pad_id == 13 and sp.bad_token_ids == [13] and sp.detokenize is False
    assert sp.seed == 123 and sp.logprobs == 1
    assert sp.temperature == float(sampling.temperature) and isinstance(sp.temperature, float)
    assert (sp.top_k, sp.top_p) == (top_k, top_p)
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_kwargs(sampling, seed=1, max_tokens=0, eos_id=0, pad_id=13)


@pytest.mark.parametrize("sleep, graphs", [(True, False), (False, True)])
def test_llm_kwargs_are_documented_arguments(tmp_path, sleep, graphs):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    cfg = TrtllmConfig(
        sleep_during_training=sleep, cuda_graphs=graphs, max_batch_size=16, max_num_tokens=4096
    )
    kv = FakeKvCacheConfig(free_gpu_memory_fraction=0.25, enable_block_reuse=False)
    kw = llm_kwargs(tmp_path, cfg, tensor_parallel_size=1, max_seq_len=64, kv_cache_config=kv)
    llm = FakeLLM(**kw)
    a = llm.args
    assert a["model"] == str(tmp_path) and a["load_format"] == "dummy" and a["skip_tokenizer_init"] is True
    assert a["orchestrator_type"] == "ray"
    assert a["ray_worker_extension_cls"] == "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
    assert a["sampler_type"] == "TRTLLMSampler" and a["allreduce_strategy"] == "NCCL"
    assert (a["max_seq_len"], a["max_input_len"], a["max_batch_size"], a["max_num_tokens"]) == (
        64,
        63,
        16,
        4096,
    )
    assert a["dtype"] == "bfloat16" and a["kv_cache_config"] is kv
    assert a["enable_sleep"] is sleep and ("enable_sleep" in kw) is sleep
    assert ("cuda_graph_config" in kw) is (not graphs) and a["cuda_graph_config"] == (
        None if not graphs else "default"
    )


def test_generate_builds_one_explicit_request_per_prompt(tmp_path):
    eng = _engine(tmp_path, dp_rank=3, sleep_during_training=False)
    llm = FakeLLM.instances[-1]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, stop_token_ids=(11,), seed=77)
    out = eng.generate(PROMPTS, sampling)
    (reqs,) = llm.requests
    assert len(reqs) == len(PROMPTS)
    for i, (p, sp) in enumerate(zip(PROMPTS, reqs)):
        assert sp.max_tokens == min(12, SMALL.max_seq_len - len(p))  # bounded by max_seq_len too
        assert sp.seed == request_seed(77, 3, i)
        assert sp.stop_token_ids == [TOK.eos_id, 11] and sp.bad_token_ids == [TOK.pad_id]
        assert (sp.temperature, sp.top_k, sp.top_p) == (0.9, 0, 0.95)
    assert len({sp.seed for sp in reqs}) == len(PROMPTS)
    again = eng.generate(PROMPTS, sampling)
    assert torch.equal(out.tokens, again.tokens) and torch.equal(out.logprobs, again.logprobs)
    other = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=78))
    assert not torch.equal(out.tokens, other.tokens)
    unseeded = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert len({sp.seed for sp in llm.requests[-1]}) == len(PROMPTS)  # drawn, then derived per prompt
    assert unseeded.tokens.shape[0] == len(PROMPTS)
    assert all(t != TOK.pad_id for r in out.responses() for t in r)  # bad_token_ids honoured


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


def _request(ids, lps, reason, extra_first=True):
    """A RequestOutput whose log-prob dicts list another candidate before the sampled token."""
    entries = []
    for t, lp in zip(ids, lps):
        e = {}
        if extra_first:
            e[t + 100] = Logprob(-0.01, 1)
        e[t] = Logprob(lp, 2)
        entries.append(e)
    return RequestOutput(0, [], [CompletionOutput(0, "", list(ids), None, entries, reason, None)], True)


def test_outputs_map_onto_the_tensor_conventions_hand_worked():
    eos, pad = 0, 13
    stops = frozenset({eos})
    # prompt [5, 6, 7] -> 9, eos (stopped); prompt [8] -> 3, 4, 2 (ran out of max_tokens=3)
    a = read_completion(_request([9, eos], [-0.5, -0.25], "stop"), 0, stops, 4)
    b = read_completion(_request([3, 4, 2], [-1.0, -2.0, -3.0], "length"), 1, stops, 3)
    assert a == Completion([9, eos], [-0.5, -0.25], True)  # read by id, not the first candidate
    assert b == Completion([3, 4, 2], [-1.0, -2.0, -3.0], False)
    out = completions_to_output([[5, 6, 7], [8]], [a, b], pad)
    assert isinstance(out, GenerationOutput)
    # lengths 3+2=5 and 1+3=4: s = 5, eos kept as the last response token, pad after row 1.
    assert out.tokens.tolist() == [[5, 6, 7, 9, eos], [8, 3, 4, 2, pad]]
    assert out.lengths.tolist() == [5, 4] and out.prompt_lengths.tolist() == [3, 1]
    assert out.ended.tolist() == [True, False]
    # logprobs[i, t] scores tokens[i, t+1]: row 0 at t = 2, 3 (9 and eos); row 1 at t = 0, 1, 2.
    assert out.logprobs.tolist() == [[0.0, 0.0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0.0]]
    assert out.response_mask().tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert out.logprobs.dtype == torch.float32 and out.tokens.dtype == torch.int64


def test_an_eos_at_the_token_limit_counts_as_ended():
    c = read_completion(_request([4, 0], [-1.0, -1.0], "length"), 0, frozenset({0}), 2)
    assert c.ended


@pytest.mark.parametrize(
    "request_output, match",
    [
        (_request([3, 4], [-1, -1], "stop"), "stop token must stay in the response"),
        (_request([3, 0, 4], [-1, -1, -1], "length"), "went on after stop token 0"),
        (_request([3], [-1], "cancelled"), "finish_reason='cancelled'"),
        (_request([], [], "length"), "no token"),
        (_request([3, 4, 5, 6], [-1] * 4, "length"), "more than max_tokens=3"),
        (
            RequestOutput(0, [], [CompletionOutput(0, "", [3], None, None, "length", None)], True),
            "None per-token",
        ),
        (
            RequestOutput(
                0, [], [CompletionOutput(0, "", [3], None, [{4: Logprob(-1.0)}], "length", None)], True
            ),
            "lack the sampled token 3",
        ),
        (
            RequestOutput(0, [], [CompletionOutput(0, "", [3], None, [-1.0], "length", None)], True),
            "expected a dict",
        ),
    ],
)
def test_an_output_that_breaks_the_conventions_is_an_error(request_output, match):
    with pytest.raises(RuntimeError, match=re.escape(match)):
        read_completion(request_output, 7, frozenset({0}), 3)


def test_generate_end_to_end_through_the_double(tmp_path):
    eng = _engine(tmp_path, sleep_during_training=False)
    llm = FakeLLM.instances[-1]
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=5))
    (returned,) = llm.returned
    for i, (p, r) in enumerate(zip(PROMPTS, returned)):
        c = r.outputs[0]
        n, P = int(out.lengths[i]), len(p)
        assert out.tokens[i, :P].tolist() == p and out.tokens[i, P:n].tolist() == c.token_ids
        assert (out.tokens[i, n:] == TOK.pad_id).all()
        assert bool(out.ended[i]) == (c.finish_reason == "stop") == (c.token_ids[-1] == TOK.eos_id)
        expected = [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)]
        assert out.logprobs[i, P - 1 : n - 1].tolist() == pytest.approx(expected)
        assert (out.logprobs[i, : P - 1] == 0).all() and (out.logprobs[i, n - 1 :] == 0).all()
    assert out.ended.any() and not out.ended.all()  # both kinds of ending are exercised


def test_stop_strings_cut_the_response(tmp_path):
    eng = _engine(tmp_path, tokenizer=TOK, sleep_during_training=False)
    sampling = SamplingParams(max_new_tokens=12, seed=3, stop_strings=(":",))
    out = eng.generate(PROMPTS, sampling)
    full = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=3))  # the same samples, uncut
    cut = 0
    for i, (r, f) in enumerate(zip(out.responses(), full.responses())):
        text = TOK.decode(r)
        if ":" in TOK.decode(f):
            assert text.endswith(":") and bool(out.ended[i]) and f[: len(r)] == r
            cut += len(r) < len(f)
        else:
            assert r == f
    assert cut  # the case is exercised


# ----------------------------------------------------------------------------------------------
# The real engine
# ----------------------------------------------------------------------------------------------


def _have_tensorrt_llm() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _have_tensorrt_llm(), reason="needs tensorrt_llm and a CUDA device")
def test_real_engine_end_to_end(tmp_path, monkeypatch):
    """A tiny Llama on one GPU: build from config.json with dummy weights, refit, sample, check the
    conventions and that the engine's log-probs are those of the policy's own forward."""
    monkeypatch.undo()  # the real device UUID
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    policy = gpt.build_policy(cfg).cuda().to(torch.bfloat16).eval()
    eng = TrtllmEngine(
        cfg, pad_id=1, eos_id=2, config=TrtllmConfig(free_gpu_memory_fraction=0.2), workdir=tmp_path
    )
    try:
        eng.refit(policy)
        prompts = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15]]
        s = SamplingParams(max_new_tokens=16, seed=11)
        out = eng.generate(prompts, s)
        again = eng.generate(prompts, s)  # slept and woke in between
        assert torch.equal(out.tokens, again.tokens)  # explicit seeds: reproducible
        for i, p in enumerate(prompts):
            n = int(out.lengths[i])
            assert out.tokens[i, : len(p)].tolist() == p
            assert bool(out.ended[i]) == (int(out.tokens[i, n - 1]) == 2)
        # The training forward's log-probs of the same tokens (temperature 1, no truncation).
        with torch.no_grad():
            logits = forward.policy_logits(policy, out.tokens.cuda()).float()
        lp = (
            torch.log_softmax(logits[:, :-1], -1)
            .gather(-1, out.tokens[:, 1:].cuda().unsqueeze(-1))
            .squeeze(-1)
        )
        mask = out.response_mask().cuda()
        gap = ((lp - out.logprobs.cuda()).abs() * mask).max().item()
        assert math.isfinite(gap) and gap < 0.1, gap  # dummy weights would be far off
    finally:
        eng.close()
