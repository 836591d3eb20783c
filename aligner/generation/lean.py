"""A lean KV-cache forward over a Megatron-core ``GPTModel``'s own parameters.

Why: Megatron's static-batching inference path (``StaticInferenceContext``) stores keys
*before* RoPE and re-applies RoPE to the whole cached prefix at every step, and each layer
goes through autograd ``Function`` wrappers, NVTX hooks and config checks. On a CPU, where a
decode step is bound by per-op overhead and memory traffic, that path ran at about half the
speed of HF ``generate``. This module runs the same arithmetic in the fewest ops:

- plain linears on the module's weight tensors (no copies: a refit is seen at once); fp32 on
  a CPU goes through oneDNN (:func:`onednn_linear_available`), about 2x MKL there;
- RoPE on the new positions only (the cache holds rotated keys);
- a cache laid out for the attention matmuls: keys ``[b, groups, d, T]``, values
  ``[b, groups, T, d]``; in a decode step the ``r`` query heads of a group share one matmul;
- Megatron's rounding order (scaled ``baddbmm``, fp32 softmax, ``t*cos + rot(t)*sin``), so
  bf16 log-probs equal those of the training forward;
- the TP collectives Megatron issues: the vocabulary-parallel embedding's all-reduce, an
  all-reduce after each row-parallel projection, an all-gather of the logits.

Only architectures that :func:`unsupported_reason` accepts take this path (the local layer
spec ``aligner.models.gpt`` builds: pre-norm, RMSNorm/LayerNorm, RoPE or learned absolute
positions, MHA/GQA/MQA, optional biases, gated or plain MLP, tied or untied head, TP without
sequence parallelism); anything else uses Megatron's own forward. The tests compare both
with a full-recompute forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["LeanDecoder", "unsupported_reason", "onednn_linear_available"]

_ONEDNN_OK: bool | None = None


def onednn_linear_available() -> bool:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` (oneDNN's fp32 inner product, the op
    inductor uses on CPU) runs here and agrees with ``F.linear``. Checked once per process.

    On the project's AMD CPUs MKL's fp32 GEMM takes a generic path (about 100 GFLOP/s per
    core) while oneDNN reaches about 200-230 on the same shapes, reading the same weight
    tensor (no packing, no copy), so a refit is still seen at once.
    """
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 16), (24, 16), (24,)))
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            _ONEDNN_OK = bool(torch.backends.mkldnn.is_available()) and torch.allclose(
                y, F.linear(x, w, b), atol=1e-5, rtol=1e-5
            )
        except Exception:  # op missing or unsupported on this build/CPU
            _ONEDNN_OK = False
    return _ONEDNN_OK


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _is_identity(m) -> bool:
    return m is None or type(m).__name__ in ("IdentityOp", "IdentityFuncOp", "Identity")


def unsupported_reason(model: nn.Module) -> str | None:
    """None when :class:`LeanDecoder` computes exactly what ``model``'s forward does, else why not."""
    if type(model).__name__ != "GPTModel":
        return f"model is a {type(model).__name__}, not a megatron GPTModel"
    if not (model.pre_process and model.post_process):
        return "pipeline-parallel stage (pre_process/post_process not both set)"
    if getattr(model, "aligner_head", "lm") != "lm":
        return "not an LM head"
    cfg = model.config
    checks = {
        "multi_latent_attention": getattr(cfg, "multi_latent_attention", False),
        "mtp_num_layers": getattr(cfg, "mtp_num_layers", None),
        "sequence_parallel": cfg.sequence_parallel,
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "fp32_residual_connection": cfg.fp32_residual_connection,
        "apply_query_key_layer_scaling": getattr(cfg, "apply_query_key_layer_scaling", False),
        "attention_output_gate": getattr(cfg, "attention_output_gate", False),
        "num_moe_experts": getattr(cfg, "num_moe_experts", None),
        "qk_layernorm": getattr(cfg, "qk_layernorm", False),
        "no_rope_freq": getattr(cfg, "no_rope_freq", None),
        "activation_func_clamp_value": getattr(cfg, "activation_func_clamp_value", None),
        "glu_linear_offset": getattr(cfg, "glu_linear_offset", 0.0),
        "flash_decode": getattr(cfg, "flash_decode", False),
    }
    on = [k for k, v in checks.items() if v]
    if on:
        return f"config options not handled by the lean path: {on}"
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={cfg.softmax_type!r}"
    if model.position_embedding_type not in ("rope", "learned_absolute"):
        return f"position_embedding_type={model.position_embedding_type!r}"
    if model.position_embedding_type == "rope":
        if cfg.rotary_interleaved:
            return "interleaved RoPE"
        rot_dim = model.rotary_pos_emb.inv_freq.numel() * 2
        if rot_dim != cfg.kv_channels:
            return f"partial RoPE (rotary dim {rot_dim} != head dim {cfg.kv_channels})"
    if cfg.num_query_groups is not None and cfg.num_query_groups < cfg.tensor_model_parallel_size:
        return "fewer query groups than tensor-parallel ranks"
    for i, layer in enumerate(model.decoder.layers):
        names = (type(layer).__name__, type(layer.self_attention).__name__, type(layer.mlp).__name__)
        if names != ("TransformerLayer", "SelfAttention", "MLP"):
            return f"layer {i} is {names}"
        att = layer.self_attention
        if not (
            _is_identity(getattr(att, "q_layernorm", None))
            and _is_identity(getattr(att, "k_layernorm", None))
        ):
            return f"layer {i} has q/k layernorms"
        if not _is_identity(getattr(layer, "cross_attention", None)):
            return f"layer {i} has cross attention"
        if _is_identity(layer.input_layernorm) or _is_identity(layer.pre_mlp_layernorm):
            return f"layer {i} fuses its layernorm into a linear layer"
    if getattr(model.decoder, "final_layernorm", None) is None:
        return "no final layernorm"
    return None


