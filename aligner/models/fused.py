"""A fused full-sequence forward over a Megatron-core ``GPTModel``'s own parameters.

Why: the training forward and backward, and the no-grad log-prob, value and score forwards,
are most of a PPO step. On a CPU, Megatron's local-spec modules spend a large share of that in
small element-wise kernels and copies: the ``[s, b, h]`` layout and its transposes, separate
RoPE passes for queries and keys with ``cat``-based half rotation, module-call and autograd
``Function`` overhead per linear. With the matrix products already at the machine's peak
(oneDNN, bf16), that overhead is what is left to remove. This module computes the same
arithmetic, on the same parameter tensors (gradients land in ``param.grad`` as usual), in a
batch-first layout with the fewest ops:

- ``eager``: plain torch ops; bit-identical logits to Megatron's forward (Megatron's rounding
  order: scaled ``baddbmm``, fp32 softmax, ``t*cos + rotate_half(t)*sin`` in the model dtype),
  and under tensor parallelism the same collectives, through Megatron's own autograd mappings
  (``copy_to``/``reduce_from_tensor_model_parallel_region``, the vocabulary-parallel
  embedding's masked lookup and all-reduce);
- ``compiled``: the same function under ``torch.compile(fullgraph=True)`` (TP=1): inductor
  fuses the norms, RoPE, softmax, SwiGLU and residual adds, forward and backward. Compiling
  takes seconds to tens of seconds per shape on a CPU (cached on disk between processes), so
  it pays off in long runs, not in tests.

Only models whose forward this reproduces exactly take this path (:func:`unsupported_reason`:
the local layer spec ``aligner.models.gpt`` builds, no dropout, no activation recompute, no
pipeline stages); anything else runs Megatron's forward. A model with LoRA adapters
(:mod:`aligner.models.lora`) runs each adapter's low-rank path unmerged, with the arithmetic and
the collectives of the module forward's hooks (no LoRA dropout: with it, Megatron's forward);
``tests/models/test_lora.py`` checks it. ``tests/models/test_fused_forward.py`` compares logits, values,
scores and every parameter's gradient with Megatron's, at TP=1 and TP=2.
"""

from __future__ import annotations

import shutil
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn

from aligner.models import local_spec
from aligner.models.config import FORWARD_MODES
from aligner.models.lora import TARGETS as LORA_TARGETS
from aligner.models.lora import column_delta, lora_config_of, row_delta
from aligner.models.rope import apply_rope, rope_tables

__all__ = ["FORWARD_MODES", "FusedForward", "unsupported_reason", "resolve_forward", "compile_available"]


def unsupported_reason(model: nn.Module) -> str | None:
    """None when :class:`FusedForward` computes exactly what ``model``'s forward does (its
    output and every gradient), else why not."""
    reason = local_spec.unsupported_reason(model, heads=("lm", "value", "reward"))
    if reason is not None:
        return reason
    lcfg = lora_config_of(model)
    if lcfg is not None and lcfg.dropout:
        return f"LoRA dropout (lora.dropout={lcfg.dropout})"
    cfg = model.config
    if cfg.hidden_dropout or cfg.attention_dropout:
        return f"dropout (hidden {cfg.hidden_dropout}, attention {cfg.attention_dropout})"
    if getattr(cfg, "recompute_granularity", None):
        return f"activation recompute ({cfg.recompute_granularity})"
    if getattr(model, "aligner_head", "lm") != "lm":
        head = model.output_layer
        if type(head).__name__ != "ScalarHead":
            return f"value/reward head is a {type(head).__name__}, not a ScalarHead"
    elif model.output_layer is not None and getattr(model.output_layer, "bias", None) is not None:
        return "LM head with a bias"
    return None


