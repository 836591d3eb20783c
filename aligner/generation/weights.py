"""Where the lean decoder's weights come from: a ``GPTModel``'s own parameters, or tensors the
engine owns in its generation layout.

:class:`~aligner.generation.decoder.LeanDecoder` reads everything it computes with (the weight
tensors of this generation rank's shard, and the architecture facts its arithmetic needs:
heads, groups, the norm functions, the activation, RoPE) from a *source* whose ``bind()``
returns :class:`LeanWeights`. Two sources:

- :class:`ModuleWeights`: the training module's own parameter tensors, read at every
  ``bind()`` (zero-copy: an optimizer step in place is seen at once). Only when the generation
  layout is the training layout (PP=1, the same TP size and dtype), and never for a model with
  LoRA adapters (:mod:`aligner.models.lora`): its weights are ``W + (alpha / r) * B @ A``, which
  only the weight stream carries merged, so such a policy generates from :class:`OwnedWeights`.
- :class:`OwnedWeights`: tensors allocated once in the generation layout (tensor-parallel size
  ``g``, any dtype), for the whole model, whatever the training layout. :meth:`OwnedWeights.load`
  copies the weight stream (:func:`aligner.models.layout.iter_megatron_tensors`: full tensors,
  the same on every rank) into them in place, taking this rank's shard of each with
  :meth:`ParallelLayout.shard <aligner.models.layout.ParallelLayout.shard>` (whole query groups
  of the fused QKV, each head ``kv_channels`` wide, the gate and up halves of a gated fc1 each
  cut ``g`` ways, the padded vocabulary of the generation TP size; q/k norms, one head wide,
  replicated). Memory: one shard of the model plus the full tensor in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aligner.models.config import ModelConfig
from aligner.models.gpt import config_of, head_of, unwrap
from aligner.models.layout import ParallelLayout, megatron_tensor_specs, weight_layout_diff
from aligner.models.local_spec import qk_norms, unsupported_reason
from aligner.models.lora import lora_config_of

__all__ = ["LayerWeights", "LeanWeights", "ModuleWeights", "OwnedWeights"]


@dataclass
class LayerWeights:
    """One transformer layer's tensors on this generation rank (column-parallel weights: this
    rank's rows; row-parallel weights: its columns; their biases replicated)."""

    norm1: Callable[[torch.Tensor], torch.Tensor]
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_proj: torch.Tensor
    b_proj: torch.Tensor | None
    norm2: Callable[[torch.Tensor], torch.Tensor]
    w_fc1: torch.Tensor
    b_fc1: torch.Tensor | None
    w_fc2: torch.Tensor
    b_fc2: torch.Tensor | None
    scale: float
    """Attention's softmax scale."""
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The norm over each query head's ``d`` values before RoPE (Qwen3), or None."""
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The same for each key head, or None."""


@dataclass
class LeanWeights:
    """Everything :class:`~aligner.generation.decoder.LeanDecoder` computes with, for one
    generation rank: its shard of every weight and the architecture facts."""

    groups: int
    """Query groups on this rank."""
    heads: int
    """Query heads on this rank."""
    d: int
    """Head dim."""
    gated: bool
    """fc1 is ``[gate; up]`` (SwiGLU)."""
    act: Callable[[torch.Tensor], torch.Tensor]
    w_emb: torch.Tensor
    """Word embeddings ``[v_local, h]``: rows ``[vocab_start, vocab_end)`` of the padded vocabulary."""
    vocab_start: int
    vocab_end: int
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    w_out: torch.Tensor
    """LM head ``[v_local, h]`` (``w_emb`` itself when the embeddings are tied)."""
    layers: list[LayerWeights]
    rotary: nn.Module | None
    """Megatron's ``RotaryEmbedding`` (RoPE tables come from it), or None for learned positions."""
    pos_weight: torch.Tensor | None
    """Learned absolute position embeddings ``[max_seq_len, h]``, or None for RoPE."""

    @property
    def rope(self) -> bool:
        return self.rotary is not None


def _norm_fn(module: nn.Module):
    """The function a plain torch norm module applies, bound to its current weights (a direct
    call skips ``nn.Module.__call__``, several microseconds a call on a CPU); any other norm
    module is returned as is."""
    kind = type(module)
    if kind is nn.RMSNorm:
        shape, w, eps = module.normalized_shape, module.weight, module.eps
        return lambda x: F.rms_norm(x, shape, w, eps)
    if kind is nn.LayerNorm:
        shape, w, b, eps = module.normalized_shape, module.weight, module.bias, module.eps
        return lambda x: F.layer_norm(x, shape, w, b, eps)
    return module


