"""The generation settings (the ``generation`` section of ``aligner/configs/actor.yaml``): how
responses are sampled during rollouts, by which engine, in which layout and dtype, and their checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from aligner.config_checks import Problems
from aligner.distributed import ParallelConfig
from aligner.generation.engine import DECODE_STEPS, SamplingParams, sampling_problems
from aligner.generation.layout import generation_tp_problems
from aligner.generation.native import ENGINE_DTYPES
from aligner.generation.trtllm.config import TrtllmConfig
from aligner.models.config import ModelConfig

__all__ = ["ENGINES", "GenerationConfig", "stop_token_problems"]

ENGINES = ("native", "trtllm")
"""The generation engines ``generation.engine`` names."""


def stop_token_problems(ids: Any, vocab_size: int | None, key: str) -> Problems:
    """What is wrong with ``ids`` as the value of ``key`` (a list of token ids, each an integer in
    ``[0, vocab_size)``; any id >= 0 when ``vocab_size`` is None), each bad id named."""
    p = Problems()
    span = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    if not isinstance(ids, (list, tuple)):
        p.expect(False, key, ids, f"a list of token ids, each an integer {span}")
        return p
    bad = [
        t
        for t in ids
        if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0)
        or (vocab_size is not None and t >= vocab_size)
    ]
    where = f"in the tokenizer's vocabulary [0, {vocab_size})" if vocab_size is not None else span
    p.expect(not bad, key, list(ids), f"token ids {where}; {bad!r} are not")
    return p


@dataclass
class GenerationConfig:
    """How responses are sampled during rollouts."""

    max_new_tokens: int = 512
    """Longest response, end-of-sequence included."""
    temperature: float = 1.0
    """Sampling temperature; the training forward divides logits by the same value."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    stop_strings: list[str] = field(default_factory=list)
    """Extra strings that end a response."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (kept as its last token), beside the tokenizer's eos
    and the other end ids of its ``generation_config.json`` (an instruct model's
    ``eos_token_id`` list), which always end one."""
    num_threads: int | None = None
    """CPU threads while generating (restored afterwards): decoding is bound by per-step overhead,
    so a CPU actor may generate on more threads than it trains on; None keeps torch's setting.
    When it exceeds the training threads, the cores are taken to be shared with the critic
    server: each step waits for the server's pending critic update before generating (counted
    in ``timers/critic_wait``)."""
    decode_step: str = "auto"
    """The native engine's decode step: ``auto`` (a CUDA graph on a GPU at TP=1, else eager),
    ``eager``, ``static``, ``graph`` (CUDA), or ``compiled`` (``torch.compile``, TP=1; on a CPU
    about 1.5x the eager step's tokens/s, after a compile of seconds per batch shape)."""
    tensor_parallel_size: int | None = None
    """The generation layout: tensor parallel over this many ranks, the whole model on each group
    of them (a divisor of the actor's tensor x pipeline parallel size); null: the training TP.
    Another size than the training TP, or pipeline-parallel training, makes the engine own a copy
    of the weights that every refit reshards into (``aligner.generation.layout``)."""
    dtype: str | None = None
    """The dtype the engine generates in: 'bf16' or 'fp32' (another than the policy's makes the
    engine own a copy of the weights); null: the policy's compute dtype."""
    engine: str = "native"
    """'native': the KV-cache decoder over the policy's weights or its own copy (CPU and GPU);
    'trtllm': TensorRT-LLM's PyTorch backend, refitted from the weight stream every step (CUDA
    and NVIDIA's container only: docs/trtllm.md)."""
    trtllm: TrtllmConfig = field(default_factory=TrtllmConfig)
    """The TensorRT-LLM engine's settings (read with ``engine: trtllm``)."""

    def _sampling_fields(self) -> dict[str, Any]:
        """The fields this config shares with :class:`SamplingParams`, by name."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingParams) if hasattr(self, f.name)}

    def sampling(self, **overrides: Any) -> SamplingParams:
        """The engine's sampling parameters for these settings, with ``overrides`` (``seed``,
        ``greedy``) on top."""
        return SamplingParams(**{**self._sampling_fields(), **overrides})

    def problems(self, prefix: str = "generation", vocab_size: int | None = None) -> Problems:
        """Each value on its own; ``stop_token_ids`` against ``vocab_size`` (the tokenizer's
        ids, else any id >= 0) when given."""
        shared = self._sampling_fields()
        stops = shared.pop("stop_token_ids")
        p = sampling_problems(shared, prefix=f"{prefix}.")
        p += stop_token_problems(stops, vocab_size, f"{prefix}.stop_token_ids")
        n = self.num_threads
        p.expect(n is None or n >= 1, f"{prefix}.num_threads", n, "an integer >= 1 or null")
        p.expect(
            self.decode_step in DECODE_STEPS,
            f"{prefix}.decode_step",
            self.decode_step,
            f"one of {list(DECODE_STEPS)}",
        )
        p.expect(
            self.dtype is None or self.dtype in ENGINE_DTYPES,
            f"{prefix}.dtype",
            self.dtype,
            f"one of {list(ENGINE_DTYPES)}, or null for the policy's dtype",
        )
        p.expect(self.engine in ENGINES, f"{prefix}.engine", self.engine, f"one of {list(ENGINES)}")
        if self.engine == "trtllm":
            p += self.trtllm.problems(f"{prefix}.trtllm")
        return p

    def layout_problems(
        self, parallel: ParallelConfig, model: ModelConfig | None = None, prefix: str = "generation"
    ) -> Problems:
        """What is wrong with ``tensor_parallel_size`` for an actor laid out as ``parallel``
        (it must divide TP x PP) and, when given, for ``model`` (its heads, query groups and MLP
        width must divide by it)."""
        return Problems(
            generation_tp_problems(
                self.tensor_parallel_size,
                parallel.tensor_model_parallel_size,
                parallel.pipeline_model_parallel_size,
                model,
                key=f"{prefix}.tensor_parallel_size",
            )
        )
