"""What the engine asks TensorRT-LLM for: the ``LLM``'s keyword arguments, and one
``SamplingParams`` per prompt with a seed of its own (the package docstring, *Build* and
*Requests*).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from aligner.generation.engine import SamplingParams
from aligner.generation.trtllm.config import TrtllmConfig, is_int

__all__ = ["WORKER_EXTENSION", "NO_END_ID", "request_seed", "sampling_kwargs", "llm_kwargs"]

WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
"""The RLHF worker extension whose ``update_weights`` takes the IPC handles."""
NO_END_ID = -1
"""``end_id`` that turns off TensorRT-LLM's own end handling, which would drop the eos token
from ``token_ids``: eos goes through ``stop_token_ids`` instead, which keeps it."""


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
    stop_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The keyword arguments of TensorRT-LLM's ``SamplingParams`` for one request.

    Greedy is ``top_k=1`` (the tempered distribution still defines the log-probs); top-k 0 and
    top-p 1.0 mean "off" in both APIs. ``logprobs=1``: the sampled token's log-prob, read by its
    id (the C++ sampler returns at most one candidate; 0 would read as "none" in some paths).
    ``stop_token_ids``: eos, the engine's ``stop_ids`` (a tokenizer's several end ids) and the
    call's, with ``end_id`` off (:data:`NO_END_ID`): the one ``end_id`` could not hold them all.
    """
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an integer >= 1")
    kw: dict[str, Any] = dict(
        max_tokens=int(max_tokens),
        end_id=NO_END_ID,
        pad_id=int(pad_id),
        stop_token_ids=sorted({int(eos_id), *(int(t) for t in (*stop_ids, *sampling.stop_token_ids))}),
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
    """The keyword arguments of TensorRT-LLM's ``LLM`` for this engine (see the package docstring)."""
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