class ModuleWeights:
    """Zero-copy: the parameter tensors of a whole ``GPTModel`` (this TP rank's shards), read
    at every :meth:`bind`, so an in-place optimizer step is seen at the next generation call."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is None and lora_config_of(model) is not None:
            # The decoder reads W alone; an engine generates with merged weights (OwnedWeights).
            reason = "it has LoRA adapters (its weights are not the merged ones; own a merged copy)"
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        self.model = model

    def bind(self) -> LeanWeights:
        m = self.model
        cfg = m.config
        att0 = m.decoder.layers[0].self_attention
        we = m.embedding.word_embeddings
        rope = m.position_embedding_type == "rope"
        layers = []
        for layer in m.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            qk = qk_norms(att)
            layers.append(
                LayerWeights(
                    norm1=_norm_fn(layer.input_layernorm),
                    w_qkv=att.linear_qkv.weight,
                    b_qkv=att.linear_qkv.bias,
                    w_proj=att.linear_proj.weight,
                    b_proj=att.linear_proj.bias,
                    norm2=_norm_fn(layer.pre_mlp_layernorm),
                    w_fc1=mlp.linear_fc1.weight,
                    b_fc1=mlp.linear_fc1.bias,
                    w_fc2=mlp.linear_fc2.weight,
                    b_fc2=mlp.linear_fc2.bias,
                    scale=float(att.core_attention.softmax_scale),
                    q_norm=None if qk is None else _norm_fn(qk[0]),
                    k_norm=None if qk is None else _norm_fn(qk[1]),
                )
            )
        return LeanWeights(
            groups=att0.num_query_groups_per_partition,
            heads=att0.num_attention_heads_per_partition,
            d=att0.hidden_size_per_attention_head,
            gated=cfg.gated_linear_unit,
            act=cfg.activation_func,
            w_emb=we.weight,
            vocab_start=we.vocab_start_index,
            vocab_end=we.vocab_end_index,
            final_norm=_norm_fn(m.decoder.final_layernorm),
            w_out=(
                m.shared_embedding_or_output_weight()
                if m.share_embeddings_and_output_weights
                else m.output_layer.weight
            ),
            layers=layers,
            rotary=m.rotary_pos_emb if rope else None,
            pos_weight=None if rope else m.embedding.position_embeddings.weight,
        )


class OwnedWeights:
    """The whole policy's weights in a generation layout, owned by the engine.

    Args:
        model: the training policy on this rank (a whole ``GPTModel`` or one pipeline stage,
            possibly wrapped), built by :mod:`aligner.models.gpt` with an LM head. The
            architecture facts that are not weights (norm kind and epsilon, activation, softmax
            scale, RoPE) are taken from it; every stage holds them.
        layout: the generation layout, TP only: ``ParallelLayout(tp=g, tp_rank=..., tp_group=...)``.
        dtype: the engine's weight dtype (default: the policy's).
        device: where the tensors live (default: the policy's device).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        m = unwrap(model)
        reason = unsupported_reason(m, stage=True)
        if reason is None and head_of(m) != "lm":
            reason = f"head {head_of(m)!r} is not an LM head"
        if reason is not None:
            raise ValueError(
                "an engine that owns its weights runs the lean decoder, which cannot run this model: "
                f"{reason}"
            )
        if layout.pp != 1:
            raise ValueError(f"a generation layout is tensor parallel only; got pipeline size {layout.pp}")
        cfg = config_of(m)
        problems = cfg.problems(layout.tp)
        if problems:
            raise ValueError(
                f"the model does not fit a generation tensor-parallel size of {layout.tp}: "
                + "; ".join(problems)
            )
        some = next(m.parameters())
        self.cfg: ModelConfig = cfg
        self.layout = layout
        self.dtype = dtype or some.dtype
        self.device = device or some.device
        layer0 = m.decoder.layers[0]
        norm = layer0.input_layernorm
        if type(norm) not in (nn.RMSNorm, nn.LayerNorm):
            raise ValueError(
                f"an engine that owns its weights needs torch RMSNorm/LayerNorm, got {type(norm).__name__}"
            )
        self._norm = (type(norm), tuple(norm.normalized_shape), norm.eps)
        qk = qk_norms(layer0.self_attention)
        # The q and k norms' (kind, shape [d], eps), or None (their weights are tensors below).
        self._qk_norms = None if qk is None else [(type(n), tuple(n.normalized_shape), n.eps) for n in qk]
        self._scale = float(layer0.self_attention.core_attention.softmax_scale)
        self._act = m.config.activation_func
        self._rotary = m.rotary_pos_emb if cfg.position_embedding == "rope" else None
        self._specs = {s.name: s for s in megatron_tensor_specs(cfg, "lm")}
        self.tensors = {
            name: torch.zeros(layout.shard_shape(s, cfg), dtype=self.dtype, device=self.device)
            for name, s in self._specs.items()
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self._bound = self._build()

    def architecture_diff(self, model: nn.Module) -> list[str]:
        """How ``model``'s architecture differs from the one these tensors were laid out for
        (empty when its weight stream fits them)."""
        return weight_layout_diff(self.cfg, config_of(unwrap(model)), "lm")

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Copy every ``(name, full tensor)`` of ``stream`` into this rank's shard of it, in
        place, and consume ``stream`` to its end (it is collective). Returns (bytes copied into
        the engine, bytes of the full tensors that came through the stream)."""
        cfg, lay = self.cfg, self.layout
        moved = seen = 0
        missing = set(self.tensors)
        with torch.no_grad():
            for name, full in stream:
                spec = self._specs.get(name)
                if spec is None or tuple(full.shape) != spec.shape:
                    expected = "no such tensor" if spec is None else f"shape {spec.shape}"
                    raise ValueError(f"weight stream tensor {name} {tuple(full.shape)}: expected {expected}")
                target = self.tensors[name]
                target.copy_(lay.shard(full, spec, cfg))
                moved += target.numel() * target.element_size()
                seen += full.numel() * full.element_size()
                missing.discard(name)
        if missing:
            raise ValueError(f"the weight stream ended without {sorted(missing)[:8]}")
        return moved, seen

    def bind(self) -> LeanWeights:
        return self._bound

    def _norm_fn(self, prefix: str, norm: tuple | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The norm whose tensors are ``prefix.weight`` (and ``.bias``); ``norm``: its (kind,
        shape, eps), the hidden-state norms' by default."""
        kind, shape, eps = norm or self._norm
        w = self.tensors[prefix + ".weight"]
        if kind is nn.RMSNorm:
            return lambda x: F.rms_norm(x, shape, w, eps)
        b = self.tensors[prefix + ".bias"]
        return lambda x: F.layer_norm(x, shape, w, b, eps)

    def _build(self) -> LeanWeights:
        cfg, lay, t = self.cfg, self.layout, self.tensors
        g = lay.tp
        qk = self._qk_norms
        layers = []
        for i in range(cfg.num_layers):
            p = f"decoder.layers.{i}."
            layers.append(
                LayerWeights(
                    norm1=self._norm_fn(p + "input_layernorm"),
                    w_qkv=t[p + "self_attention.linear_qkv.weight"],
                    b_qkv=t.get(p + "self_attention.linear_qkv.bias"),
                    w_proj=t[p + "self_attention.linear_proj.weight"],
                    b_proj=t.get(p + "self_attention.linear_proj.bias"),
                    norm2=self._norm_fn(p + "pre_mlp_layernorm"),
                    w_fc1=t[p + "mlp.linear_fc1.weight"],
                    b_fc1=t.get(p + "mlp.linear_fc1.bias"),
                    w_fc2=t[p + "mlp.linear_fc2.weight"],
                    b_fc2=t.get(p + "mlp.linear_fc2.bias"),
                    scale=self._scale,
                    q_norm=None if qk is None else self._norm_fn(p + "self_attention.q_layernorm", qk[0]),
                    k_norm=None if qk is None else self._norm_fn(p + "self_attention.k_layernorm", qk[1]),
                )
            )
        rows = cfg.padded_vocab_size(g) // g
        w_emb = t["embedding.word_embeddings.weight"]
        return LeanWeights(
            groups=cfg.kv_heads // g,
            heads=cfg.num_attention_heads // g,
            d=cfg.head_dim,
            gated=cfg.activation == "swiglu",
            act=self._act,
            w_emb=w_emb,
            vocab_start=lay.tp_rank * rows,
            vocab_end=(lay.tp_rank + 1) * rows,
            final_norm=self._norm_fn("decoder.final_layernorm"),
            w_out=w_emb if cfg.tie_embeddings else t["output_layer.weight"],
            layers=layers,
            rotary=self._rotary,
            pos_weight=t.get("embedding.position_embeddings.weight"),
        )