def compile_available() -> str | None:
    """None when ``torch.compile`` can build CPU kernels here, else why not (inductor needs a
    C++ compiler on the CPU)."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH; inductor needs one for CPU kernels"
    return None


def resolve_forward(mode: str, model: nn.Module, tp_size: int = 1) -> tuple[str, str | None]:
    """The forward ``mode`` resolves to for ``model``, and why another was not taken.

    ``auto``: ``fused`` where supported, else ``megatron``. ``fused`` and ``compiled`` raise
    ``ValueError`` with the reason when the model (or, for ``compiled``, TP > 1 or the machine)
    does not allow them.
    """
    if mode not in FORWARD_MODES:
        raise ValueError(f"model_forward={mode!r}: expected one of {list(FORWARD_MODES)}")
    if mode == "megatron":
        return "megatron", None
    reason = unsupported_reason(model)
    if reason is not None:
        if mode == "auto":
            return "megatron", reason
        raise ValueError(f"model_forward={mode!r} cannot run this model: {reason}")
    if mode == "compiled":
        if tp_size > 1:
            raise ValueError(
                f"model_forward='compiled' needs tensor_parallel_size 1 (got {tp_size}); "
                "use 'fused' (the same ops, uncompiled, with Megatron's collectives)"
            )
        why = compile_available()
        if why is not None:
            raise ValueError(f"model_forward='compiled' is not available: {why}")
    return ("fused" if mode == "auto" else mode), None


class _Spec:
    """What the pure forward needs to know about the architecture (hashable, static)."""

    def __init__(self, model: nn.Module, tp_size: int) -> None:
        cfg = model.config
        att = model.decoder.layers[0].self_attention
        self.layers = len(model.decoder.layers)
        self.groups = att.num_query_groups_per_partition
        self.heads = att.num_attention_heads_per_partition
        self.d = att.hidden_size_per_attention_head
        self.scale = float(att.core_attention.softmax_scale)
        self.gated = bool(cfg.gated_linear_unit)
        self.act = cfg.activation_func
        norm = model.decoder.final_layernorm
        self.rms = isinstance(norm, nn.RMSNorm)
        self.eps = float(norm.eps)
        # q/k norms over each head (Qwen3): None, or (RMSNorm?, eps) of the q and k norms.
        qk = local_spec.qk_norms(att)
        self.qk_norm = None if qk is None else tuple((isinstance(m, nn.RMSNorm), float(m.eps)) for m in qk)
        self.hidden = int(cfg.hidden_size)
        self.rope = model.position_embedding_type == "rope"
        self.head = getattr(model, "aligner_head", "lm")
        self.tp_size = tp_size
        # LoRA (aligner.models.lora): None, or (the adapted targets in TARGETS order, alpha / r).
        lcfg = lora_config_of(model)
        self.lora = (
            None if lcfg is None else (tuple(t for t in LORA_TARGETS if t in lcfg.targets), lcfg.scale)
        )
        self.key = (
            self.layers,
            self.groups,
            self.heads,
            self.d,
            self.scale,
            self.gated,
            self.act,
            self.rms,
            self.eps,
            self.hidden,
            self.rope,
            self.qk_norm,
            self.head,
            tp_size,
            self.lora,
        )


def _params(model: nn.Module, spec: _Spec) -> list[torch.Tensor | None]:
    """The tensors the forward reads, in a fixed order (None where a layer has no bias)."""
    out: list[torch.Tensor | None] = [model.embedding.word_embeddings.weight]
    out.append(None if spec.rope else model.embedding.position_embeddings.weight)
    for layer in model.decoder.layers:
        att, mlp = layer.self_attention, layer.mlp
        norm = layer.input_layernorm
        out += [norm.weight, getattr(norm, "bias", None)]
        out += [att.linear_qkv.weight, att.linear_qkv.bias, att.linear_proj.weight, att.linear_proj.bias]
        qk = local_spec.qk_norms(att)
        for m in qk or (None, None):
            out += [None, None] if m is None else [m.weight, getattr(m, "bias", None)]
        norm = layer.pre_mlp_layernorm
        out += [norm.weight, getattr(norm, "bias", None)]
        out += [mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias]
        for target in spec.lora[0] if spec.lora else ():  # each adapted linear's (A, B)
            linear = (att if target in ("linear_qkv", "linear_proj") else mlp).get_submodule(target)
            out += [linear.lora_A, linear.lora_B]
    norm = model.decoder.final_layernorm
    out += [norm.weight, getattr(norm, "bias", None)]
    if spec.head == "lm":
        w = (
            model.shared_embedding_or_output_weight()
            if model.share_embeddings_and_output_weights
            else model.output_layer.weight
        )
        out += [w, None]
    else:
        out += [model.output_layer.weight, model.output_layer.bias]
    return out


# Bytes of one chunk's [rows, n, n] scores on a CPU: small enough to stay in a core's cache.
_CHUNK_BYTES = 1 << 20


def attention_rows_per_chunk(q: torch.Tensor) -> int:
    """How many of ``q``'s ``B`` (batch x head) rows attention computes at once.

    On a CPU the ``[B, n, n]`` scores of a long sequence are far larger than the cache (at 64
    sequences x 8 heads x 208 positions, 44 MB in bf16) and every pass over them (the product,
    the softmax, the product with the values; the same again backward) goes to memory:
    computed ``_CHUNK_BYTES`` at a time, each chunk is made, used and dropped in cache.
    Measured on one core at that size, a layer's attention took 30 ms instead of 32-48 ms
    forward without gradients, and 62 ms instead of 69-73 ms forward and backward; at 64
    positions it made no difference. Every row is computed by the same kernels on the same
    operands either way, so the results are bit-identical to one chunk. At least one row per
    thread; on other devices one chunk.
    """
    b, n = q.shape[0], q.shape[1]
    if q.device.type != "cpu":
        return max(b, 1)
    rows = max(torch.get_num_threads(), _CHUNK_BYTES // max(1, n * n * q.element_size()))
    return max(1, min(b, rows))


@torch.library.custom_op("aligner::causal_attention", mutates_args=())
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, keep_probs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention core: ``k``, ``v`` ``[B, n, d]`` (one row per batch x head), ``q``
    ``[B, m, d]`` for the last ``m <= n`` positions, ``mask`` ``[m, n]`` (those rows of the
    causal mask: 0 on and below the diagonal, -inf above, in the model dtype) -> (context
    ``[B, m, d]``, probabilities ``[B, m, n]`` for the backward when ``keep_probs``, else an
    empty tensor). A ``[B, m, n]`` mask gives each row its own (queries at other positions).

    ``baddbmm(mask, q, k^T, alpha=scale)`` rounds ``scale * q k^T`` once, as Megatron's
    ``baddbmm(beta=0)`` does, and adding 0 or -inf is exact; torch's softmax reads the scores
    in the model dtype and accumulates in fp32, which is Megatron's fp32 softmax without the
    fp32 copies. Rows are computed in chunks (:func:`attention_rows_per_chunk`). A custom op so
    that ``torch.compile`` leaves these batched products and the softmax to their native
    kernels (measured faster here than inductor's).

    Measured slower on a CPU at 64-208 positions, head dim 32 (one thread, forward and
    backward): skipping the masked upper half by query blocks of 16-64 (1.1-1.6x the time:
    the blocks' products are too small), SDPA's flash kernel (2.4x forward, 8x with the
    backward), and a plain C kernel that visits only the keys each row sees (2-3x: per-row
    overheads; it would need tiles of several query rows to win).
    """
    b, n, _ = q.shape
    out = q.new_empty(b, n, v.shape[-1])
    probs = q.new_empty(b, n, k.shape[1]) if keep_probs else q.new_empty(0)
    rows = attention_rows_per_chunk(q)
    for i in range(0, b, rows):
        sl = slice(i, i + rows)
        m = mask[sl] if mask.dim() == 3 else mask
        scores = torch.baddbmm(m, q[sl], k[sl].transpose(1, 2), beta=1.0, alpha=scale)
        if keep_probs:
            p = torch.ops.aten._softmax.out(scores, -1, False, out=probs[sl])
        else:
            p = torch.softmax(scores, dim=-1)
        torch.bmm(p, v[sl], out=out[sl])
    return out, probs


