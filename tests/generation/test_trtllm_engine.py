"""The TensorRT-LLM engine up to the package boundary, against a test double of TensorRT-LLM's
LLM API (the 1.2 release line the engine targets), and the container recipe that has it.

The double writes the documented signatures down (``LLM``'s arguments from ``TorchLlmArgs``,
``SamplingParams``, ``KvCacheConfig``, ``_collective_rpc`` and the RLHF worker extension's
``update_weights``; ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` shapes): a misspelled
keyword or a value of the wrong type fails, as pydantic or Python would in the real package. Its
"model" samples from a seeded stream per request and honours ``stop_token_ids``,
``include_stop_str_in_output``, ``end_id`` and ``bad_token_ids`` as the engine documents them, so
the adapter's choices show in its outputs. Its ``update_weights`` decodes the payload as
TensorRT-LLM's worker does (base64, unpickle, rebuild each handle), so the refit is checked
tensor by tensor against the HF export.

The test marked ``gpu`` runs the real engine where ``tensorrt_llm`` and CUDA are present.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import pickle
import random
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from aligner import distributed
from aligner.generation import trtllm
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.trtllm import TrtllmConfig, TrtllmEngine
from aligner.generation.trtllm import engine as trtllm_engine
from aligner.generation.trtllm.handles import default_architecture, ipc_handles
from aligner.generation.trtllm.outputs import Completion, completions_to_output, read_completion
from aligner.generation.trtllm.requests import llm_kwargs, request_seed, sampling_kwargs
from aligner.models import forward, gpt
from aligner.models.config import ModelConfig
from aligner.models.hf import iter_hf_tensors
from aligner.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]
UUID = "GPU-00000000-1111-2222-3333-444444444444"


# ----------------------------------------------------------------------------------------------
# The test double: TensorRT-LLM 1.2's LLM API, as documented
# ----------------------------------------------------------------------------------------------


class Spec(NamedTuple):
    """A documented type: a predicate and how the documentation writes it."""

    ok: Any
    text: str


def is_(t: type) -> Spec:
    # bool is not an int and an int is not a float here: pydantic's strict models and the
    # C++ bindings behind these classes take the documented types.
    return Spec(lambda v: isinstance(v, t) and (t is bool or not isinstance(v, bool)), t.__name__)


def opt(s: Spec) -> Spec:
    return Spec(lambda v: v is None or s.ok(v), f"Optional[{s.text}]")


def list_of(s: Spec) -> Spec:
    return Spec(lambda v: isinstance(v, list) and all(s.ok(x) for x in v), f"List[{s.text}]")


def literal(*values: str) -> Spec:
    return Spec(lambda v: v in values, f"Literal{list(values)}")


ANY = Spec(lambda v: True, "Any")


def check_call(what: str, documented: dict[str, tuple[Spec, Any]], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` against the documented keyword arguments: unknown names and wrong types raise
    TypeError; returns every field, the defaults filled in."""
    for name, value in kwargs.items():
        if name not in documented:
            raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
        spec = documented[name][0]
        if not spec.ok(value):
            raise TypeError(f"{what}: {name}={value!r} is not {spec.text}")
    return {name: kwargs.get(name, default) for name, (_, default) in documented.items()}


# ExecutorMemoryType values of the 1.2 line (docs: sleep/wakeup tags).
MEMORY_TAGS = {
    "sampler",
    "drafter",
    "guided_decoder",
    "spec_resource_manager",
    "model_extra",
    "executor_extra",
    "kv_cache",
    "model",
    "draft_model",
}


class FakeKvCacheConfig:
    """``tensorrt_llm.llmapi.KvCacheConfig`` (the fields the engine may set)."""

    DOC = {
        "free_gpu_memory_fraction": (opt(is_(float)), None),
        "enable_block_reuse": (is_(bool), True),
        "max_tokens": (opt(is_(int)), None),
    }

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(check_call("KvCacheConfig", self.DOC, kwargs))


