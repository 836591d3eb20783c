""":class:`TrtllmEngine`: TensorRT-LLM behind the generation-engine protocol (see the package
docstring).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aligner.distributed import all_gather_json
from aligner.generation.engine import GenerationOutput, SamplingParams, engine_stop_ids
from aligner.generation.layout import broadcast_output
from aligner.generation.sampling import check_prompts
from aligner.generation.trtllm.boundary import LlmApi, load_llm_api
from aligner.generation.trtllm.config import DTYPES, TrtllmConfig, is_int
from aligner.generation.trtllm.handles import (
    default_architecture,
    ipc_handles,
    local_device_uuid,
    write_hf_config_dir,
)
from aligner.generation.trtllm.outputs import completions_to_output, read_completion
from aligner.generation.trtllm.requests import llm_kwargs, request_seed, sampling_kwargs
from aligner.models.config import ModelConfig
from aligner.models.hf import iter_hf_tensors
from aligner.models.hf_config import (
    check_hf_folder,
    export_problems,
    hf_architecture,
    model_config_from_hf,
    resolve_architecture,
)
from aligner.models.layout import bucketed, weight_layout_diff

__all__ = ["TrtllmEngine", "WEIGHT_TAGS", "KV_CACHE_TAGS"]

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


class TrtllmEngine:
    """Generation with TensorRT-LLM (PyTorch backend), refitted from the policy every step.

    Args:
        model_config: the policy's architecture (the weight stream's shapes).
        pad_id: written after each sample's end.
        eos_id: ends a sample (kept as its last token).
        stop_ids: more ids that end every sample, sent with eos as ``stop_token_ids`` (None: the
            tokenizer's ``stop_ids`` when ``eos_id`` is the tokenizer's:
            :func:`~aligner.generation.engine.engine_stop_ids`).
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
        stop_ids: Sequence[int] | None = None,
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
        self.stop_ids = engine_stop_ids(self.eos_id, tokenizer, stop_ids)
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
        if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
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
        held = {p.device for p in policy.parameters()}
        if self.device.type == "cuda" and held != {self.device}:
            # The engine maps CUDA-IPC handles: a CPU tensor's handle is a shared-memory file.
            raise ValueError(
                f"TensorRT-LLM refit: the policy's weights are on {sorted(map(str, held))}, not on this "
                f"rank's GPU {self.device}: the engine loads them from CUDA tensors"
            )
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
        texts = all_gather_json(uuid + "\n" + mine[uuid], self.group)
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
        stop_ids = frozenset({*self.stop_ids, *sampling.stop_token_ids})
        max_tokens = [min(sampling.max_new_tokens, self.max_seq_len - len(p)) for p in prompts]
        params = [
            self._api.SamplingParams(
                **sampling_kwargs(
                    sampling,
                    seed=request_seed(seed, self.dp_rank, i),
                    max_tokens=max_tokens[i],
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    stop_ids=self.stop_ids,
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
