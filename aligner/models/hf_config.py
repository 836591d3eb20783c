"""Hugging Face architectures and configs, and how they map onto our :class:`ModelConfig`.

Supported: the Llama family (Llama 2/3.x with or without llama3 RoPE scaling, Mistral,
Qwen2/Qwen2.5, Qwen3 with its per-head q/k norms; any of them with a head width of its own)
and GPT-2, each as a causal LM (our policy) or a sequence classifier (our critic or reward
model). :func:`resolve_architecture` and :func:`architecture_for` name them;
:func:`model_config_from_hf` reads an HF config into a :class:`ModelConfig`, rejecting (with
every reason at once) what Megatron cannot run as HF does; :func:`hf_config_from_model_config`
writes one back, keeping what ModelConfig does not decide (token ids, a sliding window) from
the config the model came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aligner.config_checks import ConfigError
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.model_files import read_json_object

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "resolve_architecture",
    "architecture_for",
    "default_architecture",
    "check_hf_folder",
    "read_hf_config",
    "hf_architecture",
    "model_config_from_hf",
    "export_problems",
    "hf_config_from_model_config",
]


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
    "qwen3": _Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "gpt2": _Family("gpt2", "GPT2Config", "GPT2LMHeadModel", "GPT2ForSequenceClassification"),
}

#: HF architecture name -> (family, HF head: "lm" or "score").
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {}
for _f in _FAMILIES.values():
    SUPPORTED_ARCHITECTURES[_f.causal_lm] = (_f.name, "lm")
    SUPPORTED_ARCHITECTURES[_f.seq_cls] = (_f.name, "score")


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


def default_architecture(cfg: ModelConfig) -> str:
    """The HF causal LM a model of ``cfg`` is written as when no architecture is named: GPT-2
    for learned positions, Qwen3 for q/k norms, Qwen2 for q/k/v biases alone, else Llama."""
    if cfg.position_embedding == "learned_absolute":
        return _FAMILIES["gpt2"].causal_lm
    if cfg.qk_layernorm:
        return _FAMILIES["qwen3"].causal_lm
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return _FAMILIES["qwen2"].causal_lm
    return _FAMILIES["llama"].causal_lm


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


# ----------------------------------------------------------------------------------------------
# HF config <-> ModelConfig
# ----------------------------------------------------------------------------------------------


def check_hf_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a Path, after checking it is an existing folder."""
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
        return read_json_object(p, "HF config")
    folder = check_hf_folder(p)
    return read_json_object(folder / "config.json", "HF config")


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
            moe = " (mixture-of-experts models are not supported)" if "moe" in arch.lower() else ""
            raise ConversionError(
                f"{where}: architecture {arch!r} is not supported{moe}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
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


#: HF ``rope_parameters`` keys of a llama3 scaling -> ModelConfig fields.
_LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position",
}


def _rope_fields(c: Any, d: dict, max_pos: int, errors: list[str]) -> dict[str, Any]:
    """ModelConfig's RoPE fields from an HF config's ``rope_parameters`` (transformers 5.x) or
    ``rope_scaling`` (older configs), with every unsupported setting appended to ``errors``:
    rope types other than 'default' and 'llama3', partial rotary, per-layer-type RoPE."""
    rp = (
        getattr(c, "rope_parameters", None)
        or getattr(c, "rope_scaling", None)
        or d.get("rope_parameters")
        or d.get("rope_scaling")
        or {}
    )
    if not isinstance(rp, Mapping):
        errors.append(f"rope_parameters={rp!r}: expected a mapping")
        rp = {}
    per_layer = sorted(k for k, v in rp.items() if isinstance(v, Mapping))
    if per_layer:
        errors.append(
            f"rope_parameters per layer type {per_layer} are not supported (one RoPE for every layer only)"
        )
        rp = {}
    theta = rp.get("rope_theta") or getattr(c, "rope_theta", None) or d.get("rope_theta") or 10000.0
    out: dict[str, Any] = {"rotary_base": float(theta)}
    prf = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        errors.append(f"partial_rotary_factor={prf!r} is not supported (rotary on the full head only)")
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type == "llama3":
        out["rope_scaling"] = "llama3"
        for key, field in _LLAMA3_KEYS.items():
            v = rp.get(key)
            if v is None and key == "original_max_position_embeddings":
                v = max_pos  # as transformers does
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                errors.append(f"rope_parameters.{key}={v!r}: expected a number (rope_type 'llama3' needs it)")
            elif field == "rope_original_max_position" and v != int(v):
                errors.append(f"rope_parameters.{key}={v!r}: expected an integer")
            else:  # ModelConfig checks the ranges, naming its own field
                out[field] = int(v) if field == "rope_original_max_position" else float(v)
    elif rope_type != "default":
        errors.append(
            f"rope_parameters.rope_type={rope_type!r} (rope scaling) is not supported; "
            "supported: 'default', 'llama3'"
        )
    return out