class FakeSamplingParams:
    """``tensorrt_llm.llmapi.SamplingParams``: keyword-only fields of the 1.x reference."""

    DOC = {
        "end_id": (opt(is_(int)), None),
        "pad_id": (opt(is_(int)), None),
        "max_tokens": (is_(int), 32),
        "bad": (opt(ANY), None),
        "bad_token_ids": (opt(list_of(is_(int))), None),
        "stop": (opt(ANY), None),
        "stop_token_ids": (opt(list_of(is_(int))), None),
        "include_stop_str_in_output": (is_(bool), False),
        "n": (is_(int), 1),
        "best_of": (opt(is_(int)), None),
        "use_beam_search": (is_(bool), False),
        "top_k": (opt(is_(int)), None),
        "top_p": (opt(is_(float)), None),
        "seed": (opt(is_(int)), None),
        "temperature": (opt(is_(float)), None),
        "min_tokens": (opt(is_(int)), None),
        "logprobs": (opt(is_(int)), None),
        "prompt_logprobs": (opt(is_(int)), None),
        "return_context_logits": (is_(bool), False),
        "return_generation_logits": (is_(bool), False),
        "exclude_input_from_output": (is_(bool), True),
        "detokenize": (is_(bool), True),
        "ignore_eos": (is_(bool), False),
    }

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = dict(kwargs)
        self.__dict__.update(check_call("SamplingParams", self.DOC, kwargs))
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise TypeError(f"SamplingParams: seed={self.seed} does not fit the runtime's uint64 seed")


class Logprob(NamedTuple):
    """``tensorrt_llm.executor.result.Logprob``."""

    logprob: float
    rank: int | None = None


