"""The TensorRT-LLM engine: TensorRT-LLM's LLM API (PyTorch backend, Ray orchestrator) behind the
:class:`~aligner.generation.engine.GenerationEngine` protocol (``generation.engine: trtllm``).

Target: TensorRT-LLM **1.2.1** (:data:`TRTLLM_VERSION`, NVIDIA's release image
``nvcr.io/nvidia/tensorrt-llm/release:1.2.1``). The 1.2 line is the first where the PyTorch
backend refits in place through a public path (the Ray orchestrator and its RLHF worker
extension: "New Ray orchestrator type" in the 1.2 release notes; 1.0 and 1.1 have no refit or
sleep for the PyTorch backend), and 1.2.1 is the newest patch release of that line. Later lines
renamed what this module relies on (the sleep switch became ``sleep_config``, the memory tags
became ``ExecutorMemoryType`` members with other names), so :func:`load_llm_api` refuses any
other release line rather than run against an API this code was not written for.

How it works (docs/design.md, "Generation engines"; docs/trtllm.md):

- **Build.** ``LLM(model=<HF folder>, load_format="dummy", skip_tokenizer_init=True,
  orchestrator_type="ray", ray_worker_extension_cls=WorkerExtension, ...)``: the folder needs only
  ``config.json`` (dummy weights; requests are token ids, so no tokenizer), written from the
  policy's :class:`~aligner.models.config.ModelConfig` by :func:`write_hf_config_dir` unless
  ``generation.trtllm.hf_config_dir`` names one. The engine holds its own copy of the weights.
- **Refit.** Every rank iterates :func:`aligner.models.hf.iter_hf_tensors` (collective over TP
  and PP: full tensors under HF names, the engine shards them itself), grouped into buckets of
  ``bucket_mb`` (:func:`aligner.models.layout.bucketed`). Each bucket becomes CUDA IPC handles
  keyed by the sending GPU's UUID (:func:`ipc_handles`); the engine's owner sends them through
  the worker extension's ``update_weights``, then ``update_weights(None)`` finalises the update
  (post-load hooks, prefix-cache reset). Each engine worker opens the handles of its own GPU.
- **Memory.** With ``sleep_during_training`` the engine is built with ``enable_sleep=True``; it
  wakes its weights before a refit and its KV cache before generating, and puts everything to
  sleep again after each ``generate`` (training follows), so training has the GPU memory.
- **Requests.** One TensorRT-LLM ``SamplingParams`` per prompt: ``max_tokens`` always set (the
  library's default is 32), eos and the stop tokens as ``stop_token_ids`` with ``end_id=-1`` and
  ``include_stop_str_in_output=True`` so the stop token stays in the response, ids the policy
  never samples as ``bad_token_ids``, ``logprobs=1``, and an explicit ``seed`` per request
  (:func:`request_seed`) for the C++ ``TRTLLMSampler``, which honours per-request seeds.
- **Outputs.** :func:`read_completion` takes each generated token's log-probability by the
  sampled id (``logprobs[j][token_ids[j]].logprob``) and checks that the stop token was kept;
  :func:`completions_to_output` writes the project's tensor conventions through
  :func:`~aligner.generation.sampling.build_output`. The log-probabilities are TensorRT-LLM's own:
  the trainer recomputes them with the training forward and logs the difference
  (``rollout/logprob_mismatch_*``).
- **Ranks.** An engine spans ``tensor_parallel_size`` GPUs. Its ``group`` is the process group of
  the ranks on those GPUs (all holding the same prompts: the same data-parallel rank, e.g. a
  tensor-parallel group); group rank 0 owns the ``LLM`` object, every member sends the handles of
  its own GPU, and the owner broadcasts each generation to the others. ``group=None``: this
  process alone, generation TP 1.

Importing this module never imports ``tensorrt_llm``: it is imported when an engine is built,
and where it is missing the error says where to get it (``Dockerfile.trtllm``).
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from aligner.config_checks import Problems
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.layout import broadcast_output
from aligner.generation.sampling import build_output, check_prompts
from aligner.models.config import ModelConfig
from aligner.models.hf import iter_hf_tensors
from aligner.models.hf_config import (
    check_hf_folder,
    export_problems,
    hf_architecture,
    hf_config_from_model_config,
    model_config_from_hf,
    resolve_architecture,
)
from aligner.models.layout import bucketed, weight_layout_diff

__all__ = [
    "TRTLLM_VERSION",
    "TRTLLM_IMAGE",
    "TrtllmConfig",
    "TrtllmEngine",
    "TrtllmUnavailableError",
    "LlmApi",
    "load_llm_api",
    "missing_package_message",
    "request_seed",
    "sampling_kwargs",
    "llm_kwargs",
    "Completion",
    "read_completion",
    "completions_to_output",
    "ipc_handles",
    "local_device_uuid",
    "default_architecture",
    "write_hf_config_dir",
]

TRTLLM_VERSION = "1.2.1"
"""The TensorRT-LLM release this module is written against (see the module docstring)."""
TRTLLM_IMAGE = f"nvcr.io/nvidia/tensorrt-llm/release:{TRTLLM_VERSION}"
"""NVIDIA's container with that release; ``Dockerfile.trtllm`` builds on it."""
WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
"""The RLHF worker extension whose ``update_weights`` takes the IPC handles."""
WEIGHT_TAGS = (
    "sampler",
    "drafter",
    "guided_decoder",
    "spec_resource_manager",
    "model_extra",
    "executor_extra",
    "model",
    "draft_model",
)
"""The 1.2 line's memory tags for everything but the KV cache (the set verl sleeps and wakes)."""
KV_CACHE_TAGS = ("kv_cache",)
"""The KV cache's memory tag; its contents are discarded by a sleep."""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""``generation.trtllm.dtype`` values and the dtype the refit sends the weights in."""
NO_END_ID = -1
"""``end_id`` that turns off TensorRT-LLM's own end handling, which would drop the eos token
from ``token_ids``: eos goes through ``stop_token_ids`` instead, which keeps it."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class TrtllmConfig:
    """The TensorRT-LLM engine's settings (``generation.trtllm.*`` in the actor's config)."""

    hf_config_dir: str | None = None
    """An HF folder whose config.json describes the policy (weights and tokenizer files are not
    read); None: written from model config into ``<logging.run_dir>/trtllm_hf_config``."""
    architecture: str | None = None
    """The HF architecture the policy is exported as; None: that of hf_config_dir, else
    Qwen2ForCausalLM for q/k/v-only biases and LlamaForCausalLM otherwise."""
    dtype: str = "bfloat16"
    """The engine's weights and activations, and the refit's wire dtype: bfloat16, float16 or float32."""
    free_gpu_memory_fraction: float = 0.5
    """Share of the GPU memory free when the engine starts that its KV cache takes, in (0, 1]."""
    max_batch_size: int | None = None
    """Most requests the engine schedules at once; None: TensorRT-LLM's default."""
    max_num_tokens: int | None = None
    """Most tokens in one engine iteration (all requests); None: TensorRT-LLM's default."""
    bucket_mb: int = 512
    """Refit bucket size in MiB: the weights go to the engine in pieces of at most this; 0: one piece."""
    sleep_during_training: bool = True
    """Release the engine's GPU memory (weights and KV cache) after each generate, wake it for
    the next refit and generate."""
    enable_block_reuse: bool = False
    """Reuse KV-cache blocks of shared prompt prefixes between requests (cleared at each refit)."""
    cuda_graphs: bool = False
    """Let the engine capture CUDA graphs; off by default because TensorRT-LLM's sleep tests of
    this release line run without them."""

    def problems(self, prefix: str = "generation.trtllm") -> Problems:
        """Every problem with these settings, each naming its key."""
        p = Problems()
        if self.hf_config_dir is not None:
            d = self.hf_config_dir
            ok = isinstance(d, str) and os.path.isfile(os.path.join(d, "config.json"))
            p.expect(ok, f"{prefix}.hf_config_dir", d, "a folder holding config.json, or null")
        if self.architecture is not None:
            ok = isinstance(self.architecture, str)
            if ok:
                try:
                    ok = resolve_architecture(self.architecture)[1] == "lm"
                except Exception:
                    ok = False
            p.expect(ok, f"{prefix}.architecture", self.architecture, "an HF causal-LM architecture or null")
        p.expect(self.dtype in DTYPES, f"{prefix}.dtype", self.dtype, f"one of {list(DTYPES)}")
        f = self.free_gpu_memory_fraction
        ok = isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and 0 < f <= 1
        p.expect(ok, f"{prefix}.free_gpu_memory_fraction", f, "a number in (0, 1]")
        for name in ("max_batch_size", "max_num_tokens"):
            v = getattr(self, name)
            p.expect(v is None or (_is_int(v) and v >= 1), f"{prefix}.{name}", v, "an integer >= 1 or null")
        p.non_negative_ints(self, prefix, ["bucket_mb"])
        for name in ("sleep_during_training", "enable_block_reuse", "cuda_graphs"):
            v = getattr(self, name)
            p.expect(isinstance(v, bool), f"{prefix}.{name}", v, "true or false")
        return p


