"""A test double of TensorRT-LLM's LLM API (the 1.2 release line the engine targets), and the
fixtures and helpers the TensorRT-LLM engine tests (tests/generation/test_trtllm_*.py) share.

The double writes the documented signatures down (``LLM``'s arguments from ``TorchLlmArgs``,
``SamplingParams``, ``KvCacheConfig``, ``_collective_rpc`` and the RLHF worker extension's
``update_weights``; ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` shapes): a misspelled
keyword or a value of the wrong type fails, as pydantic or Python would in the real package. Its
"model" samples from a seeded stream per request and honours ``stop_token_ids``,
``include_stop_str_in_output``, ``end_id`` and ``bad_token_ids`` as the engine documents them, so
the adapter's choices show in its outputs. Its ``update_weights`` decodes the payload as
TensorRT-LLM's worker does (base64, unpickle, rebuild each handle), so the refit is checked
tensor by tensor against the HF export.

The fixtures ``_world`` (a one-process world, per test module) and ``_fake_gpu`` (this process
"is" the GPU ``UUID``) are autouse: each test module imports both.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from aligner import distributed
from aligner.generation import trtllm
from aligner.generation.trtllm import TrtllmConfig, TrtllmEngine
from aligner.generation.trtllm import engine as trtllm_engine
from aligner.models import gpt
from aligner.models.config import ModelConfig
from aligner.tokenizers import CharTokenizer

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
# ~1.6 MiB per layer in bf16: several buckets of 1 MiB.
WIDE = ModelConfig(
    num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, vocab_size=96, max_seq_len=32
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
