"""The TensorRT-LLM engine's settings (``generation.trtllm.*`` in the actor's config) and their checks."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from aligner.config_checks import Problems
from aligner.models.hf_config import resolve_architecture

__all__ = ["DTYPES", "TrtllmConfig", "is_int"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""``generation.trtllm.dtype`` values and the dtype the refit sends the weights in."""


def is_int(v: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(v, int) and not isinstance(v, bool)


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
            p.expect(v is None or (is_int(v) and v >= 1), f"{prefix}.{name}", v, "an integer >= 1 or null")
        p.non_negative_ints(self, prefix, ["bucket_mb"])
        for name in ("sleep_during_training", "enable_block_reuse", "cuda_graphs"):
            v = getattr(self, name)
            p.expect(isinstance(v, bool), f"{prefix}.{name}", v, "true or false")
        return p
