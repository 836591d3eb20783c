"""A fused full-sequence forward over a Megatron-core ``GPTModel``'s own parameters.

Why: the training forward and backward, and the no-grad log-prob, value and score forwards,
are most of a PPO step. On a CPU, Megatron's local-spec modules spend a large share of that in
small element-wise kernels and copies: the ``[s, b, h]`` layout and its transposes, separate
RoPE passes for queries and keys with ``cat``-based half rotation, module-call and autograd
``Function`` overhead per linear; on any device their attention keeps the ``[b, heads, s, s]``
probabilities for the backward. This module computes the same function, on the same parameter
tensors (gradients land in ``param.grad`` as usual), in a batch-first layout with the fewest
ops:

- ``eager``: plain torch ops, attention by ``scaled_dot_product_attention``
  (:mod:`aligner.models.attention`: flash or memory-efficient kernels, grouped-query attention
  without repeated keys and values); Megatron's order of rounding everywhere else (RoPE as
  ``t*cos + rotate_half(t)*sin`` in the model dtype), and under tensor parallelism the same
  collectives, through Megatron's own autograd mappings (``copy_to``/
  ``reduce_from_tensor_model_parallel_region``, the vocabulary-parallel embedding's masked
  lookup and all-reduce);
- ``compiled``: the same function under ``torch.compile(fullgraph=True)`` (TP=1): inductor
  fuses the norms, RoPE, SwiGLU and residual adds, forward and backward. Compiling takes
  seconds to tens of seconds per shape on a CPU (cached on disk between processes), so it pays
  off in long runs, not in tests.

Outputs equal Megatron's to the attention kernels' round-off, not bit for bit (their scores
are accumulated in another order, and kept in fp32 in a bf16 model); the tests state the gaps.

Activation recompute (``model.recompute: full``, Megatron's ``recompute_granularity="full"``):
each transformer layer runs under ``torch.utils.checkpoint`` (non-reentrant) when gradients are
being recorded, keeping only its input; the backward runs the layer again. Gradients are the
same as without, bit for bit (the same kernels on the same inputs).

Packed rows (:meth:`FusedForward.packed`, :mod:`aligner.models.packing`): the same layers over
rows laid end to end in one ``[1, T]`` sequence, RoPE (or the learned position embedding) read
at each token's position in its own row, attention causal within each row
(:func:`~aligner.models.attention.varlen_causal_attention`); the outputs are the padded
forward's at the real positions, to round-off (``tests/models/test_packing.py``).

Only models whose forward this reproduces take this path (:func:`unsupported_reason`: the
local layer spec ``aligner.models.gpt`` builds, no dropout, no pipeline stages); anything else
runs Megatron's forward. A model with LoRA adapters (:mod:`aligner.models.lora`) runs each
adapter's low-rank path unmerged, with the arithmetic and the collectives of the module
forward's hooks (no LoRA dropout: with it, Megatron's forward); ``tests/models/test_lora.py``
checks it. ``tests/models/test_fused_forward.py`` compares logits, values, scores and every
parameter's gradient with Megatron's, at TP=1 and TP=2, with and without recompute.
"""

from __future__ import annotations

import shutil
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from aligner.models import local_spec
from aligner.models.attention import (
    causal_attention,
    grouped_attention,
    heads_last,
    queries_by_group,
    varlen_causal_attention,
)
from aligner.models.config import FORWARD_MODES
from aligner.models.lora import TARGETS as LORA_TARGETS
from aligner.models.lora import column_delta, lora_config_of, row_delta
from aligner.models.packing import PackedRows
from aligner.models.rope import apply_rope, rope_tables

__all__ = ["FORWARD_MODES", "FusedForward", "unsupported_reason", "resolve_forward", "compile_available"]


def unsupported_reason(model: nn.Module) -> str | None:
    """None when :class:`FusedForward` computes what ``model``'s forward does (its output and
    every gradient, to the attention kernels' round-off), else why not."""
    reason = local_spec.unsupported_reason(model, heads=("lm", "value", "reward"))
    if reason is not None:
        return reason
    lcfg = lora_config_of(model)
    if lcfg is not None and lcfg.dropout:
        return f"LoRA dropout (lora.dropout={lcfg.dropout})"
    cfg = model.config
    if cfg.hidden_dropout or cfg.attention_dropout:
        return f"dropout (hidden {cfg.hidden_dropout}, attention {cfg.attention_dropout})"
    if getattr(cfg, "recompute_granularity", None) not in (None, "full"):
        return (
            f"activation recompute {cfg.recompute_granularity!r} (the fused forward recomputes "
            "whole layers: recompute_granularity 'full')"
        )
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
        # Megatron's full recompute: every layer checkpointed (its method and layer count
        # only trade memory for time the same way; per layer here).
        self.recompute = getattr(cfg, "recompute_granularity", None) == "full"
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
            self.recompute,
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