class CompletionOutput(NamedTuple):
    """``tensorrt_llm.llmapi.CompletionOutput`` (the fields the engine reads, and their neighbours)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestOutput(NamedTuple):
    """``tensorrt_llm.llmapi.RequestOutput``."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class FakeLLM:
    """``tensorrt_llm.LLM`` (PyTorch backend) with the Ray orchestrator and the RLHF worker
    extension: the constructor's documented arguments, ``generate``, ``_collective_rpc``,
    ``shutdown``. ``DEVICE_UUIDS``: the GPUs its workers sit on (one per TP rank)."""

    DOC = {
        # LLM's own arguments
        "model": (is_(str), None),
        "tokenizer": (opt(is_(str)), None),
        "tokenizer_mode": (literal("auto", "slow"), "auto"),
        "skip_tokenizer_init": (is_(bool), False),
        "trust_remote_code": (is_(bool), False),
        "tensor_parallel_size": (is_(int), 1),
        "dtype": (literal("auto", "float16", "bfloat16", "float32"), "auto"),
        "revision": (opt(is_(str)), None),
        "tokenizer_revision": (opt(is_(str)), None),
        # TorchLlmArgs
        "pipeline_parallel_size": (is_(int), 1),
        "load_format": (literal("auto", "dummy"), "auto"),
        "kv_cache_config": (Spec(lambda v: isinstance(v, FakeKvCacheConfig), "KvCacheConfig"), None),
        "max_batch_size": (opt(is_(int)), None),
        "max_num_tokens": (opt(is_(int)), None),
        "max_seq_len": (opt(is_(int)), None),
        "max_input_len": (opt(is_(int)), None),
        "model_kwargs": (opt(is_(dict)), None),
        "enable_chunked_prefill": (is_(bool), False),
        "cuda_graph_config": (opt(ANY), "default"),
        "sampler_type": (literal("auto", "TorchSampler", "TRTLLMSampler"), "auto"),
        "allreduce_strategy": (
            opt(literal("AUTO", "NCCL", "UB", "MINLATENCY", "ONESHOT", "TWOSHOT", "LOWPRECISION", "MNNVL")),
            "AUTO",
        ),
        "orchestrator_type": (opt(literal("rpc", "ray")), None),
        "ray_worker_extension_cls": (opt(is_(str)), None),
        "enable_sleep": (is_(bool), False),
    }
    DEVICE_UUIDS: tuple[str, ...] = (UUID,)
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.args = check_call("LLM", self.DOC, kwargs)
        self.kwargs = dict(kwargs)
        conf = json.loads((Path(self.args["model"]) / "config.json").read_text())
        self.vocab_size = int(conf["vocab_size"])
        assert len(self.DEVICE_UUIDS) == self.args["tensor_parallel_size"]
        self.events: list[tuple[str, Any]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.buckets: list[list[str]] = []
        self.requests: list[list[FakeSamplingParams]] = []
        self.returned: list[list[RequestOutput]] = []
        self.asleep: set[str] = set()
        self.closed = False
        FakeLLM.instances.append(self)

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self,
        inputs: Any,
        sampling_params: Any = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: Any = None,
    ) -> list[RequestOutput]:
        assert not self.closed
        if self.asleep:
            raise RuntimeError(f"generate while memory is released: {sorted(self.asleep)}")
        if not (isinstance(inputs, list) and all(isinstance(p, list) for p in inputs)):
            raise TypeError("inputs: expected a batch, a list of token-id lists")
        if not (isinstance(sampling_params, list) and len(sampling_params) == len(inputs)):
            raise TypeError("sampling_params: expected one SamplingParams per prompt")
        if not all(isinstance(sp, FakeSamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params: expected SamplingParams")
        if self.args["skip_tokenizer_init"] and any(
            sp.end_id is None or sp.detokenize for sp in sampling_params
        ):
            raise ValueError("skip_tokenizer_init=True needs end_id set and detokenize=False")
        self.events.append(("generate", len(inputs)))
        self.requests.append(list(sampling_params))
        out = [self._one(i, p, sp) for i, (p, sp) in enumerate(zip(inputs, sampling_params))]
        self.returned.append(out)
        return out

    def _one(self, i: int, prompt: list[int], sp: FakeSamplingParams) -> RequestOutput:
        rng = random.Random(sp.seed if sp.seed is not None else 0)
        banned = set(sp.bad_token_ids or ())
        allowed = [t for t in range(self.vocab_size) if t not in banned]
        stops = set(sp.stop_token_ids or ())
        ids: list[int] = []
        lps: list[dict[int, Logprob]] = []
        reason, stop_reason = "length", None
        for j in range(sp.max_tokens):
            if sp.top_k == 1:  # greedy: a fixed function of the context
                tok = allowed[(sum(prompt) + 3 * j) % len(allowed)]
            else:
                tok = rng.choice(allowed)
            lp = -0.5 - 0.25 * j - 0.01 * tok
            entry: dict[int, Logprob] = {}
            other = allowed[(tok + 1) % len(allowed)]
            if other != tok:
                entry[other] = Logprob(lp + 0.1, 1)  # the top-1 candidate, listed first
            entry[tok] = Logprob(lp, 2 if other != tok else 1)
            if tok == sp.end_id:  # the engine's own end handling drops the end token
                reason = "stop"
                break
            ids.append(tok)
            lps.append(entry)
            if tok in stops:
                reason, stop_reason = "stop", tok
                if not sp.include_stop_str_in_output:
                    ids.pop()
                    lps.pop()
                break
        c = CompletionOutput(
            0, "", ids, sum(e[t].logprob for e, t in zip(lps, ids)), lps, reason, stop_reason
        )
        return RequestOutput(i, list(prompt), [c], True)

    # -- the RLHF worker extension ---------------------------------------------------------------

    def _collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        assert not self.closed
        if not isinstance(method, str) or not isinstance(args, tuple):
            raise TypeError("_collective_rpc(method: str, args: tuple)")
        if method == "update_weights":
            (handles,) = args
            self._update_weights(handles)
        elif method in ("sleep", "wakeup"):
            if not self.args["enable_sleep"]:
                raise RuntimeError(f"{method}: the LLM was built without enable_sleep=True")
            (tags,) = args
            if not (isinstance(tags, list) and tags and set(tags) <= MEMORY_TAGS):
                raise TypeError(f"{method}: tags={tags!r}: expected a list of {sorted(MEMORY_TAGS)}")
            groups = {"kv_cache" if t == "kv_cache" else "weights" for t in tags}
            if method == "sleep":
                self.asleep |= groups
            else:
                self.asleep -= groups
            self.events.append((method, sorted(groups)))
        elif method == "reset_prefix_cache":
            if args:
                raise TypeError("reset_prefix_cache() takes no arguments")
            self.events.append(("reset_prefix_cache", None))
        else:
            raise AttributeError(f"the worker has no method {method!r}")
        return [None] * len(self.DEVICE_UUIDS)

    def _update_weights(self, ipc_handles: dict | None) -> None:
        """As ``WorkerExtension.update_weights``: each worker takes its own GPU's handles."""
        if "weights" in self.asleep:
            raise RuntimeError("update_weights while the weights' memory is released")
        if ipc_handles is None:
            self.events.append(("finalize", None))
            return
        if not isinstance(ipc_handles, dict):
            raise TypeError(f"ipc_handles: expected Optional[dict], got {type(ipc_handles).__name__}")
        names = None
        for dev, uuid in enumerate(self.DEVICE_UUIDS):
            if uuid not in ipc_handles:
                raise ValueError(f"Device UUID {uuid} not found in ipc_handles")
            payload = ipc_handles[uuid]
            if not isinstance(payload, str):
                raise TypeError("expected the base64 string of a pickled handle list")
            all_handles = pickle.loads(base64.b64decode(payload))
            if not isinstance(all_handles, list):
                raise ValueError(f"Deserialized data must be a list, got {type(all_handles).__name__}")
            got = {}
            for name, (func, hargs) in all_handles:
                hargs = list(hargs)
                if len(hargs) > 6:  # a CUDA handle: the worker puts its own device id in
                    hargs[6] = dev
                got[name] = func(*hargs).clone()
            if names is None:
                names = list(got)
                self.buckets.append(names)
                self.weights.update(got)
            else:  # every GPU receives the same full tensors
                assert list(got) == names
                for n in names:
                    assert torch.equal(got[n], self.weights[n]), n
        self.events.append(("update_weights", len(names or ())))

    def shutdown(self) -> None:
        self.closed = True
        self.events.append(("shutdown", None))


API = trtllm.LlmApi(FakeLLM, FakeSamplingParams, FakeKvCacheConfig)


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------

TOK = CharTokenizer()  # digits, ':' and ','; eos 0, pad 13 (never sampled)
SMALL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=TOK.vocab_size,
    max_seq_len=24,
)


@pytest.fixture(scope="module", autouse=True)
def _world():
    distributed.initialize(distributed.ParallelConfig())
    yield
    distributed.destroy()


@pytest.fixture(autouse=True)
def _fake_gpu(monkeypatch):
    """This process "is" the GPU ``UUID`` (the real lookup needs CUDA)."""
    monkeypatch.setattr(trtllm_engine, "local_device_uuid", lambda: UUID)
    FakeLLM.instances.clear()


def _engine(tmp_path, cfg: ModelConfig = SMALL, **config: Any) -> TrtllmEngine:
    kw: dict[str, Any] = {
        k: config.pop(k) for k in list(config) if k in ("dp_rank", "max_seq_len", "tokenizer")
    }
    return TrtllmEngine(
        cfg,
        pad_id=TOK.pad_id,
        eos_id=TOK.eos_id,
        config=TrtllmConfig(**config),
        workdir=tmp_path,
        sample_vocab_size=TOK.sample_vocab_size if cfg.vocab_size == TOK.vocab_size else None,
        llm_factory=lambda: API,
        **kw,
    )


def _policy(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return gpt.build_policy(cfg)


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11, 12], [2, 2]]


