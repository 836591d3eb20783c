"""The architecture of a GPT-style model, independent of how it is parallelised, and the two
errors of the models package: :class:`ConfigError` (a wrong config value) and
:class:`ConversionError` (a checkpoint, an HF folder or a config that cannot be converted)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelConfig", "ConfigError", "ConversionError", "FORWARD_MODES"]

NORMS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh", "relu", "silu")
POSITIONS = ("rope", "learned_absolute")
#: How a model's full-sequence forwards run (``model_forward``; see ``aligner.models.fused``).
FORWARD_MODES = ("auto", "fused", "compiled", "megatron")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names every offending field."""


class ConversionError(ValueError):
    """A checkpoint or config cannot be converted; the message names the file/tensor/field."""


@dataclass
class ModelConfig:
    """A decoder-only transformer, as the Llama and GPT-2 families describe theirs."""

    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None means one per query head."""
    ffn_hidden_size: int | None = None
    """Inner width of the MLP; None means 4 x hidden_size (or 8/3 x, rounded, for SwiGLU)."""
    vocab_size: int = 16
    """Tokens the tokenizer can produce (before any padding for tensor parallelism)."""
    max_seq_len: int = 64
    """Longest prompt + response the model accepts."""
    normalization: str = "RMSNorm"
    """'RMSNorm' (Llama) or 'LayerNorm' (GPT-2)."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the norms."""
    activation: str = "swiglu"
    """'swiglu' (gated SiLU, Llama), 'gelu', 'gelu_tanh' (GPT-2), 'relu' or 'silu'."""
    position_embedding: str = "rope"
    """'rope' (rotary) or 'learned_absolute' (GPT-2)."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    add_bias_linear: bool = False
    """Biases on every linear layer (GPT-2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of fresh weights."""
    hidden_dropout: float = 0.0
    """Dropout on the residual stream; 0 for RL so the first PPO ratio is exactly 1."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities; 0 for RL for the same reason."""
    make_vocab_size_divisible_by: int = 1
    """Pad the embedding rows to a multiple of this x TP size (Megatron's padded vocab)."""

    def __post_init__(self) -> None:
        errors = self.problems()
        if errors:
            raise ConfigError("invalid model config:\n  " + "\n  ".join(errors))

    def problems(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[str]:
        """Every problem with this config (and with a TP/PP layout of it), as messages."""
        e: list[str] = []

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                e.append(f"{name}={v!r}: expected a positive integer")

        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_seq_len",
            "make_vocab_size_divisible_by",
        ):
            positive(name)
        if self.num_query_groups is not None:
            positive("num_query_groups")
        if self.ffn_hidden_size is not None:
            positive("ffn_hidden_size")
        if e:
            return e
        if self.hidden_size % self.num_attention_heads:
            e.append(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            e.append(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.kv_heads}"
            )
        if self.normalization not in NORMS:
            e.append(f"normalization={self.normalization!r}: expected one of {NORMS}")
        if self.activation not in ACTIVATIONS:
            e.append(f"activation={self.activation!r}: expected one of {ACTIVATIONS}")
        if self.position_embedding not in POSITIONS:
            e.append(f"position_embedding={self.position_embedding!r}: expected one of {POSITIONS}")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                e.append(f"{name}={v!r}: expected a probability in [0, 1)")
        if self.norm_epsilon <= 0:
            e.append(f"norm_epsilon={self.norm_epsilon!r}: expected > 0")
        if self.position_embedding == "rope" and self.head_dim % 2:
            e.append(f"head dim {self.head_dim} (hidden_size/num_attention_heads) must be even for rope")
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        if tp > 1:
            if self.num_attention_heads % tp:
                e.append(
                    f"num_attention_heads={self.num_attention_heads} is not divisible by "
                    f"tensor_model_parallel_size={tp}"
                )
            if self.kv_heads % tp:
                e.append(
                    f"num_query_groups={self.kv_heads} is not divisible by tensor_model_parallel_size={tp}"
                )
            if self.ffn_size % tp:
                e.append(
                    f"ffn_hidden_size={self.ffn_size} is not divisible by tensor_model_parallel_size={tp}"
                )
        if pp > 1 and self.num_layers % pp:
            e.append(f"num_layers={self.num_layers} is not divisible by pipeline_model_parallel_size={pp}")
        return e

    def check_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
        errors = self.problems(tensor_parallel_size, pipeline_parallel_size)
        if errors:
            raise ConfigError("model config does not fit the parallel layout:\n  " + "\n  ".join(errors))

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            # Llama's 2/3 x 4h, rounded up to a multiple of 8.
            return int(math.ceil(8 * self.hidden_size / 3 / 8) * 8)
        return 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**d)

    def architecture_diff(self, other: ModelConfig) -> list[str]:
        """Fields that differ in a way that changes the weights' shapes or meaning."""
        ignore = {"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by"}
        out = []
        for f in dataclasses.fields(self):
            if f.name in ignore:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "ffn_hidden_size":
                a, b = self.ffn_size, other.ffn_size
            if f.name == "num_query_groups":
                a, b = self.kv_heads, other.kv_heads
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out