# ----------------------------------------------------------------------------------------------
# The package boundary
# ----------------------------------------------------------------------------------------------


class TrtllmUnavailableError(ImportError):
    """TensorRT-LLM cannot be used here: not installed, or another release line."""


class LlmApi(NamedTuple):
    """The three classes of TensorRT-LLM's LLM API the engine uses."""

    LLM: Any
    """``tensorrt_llm.LLM`` (the PyTorch backend)."""
    SamplingParams: Any
    """``tensorrt_llm.llmapi.SamplingParams``."""
    KvCacheConfig: Any
    """``tensorrt_llm.llmapi.KvCacheConfig``."""


def missing_package_message(cause: BaseException | str) -> str:
    """What to tell a user whose ``import tensorrt_llm`` failed with ``cause``."""
    return (
        f"generation.engine=trtllm needs TensorRT-LLM {TRTLLM_VERSION} (the tensorrt_llm package), which "
        f"cannot be imported here ({cause}). TensorRT-LLM installs only on Linux with CUDA and Python "
        "3.10 or 3.12 (its PyPI entry is a stub that fetches the real wheel from NVIDIA's own index); "
        f"run the actor in NVIDIA's TensorRT-LLM container instead: `docker build -f Dockerfile.trtllm "
        f"-t aligner:trtllm .` builds this project on {TRTLLM_IMAGE} (docs/trtllm.md). Or set "
        "generation.engine=native."
    )