# ----------------------------------------------------------------------------------------------
# The package boundary
# ----------------------------------------------------------------------------------------------


def test_importing_the_module_does_not_import_tensorrt_llm():
    """In a fresh interpreter, where the package may be installed (NVIDIA's container) or not."""
    code = "import sys, aligner.generation.trtllm; print('tensorrt_llm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_missing_package_names_the_package_its_needs_and_the_recipe(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # "import tensorrt_llm" raises ImportError
    with pytest.raises(ImportError) as err:
        trtllm.load_llm_api()
    assert isinstance(err.value, trtllm.TrtllmUnavailableError)
    msg = str(err.value)
    for part in (
        "tensorrt_llm",
        trtllm.TRTLLM_VERSION,
        "CUDA",
        "3.10",
        "3.12",
        "Dockerfile.trtllm",
        trtllm.TRTLLM_IMAGE,
    ):
        assert part in msg, part
    with pytest.raises(trtllm.TrtllmUnavailableError):  # the engine's default factory
        TrtllmEngine(SMALL, pad_id=TOK.pad_id, eos_id=TOK.eos_id, workdir=tmp_path)


def _fake_package(monkeypatch, version: str) -> None:
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__version__ = version
    pkg.LLM = FakeLLM
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.SamplingParams = FakeKvCacheConfig, FakeSamplingParams
    pkg.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)


@pytest.mark.parametrize("version", ["1.2.1", "1.2.0", "1.2.0rc6"])
def test_the_targeted_release_line_loads(monkeypatch, version):
    _fake_package(monkeypatch, version)
    assert trtllm.load_llm_api() == API


