"""Hugging Face <-> Megatron-core conversion for the Llama family (Llama, Mistral, Qwen2) and GPT-2.

Three layers, each written once and shared by every consumer:

1. **Canonical Megatron tensors.** :func:`megatron_tensor_specs` lists, for a :class:`ModelConfig`
   and a head (``"lm"``, ``"value"``, ``"reward"``), every tensor of the model as it is at
   TP=1/PP=1: Megatron's own names with *global* layer numbers, the vocabulary *un-padded*.
   :func:`iter_megatron_tensors` streams those full tensors out of a (TP/PP-sharded) model and
   :func:`load_megatron_tensors` puts full tensors back as this rank's shards. Our own checkpoint
   format (:mod:`aligner.models.checkpoint_io`) is exactly this stream written to safetensors.
2. **HF naming.** A rule per canonical tensor says which HF tensors it is made of and how
   (split the fused QKV per query group, ``linear_fc1`` into gate/up, transpose GPT-2's Conv1D).
3. **Consumers.** :func:`iter_hf_tensors` (the stream an inference engine can take as
   ``(name, tensor)`` pairs), :func:`export_hf` (an HF folder), :func:`load_hf_into_megatron`
   and :func:`import_hf` (an HF folder or state dict into a Megatron model).

Collective contract of the export stream: every rank of the world must iterate it to the end,
in the same order (it all-gathers over the TP group and broadcasts over the PP group), and
**every rank yields every full tensor**, so any rank can consume it. Yielded tensors may share
storage with the model's parameters: copy them if you keep them past a parameter update.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aligner.checkpoint import atomic_directory
from aligner.distributed import barrier, is_writer
from aligner.models.config import ConfigError, ModelConfig

__all__ = [
    "ConversionError",
    "SUPPORTED_ARCHITECTURES",
    "ROLES",
    "TensorSpec",
    "HFTensorSource",
    "read_hf_config",
    "hf_architecture",
    "resolve_architecture",
    "architecture_for",
    "model_config_from_hf",
    "hf_config_from_model_config",
    "megatron_tensor_specs",
    "hf_tensor_specs",
    "iter_megatron_tensors",
    "load_megatron_tensors",
    "iter_hf_tensors",
    "export_hf",
    "validate_hf_folder",
    "weight_layout_diff",
    "load_hf_into_megatron",
    "import_hf",
    "build_model",
]


class ConversionError(ValueError):
    """A checkpoint or config cannot be converted; the message names the file/tensor/field."""


# ----------------------------------------------------------------------------------------------
# Architectures
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    name: str
    config_class: str
    causal_lm: str
    seq_cls: str


_FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaConfig", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": _Family("mistral", "MistralConfig", "MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": _Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "gpt2": _Family("gpt2", "GPT2Config", "GPT2LMHeadModel", "GPT2ForSequenceClassification"),
}
_LLAMA_LIKE = ("llama", "mistral", "qwen2")

#: HF architecture name -> (family, HF head: "lm" or "score").
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {}
for _f in _FAMILIES.values():
    SUPPORTED_ARCHITECTURES[_f.causal_lm] = (_f.name, "lm")
    SUPPORTED_ARCHITECTURES[_f.seq_cls] = (_f.name, "score")

#: Our roles -> the head of the Megatron model (``model.aligner_head``).
ROLES: dict[str, str] = {"policy": "lm", "critic": "value", "reward": "reward"}


def resolve_architecture(arch: str) -> tuple[str, str]:
    """``"LlamaForCausalLM"`` -> ``("llama", "lm")``. A bare family name (``"llama"``,
    ``"gpt2"``) means its causal LM."""
    if arch in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[arch]
    if isinstance(arch, str) and arch.lower() in _FAMILIES:
        return arch.lower(), "lm"
    raise ConversionError(
        f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)} "
        f"(or a family name: {sorted(_FAMILIES)})"
    )


def architecture_for(arch: str, head: str) -> str:
    """The HF architecture of ``arch``'s family that holds a model with this head:
    the causal LM for ``"lm"``, the sequence classifier for ``"value"``/``"reward"``."""
    family, _ = resolve_architecture(arch)
    f = _FAMILIES[family]
    if head == "lm":
        return f.causal_lm
    if head in ("value", "reward"):
        return f.seq_cls
    raise ConversionError(f"unknown model head {head!r}; expected 'lm', 'value' or 'reward'")


def _role_head(role: str) -> str:
    if role not in ROLES:
        raise ConversionError(f"role={role!r}: expected one of {sorted(ROLES)}")
    return ROLES[role]


def _config_of(model: torch.nn.Module, cfg: ModelConfig | None) -> ModelConfig:
    if cfg is not None:
        return cfg
    found = getattr(model, "aligner_config", None)
    if not isinstance(found, ModelConfig):
        raise ConversionError("no model config given and the model has no aligner_config")
    return found


def _head_of(model: torch.nn.Module) -> str:
    head = getattr(model, "aligner_head", None)
    if head not in ("lm", "value", "reward"):
        raise ConversionError("the model has no aligner_head; build it with aligner.models.gpt")
    return head


# ----------------------------------------------------------------------------------------------
# HF config <-> ModelConfig
# ----------------------------------------------------------------------------------------------


def _load_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConversionError(f"{what}: {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{what}: {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{what}: {path} holds a {type(data).__name__}, expected a JSON object")
    return data


def _check_folder(folder: str | os.PathLike) -> Path:
    p = Path(folder)
    if not p.exists():
        raise ConversionError(f"HF checkpoint folder {p} does not exist")
    if not p.is_dir():
        raise ConversionError(f"HF checkpoint {p} is not a folder")
    return p


def read_hf_config(src: Any) -> dict:
    """The HF config as a dict, from a folder, a ``config.json`` path, a dict or a
    ``transformers.PretrainedConfig``."""
    if isinstance(src, Mapping):
        return dict(src)
    if hasattr(src, "to_dict") and not isinstance(src, (str, os.PathLike)):
        return src.to_dict()
    p = Path(src)
    if p.is_file() and p.name.endswith(".json"):
        return _load_json(p, "HF config")
    folder = _check_folder(p)
    return _load_json(folder / "config.json", "HF config")


def hf_architecture(src: Any) -> str:
    """The (supported) architecture named by an HF config: ``architectures[0]``, else the
    causal LM of its ``model_type``."""
    d = read_hf_config(src)
    archs = d.get("architectures")
    where = _config_where(src)
    if archs:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConversionError(f"{where}: field 'architectures'={archs!r}: expected a list of names")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConversionError(
                f"{where}: architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        return arch
    mt = d.get("model_type")
    if mt in _FAMILIES:
        return _FAMILIES[mt].causal_lm
    raise ConversionError(
        f"{where}: neither 'architectures' nor a supported 'model_type' (got model_type={mt!r}); "
        f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _config_where(src: Any) -> str:
    if isinstance(src, (str, os.PathLike)):
        p = Path(src)
        return str(p if p.name.endswith(".json") else p / "config.json")
    return "HF config"


def _hf_config_object(d: dict, family: str, where: str):
    import transformers

    cls = getattr(transformers, _FAMILIES[family].config_class)
    clean = {k: v for k, v in d.items() if k not in ("transformers_version",)}
    try:
        return cls(**clean)
    except Exception as e:  # transformers validates some fields itself
        raise ConversionError(f"{where}: {_FAMILIES[family].config_class} rejects it: {e}") from e


def _int_field(c: Any, name: str, where: str) -> int:
    v = getattr(c, name, None)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConversionError(f"{where}: field {name!r}={v!r}: expected a positive integer")
    return v


def model_config_from_hf(src: Any, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` for an HF folder / ``config.json`` / dict / ``PretrainedConfig``.

    ``overrides`` set ModelConfig fields the HF config does not decide (e.g.
    ``make_vocab_size_divisible_by``, dropouts, or a shorter ``max_seq_len`` for rope models).
    For rope models with a sliding window (Mistral), ``max_seq_len`` is capped at the window:
    within it, sliding-window attention is full causal attention, which is what Megatron runs.
    """
    where = _config_where(src)
    d = read_hf_config(src)
    arch = hf_architecture(src)
    family, hf_head = resolve_architecture(arch)
    c = _hf_config_object(d, family, where)
    errors: list[str] = []

    if hf_head == "score":
        n = getattr(c, "num_labels", 1)
        if n != 1:
            errors.append(f"num_labels={n}: a reward model needs exactly one output (num_labels=1)")

    if family == "gpt2":
        L, H = _int_field(c, "n_layer", where), _int_field(c, "n_embd", where)
        heads = _int_field(c, "n_head", where)
        inner = getattr(c, "n_inner", None)
        act_map = {
            "gelu_new": "gelu_tanh",
            "gelu_pytorch_tanh": "gelu_tanh",
            "gelu_fast": "gelu_tanh",
            "gelu": "gelu",
            "relu": "relu",
            "silu": "silu",
            "swish": "silu",
        }
        act = getattr(c, "activation_function", "gelu_new")
        if act not in act_map:
            errors.append(f"activation_function={act!r} is not supported; supported: {sorted(act_map)}")
        if not getattr(c, "scale_attn_weights", True):
            errors.append("scale_attn_weights=False is not supported (Megatron always scales by 1/sqrt(d))")
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            errors.append("scale_attn_by_inverse_layer_idx=True is not supported")
        if getattr(c, "add_cross_attention", False):
            errors.append("add_cross_attention=True is not supported (decoder-only models only)")
        fields: dict[str, Any] = dict(
            num_layers=L,
            hidden_size=H,
            num_attention_heads=heads,
            num_query_groups=None,
            ffn_hidden_size=int(inner) if inner else 4 * H,
            vocab_size=_int_field(c, "vocab_size", where),
            max_seq_len=_int_field(c, "n_positions", where),
            normalization="LayerNorm",
            norm_epsilon=float(getattr(c, "layer_norm_epsilon", 1e-5)),
            activation=act_map.get(act, "gelu_tanh"),
            position_embedding="learned_absolute",
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
            add_bias_linear=True,
            add_qkv_bias=False,
        )
    else:
        L, H = _int_field(c, "num_hidden_layers", where), _int_field(c, "hidden_size", where)
        heads = _int_field(c, "num_attention_heads", where)
        kv = getattr(c, "num_key_value_heads", None) or heads
        act = getattr(c, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            errors.append(f"hidden_act={act!r} is not supported (the Llama family converts with 'silu' only)")
        head_dim = getattr(c, "head_dim", None)
        if head_dim is not None and heads and head_dim * heads != H:
            errors.append(
                f"head_dim={head_dim} differs from hidden_size/num_attention_heads="
                f"{H}/{heads}; ModelConfig has no separate head dimension"
            )
        rp = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if rp and all(isinstance(v, dict) for v in rp.values()):
            errors.append(f"rope_parameters per layer type {sorted(rp)} are not supported")
            rp = {}
        rope_type = rp.get("rope_type") or rp.get("type") or "default"
        if rope_type != "default":
            errors.append(
                f"rope_parameters.rope_type={rope_type!r} (rope scaling) is not supported; "
                "supported: 'default'"
            )
        theta = rp.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
        prf = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            errors.append(f"partial_rotary_factor={prf!r} is not supported (rotary on the full head only)")
        max_pos = _int_field(c, "max_position_embeddings", where)
        window = getattr(c, "sliding_window", None)
        uses_window = window is not None and (
            family == "mistral"
            or getattr(c, "use_sliding_window", False)
            or "sliding_attention" in (getattr(c, "layer_types", None) or [])
        )
        if uses_window and window is not None:
            max_pos = min(max_pos, int(window))
            if overrides.get("max_seq_len", max_pos) > max_pos:
                errors.append(
                    f"max_seq_len={overrides['max_seq_len']} is longer than sliding_window={window}: "
                    "Megatron's local attention has no sliding window"
                )
        attn_bias = bool(getattr(c, "attention_bias", False))
        mlp_bias = bool(getattr(c, "mlp_bias", False))
        add_bias_linear, add_qkv_bias = False, False
        if family == "qwen2":
            add_qkv_bias = True  # Qwen2 always has q/k/v biases and no others
        elif attn_bias or mlp_bias:
            if attn_bias and mlp_bias:
                add_bias_linear = True
            else:
                errors.append(
                    f"attention_bias={attn_bias}, mlp_bias={mlp_bias}: only both or neither "
                    "are supported (Megatron's add_bias_linear covers every linear layer)"
                )
        fields = dict(
            num_layers=L,
            hidden_size=H,
            num_attention_heads=heads,
            num_query_groups=int(kv),
            ffn_hidden_size=_int_field(c, "intermediate_size", where),
            vocab_size=_int_field(c, "vocab_size", where),
            max_seq_len=max_pos,
            normalization="RMSNorm",
            norm_epsilon=float(getattr(c, "rms_norm_eps", 1e-6)),
            activation="swiglu",
            position_embedding="rope",
            rotary_base=float(theta),
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            add_bias_linear=add_bias_linear,
            add_qkv_bias=add_qkv_bias,
        )
    if errors:
        raise ConversionError(f"{where} ({arch}) cannot be converted:\n  " + "\n  ".join(errors))
    if (
        fields["position_embedding"] == "learned_absolute"
        and "max_seq_len" in overrides
        and overrides["max_seq_len"] != fields["max_seq_len"]
    ):
        raise ConversionError(
            f"{where}: max_seq_len={overrides['max_seq_len']} differs from n_positions="
            f"{fields['max_seq_len']}, the size of the learned position table"
        )
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise ConversionError(f"{where} ({arch}) gives an invalid model config: {e}") from e


def _export_problems(cfg: ModelConfig, family: str) -> list[str]:
    e: list[str] = []
    if family == "gpt2":
        if cfg.normalization != "LayerNorm":
            e.append(f"normalization={cfg.normalization!r}: GPT-2 needs 'LayerNorm'")
        if cfg.position_embedding != "learned_absolute":
            e.append(f"position_embedding={cfg.position_embedding!r}: GPT-2 needs 'learned_absolute'")
        if not cfg.add_bias_linear:
            e.append("add_bias_linear=False: GPT-2 has biases on every linear layer")
        if cfg.activation not in ("gelu_tanh", "gelu", "relu", "silu"):
            e.append(f"activation={cfg.activation!r}: GPT-2 has no gated MLP")
        return e
    if cfg.normalization != "RMSNorm":
        e.append(f"normalization={cfg.normalization!r}: the Llama family needs 'RMSNorm'")
    if cfg.position_embedding != "rope":
        e.append(f"position_embedding={cfg.position_embedding!r}: the Llama family needs 'rope'")
    if cfg.activation != "swiglu":
        e.append(f"activation={cfg.activation!r}: the Llama family needs 'swiglu'")
    if family == "qwen2":
        if cfg.add_bias_linear:
            e.append("add_bias_linear=True: Qwen2 has biases on q/k/v only")
        if not cfg.add_qkv_bias:
            e.append("add_qkv_bias=False: Qwen2 always has q/k/v biases")
    elif family == "mistral":
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            e.append("biases: Mistral has no biases")
    elif cfg.add_qkv_bias and not cfg.add_bias_linear:
        e.append(
            "add_qkv_bias=True without add_bias_linear: Llama's attention_bias also biases o_proj; "
            "export as Qwen2ForCausalLM instead"
        )
    return e


_GPT2_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_from_model_config(
    cfg: ModelConfig, arch: str, base: Any = None, dtype: torch.dtype | None = None
):
    """The ``transformers`` config object for ``cfg`` as ``arch``.

    ``base`` (an HF config dict/folder, e.g. the one the model was imported from) supplies
    everything ModelConfig does not decide: token ids, and for rope models its
    ``max_position_embeddings``/``sliding_window`` (which the import may have capped).
    """
    import transformers

    family, hf_head = resolve_architecture(arch)
    arch = architecture_for(arch, "lm" if hf_head == "lm" else "reward")
    problems = _export_problems(cfg, family)
    if problems:
        raise ConversionError(f"cannot export this model as {arch}:\n  " + "\n  ".join(problems))
    base_d = read_hf_config(base) if base is not None else {}
    same_family = False
    if base_d:
        try:
            same_family = resolve_architecture(hf_architecture(base_d))[0] == family
        except ConversionError:
            same_family = False
    kw: dict[str, Any] = {}
    if same_family:
        drop = {
            "architectures",
            "transformers_version",
            "_name_or_path",
            "id2label",
            "label2id",
            "num_labels",
            "torch_dtype",
            "dtype",
            "rope_scaling",
        }
        kw.update({k: v for k, v in base_d.items() if k not in drop})
    else:
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in base_d:
                kw[k] = base_d[k]
    if family == "gpt2":
        kw.update(
            n_layer=cfg.num_layers,
            n_embd=cfg.hidden_size,
            n_head=cfg.num_attention_heads,
            n_inner=cfg.ffn_size,
            n_positions=cfg.max_seq_len,
            vocab_size=cfg.vocab_size,
            layer_norm_epsilon=cfg.norm_epsilon,
            activation_function=_GPT2_ACT[cfg.activation],
            tie_word_embeddings=cfg.tie_embeddings,
        )
    else:
        keep_window = (
            same_family
            and isinstance(base_d.get("max_position_embeddings"), int)
            and base_d["max_position_embeddings"] >= cfg.max_seq_len
        )
        kw.update(
            num_hidden_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.kv_heads,
            intermediate_size=cfg.ffn_size,
            vocab_size=cfg.vocab_size,
            hidden_act="silu",
            rms_norm_eps=cfg.norm_epsilon,
            tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        )
        kw.pop("rope_theta", None)
        if not keep_window:
            kw["max_position_embeddings"] = cfg.max_seq_len
            if family == "mistral":
                kw["sliding_window"] = None
            if family == "qwen2":
                kw.update(use_sliding_window=False, sliding_window=None)
                kw.pop("layer_types", None)
        if family in ("llama", "mistral"):
            kw["head_dim"] = cfg.head_dim
        if family == "llama":
            kw.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    kw["architectures"] = [arch]
    if hf_head == "score":
        kw["num_labels"] = 1
    if dtype is not None:
        kw["dtype"] = _dtype_name(dtype)
    cls = getattr(transformers, _FAMILIES[family].config_class)
    return cls(**kw)


# ----------------------------------------------------------------------------------------------
# Canonical Megatron tensors and their TP/PP layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the full (TP=1, PP=1, un-padded vocab) Megatron model."""

    name: str
    """Megatron's name with the global layer number."""
    shape: tuple[int, ...]
    split: str
    """How TP shards it: 'replicated', 'column' (rows), 'row' (columns), 'glu' ([gate; up]
    rows, each half sharded) or 'vocab' (rows, padded to the padded vocabulary)."""
    place: str
    """'first' (first PP stage), 'last' (last PP stage) or 'layer'."""
    layer: int | None = None


def megatron_tensor_specs(cfg: ModelConfig, head: str = "lm") -> list[TensorSpec]:
    """Every tensor of the model in a fixed order (the same on every rank)."""
    if head not in ("lm", "value", "reward"):
        raise ConversionError(f"unknown model head {head!r}; expected 'lm', 'value' or 'reward'")
    H, V, F = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    heads, kv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv_rows = (heads + 2 * kv) * d
    norms = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    bias = cfg.add_bias_linear
    qkv_bias = cfg.add_qkv_bias or cfg.add_bias_linear
    glu = cfg.activation == "swiglu"
    out = [TensorSpec("embedding.word_embeddings.weight", (V, H), "vocab", "first")]
    if cfg.position_embedding == "learned_absolute":
        out.append(
            TensorSpec("embedding.position_embeddings.weight", (cfg.max_seq_len, H), "replicated", "first")
        )
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."

        def add(suffix: str, shape: tuple[int, ...], split: str, p: str = p, i: int = i) -> None:
            out.append(TensorSpec(p + suffix, shape, split, "layer", i))

        for s in norms:
            add(f"input_layernorm.{s}", (H,), "replicated")
        add("self_attention.linear_qkv.weight", (qkv_rows, H), "column")
        if qkv_bias:
            add("self_attention.linear_qkv.bias", (qkv_rows,), "column")
        add("self_attention.linear_proj.weight", (H, heads * d), "row")
        if bias:
            add("self_attention.linear_proj.bias", (H,), "replicated")
        for s in norms:
            add(f"pre_mlp_layernorm.{s}", (H,), "replicated")
        add("mlp.linear_fc1.weight", ((2 if glu else 1) * F, H), "glu" if glu else "column")
        if bias:
            add("mlp.linear_fc1.bias", ((2 if glu else 1) * F,), "glu" if glu else "column")
        add("mlp.linear_fc2.weight", (H, F), "row")
        if bias:
            add("mlp.linear_fc2.bias", (H,), "replicated")
    for s in norms:
        out.append(TensorSpec(f"decoder.final_layernorm.{s}", (H,), "replicated", "last"))
    if head == "lm":
        if not cfg.tie_embeddings:
            out.append(TensorSpec("output_layer.weight", (V, H), "vocab", "last"))
    else:
        out.append(TensorSpec("output_layer.weight", (1, H), "replicated", "last"))
        out.append(TensorSpec("output_layer.bias", (1,), "replicated", "last"))
    return out


@dataclass(frozen=True)
class _Layout:
    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    pp: int = 1
    pp_rank: int = 0
    pp_group: Any = None

    @classmethod
    def current(cls) -> _Layout:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=mpu.get_tensor_model_parallel_world_size(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_group=mpu.get_tensor_model_parallel_group(),
            pp=mpu.get_pipeline_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_group=mpu.get_pipeline_model_parallel_group(),
        )

    def owner(self, spec: TensorSpec, cfg: ModelConfig) -> int:
        if spec.place == "first":
            return 0
        if spec.place == "last":
            return self.pp - 1
        assert spec.layer is not None
        return spec.layer // (cfg.num_layers // self.pp)

    def local_name(self, spec: TensorSpec, cfg: ModelConfig) -> str:
        if spec.layer is None:
            return spec.name
        offset = self.owner(spec, cfg) * (cfg.num_layers // self.pp)
        prefix = f"decoder.layers.{spec.layer}."
        return f"decoder.layers.{spec.layer - offset}." + spec.name[len(prefix) :]

    def targets(self, cfg: ModelConfig, head: str) -> list[tuple[TensorSpec, str]]:
        """(spec, local name) of every tensor this rank holds."""
        out = [
            (s, self.local_name(s, cfg))
            for s in megatron_tensor_specs(cfg, head)
            if self.owner(s, cfg) == self.pp_rank
        ]
        if head == "lm" and cfg.tie_embeddings and self.pp > 1 and self.pp_rank == self.pp - 1:
            # The last stage keeps its own copy of the tied embedding as the LM head.
            emb = megatron_tensor_specs(cfg, head)[0]
            out.append((emb, "output_layer.weight"))
        return out

    def shard_shape(self, spec: TensorSpec, cfg: ModelConfig) -> tuple[int, ...]:
        s, tp = list(spec.shape), self.tp
        if spec.split == "vocab":
            s[0] = cfg.padded_vocab_size(tp) // tp
        elif spec.split in ("column", "glu"):
            s[0] //= tp
        elif spec.split == "row":
            s[1] //= tp
        return tuple(s)


def _shard(full: torch.Tensor, spec: TensorSpec, cfg: ModelConfig, lay: _Layout) -> torch.Tensor:
    tp, r = lay.tp, lay.tp_rank
    if spec.split == "vocab":
        padded = cfg.padded_vocab_size(tp)
        if padded > full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return full.chunk(tp, 0)[r]
    if spec.split == "column":
        return full.chunk(tp, 0)[r]
    if spec.split == "row":
        return full.chunk(tp, 1)[r]
    if spec.split == "glu":
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])
    return full