@causal_attention.register_fake
def _(q, k, v, mask, scale, keep_probs):
    b, n, _ = q.shape
    probs = q.new_empty(b, n, k.shape[1]) if keep_probs else q.new_empty(0)
    return q.new_empty(b, n, v.shape[-1]), probs


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, _mask, scale, keep_probs = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.scale = scale
    ctx.keep_probs = keep_probs
    # The probabilities are an output only for the backward; no zero gradient is made for them.
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


@torch.library.custom_op("aligner::causal_attention_backward", mutates_args=())
def causal_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probs: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`causal_attention`'s context for ``q``, ``k``, ``v`` (contiguous
    ``[B, n, d]``), chunk by chunk as the forward. A custom op of its own, so that a compiled
    backward calls it by name rather than tracing its loop into per-chunk copies.

    Both ops' bodies run as they are at every call. What :func:`_attention_backward` does
    around them is traced into a compiled backward and cached on disk under a key made from
    the forward graph, which names the forward op but holds none of this code: a change there
    needs a new op name, or a cached backward outlives it."""
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rows = attention_rows_per_chunk(q)
    for i in range(0, q.shape[0], rows):
        sl = slice(i, i + rows)
        p, g = probs[sl], grad_out[sl]
        torch.bmm(p.transpose(1, 2), g, out=grad_v[sl])
        grad_probs = torch.bmm(g, v[sl].transpose(1, 2))
        grad_scores = torch._softmax_backward_data(grad_probs, p, -1, p.dtype)
        torch.bmm(grad_scores, k[sl], out=grad_q[sl]).mul_(scale)
        torch.bmm(grad_scores.transpose(1, 2), q[sl], out=grad_k[sl]).mul_(scale)
    return grad_q, grad_k, grad_v


@causal_attention_backward.register_fake
def _(grad_out, q, k, v, probs, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_backward(ctx, grad_out, _grad_probs):
    q, k, v, probs = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    if not ctx.keep_probs:
        raise RuntimeError("causal_attention ran with keep_probs=False: it has no backward")
    grad_q, grad_k, grad_v = causal_attention_backward(grad_out.contiguous(), q, k, v, probs, ctx.scale)
    return grad_q, grad_k, grad_v, None, None, None


causal_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def _forward_fn(spec: _Spec, start: int = 0, rows: bool = False):
    """The pure forward for one architecture: ``(tokens, cos, sin, mask, *params) -> output``
    at positions ``start..n-1``; with ``rows``, ``(tokens, cos, sin, mask, idx, *params) ->
    [b, 1, ...]``, the output at position ``idx[i]`` of each sequence ``i``."""
    g, h, d = spec.groups, spec.heads, spec.d
    r = h // g
    tp = spec.tp_size
    if tp > 1:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region as copy_to,
        )
        from megatron.core.tensor_parallel.mappings import (
            reduce_from_tensor_model_parallel_region as reduce_from,
        )
    else:
        copy_to = reduce_from = None

    def norm(x, w, b):
        if spec.rms:
            return F.rms_norm(x, (spec.hidden,), w, spec.eps)
        return F.layer_norm(x, (spec.hidden,), w, b, spec.eps)

    def head_norm(x, w, b, kind):  # a q or k norm: over each head's d values
        rms, eps = kind
        if rms:
            return F.rms_norm(x, (d,), w, eps)
        return F.layer_norm(x, (d,), w, b, eps)

    lora_targets, lora_scale = spec.lora or ((), 0.0)

    def col(x, w, b, ab=None, late_bias=False):
        """Column-parallel linear: the input is replicated, its grad all-reduced. ``ab``: its
        LoRA (A, B), added after the bias, or (``late_bias``: Megatron's fc1 returns its bias
        apart) before it."""
        x = copy_to(x) if tp > 1 else x
        if ab is None:
            return F.linear(x, w, b)
        o = F.linear(x, w, None if late_bias else b)
        o = o + column_delta(x, ab[0], ab[1], lora_scale, tp)
        return o + b if late_bias and b is not None else o

    def row(x, w, b, ab=None):
        """Row-parallel linear: partial sums all-reduced, then its LoRA (A, B), then the bias."""
        o = F.linear(x, w)
        if tp > 1:
            o = reduce_from(o)
        if ab is not None:
            o = o + row_delta(x, ab[0], ab[1], lora_scale, tp)
        return o if b is None else o + b

    def embed(tokens, we):
        if tp == 1:
            return F.embedding(tokens, we)
        # Megatron's VocabParallelEmbedding: look up this rank's rows, zeros elsewhere, sum.
        rank = mpu.get_tensor_model_parallel_rank()
        start = rank * we.shape[0]
        outside = (tokens < start) | (tokens >= start + we.shape[0])
        x = F.embedding((tokens - start).masked_fill(outside, 0), we)
        return reduce_from(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def forward(tokens, cos, sin, mask, *p):
        b, n = tokens.shape
        if rows:
            idx, p = p[0], p[1:]
            at = torch.arange(b, device=tokens.device)
        x = embed(tokens, p[0])
        if not spec.rope:
            x = x + p[1][:n]
        i = 2
        for layer in range(spec.layers):
            n1w, n1b, wqkv, bqkv, wproj, bproj, qw, qb, kw, kb, n2w, n2b, w1, b1, w2, b2 = p[i : i + 16]
            i += 16
            ab = {}  # LoRA: target -> (A, B)
            for target in lora_targets:
                ab[target] = (p[i], p[i + 1])
                i += 2
            # The last layer's keys and values are needed at every position, everything else
            # (queries, attention output, MLP, head) only from ``start`` on.
            last = layer == spec.layers - 1
            s0 = start if last else 0
            m = n - s0
            qkv = col(norm(x, n1w, n1b), wqkv, bqkv, ab.get("linear_qkv")).view(b, n, g, r + 2, d)
            if spec.qk_norm is None:
                qk = qkv[:, :, :, : r + 1]
            else:  # each query and key head normalised on its own, before RoPE
                qn = head_norm(qkv[:, :, :, :r], qw, qb, spec.qk_norm[0])
                kn = head_norm(qkv[:, :, :, r : r + 1], kw, kb, spec.qk_norm[1])
                qk = torch.cat([qn, kn], dim=3)
            if spec.rope:
                qk = apply_rope(qk, cos, sin)
            if rows and last:  # one query per sequence, each under its own row of the mask
                q = qk[at, idx, :, :r].reshape(b * h, 1, d)
                qmask = mask[idx].unsqueeze(1).expand(b, h, n).reshape(b * h, 1, n)
            else:
                q = qk[:, s0:, :, :r].permute(0, 2, 3, 1, 4).reshape(b * h, m, d)
                qmask = mask[s0:]
            k = qk[:, :, :, r].transpose(1, 2)  # [b, g, n, d]
            v = qkv[:, :, :, r + 1].transpose(1, 2)
            if r > 1:
                k = k.unsqueeze(2).expand(b, g, r, n, d)
                v = v.unsqueeze(2).expand(b, g, r, n, d)
            k = k.reshape(b * h, n, d)
            v = v.reshape(b * h, n, d)
            keep = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            ctx = causal_attention(q, k, v, qmask, spec.scale, keep)[0]
            ctx = ctx.view(b, h, q.shape[1], d).transpose(1, 2).reshape(b, q.shape[1], h * d)
            if rows and last:
                x = x[at, idx].unsqueeze(1)
            elif s0:
                x = x[:, s0:]
            x = x + row(ctx, wproj, bproj, ab.get("linear_proj"))
            f = col(norm(x, n2w, n2b), w1, b1, ab.get("linear_fc1"), late_bias=True)
            if spec.gated:
                a, u = f.chunk(2, dim=-1)
                f = spec.act(a) * u
            else:
                f = spec.act(f)
            x = x + row(f, w2, b2, ab.get("linear_fc2"))
        x = norm(x, p[i], p[i + 1])
        w, bias = p[i + 2], p[i + 3]
        if spec.head == "lm":
            return col(x, w, None)  # [b, n, vocab shard]
        # ScalarHead: computed in fp32 whatever the weights' dtype.
        return F.linear(x.float(), w.float(), bias.float())  # [b, n, 1]

    return forward


_COMPILED: dict[tuple, object] = {}
_COMPILED_LOCK = threading.Lock()
# Compiled forwards per architecture whose last layer starts past position 0. Each is one more
# compile (tens of seconds on a CPU); a run whose shortest prompt keeps changing gets these
# many and then reuses the nearest one below its start (or the full forward).
MAX_TRIMMED_COMPILES = 4


def _own_code(fn, name: str):
    """``fn`` under a code object of its own. dynamo keeps its compiled entries and the record
    of which inputs changed between calls (which it then makes symbolic) per code object: with
    one shared code, a second ``start`` would turn every variant's constant into a symbol and
    its kernels into slower shape-generic ones."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compiled_variant(spec: _Spec, variant: int | str):
    """The compiled forward of ``variant`` (a start position, or ``"rows"``: one position per
    sequence), compiled once per architecture; the caller holds ``_COMPILED_LOCK``."""
    fn = _COMPILED.get((spec.key, variant))
    if fn is None:
        if variant == "rows":
            fn = _own_code(_forward_fn(spec, rows=True), f"forward_{spec.head}_at_rows")
        elif variant:
            fn = _own_code(_forward_fn(spec, variant), f"forward_{spec.head}_from_{variant}")
        else:
            fn = _forward_fn(spec)
        fn = _COMPILED[(spec.key, variant)] = torch.compile(fn, fullgraph=True)
    return fn