@pytest.mark.parametrize("version", ["1.1.0", "1.3.0rc13", "0.21.0"])
def test_another_release_line_is_refused_naming_both(monkeypatch, version):
    _fake_package(monkeypatch, version)
    with pytest.raises(trtllm.TrtllmUnavailableError, match=re.escape(version)) as err:
        trtllm.load_llm_api()
    assert trtllm.TRTLLM_VERSION in str(err.value)


def test_the_double_rejects_misspelled_keywords_and_wrong_types(tmp_path):
    with pytest.raises(TypeError, match="max_token"):
        FakeSamplingParams(max_token=4)
    with pytest.raises(TypeError, match="temperature"):
        FakeSamplingParams(temperature=1)  # an int where the API documents a float
    with pytest.raises(TypeError, match="top_k"):
        FakeSamplingParams(top_k=True)
    with pytest.raises(TypeError, match="enable_block_reuse"):
        FakeKvCacheConfig(enable_block_reuse=1)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    with pytest.raises(TypeError, match="enable_sleeps"):
        FakeLLM(model=str(tmp_path), enable_sleeps=True)
    with pytest.raises(TypeError, match="load_format"):
        FakeLLM(model=str(tmp_path), load_format="dumy")


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
# Refit and memory
# ----------------------------------------------------------------------------------------------

# ~1.6 MiB per layer in bf16: several buckets of 1 MiB.
WIDE = ModelConfig(
    num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, vocab_size=96, max_seq_len=32
)


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


# ----------------------------------------------------------------------------------------------
# Configuration and the HF folder
# ----------------------------------------------------------------------------------------------


def test_config_problems_name_every_bad_field(tmp_path):
    assert TrtllmConfig().problems() == []
    bad = TrtllmConfig(
        hf_config_dir=str(tmp_path / "absent"),
        architecture="LlamaForSequenceClassification",
        dtype="fp8",
        free_gpu_memory_fraction=0.0,
        max_batch_size=0,
        max_num_tokens=2.5,
        bucket_mb=-1,
        sleep_during_training="yes",
    )
    p = bad.problems("generation.trtllm")
    keys = [m.split("=")[0] for m in p]
    assert keys == [
        "generation.trtllm.hf_config_dir",
        "generation.trtllm.architecture",
        "generation.trtllm.dtype",
        "generation.trtllm.free_gpu_memory_fraction",
        "generation.trtllm.max_batch_size",
        "generation.trtllm.max_num_tokens",
        "generation.trtllm.bucket_mb",
        "generation.trtllm.sleep_during_training",
    ]
    assert "'fp8': expected one of ['bfloat16', 'float16', 'float32']" in p[2]
    with pytest.raises(ValueError, match="8 problem"):
        TrtllmEngine(SMALL, pad_id=13, eos_id=0, config=bad, workdir=tmp_path, llm_factory=lambda: API)


def test_the_engine_is_built_from_an_hf_config_folder_of_the_policy(tmp_path):
    from aligner.models.hf_config import hf_architecture, model_config_from_hf
    from aligner.models.layout import weight_layout_diff

    _engine(tmp_path, WIDE)
    folder = Path(FakeLLM.instances[-1].args["model"])
    assert folder == tmp_path / "trtllm_hf_config" and sorted(p.name for p in folder.iterdir()) == [
        "config.json"
    ]
    assert hf_architecture(folder) == "LlamaForCausalLM"
    assert weight_layout_diff(WIDE, model_config_from_hf(folder), "lm") == []
    # A given folder is used as it is, after checking that it describes the policy.
    eng = _engine(tmp_path / "x", WIDE, hf_config_dir=str(folder))
    assert FakeLLM.instances[-1].args["model"] == str(folder) and eng.arch == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="does not describe the policy"):
        _engine(tmp_path / "y", SMALL, hf_config_dir=str(folder))
    with pytest.raises(ValueError, match="workdir"):
        TrtllmEngine(SMALL, pad_id=13, eos_id=0, llm_factory=lambda: API)


def test_qwen2_shaped_policies_are_served_as_qwen2():
    cfg = ModelConfig(add_qkv_bias=True, vocab_size=14)
    assert default_architecture(cfg) == "Qwen2ForCausalLM"
    assert default_architecture(SMALL) == "LlamaForCausalLM"
    assert default_architecture(dataclasses.replace(SMALL, qk_layernorm=True)) == "Qwen3ForCausalLM"