def model_config_from_hf(src: Any, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` for an HF folder / ``config.json`` / dict / ``PretrainedConfig``.

    ``overrides`` set ModelConfig fields the HF config does not decide (e.g.
    ``make_vocab_size_divisible_by``, dropouts, or a shorter ``max_seq_len`` for rope models).
    For rope models with a sliding window that is used (Mistral; Qwen2/Qwen3 with
    ``use_sliding_window``), ``max_seq_len`` is capped at the window: within it, sliding-window
    attention is full causal attention, which is what Megatron runs. A window present but
    unused (Qwen2.5's ``use_sliding_window: false``) caps nothing.
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
        kv_channels = None
        if head_dim is not None:
            if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
                errors.append(f"head_dim={head_dim!r}: expected a positive integer")
            elif head_dim * heads != H:
                kv_channels = head_dim  # a head width of its own (Qwen3, some Llamas)
        max_pos = _int_field(c, "max_position_embeddings", where)
        rope = _rope_fields(c, d, max_pos, errors)
        window = getattr(c, "sliding_window", None)
        # Mistral's window covers every layer; Qwen2/Qwen3 (and transformers' per-layer
        # configs) name the layers that use it, none unless use_sliding_window is set.
        uses_window = window is not None and (
            family == "mistral" or "sliding_attention" in (getattr(c, "layer_types", None) or [])
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
        elif family == "qwen3":
            if attn_bias:
                errors.append(
                    "attention_bias=True is not supported for Qwen3 (it biases q/k/v and o_proj but not "
                    "the MLP; Megatron's add_bias_linear covers every linear layer); supported: false"
                )
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
            tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            add_bias_linear=add_bias_linear,
            add_qkv_bias=add_qkv_bias,
            kv_channels=kv_channels,
            qk_layernorm=family == "qwen3",
            **rope,
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


def export_problems(cfg: ModelConfig, family: str) -> list[str]:
    """Why ``cfg`` cannot be written as a model of HF ``family`` (empty: it can)."""
    e: list[str] = []
    if family == "gpt2":
        if cfg.qk_layernorm:
            e.append("qk_layernorm=True: GPT-2 has no q/k norms")
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            e.append(f"kv_channels={cfg.kv_channels}: GPT-2's heads are hidden_size/n_head wide")
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
    if family == "qwen3":
        if not cfg.qk_layernorm:
            e.append("qk_layernorm=False: Qwen3 always has q/k norms")
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            e.append("biases: Qwen3 is exported without biases (attention_bias=false)")
        return e
    if cfg.qk_layernorm:
        e.append(f"qk_layernorm=True: {family} has no q/k norms; export as Qwen3ForCausalLM instead")
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


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """HF's ``rope_parameters`` for ``cfg``'s RoPE (plain, or llama3-scaled)."""
    rp: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.rope_scaling == "llama3":
        rp["rope_type"] = "llama3"
        for key, field in _LLAMA3_KEYS.items():
            rp[key] = getattr(cfg, field)
    return rp


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
    problems = export_problems(cfg, family)
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
            rope_parameters=_rope_parameters(cfg),
            head_dim=cfg.head_dim,
        )
        kw.pop("rope_theta", None)
        if not keep_window:
            kw["max_position_embeddings"] = cfg.max_seq_len
            if family == "mistral":
                kw["sliding_window"] = None
            if family in ("qwen2", "qwen3"):
                kw.update(use_sliding_window=False, sliding_window=None)
                kw.pop("layer_types", None)
        if family == "llama":
            kw.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
        if family == "qwen3":
            kw["attention_bias"] = False
    kw["architectures"] = [arch]
    if hf_head == "score":
        kw["num_labels"] = 1
    if dtype is not None:
        kw["dtype"] = _dtype_name(dtype)
    cls = getattr(transformers, _FAMILIES[family].config_class)
    return cls(**kw)