def _release_line(version: str) -> tuple[int, int] | None:
    """``"1.2.1"`` / ``"1.2.0rc6"`` -> ``(1, 2)``; None when it does not start with two numbers."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = ""
    for ch in parts[1]:
        if not ch.isdigit():
            break
        minor += ch
    return (int(parts[0]), int(minor)) if minor else None


def load_llm_api() -> LlmApi:
    """Import TensorRT-LLM's LLM API (the default ``llm_factory``), or raise
    :class:`TrtllmUnavailableError` saying what is missing and where to get it."""
    # The Ray orchestrator runs without MPI; TensorRT-LLM's own Ray tests set this before
    # importing the package (tests/unittest/_torch/ray_orchestrator/conftest.py).
    os.environ.setdefault("TLLM_DISABLE_MPI", "1")
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import KvCacheConfig
        from tensorrt_llm.llmapi import SamplingParams as TrtSamplingParams
    except (ImportError, OSError) as e:
        raise TrtllmUnavailableError(missing_package_message(e)) from e
    version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    if _release_line(version) != _release_line(TRTLLM_VERSION):
        raise TrtllmUnavailableError(
            f"tensorrt_llm {version} is installed, but this engine is written against the "
            f"{TRTLLM_VERSION} release line (1.2.x: enable_sleep, its memory tags, the Ray worker "
            f"extension); use {TRTLLM_IMAGE} (Dockerfile.trtllm) or set generation.engine=native"
        )
    return LlmApi(LLM, TrtSamplingParams, KvCacheConfig)


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def request_seed(seed: int, dp_rank: int, index: int) -> int:
    """The seed of prompt ``index`` on data-parallel rank ``dp_rank`` in a call seeded with
    ``seed`` (the trainer passes one per step): 63 bits of a hash of the three, so that
    neighbouring triples give unrelated streams and every request of a step has its own."""
    text = f"aligner.trtllm:{int(seed)}:{int(dp_rank)}:{int(index)}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sampling_kwargs(
    sampling: SamplingParams,
    *,
    seed: int,
    max_tokens: int,
    eos_id: int,
    pad_id: int,
    banned_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The keyword arguments of TensorRT-LLM's ``SamplingParams`` for one request.

    Greedy is ``top_k=1`` (the tempered distribution still defines the log-probs); top-k 0 and
    top-p 1.0 mean "off" in both APIs. ``logprobs=1``: the sampled token's log-prob, read by its
    id (the C++ sampler returns at most one candidate; 0 would read as "none" in some paths).
    """
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an integer >= 1")
    kw: dict[str, Any] = dict(
        max_tokens=int(max_tokens),
        end_id=NO_END_ID,
        pad_id=int(pad_id),
        stop_token_ids=sorted({int(eos_id), *(int(t) for t in sampling.stop_token_ids)}),
        include_stop_str_in_output=True,
        detokenize=False,
        seed=int(seed),
        logprobs=1,
        temperature=float(sampling.temperature),
        top_k=1 if sampling.greedy else int(sampling.top_k),
        top_p=1.0 if sampling.greedy else float(sampling.top_p),
    )
    if banned_ids:
        kw["bad_token_ids"] = [int(t) for t in banned_ids]
    return kw