def _compiled_fn(spec: _Spec, start: int = 0) -> tuple[int, object]:
    """``(start', fn)``: the compiled forward from ``start' <= start`` on, one per architecture
    and ``start'``, shared by every model of it (policy and reference): the parameters are
    arguments, so only shapes and dtypes are guarded."""
    with _COMPILED_LOCK:
        if (spec.key, start) not in _COMPILED and start:
            trimmed = [s for k, s in _COMPILED if k == spec.key and isinstance(s, int) and s]
            if len(trimmed) >= MAX_TRIMMED_COMPILES:
                start = max((s for s in trimmed if s <= start), default=0)
        return start, _compiled_variant(spec, start)


def _compiled_rows_fn(spec: _Spec):
    """The compiled forward at one position per sequence (:meth:`FusedForward.at`), one per
    architecture: the positions are a tensor argument, so every batch's lengths share it."""
    with _COMPILED_LOCK:
        return _compiled_variant(spec, "rows")


class FusedForward:
    """``model``'s full-sequence forward, fused: ``tokens [b, s] -> [b, s, v]`` logits (this TP
    rank's vocabulary shard, model dtype) for an LM head, ``[b, s, 1]`` fp32 for a value or
    reward head, as ``GPTModel.forward(tokens, positions, attention_mask=None)`` returns them.

    Reads the model's parameters at every call, so an optimizer step or a weight load is seen
    at once. ``compiled``: run under ``torch.compile`` (TP=1 only).
    """

    def __init__(self, model: nn.Module, *, compiled: bool = False, tp_size: int = 1) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FusedForward cannot run this model: {reason}")
        if compiled and tp_size > 1:
            raise ValueError("a compiled fused forward needs tensor_parallel_size 1")
        self.model = model
        self.compiled = compiled
        self.spec = _Spec(model, tp_size)
        self._fns: dict[int, tuple[int, object]] = {}  # start -> (start taken, forward)
        self._rows_fn = None
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tables_for(self, n: int, dtype: torch.dtype, device: torch.device):
        """(cos, sin with its first half negated, causal mask) for ``n`` positions, cached."""
        key = (n, dtype, device)
        t = self._tables.get(key)
        if t is None:
            mask = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu_(1)
            if self.spec.rope:
                cos, sin = rope_tables(self.model, n, self.spec.d, dtype, device)
            else:
                cos = sin = mask.new_zeros(())
            t = (cos, sin, mask)
            self._tables = {key: t}  # one length at a time is the common case
        return t

    def _inputs(self, n: int):
        """(parameters, cos, sin, causal mask) for a forward over ``n`` positions."""
        params = _params(self.model, self.spec)
        return (params, *self._tables_for(n, params[0].dtype, params[0].device))

    def __call__(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The output at positions ``start..s-1`` (``[b, s - start, ...]``). Every layer but the
        last runs at all positions (later positions attend to them); the last one computes its
        keys and values everywhere and the rest from ``start`` on (compiled: from the start of
        the nearest compiled variant at or below it, see ``MAX_TRIMMED_COMPILES``)."""
        n = tokens.shape[1]
        if not 0 <= start < n:
            raise ValueError(f"start={start}: expected 0 <= start < {n} (the sequence length)")
        params, cos, sin, mask = self._inputs(n)
        fn = self._fns.get(start)
        if fn is None:
            fn = _compiled_fn(self.spec, start) if self.compiled else (start, _forward_fn(self.spec, start))
            self._fns[start] = fn
        taken, fn = fn
        out = fn(tokens, cos, sin, mask, *params)
        return out[:, start - taken :] if start != taken else out

    def at(self, tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The output at position ``idx[i]`` of each sequence ``i`` (``[b, 1, ...]``): a reward
        model's score at each sequence's last token. The last layer runs only there (its keys
        and values everywhere); one compiled variant serves every ``idx``."""
        b, n = tokens.shape
        if idx.shape != (b,):
            raise ValueError(f"idx has shape {tuple(idx.shape)}: expected ({b},), one position per sequence")
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < n):
            raise ValueError(f"idx must lie in [0, {n}) (the sequence length), got {idx.tolist()}")
        params, cos, sin, mask = self._inputs(n)
        if self._rows_fn is None:
            self._rows_fn = (
                _compiled_rows_fn(self.spec) if self.compiled else _forward_fn(self.spec, rows=True)
            )
        return self._rows_fn(tokens, cos, sin, mask, idx.to(tokens.device, torch.int64), *params)
