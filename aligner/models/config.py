"""The architecture of a GPT-style model, independent of how it is parallelised, and the models
package's error :class:`ConversionError` (a checkpoint, an HF folder or a config that cannot be
converted). A wrong config value raises :class:`aligner.config_checks.ConfigError`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from aligner.config_checks import ConfigError

__all__ = ["ModelConfig", "ConversionError", "FORWARD_MODES", "RECOMPUTE", "RUNTIME_KEYS"]

NORMS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh", "relu", "silu")
POSITIONS = ("rope", "learned_absolute")
#: RoPE frequency scalings (``rope_scaling``; None is plain RoPE).
ROPE_SCALINGS = ("llama3",)
#: How a model's full-sequence forwards run (``model_forward``; see ``aligner.models.fused``).
FORWARD_MODES = ("auto", "fused", "compiled", "megatron")
#: Activation recompute while training (``recompute``): none, or every transformer layer.
RECOMPUTE = ("none", "full")
#: Fields that say how the model computes, not what: never part of its architecture.
RUNTIME_KEYS = ("recompute",)


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
    kv_channels: int | None = None
    """Width of each attention head; None means hidden_size / num_attention_heads (Qwen3 sets its own)."""
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
    rope_scaling: str | None = None
    """RoPE frequency scaling: None (plain RoPE) or 'llama3' (Llama 3.1+, the four fields below)."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above rope_original_max_position / this are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below rope_original_max_position / this are kept."""
    rope_original_max_position: int = 8192
    """llama3 scaling: the context length the model was pretrained at."""
    qk_layernorm: bool = False
    """A norm (of the model's normalization) over each head's query and key, before RoPE (Qwen3)."""
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
    recompute: str = "none"
    """Activation recompute while training: 'none', or 'full' (each transformer layer keeps only
    its input and runs again in the backward: the activations of one layer at a time instead of
    all of them, for about one more forward of compute). The same gradients either way."""

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
        if self.kv_channels is not None:
            positive("kv_channels")
        if e:
            return e
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            e.append(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads} (set kv_channels for a head width of its own)"
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
            what = "kv_channels" if self.kv_channels is not None else "hidden_size/num_attention_heads"
            e.append(f"head dim {self.head_dim} ({what}) must be even for rope")
        if self.recompute not in RECOMPUTE:
            e.append(
                f"recompute={self.recompute!r}: expected one of {RECOMPUTE} "
                "('full': every layer's activations recomputed in the backward)"
            )
        if not isinstance(self.qk_layernorm, bool):
            e.append(f"qk_layernorm={self.qk_layernorm!r}: expected true or false")
        e.extend(self._rope_scaling_problems())
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

    def _rope_scaling_problems(self) -> list[str]:
        if self.rope_scaling is None:
            return []
        if self.rope_scaling not in ROPE_SCALINGS:
            return [f"rope_scaling={self.rope_scaling!r}: expected null or one of {ROPE_SCALINGS}"]
        e = []
        if self.position_embedding != "rope":
            e.append(
                f"rope_scaling={self.rope_scaling!r} needs position_embedding='rope', "
                f"got {self.position_embedding!r}"
            )

        def number(name: str) -> float | None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                e.append(f"{name}={v!r}: expected a positive number")
                return None
            return float(v)

        factor = number("rope_scaling_factor")
        low, high = number("rope_low_freq_factor"), number("rope_high_freq_factor")
        if factor is not None and factor < 1.0:
            e.append(f"rope_scaling_factor={factor!r}: expected >= 1 (it divides the low frequencies)")
        if low is not None and high is not None and high <= low:
            e.append(
                f"rope_high_freq_factor={high!r} must be greater than rope_low_freq_factor={low!r} "
                "(the smoothing between them divides by their difference)"
            )
        v = self.rope_original_max_position
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            e.append(f"rope_original_max_position={v!r}: expected a positive integer")
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
        """The width of one attention head: ``kv_channels``, else hidden_size / heads."""
        if self.kv_channels is not None:
            return self.kv_channels
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

    def with_runtime_of(self, other: ModelConfig) -> ModelConfig:
        """This architecture with ``other``'s :data:`RUNTIME_KEYS` (how it computes): a model
        that takes its architecture from a folder keeps the run's settings."""
        return dataclasses.replace(self, **{k: getattr(other, k) for k in RUNTIME_KEYS})

    def architecture_diff(self, other: ModelConfig) -> list[str]:
        """Fields that differ in a way that changes the weights' shapes or meaning."""
        ignore = {"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by"}
        ignore.update(RUNTIME_KEYS)
        if self.rope_scaling is None and other.rope_scaling is None:
            # The scaling's parameters mean nothing without it.
            ignore |= {
                "rope_scaling_factor",
                "rope_low_freq_factor",
                "rope_high_freq_factor",
                "rope_original_max_position",
            }
        if self.kv_channels is None and other.kv_channels is None:
            ignore.add("kv_channels")  # derived from fields compared on their own
        out = []
        for f in dataclasses.fields(self):
            if f.name in ignore:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "ffn_hidden_size":
                a, b = self.ffn_size, other.ffn_size
            if f.name == "num_query_groups":
                a, b = self.kv_heads, other.kv_heads
            if f.name == "kv_channels":
                a, b = self.head_dim, other.head_dim
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out