def test_generation_tp_needs_a_group_of_that_size(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but the engine group has 1"):
        TrtllmEngine(
            SMALL, pad_id=13, eos_id=0, tensor_parallel_size=2, workdir=tmp_path, llm_factory=lambda: API
        )


def test_max_seq_len_stays_within_the_policy_positions(tmp_path):
    with pytest.raises(ValueError, match="max_seq_len=25"):
        _engine(tmp_path, max_seq_len=SMALL.max_seq_len + 1)


def test_bad_token_ids_come_from_the_sampled_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="eos_id=12"):
        TrtllmEngine(
            SMALL, pad_id=13, eos_id=12, sample_vocab_size=12, workdir=tmp_path, llm_factory=lambda: API
        )
    eng = _engine(tmp_path)
    assert eng.banned_ids == [TOK.pad_id]


def _tp2_worker(rank: int, port: int, workdir: str) -> None:
    """Training TP 2 on two gloo processes, one engine of generation TP 2 owned by TP rank 0."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    uuids = ("GPU-rank0", "GPU-rank1")
    trtllm_engine.local_device_uuid = lambda: uuids[dist.get_rank()]  # each rank "is" its own GPU
    FakeLLM.DEVICE_UUIDS = uuids
    try:
        ps = distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=2), seed=5)
        policy = gpt.build_policy(WIDE)
        eng = TrtllmEngine(
            WIDE,
            pad_id=1,
            eos_id=0,
            dp_rank=ps.dp_rank,
            tensor_parallel_size=2,
            group=ps.tp_group,
            config=TrtllmConfig(bucket_mb=1),
            workdir=workdir,
            llm_factory=lambda: API,
        )
        assert eng.is_owner == (ps.tp_rank == 0) and len(FakeLLM.instances) == (ps.tp_rank == 0)
        eng.refit(policy)
        expected = {
            n: t.clone() for n, t in iter_hf_tensors(policy, WIDE, "LlamaForCausalLM", dtype=torch.bfloat16)
        }
        if eng.is_owner:
            llm = FakeLLM.instances[-1]
            # Both GPUs' handles arrived (the double rebuilt each and found them equal).
            assert list(llm.weights) == list(expected) and len(llm.buckets) > 2
            for n, t in expected.items():
                assert torch.equal(llm.weights[n], t), n
            assert llm.events[-1] == ("finalize", None)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=9))
        for t in (out.tokens, out.lengths, out.prompt_lengths, out.logprobs, out.ended.long()):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
            assert torch.equal(parts[0], parts[1]), "the engine group's ranks got different outputs"
        eng.close()
    finally:
        distributed.destroy()


@pytest.mark.multiprocess
def test_an_engine_group_of_two_ranks_refits_from_both_gpus_and_shares_its_output(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp2_worker, args=(distributed.free_port(), str(tmp_path)), nprocs=2, join=True)


# ----------------------------------------------------------------------------------------------
# The container recipe
# ----------------------------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        buf += (" " if buf else "") + s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_the_recipe_builds_on_the_targeted_release_image_and_installs_the_project():
    steps = _instructions((ROOT / "Dockerfile.trtllm").read_text())
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0].split()[0])
    assert image == trtllm.TRTLLM_IMAGE
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    copies = [rest for word, rest in steps if word == "COPY"]
    assert "pip install --no-deps ." in runs
    assert any(c.split()[0] == "aligner" for c in copies) and any("pyproject.toml" in c for c in copies)
    # The dependencies it adds are the project's own pins (never a second torch or transformers,
    # which the image's TensorRT-LLM is built against), plus Ray for the orchestrator.
    tomllib = pytest.importorskip("tomllib")

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.split(r"[<>=\[; ]", d)[0].lower(): d.split(";")[0].strip() for d in deps}
    installed = re.findall(r'"([A-Za-z0-9_.\-\[\],]+(?:[<>=!~]=?[^"]*)?)"', runs)
    assert installed, runs
    for spec in installed:
        name = re.split(r"[<>=!~\[]", spec)[0].lower()
        assert name not in ("torch", "transformers"), spec
        assert name == "ray" or spec == pins.get(name), (spec, pins.get(name))
    assert "constraint" in runs  # the image's own torch/transformers/numpy are held in place


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