class _Layer:
    __slots__ = (
        "norm1",
        "w_qkv",
        "b_qkv",
        "w_proj",
        "b_proj",
        "norm2",
        "w_fc1",
        "b_fc1",
        "w_fc2",
        "b_fc2",
        "scale",
        "k",
        "v",
    )


class LeanDecoder:
    """Prefill + one-token decode steps of a ``GPTModel`` with a private KV cache.

    Usage per generation call: :meth:`begin` (binds the current weights, allocates the cache),
    :meth:`forward` for ``[0, n)`` then one position at a time, :meth:`end` (frees the cache).
    """

    def __init__(self, model: nn.Module, tp_group=None, tp_size: int = 1, cpu_linear: str = "auto") -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        if cpu_linear not in ("auto", "onednn", "default"):
            raise ValueError(f"cpu_linear={cpu_linear!r}: expected 'auto', 'onednn' or 'default'")
        self.model = model
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.cpu_linear = cpu_linear
        self.layers: list[_Layer] = []
        self.linear = F.linear

    # -- per call -------------------------------------------------------------------------

    def begin(self, batch: int, max_len: int) -> None:
        """Bind the model's current parameter tensors and allocate the KV cache for ``[b, T]``."""
        m = self.model
        cfg = m.config
        self.rope = m.position_embedding_type == "rope"
        self.gated = cfg.gated_linear_unit
        self.act = cfg.activation_func
        self.embedding = m.embedding
        self.final_norm = m.decoder.final_layernorm
        self.w_out = (
            m.shared_embedding_or_output_weight()
            if m.share_embeddings_and_output_weights
            else m.output_layer.weight
        )
        ref = m.embedding.word_embeddings.weight
        dtype, dev = ref.dtype, ref.device
        self.dtype = dtype
        # fp32 on the CPU: oneDNN's inner product instead of MKL's GEMM (see
        # onednn_linear_available); bf16 F.linear already goes to oneDNN.
        use_onednn = dev.type == "cpu" and dtype == torch.float32 and self.cpu_linear != "default"
        if use_onednn and not onednn_linear_available():
            if self.cpu_linear == "onednn":
                raise RuntimeError(
                    "cpu_linear='onednn': torch.ops.mkldnn._linear_pointwise is not usable here"
                )
            use_onednn = False
        self.linear = _onednn_linear if use_onednn else F.linear
        att0 = m.decoder.layers[0].self_attention
        self.groups = att0.num_query_groups_per_partition
        self.heads = att0.num_attention_heads_per_partition
        self.r = self.heads // self.groups
        self.d = att0.hidden_size_per_attention_head
        self.batch, self.max_len = batch, max_len
        self._zero = torch.zeros((), dtype=dtype, device=dev)  # baddbmm input (beta=0)
        self.layers = []
        for layer in m.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            L = _Layer()
            L.norm1, L.norm2 = layer.input_layernorm, layer.pre_mlp_layernorm
            L.w_qkv, L.b_qkv = att.linear_qkv.weight, att.linear_qkv.bias
            L.w_proj, L.b_proj = att.linear_proj.weight, att.linear_proj.bias
            L.w_fc1, L.b_fc1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
            L.w_fc2, L.b_fc2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
            L.scale = float(att.core_attention.softmax_scale)
            L.k = torch.empty(batch, self.groups, self.d, max_len, dtype=dtype, device=dev)
            L.v = torch.empty(batch, self.groups, max_len, self.d, dtype=dtype, device=dev)
            self.layers.append(L)
        if self.rope:
            # emb [T, 1, 1, d] = cat(freqs, freqs); RoPE(x) = x*cos + rotate_half(x)*sin with
            # rotate_half([x1, x2]) = [-x2, x1] = swap_halves(x) * [-1, 1].
            emb = m.rotary_pos_emb.get_emb(max_len).reshape(max_len, self.d).float().to(dev)
            cos, sin = emb.cos(), emb.sin()
            sin = torch.cat([-sin[:, : self.d // 2], sin[:, self.d // 2 :]], dim=-1)
            self.cos = cos.to(dtype).view(1, max_len, 1, 1, self.d)
            self.sin = sin.to(dtype).view(1, max_len, 1, 1, self.d)
        else:
            self.pos_weight = m.embedding.position_embeddings.weight

    def end(self) -> None:
        """Drop the cache and the bound tensors."""
        self.layers = []
        self.cos = self.sin = None

    # -- forward --------------------------------------------------------------------------

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """[b, n] -> [b, n, h], as Megatron's VocabParallelEmbedding: each TP rank looks up the
        ids in its row range (zeros elsewhere) and an all-reduce sums the shards."""
        we = self.embedding.word_embeddings
        if self.tp_size > 1:
            outside = (tokens < we.vocab_start_index) | (tokens >= we.vocab_end_index)
            x = F.embedding((tokens - we.vocab_start_index).masked_fill_(outside, 0), we.weight)
            x = self._reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
        else:
            x = F.embedding(tokens, we.weight)
        if not self.rope:
            x = x + self.pos_weight[start : start + tokens.shape[1]]
        return x

    def _prefill_attention(self, q: torch.Tensor, L: _Layer, n: int, scale: float) -> torch.Tensor:
        """Causal attention of positions [0, n) (q ``[b, n, g, r, d]``) over the cache, computed
        as Megatron's DotProductAttention does (scaled baddbmm, fp32 masked softmax, bmm) so
        that bf16 results round the same way. Returns ``[b, n, heads * d]``."""
        b, g, r, d = q.shape[0], self.groups, self.r, self.d
        h = g * r
        q = q.permute(0, 2, 3, 1, 4).reshape(b * h, n, d)  # heads ordered (group, r)
        keys = L.k[:, :, :, :n].unsqueeze(2).expand(b, g, r, d, n).reshape(b * h, d, n)
        values = L.v[:, :, :n].unsqueeze(2).expand(b, g, r, n, d).reshape(b * h, n, d)
        scores = torch.baddbmm(self._zero, q, keys, beta=0.0, alpha=scale).float()
        causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu_(1)
        probs = torch.softmax(scores.masked_fill_(causal, float("-inf")), dim=-1).to(values.dtype)
        ctx = torch.bmm(probs, values).view(b, h, n, d)
        return ctx.permute(0, 2, 1, 3).reshape(b, n, h * d)

    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run positions ``[start, start + n)`` (``tokens`` ``[b, n]``) through the model,
        appending their keys/values to the cache, and return the last position's logits
        ``[b, v]`` over the full (TP-gathered, padded) vocabulary.

        ``n > 1`` is allowed only at ``start == 0`` (the prefill)."""
        b, n = tokens.shape
        g, r, d = self.groups, self.r, self.d
        end = start + n
        if n > 1 and start != 0:
            raise ValueError("multi-token forward is only supported from position 0")
        x = self._embed(tokens, start)
        for L in self.layers:
            h = L.norm1(x)
            qkv = self.linear(h, L.w_qkv, L.b_qkv).view(b, n, g, r + 2, d)
            qk = qkv[:, :, :, : r + 1]  # queries and key of each group
            if self.rope:
                # Megatron's order of rounding: t*cos + rotate_half(t)*sin, three ops.
                qk = qk * self.cos[:, start:end] + qk.roll(d // 2, dims=-1) * self.sin[:, start:end]
            # Cache: keys transposed [b, g, d, T] (q @ K^T reads it as is), values [b, g, T, d].
            L.k[:, :, :, start:end].copy_(qk[:, :, :, r].permute(0, 2, 3, 1))
            L.v[:, :, start:end].copy_(qkv[:, :, :, r + 1].transpose(1, 2))
            T = self.max_len
            if n == 1:
                # One query position: the r query heads of a group attend to the same cached
                # keys, so they ride in the matmul's row dimension (grouped-query for free).
                # baddbmm(alpha=scale) and an fp32 softmax, as Megatron's DotProductAttention.
                q = qk[:, 0, :, :r].reshape(b * g, r, d)
                scores = torch.baddbmm(
                    self._zero, q, L.k.view(b * g, d, T)[:, :, :end], beta=0.0, alpha=L.scale
                )
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qkv.dtype)
                ctx = torch.bmm(probs, L.v.view(b * g, T, d)[:, :end]).view(b, 1, g * r * d)
            else:
                ctx = self._prefill_attention(qk[:, :, :, :r], L, n, L.scale)
            o = self._reduce(self.linear(ctx, L.w_proj))
            if L.b_proj is not None:
                o = o + L.b_proj
            x = x + o
            h = L.norm2(x)
            f = self.linear(h, L.w_fc1, L.b_fc1)
            if self.gated:
                a, u = f.chunk(2, dim=-1)
                f = self.act(a) * u
            else:
                f = self.act(f)
            o = self._reduce(self.linear(f, L.w_fc2))
            if L.b_fc2 is not None:
                o = o + L.b_fc2
            x = x + o
        h = self.final_norm(x[:, -1])
        logits = self.linear(h, self.w_out)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits
