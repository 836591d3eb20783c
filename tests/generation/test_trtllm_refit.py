"""The TensorRT-LLM engine's refit and memory, against the test double of TensorRT-LLM's LLM API
(tests/_trtllm_fakes.py): the IPC-handle payload format, the weights sent equal to the HF export
in buckets and tracking the policy, GPU memory released during training and resumed in order, and
``close``.
"""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
from _trtllm_fakes import (
    PROMPTS,
    SMALL,
    UUID,
    WIDE,
    FakeLLM,
    _engine,
    _fake_gpu,  # noqa: F401  (an autouse fixture)
    _policy,
    _world,  # noqa: F401  (an autouse fixture)
)

from aligner.generation.engine import SamplingParams
from aligner.generation.trtllm.handles import ipc_handles
from aligner.models.hf import iter_hf_tensors

# ----------------------------------------------------------------------------------------------
# Refit and memory
# ----------------------------------------------------------------------------------------------


def test_ipc_handles_payload_is_the_documented_format():
    bucket = [("a", torch.randn(3, 4).to(torch.bfloat16)), ("b", torch.arange(5.0))]
    payload = ipc_handles(bucket, UUID)
    assert list(payload) == [UUID] and isinstance(payload[UUID], str)
    handles = pickle.loads(base64.b64decode(payload[UUID]))
    assert [n for n, _ in handles] == ["a", "b"]
    for (_, t), (_, (func, args)) in zip(bucket, handles):
        assert torch.equal(func(*args), t)  # a CPU handle here; CUDA ones on a GPU


@pytest.mark.parametrize("bucket_mb", [1, 0])
def test_refit_sends_exactly_the_hf_export_in_buckets(tmp_path, bucket_mb):
    policy = _policy(WIDE)
    eng = _engine(tmp_path, WIDE, bucket_mb=bucket_mb, sleep_during_training=False)
    llm = FakeLLM.instances[-1]
    eng.refit(policy)
    expected = dict(iter_hf_tensors(policy, WIDE, "LlamaForCausalLM", dtype=torch.bfloat16))
    assert list(llm.weights) == list(expected)  # names, in stream order
    for name, t in expected.items():
        assert llm.weights[name].dtype == torch.bfloat16 and torch.equal(llm.weights[name], t), name
    sizes = [sum(expected[n].numel() * 2 for n in b) for b in llm.buckets]
    if bucket_mb:
        assert len(llm.buckets) > 2
        for b, size in zip(llm.buckets, sizes):
            assert size <= 2**20 or len(b) == 1  # a tensor larger than a bucket travels alone
    else:
        assert len(llm.buckets) == 1
    updates = [e for e in llm.events if e[0] in ("update_weights", "finalize")]
    assert updates == [("update_weights", len(b)) for b in llm.buckets] + [("finalize", None)]
    assert eng.refits == 1


def test_refit_tracks_the_policy(tmp_path):
    policy = _policy(WIDE)
    eng = _engine(tmp_path, WIDE, sleep_during_training=False)
    llm = FakeLLM.instances[-1]
    eng.refit(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(-1.0)
    eng.refit(policy)
    for name, t in iter_hf_tensors(policy, WIDE, "LlamaForCausalLM", dtype=torch.bfloat16):
        assert torch.equal(llm.weights[name], t), name


@pytest.mark.parametrize("reuse", [False, True])
def test_memory_is_released_during_training_and_resumed_in_order(tmp_path, reuse):
    policy = _policy(SMALL)
    eng = _engine(tmp_path, bucket_mb=0, enable_block_reuse=reuse)
    llm = FakeLLM.instances[-1]
    s = SamplingParams(max_new_tokens=4, seed=1)
    for _ in range(2):  # two PPO steps: refit, generate, (train)
        eng.refit(policy)
        eng.generate(PROMPTS, s)
        assert llm.asleep == {"weights", "kv_cache"}  # training has the memory
    reset = [("reset_prefix_cache", None)] if reuse else []  # prefix-reuse state, before the KV cache goes
    assert llm.events == [
        ("update_weights", len(llm.buckets[0])),
        ("finalize", None),
        ("generate", len(PROMPTS)),
        *reset,
        ("sleep", ["kv_cache", "weights"]),
        ("wakeup", ["weights"]),  # the weights first: the refit writes into them
        ("update_weights", len(llm.buckets[0])),
        ("finalize", None),
        ("wakeup", ["kv_cache"]),  # then the cache, just before generating
        ("generate", len(PROMPTS)),
        *reset,
        ("sleep", ["kv_cache", "weights"]),
    ]
    assert llm.args["kv_cache_config"].enable_block_reuse is reuse
    n = len(llm.events)
    eng.release()  # already released: nothing to do
    assert len(llm.events) == n
    eng.resume()
    assert llm.events[n:] == [("wakeup", ["weights"]), ("wakeup", ["kv_cache"])] and not llm.asleep
    eng.resume()
    assert len(llm.events) == n + 2


def test_without_sleep_nothing_is_released(tmp_path):
    eng = _engine(tmp_path, sleep_during_training=False)
    llm = FakeLLM.instances[-1]
    eng.refit(_policy(SMALL))
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    eng.release()
    eng.resume()
    assert not any(e[0] in ("sleep", "wakeup", "reset_prefix_cache") for e in llm.events)
    assert "enable_sleep" not in llm.kwargs


def test_close_shuts_the_engine_down_once(tmp_path):
    eng = _engine(tmp_path)
    llm = FakeLLM.instances[-1]
    eng.close()
    eng.close()
    assert llm.events == [("shutdown", None)]
    with pytest.raises(RuntimeError, match="closed"):
        eng.refit(_policy(SMALL))