def _gather(shard: torch.Tensor, spec: TensorSpec, cfg: ModelConfig, lay: _Layout) -> torch.Tensor:
    shard = shard.detach()
    if lay.tp > 1 and spec.split != "replicated":
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(lay.tp)]
        dist.all_gather(parts, shard, group=lay.tp_group)
        if spec.split in ("column", "vocab"):
            full = torch.cat(parts, 0)
        elif spec.split == "row":
            full = torch.cat(parts, 1)
        else:  # glu: each rank holds [gate_shard; up_shard]
            halves = [p.chunk(2, 0) for p in parts]
            full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    else:
        full = shard
    if spec.split == "vocab":
        full = full[: cfg.vocab_size]
    return full


def _check_local_model(model: torch.nn.Module, cfg: ModelConfig, head: str, lay: _Layout) -> dict:
    from aligner.models.gpt import shape_mismatches, tensor_state_dict

    cfg.check_parallel(lay.tp, lay.pp)
    local = tensor_state_dict(model)
    expected = {name: lay.shard_shape(spec, cfg) for spec, name in lay.targets(cfg, head)}
    problems = shape_mismatches(expected, {k: tuple(v.shape) for k, v in local.items()})
    if problems:
        raise ConversionError(
            f"the model on this rank (TP {lay.tp_rank}/{lay.tp}, PP {lay.pp_rank}/{lay.pp}) does not match "
            f"its model config: " + ", ".join(problems)
        )
    return local


