"""How each canonical Megatron tensor is named and shaped in a Hugging Face checkpoint.

One :class:`HFRule` per tensor of :func:`aligner.models.layout.megatron_tensor_specs`
(:func:`hf_rules`): which HF tensors it is made of and how. Megatron fuses what HF keeps
apart, so a rule may split or join: the fused QKV is ``[q_1..q_r, k, v]`` per query group
(split into HF's ``q_proj``/``k_proj``/``v_proj``, or GPT-2's ``c_attn`` in ``[q | k | v]``
order), ``linear_fc1`` of a gated MLP is ``[gate; up]`` (HF's ``gate_proj``/``up_proj``), and
GPT-2's Conv1D stores linear weights transposed; Qwen3's per-head query/key norms are
``self_attn.q_norm``/``k_norm``. :func:`hf_tensor_specs` lists the HF tensors of a model in
export order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aligner.models.config import ConversionError, ModelConfig
from aligner.models.hf_config import resolve_architecture
from aligner.models.layout import megatron_tensor_specs

__all__ = ["HFRule", "hf_rules", "hf_tensor_specs"]


@dataclass(frozen=True)
class HFRule:
    """How one canonical tensor is stored in an HF checkpoint: as the tensors ``hf_names`` of
    shapes ``hf_shapes`` (none, one or several), made by ``to_hf`` and joined by ``from_hf``."""

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


def _ident(hf: str, shape: tuple[int, ...]) -> HFRule:
    return HFRule((hf,), (shape,), lambda t: [t], lambda ts: ts[0])


def _transposed(hf: str, hf_shape: tuple[int, ...]) -> HFRule:
    """GPT-2's Conv1D stores [in, out]; Megatron's linear [out, in]."""
    return HFRule((hf,), (hf_shape,), lambda t: [t.t().contiguous()], lambda ts: ts[0].t().contiguous())


def _zero_bias_rule(name: str) -> HFRule:
    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        if torch.count_nonzero(t).item():
            raise ConversionError(
                f"{name}={t.float().tolist()} is not zero, and the HF sequence-classification head "
                "(score) has no bias; export would change every score by this constant"
            )
        return []

    return HFRule((), (), to_hf, lambda ts: torch.zeros(1))


def hf_rules(cfg: ModelConfig, family: str, head: str, hf_head: str) -> dict[str, HFRule | None]:
    """Canonical name -> how it is stored in HF (None: HF does not hold it, keep the model's),
    for our ``head`` model as HF ``family`` with HF head ``hf_head`` (``"lm"`` or ``"score"``;
    see :func:`aligner.models.hf_config.resolve_architecture`)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    heads, kv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv_shapes = ((heads * d, H), (kv * d, H), (kv * d, H))
    gpt2 = family == "gpt2"
    pre = "transformer." if gpt2 else "model."
    rules: dict[str, HFRule | None] = {}
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


def _llama_layer_rule(cfg: ModelConfig, p: str, suffix: str, qkv_shapes) -> HFRule:
    H, F = cfg.hidden_size, cfg.ffn_size
    a, m = p + "self_attn.", p + "mlp."
    if suffix in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        hf = "input_layernorm.weight" if suffix.startswith("input") else "post_attention_layernorm.weight"
        return _ident(p + hf, (H,))
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        shapes = qkv_shapes if kind == "weight" else tuple(s[:1] for s in qkv_shapes)
        return HFRule(
            tuple(f"{a}{x}_proj.{kind}" for x in "qkv"),
            shapes,
            lambda t: _qkv_split(cfg, t),
            lambda ts: _qkv_fuse(cfg, *ts),
        )
    if suffix == "self_attention.q_layernorm.weight":  # Qwen3's per-head RMSNorm of the queries
        return _ident(a + "q_norm.weight", (cfg.head_dim,))
    if suffix == "self_attention.k_layernorm.weight":  # ... and of the keys
        return _ident(a + "k_norm.weight", (cfg.head_dim,))
    if suffix == "self_attention.linear_proj.weight":
        return _ident(a + "o_proj.weight", (H, cfg.num_attention_heads * cfg.head_dim))
    if suffix == "self_attention.linear_proj.bias":
        return _ident(a + "o_proj.bias", (H,))
    if suffix.startswith("mlp.linear_fc1."):
        kind = suffix.rsplit(".", 1)[1]
        shape = (F, H) if kind == "weight" else (F,)
        return HFRule(
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


def _gpt2_layer_rule(cfg: ModelConfig, p: str, suffix: str) -> HFRule:
    H, F = cfg.hidden_size, cfg.ffn_size
    if suffix.startswith(("input_layernorm.", "pre_mlp_layernorm.")):
        ln = "ln_1." if suffix.startswith("input") else "ln_2."
        return _ident(p + ln + suffix.rsplit(".", 1)[1], (H,))
    if suffix == "self_attention.linear_qkv.weight":
        # c_attn: Conv1D [H, 3H] = [q | k | v] along the output dim.
        return HFRule(
            (p + "attn.c_attn.weight",),
            ((H, 3 * H),),
            lambda t: [torch.cat(_qkv_split(cfg, t), 0).t().contiguous()],
            lambda ts: _qkv_fuse(cfg, *ts[0].t().chunk(3, 0)),
        )
    if suffix == "self_attention.linear_qkv.bias":
        return HFRule(
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
    for rule in hf_rules(cfg, family, head, hf_head).values():
        if rule is not None:
            out.extend(zip(rule.hf_names, rule.hf_shapes))
    return out
