"""A lean KV-cache forward over a Megatron-core ``GPTModel``'s weights: its own parameters, or
tensors an engine owns in another tensor-parallel layout.

Why: Megatron's static-batching inference path (``StaticInferenceContext``) stores keys
*before* RoPE and re-applies RoPE to the whole cached prefix at every step, and each layer
goes through autograd ``Function`` wrappers, NVTX hooks and config checks. On a CPU, where a
decode step is bound by per-op overhead and memory traffic, that path ran at about half the
speed of HF ``generate``. This module runs the same arithmetic in the fewest ops:

- plain linears on the weight tensors of a source (:mod:`aligner.generation.weights`): the
  module's own parameters (no copies: a refit is seen at once) or tensors owned in the
  generation layout; fp32 on a CPU goes through oneDNN (:func:`onednn_linear_available`),
  about 2x MKL there; norms are called as the functions the torch norm modules wrap (no
  module-call machinery per step);
- RoPE on the new positions only (the cache holds rotated keys);
- attention by ``scaled_dot_product_attention`` (:mod:`aligner.models.attention`: flash or
  memory-efficient kernels, no ``[b, heads, s, s]`` scores kept): the prefill causal with
  grouped-query attention read group by group, a decode step with the ``r`` query heads of a
  group as the rows of one query against that group's cached keys (no keys or values repeated);
- a cache of keys and values ``[b, groups, capacity, d]``, contiguous, the capacity growing in
  chunks as the sequence does; a decode step attends over the filled part (a slice; with
  fixed shapes, the whole capacity under a length mask);
- the cache storage is allocated once and kept across calls on a CPU (a fresh multi-megabyte
  buffer per call costs page faults there); on a GPU it is freed after each call (the
  caching allocator makes reallocation cheap, and the memory is the training step's);
- Megatron's order of rounding outside attention (``t*cos + rot(t)*sin``), and the same
  attention kernels as the fused training forward (:mod:`aligner.models.fused`), so log-probs
  equal the training forward's to the kernels' round-off;
- the TP collectives Megatron issues, over the group of the weights' layout: the
  vocabulary-parallel embedding's all-reduce, an all-reduce after each row-parallel
  projection, an all-gather of the logits.

Two decode steps compute the same thing. :meth:`LeanDecoder.decode` attends over the
positions filled so far (fewest operations, the CPU default). :meth:`LeanDecoder.decode_static`
keeps every shape fixed (the position is a tensor, attention runs over the whole capacity under
a mask built on the device), which is what a CUDA graph can capture and replay
(:class:`CudaGraphDecodeStep`) and what ``torch.compile`` turns into one set of fused kernels
for every position (:class:`CompiledDecodeStep`, with attention as products and sums).

Only architectures that :func:`aligner.models.local_spec.unsupported_reason` accepts take
this path (the local layer spec ``aligner.models.gpt`` builds: pre-norm, RMSNorm/LayerNorm,
RoPE (plain or scaled) or learned absolute positions, MHA/GQA/MQA of any head width, optional
q/k norms per head, optional biases, gated or plain MLP, tied or untied head, TP without
sequence parallelism); anything else uses Megatron's own forward. The tests compare both with
a full-recompute forward, and owned weights with the module's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aligner.generation.weights import ModuleWeights, OwnedWeights
from aligner.models.attention import causal_attention, grouped_attention, heads_last
from aligner.models.rope import apply_rope, rotary_tables

__all__ = [
    "LeanDecoder",
    "CudaGraphDecodeStep",
    "CompiledDecodeStep",
    "onednn_linear_available",
]

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
        "q_norm",
        "k_norm",
        "k",
        "v",
    )
    # k, v: this layer's cache, [b, groups, capacity, d] each (see LeanDecoder).


class LeanDecoder:
    """Prefill + one-token decode steps of a ``GPTModel``'s weights with a private KV cache.

    Usage per generation call: :meth:`begin` (binds the current weights, makes the cache ready
    for ``[b, T]``), :meth:`prefill` for positions ``[0, n)``, then :meth:`decode` (or
    :meth:`decode_static`) one position at a time, :meth:`end` (unbinds; frees the cache
    unless it is kept).

    The cache of a layer holds keys and values as ``[b, groups, capacity, d]``, contiguous.
    ``capacity`` grows in steps of ``chunk`` positions as the sequence does (re-laid out into
    the other half of a double buffer, a fraction of a step's reading every ``chunk`` steps).
    :meth:`decode` attends over the filled positions; :meth:`decode_static` over the whole
    capacity reserved so far (all of ``max_len`` unless told otherwise), the unfilled tail
    masked out.

    Args:
        source: where the weights come from: a whole ``GPTModel`` (its own parameters, see
            :func:`aligner.models.local_spec.unsupported_reason`; wrapped in
            :class:`~aligner.generation.weights.ModuleWeights`), or a source object such as
            :class:`~aligner.generation.weights.OwnedWeights`.
        tp_group, tp_size: the tensor-parallel group of the weights' layout.
        cpu_linear: fp32 linears on a CPU: ``"auto"``/``"onednn"`` (oneDNN) or ``"default"``.
        keep_cache: keep the cache buffers between calls; None: on a CPU yes, on a GPU no.
        chunk: positions the cache's capacity grows by.
    """

    def __init__(
        self,
        source: nn.Module | ModuleWeights | OwnedWeights,
        tp_group=None,
        tp_size: int = 1,
        cpu_linear: str = "auto",
        keep_cache: bool | None = None,
        chunk: int = 32,
    ) -> None:
        if isinstance(source, nn.Module):
            source = ModuleWeights(source)
        if cpu_linear not in ("auto", "onednn", "default"):
            raise ValueError(f"cpu_linear={cpu_linear!r}: expected 'auto', 'onednn' or 'default'")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r}: expected an integer >= 1")
        self.source = source
        # The module whose own parameters are read (None for owned weights).
        self.model = source.model if isinstance(source, ModuleWeights) else None
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.cpu_linear = cpu_linear
        self.keep_cache = keep_cache
        self.chunk = chunk
        self.layers: list[_Layer] = []
        self.linear = F.linear
        # Double-buffered flat storage: [layer][keys, values][half 0, half 1].
        self._store: list[list[list[torch.Tensor | None]]] = []
        self._store_key: tuple | None = None
        self._half = 0
        self.batch = self.max_len = self.capacity = 0

    # -- per call -------------------------------------------------------------------------

    def begin(self, batch: int, max_len: int) -> None:
        """Bind the source's current weight tensors and make the cache ready for ``batch``
        rows of up to ``max_len`` positions (its capacity starts at 0 and grows)."""
        w = self.source.bind()
        self.rope = w.rope
        self.gated = w.gated
        self.act = w.act
        self.w_emb, self.vocab_start, self.vocab_end = w.w_emb, w.vocab_start, w.vocab_end
        self.final_norm = w.final_norm
        self.w_out = w.w_out
        dtype, dev = w.w_emb.dtype, w.w_emb.device
        self.dtype, self.device = dtype, dev
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
        self.groups, self.heads, self.d = w.groups, w.heads, w.d
        self.r = self.heads // self.groups
        self.layers = []
        for lw in w.layers:
            L = _Layer()
            L.norm1, L.norm2 = lw.norm1, lw.norm2
            L.w_qkv, L.b_qkv = lw.w_qkv, lw.b_qkv
            L.w_proj, L.b_proj = lw.w_proj, lw.b_proj
            L.w_fc1, L.b_fc1 = lw.w_fc1, lw.b_fc1
            L.w_fc2, L.b_fc2 = lw.w_fc2, lw.b_fc2
            L.scale = lw.scale
            L.q_norm, L.k_norm = lw.q_norm, lw.k_norm
            self.layers.append(L)
        self.batch, self.max_len, self.capacity = batch, max_len, 0
        self._allocate(batch * self.groups * max_len * self.d)
        T = max_len
        # decode_static's mask: 0 at the positions up to the current one, -inf after.
        self._t_index = torch.arange(T, device=dev)
        self._open = torch.zeros((), dtype=dtype, device=dev)
        self._shut = torch.full((), float("-inf"), dtype=dtype, device=dev)
        if self.rope:
            self.cos, self.sin = rotary_tables(w.rotary, T, self.d, dtype, dev)
        else:
            self.pos_weight = w.pos_weight

    def _allocate(self, numel: int) -> None:
        """Room for ``numel`` elements per layer, per keys/values, per half of the double
        buffer (each half allocated when first used); a kept store that is large enough (same
        kind) is reused."""
        kind = (len(self.layers), self.dtype, self.device)
        if self._store_key is not None and self._store_key[0] == kind and self._store_key[1] >= numel:
            return
        self._store = [[[None, None], [None, None]] for _ in self.layers]  # [layer][k/v][half]
        self._store_key = (kind, numel)

    def _buffer(self, layer: int, kv: int, half: int) -> torch.Tensor:
        buf = self._store[layer][kv][half]
        if buf is None:
            # Zeros, not empty: masked positions are multiplied by probability 0 (decode_static),
            # which must not meet a NaN bit pattern.
            buf = torch.zeros(self._store_key[1], dtype=self.dtype, device=self.device)
            self._store[layer][kv][half] = buf
        return buf

    def reserve(self, end: int) -> None:
        """Make the cache hold positions ``[0, end)``: grow the capacity to ``end`` rounded up
        to a multiple of ``chunk`` (at most ``max_len``), moving what it holds."""
        if end <= self.capacity:
            return
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is beyond the cache's max_len {self.max_len}")
        new = min(self.max_len, -(-end // self.chunk) * self.chunk)
        b, g, d, old = self.batch, self.groups, self.d, self.capacity
        half = 1 - self._half
        n = b * g * new * d
        for i, L in enumerate(self.layers):
            k = self._buffer(i, 0, half)[:n].view(b, g, new, d)
            v = self._buffer(i, 1, half)[:n].view(b, g, new, d)
            if old:
                k[:, :, :old].copy_(L.k)
                v[:, :, :old].copy_(L.v)
            k[:, :, old:].zero_()
            v[:, :, old:].zero_()
            L.k, L.v = k, v
        self._half, self.capacity = half, new

    def end(self) -> None:
        """Unbind the weights; free the cache unless it is kept (see ``keep_cache``)."""
        self.layers = []
        keep = self.keep_cache
        if keep is None:
            keep = getattr(self, "device", None) is not None and self.device.type == "cpu"
        if not keep:
            self.release()

    def release(self) -> None:
        """Free the cache storage and the RoPE tables."""
        self.layers = []
        self._store = []
        self._store_key = None
        self.cos = self.sin = None
        self.capacity = 0

    # -- forward --------------------------------------------------------------------------

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, n] -> [b, n, h], as Megatron's VocabParallelEmbedding: each TP rank looks up the
        ids in its row range (zeros elsewhere) and an all-reduce sums the shards."""
        if self.tp_size > 1:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            x = F.embedding((tokens - self.vocab_start).masked_fill_(outside, 0), self.w_emb)
            return self._reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
        return F.embedding(tokens, self.w_emb)

    @staticmethod
    def _attention_reduced(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor
    ) -> torch.Tensor:
        """:func:`~aligner.models.attention.grouped_attention` (``q`` ``[b, g, m, d]``, ``keys``,
        ``values`` ``[b, g, t, d]``, ``mask`` ``[t]`` added to the scores) written as products
        and sums, accumulated in fp32 as the attention kernels do. Eagerly it materialises
        ``[b, g, m, t, d]`` products; compiled, each sum is one fused loop reading the cache
        once, which for a decode step's few query rows beats many tiny batched matmuls."""
        scores = (q.float().unsqueeze(3) * keys.float().unsqueeze(2)).sum(-1) * scale  # [b, g, m, t]
        probs = torch.softmax(scores + mask.float(), dim=-1)
        return (probs.unsqueeze(-1) * values.float().unsqueeze(2)).sum(3).to(values.dtype)

    def _queries_keys(self, qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
        """``qkv`` [b, n, g, r+2, d] -> the queries and key of each group [b, n, g, r+1, d],
        each head through the layer's q/k norm when it has them (before RoPE, as Megatron)."""
        r = self.r
        if L.q_norm is None:
            return qkv[:, :, :, : r + 1]
        return torch.cat([L.q_norm(qkv[:, :, :, :r]), L.k_norm(qkv[:, :, :, r : r + 1])], dim=3)

    def _layer_stack(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The transformer layers on ``x`` [b, n, h]; ``attend(qkv [b, n, g, r+2, d], L)``
        writes the cache and returns the attention context [b, n, heads*d]."""
        b, n = x.shape[:2]
        g, r, d = self.groups, self.r, self.d
        for L in self.layers:
            h = L.norm1(x)
            qkv = self.linear(h, L.w_qkv, L.b_qkv).view(b, n, g, r + 2, d)
            o = self._reduce(self.linear(attend(qkv, L), L.w_proj))
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
        return x

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """[b, h] final hidden state -> [b, v] logits over the full (gathered, padded) vocabulary."""
        logits = self.linear(self.final_norm(x_last), self.w_out)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions ``[0, n)`` (``tokens`` [b, n]) into the cache; the last position's logits [b, v]."""
        b, n = tokens.shape
        g, r, d = self.groups, self.r, self.d
        self.reserve(n)
        x = self._embed(tokens)
        if not self.rope:
            x = x + self.pos_weight[:n]
        cos = self.cos[:, :n] if self.rope else None
        sin = self.sin[:, :n] if self.rope else None

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)  # queries and key of each group
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            k, v = qk[:, :, :, r].transpose(1, 2), qkv[:, :, :, r + 1].transpose(1, 2)  # [b, g, n, d]
            L.k[:, :, :n].copy_(k)
            L.v[:, :, :n].copy_(v)
            # Causal attention over [0, n) from the fresh keys/values, heads ordered (group, r).
            q = qk[:, :, :, :r].permute(0, 2, 3, 1, 4).reshape(b, g * r, n, d)
            return heads_last(causal_attention(q, k, v, L.scale), g * r)

        return self._logits(self._layer_stack(x, attend)[:, -1])

    def decode(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Position ``start`` (``tokens`` [b, 1]) into the cache, attending to ``[0, start]``;
        its logits [b, v]."""
        b = tokens.shape[0]
        g, r, d = self.groups, self.r, self.d
        end = start + 1
        self.reserve(end)
        x = self._embed(tokens)
        if not self.rope:
            x = x + self.pos_weight[start:end]
        cos = self.cos[:, start:end] if self.rope else None
        sin = self.sin[:, start:end] if self.rope else None

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            L.k[:, :, start].copy_(qk[:, 0, :, r])
            L.v[:, :, start].copy_(qkv[:, 0, :, r + 1])
            # One query position: the r query heads of a group attend to the same cached keys,
            # so they are the rows of one query per group (grouped-query for free), over the
            # filled positions [0, end).
            q = qk[:, 0, :, :r]  # [b, g, r, d]
            ctx = grouped_attention(q, L.k[:, :, :end], L.v[:, :, :end], L.scale)
            return ctx.reshape(b, 1, g * r * d)

        return self._logits(self._layer_stack(x, attend)[:, -1])

    def decode_static(
        self, tokens: torch.Tensor, pos: torch.Tensor, reduced: bool = False, grow: bool = True
    ) -> torch.Tensor:
        """:meth:`decode` with every shape fixed: ``pos`` is a one-element int64 tensor on the
        model's device, the new key/value are written with ``index_copy_`` and attention runs
        over the whole capacity under a mask. Nothing in it depends on host values, so a CUDA
        graph can capture it once and replay it for every position, and a compiled version
        serves every position of a capacity. ``reduced``: attention as products and sums
        (:meth:`_attention_reduced`, for compiled code). ``grow``: first grow the capacity to
        ``max_len`` (a CUDA graph needs the cache's final addresses); False: attend over the
        capacity reserved so far, which the caller has made cover ``pos``."""
        b = tokens.shape[0]
        if grow:
            self.reserve(self.max_len)
        g, r, d, T = self.groups, self.r, self.d, self.capacity
        x = self._embed(tokens)
        if not self.rope:
            x = x + self.pos_weight.index_select(0, pos)
        cos = self.cos.index_select(1, pos) if self.rope else None
        sin = self.sin.index_select(1, pos) if self.rope else None
        mask = torch.where(self._t_index[:T] <= pos, self._open, self._shut)  # [T]: 0 / -inf

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            L.k.index_copy_(2, pos, qk[:, :, :, r].transpose(1, 2))  # [b, g, 1, d]
            L.v.index_copy_(2, pos, qkv[:, :, :, r + 1].transpose(1, 2))
            q = qk[:, 0, :, :r]  # [b, g, r, d]
            if reduced:
                ctx = self._attention_reduced(q, L.k, L.v, L.scale, mask)
            else:
                ctx = grouped_attention(q, L.k, L.v, L.scale, mask.view(1, 1, 1, T))
            return ctx.reshape(b, 1, g * r * d)

        return self._logits(self._layer_stack(x, attend)[:, -1])

    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """:meth:`prefill` at ``start == 0``, else :meth:`decode` (one position)."""
        if start == 0:
            return self.prefill(tokens)
        if tokens.shape[1] != 1:
            raise ValueError("multi-token forward is only supported from position 0")
        return self.decode(tokens, start)


class CudaGraphDecodeStep:
    """:meth:`LeanDecoder.decode_static` captured once in a CUDA graph and replayed per step.

    A decode step of a small model on a GPU is a few hundred kernel launches whose launch cost
    exceeds their work; a replayed graph launches them all at once. Inputs are copied into
    static buffers (the token column, the position) and the logits come back in a static
    buffer, valid until the next replay. Build it after :meth:`LeanDecoder.begin` and before the
    prefill: the warm-up runs write position 0 of the cache, which the prefill then overwrites.
    """

    def __init__(self, lean: LeanDecoder, batch: int) -> None:
        dev = lean.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {dev}")
        lean.reserve(lean.max_len)  # the graph reads the cache's final addresses
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel selection)
            for _ in range(2):
                lean.decode_static(self.tokens, self.pos)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = lean.decode_static(self.tokens, self.pos)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.fill_(start)
        self.graph.replay()
        return self.logits


_COMPILED_STEP = None
_RECOMPILE_LIMIT = 64


def _static_step(lean: LeanDecoder, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return lean.decode_static(tokens, pos, reduced=True, grow=False)


class CompiledDecodeStep:
    """:meth:`LeanDecoder.decode_static` under ``torch.compile(fullgraph=True)``.

    On a CPU a decode step of a small model is a few hundred small kernels whose dispatch and
    memory passes outweigh their arithmetic; inductor fuses the norms, RoPE, cache writes,
    attention and SwiGLU into a few loops around the matrix products. One compiled function
    per process serves every decoder: the decoder is an argument, so its weights, cache and
    tables are guarded by shape and dtype only, and a new batch size or cache capacity is one
    more compile (seconds, cached on disk between processes). TP=1 only.

    Attention reads the whole cache at every step, so the cache grows as the sequence does:
    its capacity doubles from ``bucket`` positions (64, 128, 256, ... up to ``max_len``), and a
    step attends over the capacity that covers its position. At 208 positions a step over all
    of them took 2.5-2.8 ms and one over 64 took 1.5-1.7 ms (64 rows, bf16, two threads), and
    a whole 192-token generation 0.45 s instead of 0.50-0.61 s. Doubling keeps the compiles to
    a few per batch size; past the first bucket no step reads more than twice the positions it
    needs.

    The first call compiles, so it is made here, before the prefill: it writes position 0 of
    the cache, which the prefill then overwrites. Logits are a fresh tensor per call.
    """

    def __init__(self, lean: LeanDecoder, batch: int, bucket: int = 64) -> None:
        global _COMPILED_STEP
        if lean.tp_size > 1:
            raise ValueError("a compiled decode step needs tensor_parallel_size 1")
        if not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket={bucket!r}: expected an integer >= 1")
        if _COMPILED_STEP is None:
            _COMPILED_STEP = torch.compile(_static_step, fullgraph=True, dynamic=False)
            # Every (batch size, capacity, architecture) is one more compiled entry of this one
            # function; dynamo's default of 8 would send the rest back to eager, silently.
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, _RECOMPILE_LIMIT)
        # Plain linears: inductor chooses the fp32 GEMM itself (it cannot lower the direct
        # oneDNN call the eager path makes).
        lean.linear = F.linear
        self.lean = lean
        self.bucket = bucket
        self.fn = _COMPILED_STEP
        self.pos = torch.zeros(1, dtype=torch.int64, device=lean.device)
        self(torch.zeros(batch, 1, dtype=torch.int64, device=lean.device), 0)

    def capacity_for(self, start: int) -> int:
        """The capacity a step at position ``start`` attends over: ``bucket`` doubled until it
        covers ``start``, at most ``max_len``."""
        c = self.bucket
        while c <= start:
            c *= 2
        return min(c, self.lean.max_len)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        lean = self.lean
        need = self.capacity_for(start)
        if lean.capacity < need:
            # reserve() rounds up to its chunk; a bucket boundary is reached exactly when the
            # chunk divides it (a capacity that overshoots just compiles once more).
            lean.reserve(need)
        self.pos.fill_(start)
        return self.fn(lean, tokens, self.pos)