def llm_kwargs(
    hf_config_dir: str | os.PathLike,
    config: TrtllmConfig,
    *,
    tensor_parallel_size: int,
    max_seq_len: int,
    kv_cache_config: Any,
) -> dict[str, Any]:
    """The keyword arguments of TensorRT-LLM's ``LLM`` for this engine (see the module docstring)."""
    kw: dict[str, Any] = dict(
        model=str(hf_config_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=int(tensor_parallel_size),
        dtype=config.dtype,
        load_format="dummy",
        max_seq_len=int(max_seq_len),
        # The default (1024) would reject longer prompts (NeMo-RL's TensorRT-LLM worker sets it too).
        max_input_len=int(max_seq_len) - 1,
        kv_cache_config=kv_cache_config,
        orchestrator_type="ray",
        ray_worker_extension_cls=WORKER_EXTENSION,
        # The C++ sampler honours per-request seeds; the Torch sampler of this line uses one
        # engine-wide generator.
        sampler_type="TRTLLMSampler",
        # TensorRT-LLM's own RL entry point (AsyncLLM) forces NCCL all-reduce: its custom
        # all-reduce caused a "convergence issue" with several rollout instances.
        allreduce_strategy="NCCL",
    )
    if config.max_batch_size is not None:
        kw["max_batch_size"] = int(config.max_batch_size)
    if config.max_num_tokens is not None:
        kw["max_num_tokens"] = int(config.max_num_tokens)
    if config.sleep_during_training:
        kw["enable_sleep"] = True
    if not config.cuda_graphs:
        kw["cuda_graph_config"] = None
    return kw


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


class Completion(NamedTuple):
    """One request's response as the engine returned it, checked."""

    token_ids: list[int]
    """Generated tokens only, the stop token (when one ended it) last."""
    logprobs: list[float]
    """The log-probability of each generated token, same length."""
    ended: bool
    """Ended by eos or a stop token (False: ran out of max_tokens)."""


def read_completion(
    request_output: Any, index: int, stop_ids: set[int] | frozenset[int], max_tokens: int
) -> Completion:
    """Check one ``RequestOutput`` and return its :class:`Completion`.

    The stop token must be the last generated token when the engine says it stopped, and no
    stop token may appear before the last; each log-probability is read by the sampled id.
    """
    outs = list(request_output.outputs)
    if len(outs) != 1:
        raise RuntimeError(f"prompt {index}: TensorRT-LLM returned {len(outs)} completions, expected 1 (n=1)")
    c = outs[0]
    ids = [int(t) for t in c.token_ids]
    reason = c.finish_reason
    where = f"prompt {index}: TensorRT-LLM"
    if reason not in ("stop", "length"):
        raise RuntimeError(f"{where} finished with finish_reason={reason!r}, expected 'stop' or 'length'")
    if not ids:
        raise RuntimeError(f"{where} generated no token (finish_reason={reason!r})")
    if len(ids) > max_tokens:
        raise RuntimeError(f"{where} generated {len(ids)} tokens, more than max_tokens={max_tokens}")
    early = [j for j, t in enumerate(ids[:-1]) if t in stop_ids]
    if early:
        j = early[0]
        raise RuntimeError(f"{where} went on after stop token {ids[j]} (position {j} of {len(ids)})")
    ended = ids[-1] in stop_ids
    if reason == "stop" and not ended:
        raise RuntimeError(
            f"{where} stopped (finish_reason='stop') but its last token {ids[-1]} is not a stop token "
            f"{sorted(stop_ids)}: the stop token must stay in the response (end_id={NO_END_ID} with "
            "include_stop_str_in_output=True)"
        )
    lps = c.logprobs
    if lps is None or len(lps) != len(ids):
        got = None if lps is None else len(lps)
        raise RuntimeError(f"{where} returned {got} per-token log-prob entries for {len(ids)} tokens")
    values = []
    for j, (tok, entry) in enumerate(zip(ids, lps)):
        if not isinstance(entry, dict):
            raise RuntimeError(
                f"{where}: log-prob entry {j} is a {type(entry).__name__}, expected a dict of token id "
                "-> Logprob (the default format, logprobs_simple_format=False)"
            )
        lp = entry.get(tok)
        if lp is None:
            raise RuntimeError(
                f"{where}: log-probs of position {j} lack the sampled token {tok}: {sorted(entry)}"
            )
        values.append(float(lp.logprob))
    return Completion(ids, values, ended)


def completions_to_output(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    pad_id: int,
    tokenizer=None,
    stop_strings: Sequence[str] = (),
    device: torch.device | str = "cpu",
) -> GenerationOutput:
    """Prompts and their completions in the project's tensor conventions (engine.py): tokens
    ``[b, s]`` prompt + response right-padded, ``logprobs[i, t]`` for the token at ``t+1``,
    stop strings applied by :func:`~aligner.generation.sampling.build_output`."""
    b = len(prompts)
    if len(completions) != b:
        raise ValueError(f"{len(completions)} completions for {b} prompts")
    plen = [len(p) for p in prompts]
    lengths = [p + len(c.token_ids) for p, c in zip(plen, completions)]
    T = max(lengths)
    tokens = torch.full((b, T), int(pad_id), dtype=torch.int64)
    logprobs = torch.zeros((b, T - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        P, L = plen[i], lengths[i]
        tokens[i, :P] = torch.tensor(list(p), dtype=torch.int64)
        tokens[i, P:L] = torch.tensor(c.token_ids, dtype=torch.int64)
        # logprobs[t] scores tokens[t+1]: the first response token (position P) sits at P-1.
        logprobs[i, P - 1 : L - 1] = torch.tensor(c.logprobs, dtype=torch.float32)
    ended = torch.tensor([c.ended for c in completions], dtype=torch.bool)
    return build_output(
        tokens.to(device),
        torch.tensor(plen, dtype=torch.int64, device=device),
        torch.tensor(lengths, dtype=torch.int64, device=device),
        logprobs.to(device),
        ended.to(device),
        int(pad_id),
        tokenizer,
        stop_strings,
    )


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def ipc_handles(bucket: Sequence[tuple[str, torch.Tensor]], device_uuid: str) -> dict[str, str]:
    """``{device_uuid: payload}`` for the worker extension's ``update_weights``: the payload is a
    base64 string of a pickled list of ``(HF name, torch.multiprocessing reduce_tensor handle)``.

    The pickle is TensorRT-LLM's documented payload format (its worker reads it with a
    restricted unpickler and rebuilds each tensor on its own device); it is the only place the
    project pickles anything. The tensors must stay alive until the engine has loaded them.
    """
    handles = [(name, reduce_tensor(t.detach())) for name, t in bucket]
    return {device_uuid: base64.b64encode(pickle.dumps(handles)).decode("ascii")}


def local_device_uuid() -> str:
    """This process's CUDA device as TensorRT-LLM names it (``"GPU-" + uuid``), the key its
    worker on that GPU looks up in ``update_weights``."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the TensorRT-LLM refit passes CUDA IPC handles of the policy's weights: it needs the "
            "policy on a CUDA device, and none is available"
        )
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return "GPU-" + str(props.uuid)


def default_architecture(cfg: ModelConfig) -> str:
    """The HF architecture a policy of ``cfg`` is exported as when none is configured (the
    converter's choice: Qwen3 for q/k norms, Qwen2 for q/k/v biases alone, GPT-2 for learned
    positions, else Llama)."""
    from aligner.models.hf_config import default_architecture as converter_default

    return converter_default(cfg)


def write_hf_config_dir(
    cfg: ModelConfig, arch: str, out_dir: str | os.PathLike, dtype: str = "bfloat16"
) -> Path:
    """Write the HF ``config.json`` of a ``cfg`` policy as ``arch`` into ``out_dir`` (the folder
    the engine is built from; no weights: it starts from dummy weights and is refitted). The
    file is replaced atomically, so ranks writing the same file at once are harmless."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(DTYPES)}")
    conf = hf_config_from_model_config(cfg, arch, dtype=DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(conf.to_json_string())
    os.replace(tmp, out / "config.json")
    return out


def _comm_device(group: Any) -> torch.device:
    """Where tensors for collectives over ``group`` live (NCCL needs CUDA)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_text(text: str, group: Any) -> list[str]:
    """Every group member's ``text``, in group-rank order (as bytes in tensors: no pickle)."""
    dev = _comm_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    n = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[: int(s)].cpu().tolist()).decode() for p, s in zip(parts, sizes)]


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


class TrtllmEngine:
    """Generation with TensorRT-LLM (PyTorch backend), refitted from the policy every step.

    Args:
        model_config: the policy's architecture (the weight stream's shapes).
        pad_id: written after each sample's end.
        eos_id: ends a sample (kept as its last token).
        max_seq_len: longest prompt + response; default ``model_config.max_seq_len``.
        dp_rank: this rank's data-parallel rank (part of every request's seed).
        tensor_parallel_size: GPUs the engine spans (generation TP): 1, or the size of ``group``.
        config: :class:`TrtllmConfig`.
        group: the process group of the ranks on the engine's GPUs, all holding the same prompts
            (one data-parallel rank, e.g. its tensor-parallel group); group rank 0 owns the
            engine. None: this process alone.
        workdir: where the HF config folder is written when ``config.hf_config_dir`` is None
            (``<workdir>/trtllm_hf_config``; the actor passes its run dir).
        tokenizer: needed for ``stop_strings``.
        sample_vocab_size: ids at or above it are never sampled (``bad_token_ids``); default all
            of ``model_config.vocab_size``.
        device: where outputs are returned; default the current CUDA device, else the CPU.
        llm_factory: returns the :class:`LlmApi`; default :func:`load_llm_api` (imports
            TensorRT-LLM, on the owner only).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        pad_id: int,
        eos_id: int,
        max_seq_len: int | None = None,
        dp_rank: int = 0,
        tensor_parallel_size: int = 1,
        config: TrtllmConfig | None = None,
        group: Any = None,
        workdir: str | os.PathLike | None = None,
        tokenizer=None,
        sample_vocab_size: int | None = None,
        device: torch.device | str | None = None,
        llm_factory: Callable[[], LlmApi] | None = None,
    ) -> None:
        self.config = config if config is not None else TrtllmConfig()
        self.config.problems().raise_if_any("generation.trtllm config")
        self.model_config = model_config
        self.pad_id, self.eos_id = int(pad_id), int(eos_id)
        self.max_seq_len = int(max_seq_len if max_seq_len is not None else model_config.max_seq_len)
        self.dp_rank = int(dp_rank)
        self.tokenizer = tokenizer
        self.vocab_size = int(model_config.vocab_size)
        sv = self.vocab_size if sample_vocab_size is None else int(sample_vocab_size)
        if not 1 <= sv <= self.vocab_size:
            raise ValueError(f"sample_vocab_size={sv}: expected 1..model vocab_size ({self.vocab_size})")
        self.banned_ids = list(range(sv, self.vocab_size))
        for name, v in (("pad_id", self.pad_id), ("eos_id", self.eos_id)):
            if not 0 <= v < self.vocab_size:
                raise ValueError(f"{name}={v}: expected an id in [0, {self.vocab_size})")
        if self.eos_id in self.banned_ids:
            raise ValueError(
                f"eos_id={self.eos_id} is at or above sample_vocab_size={sv}: it could never end a sample"
            )
        if not 2 <= self.max_seq_len <= model_config.max_seq_len:
            raise ValueError(
                f"max_seq_len={self.max_seq_len}: expected 2..model max_seq_len ({model_config.max_seq_len}): "
                "a prompt token and a response token, within the positions the engine's config.json has"
            )
        self._init_group(group, tensor_parallel_size)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.arch = self._resolve_architecture()
        self.refits = 0
        self._asleep: set[str] = set()  # "weights" and/or "kv_cache", on the owner
        self._llm: Any = None
        self._api: LlmApi | None = None
        if self.is_owner:
            hf_dir = self._hf_config_dir(workdir)
            self._api = (llm_factory or load_llm_api)()
            kv = self._api.KvCacheConfig(
                free_gpu_memory_fraction=float(self.config.free_gpu_memory_fraction),
                enable_block_reuse=bool(self.config.enable_block_reuse),
            )
            self._llm = self._api.LLM(
                **llm_kwargs(
                    hf_dir,
                    self.config,
                    tensor_parallel_size=self.tensor_parallel_size,
                    max_seq_len=self.max_seq_len,
                    kv_cache_config=kv,
                )
            )

    # -- set-up -----------------------------------------------------------------------------

    def _init_group(self, group: Any, tensor_parallel_size: int) -> None:
        if not _is_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: expected an integer >= 1")
        size = 1 if group is None else dist.get_world_size(group)
        if size != tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} but the engine group has {size} rank(s): "
                "every GPU of the engine must be a rank of its group (each sends the weights' IPC "
                "handles of its own GPU), so pass group= with tensor_parallel_size ranks (or TP 1 alone)"
            )
        self.tensor_parallel_size = tensor_parallel_size
        self.group = group if size > 1 else None
        self.is_owner = self.group is None or dist.get_rank(self.group) == 0

    def _resolve_architecture(self) -> str:
        cfg = self.config
        if cfg.architecture is not None:
            arch = cfg.architecture
        elif cfg.hf_config_dir is not None:
            arch = hf_architecture(check_hf_folder(cfg.hf_config_dir))
        else:
            arch = default_architecture(self.model_config)
        family, head = resolve_architecture(arch)
        if head != "lm":
            raise ValueError(f"generation.trtllm.architecture={arch!r}: expected a causal-LM architecture")
        problems = export_problems(self.model_config, family)
        if problems:
            raise ValueError(
                f"the policy cannot be served as {arch} (generation.trtllm.architecture):\n  "
                + "\n  ".join(problems)
            )
        return arch

    def _hf_config_dir(self, workdir: str | os.PathLike | None) -> Path:
        cfg = self.config
        if cfg.hf_config_dir is not None:
            folder = check_hf_folder(cfg.hf_config_dir)
            diff = weight_layout_diff(self.model_config, model_config_from_hf(folder), "lm")
            if diff:
                raise ValueError(
                    f"generation.trtllm.hf_config_dir={str(folder)!r}: its config.json does not describe "
                    f"the policy (model config != file): " + "; ".join(diff)
                )
            return folder
        if workdir is None:
            raise ValueError(
                "generation.trtllm.hf_config_dir is null and no workdir was given to write the engine's "
                "HF config folder into: pass workdir= (the run dir) or set generation.trtllm.hf_config_dir"
            )
        return write_hf_config_dir(
            self.model_config, self.arch, Path(workdir) / "trtllm_hf_config", cfg.dtype
        )

    # -- protocol ---------------------------------------------------------------------------

    def refit(self, policy: torch.nn.Module) -> None:
        """Send ``policy``'s current weights to the engine. Collective: every rank of the world
        calls it (the weight stream gathers over TP and PP)."""
        if self.is_owner:
            self._wake({"weights"})
        uuid: str | None = None
        stream = iter_hf_tensors(policy, self.model_config, self.arch, dtype=DTYPES[self.config.dtype])
        for bucket in bucketed(stream, self.config.bucket_mb * 2**20):
            if uuid is None:
                uuid = local_device_uuid()
            handles = self._gather_handles(ipc_handles(bucket, uuid), uuid)
            if self.is_owner:
                self._rpc("update_weights", handles)
            # The engine has copied the tensors once the owner's call returns: only then may the
            # senders drop them.
            self._barrier()
            del bucket, handles
        if self.is_owner:
            self._rpc("update_weights", None)  # finalise: post-load hooks, prefix-cache reset
        self._barrier()
        self.refits += 1

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """One response per prompt (token-id lists). Every member of the engine's group calls it
        with the same prompts and gets the same output."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("sampling.stop_strings needs a tokenizer: pass tokenizer= to TrtllmEngine")
        prompts = check_prompts(prompts, self.max_seq_len, self.vocab_size)
        out = self._generate_here(prompts, sampling) if self.is_owner else None
        if self.group is not None:
            out = broadcast_output(out, self.group, self.device)
        assert out is not None
        return out

    # -- memory -----------------------------------------------------------------------------

    def release(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) until :meth:`resume`, a refit or a
        generate; a no-op without ``sleep_during_training`` or on a non-owner rank."""
        if not (self.is_owner and self.config.sleep_during_training and self._llm is not None):
            return
        awake = [g for g in ("weights", "kv_cache") if g not in self._asleep]
        if not awake:
            return
        if self.config.enable_block_reuse:
            # The KV cache's contents are discarded by the sleep: drop the prefix-reuse state first.
            self._rpc("reset_prefix_cache")
        self._rpc("sleep", self._tags(awake))
        self._asleep.update(awake)

    def resume(self) -> None:
        """Take back the memory :meth:`release` freed (weights first, then the KV cache)."""
        if self.is_owner:
            self._wake({"weights", "kv_cache"})

    def close(self) -> None:
        """Shut the engine down (its workers and their GPU memory); idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _tags(groups: Sequence[str]) -> list[str]:
        tags: list[str] = []
        for g in ("weights", "kv_cache"):
            if g in groups:
                tags += WEIGHT_TAGS if g == "weights" else KV_CACHE_TAGS
        return tags

    def _wake(self, groups: set[str]) -> None:
        # Weights before the KV cache, each only if asleep (verl's order: weights, refit, KV cache).
        for g in ("weights", "kv_cache"):
            if g in groups and g in self._asleep:
                self._rpc("wakeup", self._tags([g]))
                self._asleep.discard(g)

    def _rpc(self, method: str, *args: Any) -> Any:
        if self._llm is None:
            raise RuntimeError("the TensorRT-LLM engine is closed")
        # The synchronous LLM's collective RPC to every worker (TensorRT-LLM's refit and sleep
        # tests call it this way; AsyncLLM wraps the same calls).
        return self._llm._collective_rpc(method, args)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _gather_handles(self, mine: dict[str, str], uuid: str) -> dict[str, str] | None:
        """Every member's ``{uuid: payload}`` merged, on the owner (None elsewhere)."""
        if self.group is None:
            return mine
        texts = _all_gather_text(uuid + "\n" + mine[uuid], self.group)
        if not self.is_owner:
            return None
        merged: dict[str, str] = {}
        for t in texts:
            key, payload = t.split("\n", 1)
            if key in merged:
                raise RuntimeError(
                    f"two ranks of the engine group are on the same GPU {key}: each GPU of a "
                    "TensorRT-LLM engine must hold exactly one rank of its group"
                )
            merged[key] = payload
        return merged

    def _generate_here(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        assert self._api is not None
        self._wake({"weights", "kv_cache"})
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        stop_ids = frozenset({self.eos_id, *sampling.stop_token_ids})
        max_tokens = [min(sampling.max_new_tokens, self.max_seq_len - len(p)) for p in prompts]
        params = [
            self._api.SamplingParams(
                **sampling_kwargs(
                    sampling,
                    seed=request_seed(seed, self.dp_rank, i),
                    max_tokens=max_tokens[i],
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    banned_ids=self.banned_ids,
                )
            )
            for i in range(len(prompts))
        ]
        results = list(self._llm.generate(prompts, sampling_params=params, use_tqdm=False))
        if len(results) != len(prompts):
            raise RuntimeError(f"TensorRT-LLM returned {len(results)} outputs for {len(prompts)} prompts")
        completions = [read_completion(r, i, stop_ids, max_tokens[i]) for i, r in enumerate(results)]
        out = completions_to_output(
            prompts, completions, self.pad_id, self.tokenizer, sampling.stop_strings, self.device
        )
        if self.config.sleep_during_training:
            self.release()  # training comes next: give it the memory
        return out