def _forward_fn(spec: _Spec, start: int = 0, rows: bool = False, packed: bool = False):
    """The pure forward for one architecture: ``(tokens, cos, sin, allowed, *params) -> output``
    at positions ``start..n-1``; with ``rows``, ``(tokens, cos, sin, allowed, idx, *params) ->
    [b, 1, ...]``, the output at position ``idx[i]`` of each sequence ``i``. ``allowed``: the
    causal mask ``[n, n]``, True on and below the diagonal (read only where queries start
    past position 0).

    With ``packed`` (:mod:`aligner.models.packing`): ``tokens [1, T]`` are rows laid end to end,
    ``cos``, ``sin`` ``[1, T, 1, 1, d]`` the tables at each token's position in its row,
    ``allowed`` the rows' ``(cu_seqlens, bounds, max_len)`` (without RoPE, ``cos`` is the position
    ids ``[1, T]``, for the learned position embeddings), and ``idx`` None or ``[T']``: the
    packed positions at which the last layer runs its output projection, MLP and head (its
    attention, a small part of it, runs everywhere) -> ``[1, T or T', ...]``."""
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

    n_lora = 2 * len(lora_targets)

    def layer(x, cos, sin, allowed, idx, lp, last):
        """One transformer layer on ``x`` ``[b, n, hidden]``; ``lp``: its 16 tensors, then each
        adapted linear's (A, B). The last layer's keys and values are needed at every position,
        everything else (queries, attention output, MLP, head) only from ``start`` on, or (with
        ``rows``) at position ``idx[i]`` of each sequence."""
        n1w, n1b, wqkv, bqkv, wproj, bproj, qw, qb, kw, kb, n2w, n2b, w1, b1, w2, b2 = lp[:16]
        ab = dict(zip(lora_targets, zip(lp[16::2], lp[17::2])))  # LoRA: target -> (A, B)
        b, n = x.shape[:2]
        qkv = col(norm(x, n1w, n1b), wqkv, bqkv, ab.get("linear_qkv")).view(b, n, g, r + 2, d)
        if spec.qk_norm is None:
            qk = qkv[:, :, :, : r + 1]
        else:  # each query and key head normalised on its own, before RoPE
            qn = head_norm(qkv[:, :, :, :r], qw, qb, spec.qk_norm[0])
            kn = head_norm(qkv[:, :, :, r : r + 1], kw, kb, spec.qk_norm[1])
            qk = torch.cat([qn, kn], dim=3)
        if spec.rope:
            qk = apply_rope(qk, cos, sin)
        k = qk[:, :, :, r].transpose(1, 2)  # [b, g, n, d]
        v = qkv[:, :, :, r + 1].transpose(1, 2)
        if packed:  # b == 1: causal attention within each row, never across rows
            cu, bounds, max_len = allowed
            q = qk[0, :, :, :r].reshape(n, h, d)  # heads ordered (group, r)
            kv = qk[0, :, :, r], qkv[0, :, :, r + 1]  # [T, g, d]
            ctx = varlen_causal_attention(q, *kv, cu, bounds, max_len, spec.scale)
            ctx = ctx.reshape(1, n, h * d)
            if last and idx is not None:
                ctx, x = ctx[:, idx], x[:, idx]
            x = x + row(ctx, wproj, bproj, ab.get("linear_proj"))
        elif rows and last:  # one query per sequence, under its own row of the causal mask
            at = torch.arange(b, device=x.device)
            q = queries_by_group(qk[at, idx, :, :r].unsqueeze(1))  # [b, g, r, d]
            ctx = grouped_attention(q, k, v, spec.scale, allowed[idx].view(b, 1, 1, n))
            x = x[at, idx].unsqueeze(1)
        elif last and start:  # queries at start..n-1: those rows of the mask, for each head
            q = queries_by_group(qk[:, start:, :, :r])  # [b, g, r * (n - start), d]
            ctx = grouped_attention(q, k, v, spec.scale, allowed[start:].repeat(r, 1))
            x = x[:, start:]
        else:
            q = qk[:, :, :, :r].permute(0, 2, 3, 1, 4).reshape(b, h, n, d)
            ctx = causal_attention(q, k, v, spec.scale)
        if not packed:
            x = x + row(heads_last(ctx, h), wproj, bproj, ab.get("linear_proj"))
        f = col(norm(x, n2w, n2b), w1, b1, ab.get("linear_fc1"), late_bias=True)
        if spec.gated:
            a, u = f.chunk(2, dim=-1)
            f = spec.act(a) * u
        else:
            f = spec.act(f)
        return x + row(f, w2, b2, ab.get("linear_fc2"))

    def forward(tokens, cos, sin, allowed, *p):
        n = tokens.shape[1]
        idx = None
        if rows or packed:
            idx, p = p[0], p[1:]
        x = embed(tokens, p[0])
        if not spec.rope:  # learned positions (packed: ``cos`` is the position ids, [1, T])
            x = x + (p[1][cos[0]] if packed else p[1][:n])
        # Recompute: only the layers' inputs are kept, each layer runs again in the backward.
        # No RNG state to restore: nothing on this path draws random numbers (no dropout).
        recompute = spec.recompute and torch.is_grad_enabled()
        i = 2
        for index in range(spec.layers):
            lp = p[i : i + 16 + n_lora]
            i += 16 + n_lora
            last = index == spec.layers - 1
            if recompute:
                x = checkpoint(
                    layer, x, cos, sin, allowed, idx, lp, last, use_reentrant=False, preserve_rng_state=False
                )
            else:
                x = layer(x, cos, sin, allowed, idx, lp, last)
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
        self._packed_fn = None
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # the packed forward's tables
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tables_for(self, n: int, dtype: torch.dtype, device: torch.device):
        """(cos, sin with its first half negated, the causal mask ``allowed``) for ``n``
        positions, cached."""
        key = (n, dtype, device)
        t = self._tables.get(key)
        if t is None:
            allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
            if self.spec.rope:
                cos, sin = rope_tables(self.model, n, self.spec.d, dtype, device)
            else:
                cos = sin = torch.zeros((), dtype=dtype, device=device)
            t = (cos, sin, allowed)
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
        params, cos, sin, allowed = self._inputs(n)
        fn = self._fns.get(start)
        if fn is None:
            fn = _compiled_fn(self.spec, start) if self.compiled else (start, _forward_fn(self.spec, start))
            self._fns[start] = fn
        taken, fn = fn
        out = fn(tokens, cos, sin, allowed, *params)
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
        params, cos, sin, allowed = self._inputs(n)
        if self._rows_fn is None:
            self._rows_fn = (
                _compiled_rows_fn(self.spec) if self.compiled else _forward_fn(self.spec, rows=True)
            )
        return self._rows_fn(tokens, cos, sin, allowed, idx.to(tokens.device, torch.int64), *params)

    def packed(self, rows: PackedRows, at: torch.Tensor | None = None) -> torch.Tensor:
        """The output of packed rows (:mod:`aligner.models.packing`), ``[1, T, ...]``, as the
        padded forward gives it at each row's real positions: attention stays within each
        row, positions restart at 0 in each. ``at``: ``[T']`` packed positions (sorted) where
        the last layer runs its output projection, MLP and head -> ``[1, T', ...]``; None: all.

        Always the eager function, also for a ``compiled`` forward: the per-row attention and a
        total length that changes with every batch do not fit one compiled graph."""
        params = _params(self.model, self.spec)
        dtype, device = params[0].dtype, params[0].device
        pos = rows.position_ids
        if self.spec.rope:
            # The longest tables built so far serve every shorter row (position p's entry does
            # not depend on the table's length).
            cos, sin = self._rope.get((dtype, device), (None, None))
            if cos is None or cos.shape[1] < rows.max_len:
                cos, sin = rope_tables(self.model, rows.max_len, self.spec.d, dtype, device)
                self._rope[(dtype, device)] = (cos, sin)
            cos, sin = cos[:, pos[0]], sin[:, pos[0]]  # [1, T, 1, 1, d]: each token's position
        else:
            cos = sin = pos
        if self._packed_fn is None:
            self._packed_fn = _forward_fn(self.spec, packed=True)
        bounds = (rows.cu_seqlens, rows.bounds, rows.max_len)
        return self._packed_fn(rows.tokens, cos, sin, bounds, at, *params)