def iter_megatron_tensors(
    model: torch.nn.Module, cfg: ModelConfig | None = None, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's full canonical tensors (see :func:`megatron_tensor_specs`).

    Collective: every rank must iterate to the end. Each tensor is all-gathered over the TP
    group of the stage that holds it and broadcast from that stage over the PP group, so every
    rank yields every tensor. ``dtype`` casts (default: the model's parameter dtype).
    """
    from aligner.models.gpt import unwrap

    m = unwrap(model)
    cfg = _config_of(m, cfg)
    head = _head_of(m)
    lay = _Layout.current()
    local = _check_local_model(m, cfg, head, lay)
    mine = {s.name: n for s, n in lay.targets(cfg, head) if lay.owner(s, cfg) == lay.pp_rank}
    some = next(iter(local.values()))
    wire, device = dtype or some.dtype, some.device
    for spec in megatron_tensor_specs(cfg, head):
        owner = lay.owner(spec, cfg)
        if owner == lay.pp_rank:
            full = _gather(local[mine[spec.name]], spec, cfg, lay).to(wire)
        else:
            full = torch.empty(spec.shape, dtype=wire, device=device)
        if lay.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, group=lay.pp_group, group_src=owner)
        yield spec.name, full


def load_megatron_tensors(
    model: torch.nn.Module,
    cfg: ModelConfig | None,
    get: Callable[[str], torch.Tensor],
    *,
    skip: frozenset | set = frozenset(),
) -> None:
    """Load full canonical tensors (``get(name)``) as this rank's shards of ``model``.

    Only the tensors of this rank's PP stage are requested. Names in ``skip`` keep their current
    values (e.g. a fresh scalar head); replicated ones are made equal across the TP group.
    """
    from aligner.models.gpt import unwrap

    m = unwrap(model)
    cfg = _config_of(m, cfg)
    head = _head_of(m)
    lay = _Layout.current()
    local = _check_local_model(m, cfg, head, lay)
    with torch.no_grad():
        for spec, name in lay.targets(cfg, head):
            target = local[name]
            if spec.name in skip:
                if lay.tp > 1:
                    src = dist.get_global_rank(lay.tp_group, 0)
                    buf = target.detach().contiguous().clone()
                    dist.broadcast(buf, src=src, group=lay.tp_group)
                    target.copy_(buf)
                continue
            full = get(spec.name)
            if tuple(full.shape) != spec.shape:
                raise ConversionError(
                    f"tensor {spec.name}: expected shape {spec.shape}, got {tuple(full.shape)}"
                )
            target.copy_(_shard(full, spec, cfg, lay))


# ----------------------------------------------------------------------------------------------
# HF names
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    from_hf: Callable[[list[torch.Tensor]], torch.Tensor]


def _qkv_fuse(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = cfg.kv_heads, cfg.head_dim
    r = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    x = torch.cat([q.reshape(g, r, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return x.reshape(g * (r + 2) * d, *rest)


def _qkv_split(cfg: ModelConfig, w: torch.Tensor) -> list[torch.Tensor]:
    g, d = cfg.kv_heads, cfg.head_dim
    r = cfg.num_attention_heads // g
    rest = tuple(w.shape[1:])
    x = w.reshape(g, r + 2, d, *rest)
    return [
        x[:, :r].reshape(g * r * d, *rest),
        x[:, r].reshape(g * d, *rest).contiguous(),
        x[:, r + 1].reshape(g * d, *rest).contiguous(),
    ]


def _ident(hf: str, shape: tuple[int, ...]) -> _Rule:
    return _Rule((hf,), (shape,), lambda t: [t], lambda ts: ts[0])


def _transposed(hf: str, hf_shape: tuple[int, ...]) -> _Rule:
    """GPT-2's Conv1D stores [in, out]; Megatron's linear [out, in]."""
    return _Rule((hf,), (hf_shape,), lambda t: [t.t().contiguous()], lambda ts: ts[0].t().contiguous())


def _zero_bias_rule(name: str) -> _Rule:
    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        if torch.count_nonzero(t).item():
            raise ConversionError(
                f"{name}={t.float().tolist()} is not zero, and the HF sequence-classification head "
                "(score) has no bias; export would change every score by this constant"
            )
        return []

    return _Rule((), (), to_hf, lambda ts: torch.zeros(1))


def _rules(cfg: ModelConfig, family: str, head: str, hf_head: str) -> dict[str, _Rule | None]:
    """Canonical name -> how it is stored in HF (None: HF does not hold it, keep the model's)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    heads, kv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv_shapes = ((heads * d, H), (kv * d, H), (kv * d, H))
    gpt2 = family == "gpt2"
    pre = "transformer." if gpt2 else "model."
    rules: dict[str, _Rule | None] = {}
    for spec in megatron_tensor_specs(cfg, head):
        n = spec.name
        if spec.layer is not None:
            suffix = n[len(f"decoder.layers.{spec.layer}.") :]
            p = f"{pre}h.{spec.layer}." if gpt2 else f"{pre}layers.{spec.layer}."
            rules[n] = (
                _gpt2_layer_rule(cfg, p, suffix) if gpt2 else _llama_layer_rule(cfg, p, suffix, qkv_shapes)
            )
        elif n == "embedding.word_embeddings.weight":
            rules[n] = _ident(pre + ("wte.weight" if gpt2 else "embed_tokens.weight"), (V, H))
        elif n == "embedding.position_embeddings.weight":
            rules[n] = _ident(pre + "wpe.weight", (cfg.max_seq_len, H))
        elif n.startswith("decoder.final_layernorm."):
            rules[n] = _ident(pre + ("ln_f." if gpt2 else "norm.") + n.rsplit(".", 1)[1], (H,))
        elif n == "output_layer.weight":
            if head == "lm":
                rules[n] = _ident("lm_head.weight", (V, H))
            else:
                rules[n] = _ident("score.weight", (1, H)) if hf_head == "score" else None
        elif n == "output_layer.bias":
            rules[n] = _zero_bias_rule(n) if hf_head == "score" else None
        else:  # pragma: no cover - every spec name is handled above
            raise AssertionError(n)
    return rules


def _llama_layer_rule(cfg: ModelConfig, p: str, suffix: str, qkv_shapes) -> _Rule:
    H, F = cfg.hidden_size, cfg.ffn_size
    a, m = p + "self_attn.", p + "mlp."
    if suffix in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        hf = "input_layernorm.weight" if suffix.startswith("input") else "post_attention_layernorm.weight"
        return _ident(p + hf, (H,))
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        shapes = qkv_shapes if kind == "weight" else tuple(s[:1] for s in qkv_shapes)
        return _Rule(
            tuple(f"{a}{x}_proj.{kind}" for x in "qkv"),
            shapes,
            lambda t: _qkv_split(cfg, t),
            lambda ts: _qkv_fuse(cfg, *ts),
        )
    if suffix == "self_attention.linear_proj.weight":
        return _ident(a + "o_proj.weight", (H, cfg.num_attention_heads * cfg.head_dim))
    if suffix == "self_attention.linear_proj.bias":
        return _ident(a + "o_proj.bias", (H,))
    if suffix.startswith("mlp.linear_fc1."):
        kind = suffix.rsplit(".", 1)[1]
        shape = (F, H) if kind == "weight" else (F,)
        return _Rule(
            (f"{m}gate_proj.{kind}", f"{m}up_proj.{kind}"),
            (shape, shape),
            lambda t: [x.contiguous() for x in t.chunk(2, 0)],
            lambda ts: torch.cat(ts, 0),
        )
    if suffix == "mlp.linear_fc2.weight":
        return _ident(m + "down_proj.weight", (H, F))
    if suffix == "mlp.linear_fc2.bias":
        return _ident(m + "down_proj.bias", (H,))
    raise ConversionError(f"no Llama-family name for decoder layer tensor {suffix!r}")


def _gpt2_layer_rule(cfg: ModelConfig, p: str, suffix: str) -> _Rule:
    H, F = cfg.hidden_size, cfg.ffn_size
    if suffix.startswith(("input_layernorm.", "pre_mlp_layernorm.")):
        ln = "ln_1." if suffix.startswith("input") else "ln_2."
        return _ident(p + ln + suffix.rsplit(".", 1)[1], (H,))
    if suffix == "self_attention.linear_qkv.weight":
        # c_attn: Conv1D [H, 3H] = [q | k | v] along the output dim.
        return _Rule(
            (p + "attn.c_attn.weight",),
            ((H, 3 * H),),
            lambda t: [torch.cat(_qkv_split(cfg, t), 0).t().contiguous()],
            lambda ts: _qkv_fuse(cfg, *ts[0].t().chunk(3, 0)),
        )
    if suffix == "self_attention.linear_qkv.bias":
        return _Rule(
            (p + "attn.c_attn.bias",),
            ((3 * H,),),
            lambda t: [torch.cat(_qkv_split(cfg, t), 0)],
            lambda ts: _qkv_fuse(cfg, *ts[0].chunk(3, 0)),
        )
    if suffix == "self_attention.linear_proj.weight":
        return _transposed(p + "attn.c_proj.weight", (H, H))
    if suffix == "self_attention.linear_proj.bias":
        return _ident(p + "attn.c_proj.bias", (H,))
    if suffix == "mlp.linear_fc1.weight":
        return _transposed(p + "mlp.c_fc.weight", (H, F))
    if suffix == "mlp.linear_fc1.bias":
        return _ident(p + "mlp.c_fc.bias", (F,))
    if suffix == "mlp.linear_fc2.weight":
        return _transposed(p + "mlp.c_proj.weight", (F, H))
    if suffix == "mlp.linear_fc2.bias":
        return _ident(p + "mlp.c_proj.bias", (H,))
    raise ConversionError(f"no GPT-2 name for decoder layer tensor {suffix!r}")


def hf_tensor_specs(
    cfg: ModelConfig, arch: str, head: str | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor an HF checkpoint of ``arch`` holds for ``cfg``, in
    export order. ``head`` defaults to the one ``arch`` holds."""
    family, hf_head = resolve_architecture(arch)
    head = head or ("lm" if hf_head == "lm" else "reward")
    out: list[tuple[str, tuple[int, ...]]] = []
    for rule in _rules(cfg, family, head, hf_head).values():
        if rule is not None:
            out.extend(zip(rule.hf_names, rule.hf_shapes))
    return out


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def _export_arch(arch: str, head: str) -> tuple[str, str, str]:
    family, _ = resolve_architecture(arch)
    full = architecture_for(arch, head)
    return full, family, SUPPORTED_ARCHITECTURES[full][1]


def iter_hf_tensors(
    model: torch.nn.Module, cfg: ModelConfig | None, arch: str, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(HF name, full tensor)`` pairs of ``model`` as ``arch`` (a family or an
    architecture name; a critic/reward model becomes the family's sequence classifier).

    Collective like :func:`iter_megatron_tensors`: every rank iterates to the end and every rank
    yields every tensor. Export-time problems (a config HF cannot express) are raised before
    any communication, identically on every rank.
    """
    from aligner.models.gpt import unwrap

    m = unwrap(model)
    cfg = _config_of(m, cfg)
    head = _head_of(m)
    full_arch, family, hf_head = _export_arch(arch, head)
    problems = _export_problems(cfg, family)
    if problems:
        raise ConversionError(f"cannot export this model as {full_arch}:\n  " + "\n  ".join(problems))
    rules = _rules(cfg, family, head, hf_head)
    for name, tensor in iter_megatron_tensors(m, cfg, dtype=dtype):
        rule = rules[name]
        if rule is None:
            continue
        parts = rule.to_hf(tensor)
        for hf_name, shape, t in zip(rule.hf_names, rule.hf_shapes, parts):
            if tuple(t.shape) != shape:  # pragma: no cover - a bug in a rule
                raise AssertionError(f"{hf_name}: produced {tuple(t.shape)}, expected {shape}")
            yield hf_name, t


_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, knowing every name/shape/dtype in advance
    (the header comes first in the format). Tensors must arrive in the declared order."""

    def __init__(
        self,
        path: str | os.PathLike,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._entries = list(entries)
        self._next = 0
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, shape, dtype in self._entries:
            if dtype not in _ST_DTYPES:
                raise ConversionError(f"safetensors cannot hold dtype {dtype} ({name})")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.path, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._entries):
            raise ConversionError(f"{self.path}: unexpected extra tensor {name}")
        exp_name, shape, dtype = self._entries[self._next]
        if name != exp_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ConversionError(
                f"{self.path}: expected tensor {exp_name} {tuple(shape)} {dtype} next, got "
                f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            self._fh.write(t.view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self._next != len(self._entries):
            missing = [e[0] for e in self._entries[self._next :]]
            raise ConversionError(f"{self.path}: {len(missing)} tensors were never written: {missing[:5]}")

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"output folder {out_dir} exists and is not empty (pass overwrite=True to replace it)"
        )


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder next to ``out_dir``; on success it replaces ``out_dir``, on
    failure it is removed (:func:`aligner.checkpoint.atomic_directory`, with no completion
    marker). Call on the writing rank only."""
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    with atomic_directory(out_dir, mark_complete=False) as tmp:
        yield tmp


def write_tensor_stream(
    stream: Iterator[tuple[str, torch.Tensor]],
    path: Path | None,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Drain ``stream`` (on every rank: it is collective) and write it to ``path`` where given."""
    writer = StreamingSafetensorsWriter(path, entries, metadata) if path is not None else None
    try:
        for name, t in stream:
            if writer is not None:
                writer.write(name, t)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _copy_tokenizer(tokenizer_dir: str | os.PathLike, dst: Path) -> None:
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise ConversionError(f"tokenizer folder {src} does not exist")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ConversionError(f"dtype={dtype!r}: expected one of {sorted(names)}")
    return names[dtype]


def export_hf(
    model: torch.nn.Module,
    cfg: ModelConfig | None,
    out_dir: str | os.PathLike,
    arch: str,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    hf_config: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as an HF folder (``config.json`` + ``model.safetensors``, tokenizer files
    copied from ``tokenizer_dir``). Collective: call on every rank; global rank 0 writes, into a
    temporary folder renamed into place. ``hf_config``: the HF config the model came from, to
    keep its token ids etc. Returns ``out_dir``."""
    from aligner.models.gpt import unwrap

    m = unwrap(model)
    cfg = _config_of(m, cfg)
    head = _head_of(m)
    dtype = _as_dtype(dtype)
    full_arch, family, hf_head = _export_arch(arch, head)
    out_dir = Path(out_dir)
    wire = dtype or next(iter(m.parameters())).dtype
    hf_conf = hf_config_from_model_config(
        cfg, full_arch, base=hf_config, dtype=wire
    )  # raises before any comm.
    _check_out_dir(out_dir, overwrite)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConversionError(f"tokenizer folder {tokenizer_dir} does not exist")
    entries = [(n, s, wire) for n, s in hf_tensor_specs(cfg, full_arch, head)]
    stream = iter_hf_tensors(m, cfg, full_arch, dtype=wire)
    if is_writer():
        with atomic_output_dir(out_dir, overwrite) as tmp:
            write_tensor_stream(stream, tmp / "model.safetensors", entries, {"format": "pt"})
            hf_conf.save_pretrained(tmp)
            if tokenizer_dir is not None:
                _copy_tokenizer(tokenizer_dir, tmp)
    else:
        write_tensor_stream(stream, None, entries)
    barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------


class HFTensorSource:
    """HF tensors by name, read one at a time: from a folder (``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards) or from an in-memory state dict.

    GPT-2 checkpoints saved without the ``transformer.`` prefix are accepted.
    """

    def __init__(self, src: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._state: dict[str, torch.Tensor] | None
        self.folder: Path | None
        if isinstance(src, Mapping):
            self.folder = None
            self._state = {k: v for k, v in src.items() if isinstance(v, torch.Tensor)}
            self._where = dict.fromkeys(self._state, "the given state dict")
            return
        self._state = None
        folder = _check_folder(src)
        self.folder = folder
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if index.is_file():
            idx = _load_json(index, "safetensors index")
            wm = idx.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise ConversionError(f"{index}: no 'weight_map' of tensor names to files")
            files = sorted(set(wm.values()))
            absent = [f for f in files if not (folder / f).is_file()]
            if absent:
                raise ConversionError(f"{index} names files that do not exist: {absent[:5]}")
            self._where = {k: str(folder / v) for k, v in wm.items()}
        elif single.is_file():
            self._where = {k: str(single) for k in self._open(str(single)).keys()}
        else:
            others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt")
            )
            hint = f" (found {others[:3]}: only safetensors are read, never pickles)" if others else ""
            raise ConversionError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")

    def _open(self, path: str):
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:
                raise ConversionError(f"{path}: cannot be read as safetensors: {e}") from e
        return self._handles[path]

    def resolve(self, name: str) -> str | None:
        if name in self._where:
            return name
        for prefix in ("transformer.",):
            if name.startswith(prefix) and name[len(prefix) :] in self._where:
                return name[len(prefix) :]
        return None

    def where(self, name: str) -> str:
        key = self.resolve(name)
        return self._where[key] if key else (str(self.folder) if self.folder else "the given state dict")

    def shape(self, name: str) -> tuple[int, ...]:
        key = self.resolve(name)
        if key is None:
            raise KeyError(name)
        if self._state is not None:
            return tuple(self._state[key].shape)
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def get(self, name: str) -> torch.Tensor:
        key = self.resolve(name)
        if key is None:
            raise ConversionError(f"tensor {name} is not in {self.folder or 'the given state dict'}")
        if self._state is not None:
            return self._state[key]
        return self._open(self._where[key]).get_tensor(key)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFTensorSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _validate_source(src: HFTensorSource, rules: dict[str, _Rule | None], arch: str) -> None:
    problems = []
    for rule in rules.values():
        if rule is None:
            continue
        for name, shape in zip(rule.hf_names, rule.hf_shapes):
            if src.resolve(name) is None:
                problems.append(f"missing tensor {name} (expected shape {shape})")
                continue
            got = src.shape(name)
            if got != tuple(shape):
                problems.append(
                    f"tensor {name} in {src.where(name)}: expected shape {tuple(shape)}, got {got}"
                )
    if problems:
        where = src.folder or "the given state dict"
        raise ConversionError(
            f"{where} does not hold a {arch} of the expected shape:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )


def validate_hf_folder(
    folder: str | os.PathLike,
    role: str = "policy",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **overrides: Any,
) -> tuple[ModelConfig, str]:
    """Check an HF folder before any work: config.json, the architecture, the TP/PP layout,
    and every tensor's presence and shape. Returns ``(cfg, architecture)``."""
    folder = _check_folder(folder)
    arch = hf_architecture(folder)
    cfg = model_config_from_hf(folder, **overrides)
    head = _role_head(role)
    _check_role(arch, head, folder)
    try:
        cfg.check_parallel(tensor_parallel_size, pipeline_parallel_size)
    except ConfigError as e:
        raise ConversionError(f"{folder / 'config.json'}: {e}") from e
    family, hf_head = resolve_architecture(arch)
    with HFTensorSource(folder) as src:
        _validate_source(src, _rules(cfg, family, head, hf_head), arch)
    return cfg, arch


def weight_layout_diff(given: ModelConfig, other: ModelConfig, head: str) -> list[str]:
    """``given.architecture_diff(other)`` less what does not change a ``head`` model's tensors:
    ``tie_embeddings`` for scalar heads, ``max_seq_len`` for rope models."""
    diff = given.architecture_diff(other)
    if head != "lm":
        diff = [x for x in diff if not x.startswith("tie_embeddings:")]
    if given.position_embedding == "rope" and other.position_embedding == "rope":
        diff = [x for x in diff if not x.startswith("max_seq_len:")]
    return diff


def _check_role(arch: str, head: str, where: Any) -> None:
    _, hf_head = resolve_architecture(arch)
    if head == "lm" and hf_head == "score":
        raise ConversionError(
            f"{where}: {arch} has a sequence-classification head, not an LM head; "
            "it can be imported as a reward model or critic, not as a policy"
        )


def load_hf_into_megatron(
    model: torch.nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    cfg: ModelConfig | None = None,
    arch: str | None = None,
) -> None:
    """Load full HF tensors (a folder, or a state dict with ``arch`` given) into this rank's
    TP shard and PP stage of ``model``. Validates everything first (one error naming the
    file/tensor/field, expected vs got).

    A critic/reward model loaded from a causal LM keeps its fresh scalar head; from a
    sequence classifier it takes ``score.weight`` (bias 0).
    """
    from aligner.models.gpt import unwrap

    m = unwrap(model)
    cfg = _config_of(m, cfg)
    head = _head_of(m)
    lay = _Layout.current()
    try:
        cfg.check_parallel(lay.tp, lay.pp)
    except ConfigError as e:
        raise ConversionError(str(e)) from e
    if isinstance(source, Mapping):
        if arch is None:
            raise ConversionError("loading from a state dict needs arch (e.g. 'LlamaForCausalLM')")
    else:
        folder = _check_folder(source)
        file_arch = hf_architecture(folder)
        if arch is None:
            arch = file_arch
        elif resolve_architecture(arch)[0] != resolve_architecture(file_arch)[0]:
            raise ConversionError(
                f"{folder / 'config.json'}: architecture {file_arch!r} is not the family of "
                f"the requested {arch!r}"
            )
        else:
            arch = file_arch
        diff = weight_layout_diff(cfg, model_config_from_hf(folder), head)
        if diff:
            raise ConversionError(
                f"{folder / 'config.json'} does not describe the given model config "
                f"(given != file): " + "; ".join(diff)
            )
    family, hf_head = resolve_architecture(arch)
    _check_role(arch, head, source if not isinstance(source, Mapping) else "state dict")
    rules = _rules(cfg, family, head, hf_head)
    _check_local_model(m, cfg, head, lay)
    with HFTensorSource(source) as src:
        _validate_source(src, rules, arch)

        def get(name: str) -> torch.Tensor:
            rule = rules[name]
            assert rule is not None
            return rule.from_hf([src.get(n) for n in rule.hf_names])

        load_megatron_tensors(m, cfg, get, skip={n for n, r in rules.items() if r is None})


def build_model(cfg: ModelConfig, role: str = "policy", params_dtype: torch.dtype = torch.float32):
    """Build the Megatron model of ``role`` for ``cfg`` on the current TP/PP layout."""
    from aligner.models import gpt

    builder = {"policy": gpt.build_policy, "critic": gpt.build_critic, "reward": gpt.build_reward_model}
    _role_head(role)
    return builder[role](cfg, params_dtype=params_dtype)


def import_hf(
    folder: str | os.PathLike,
    role: str = "policy",
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> tuple[torch.nn.Module, ModelConfig]:
    """Build our ``role`` model from an HF folder on the current TP/PP layout (call after
    :func:`aligner.distributed.initialize` on every rank). ``overrides``: ModelConfig fields
    such as ``make_vocab_size_divisible_by``. Returns ``(model, cfg)``."""
    lay = _Layout.current()
    cfg, arch = validate_hf_folder(folder, role, lay.tp, lay.pp, **overrides)
    model = build_model(cfg, role, params_dtype)
    load_hf_into_megatron(model, folder, cfg, arch)
    return model, cfg
