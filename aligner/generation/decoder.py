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
- *ragged batches*: every row has its own length. A row's cache slot is its position (prompt
  at slots ``[0, prompt_len)``, response after it), so a row's RoPE angle and its attention
  range are its own and rows never see padding. The prefill packs the prompts (the linears run
  on the real tokens only, no padding) and runs causal attention per run of equally long rows;
  a decode step takes one position per row (``pos`` ``[b]``), writes each row's key and value
  at its own slot and attends each row to its slots ``[0, pos]``;
- attention by ``scaled_dot_product_attention`` (:mod:`aligner.models.attention`: flash or
  memory-efficient kernels, no ``[b, heads, s, s]`` scores kept): the prefill causal with
  grouped-query attention read group by group, a decode step with the ``r`` query heads of a
  group as the rows of one query against that group's cached keys (no keys or values repeated);
- a cache of keys and values ``[b, groups, capacity, d]``, contiguous, the capacity growing in
  chunks as asked (:class:`~aligner.generation.steppers.LeanStepper` lays out all positions at
  once, except for a compiled step). The eager decode step cuts the rows into *spans* of similar
  lengths (:func:`attention_spans`; rows sorted by length make them contiguous) and attends each
  span over its own longest range, under a per-row mask, so a short row does not read the long
  rows' positions; the fixed-shape step attends over the whole capacity under a mask;
- rows that have stopped stop costing: the eager step takes the cache row of each row it
  computes (``rows``), so stopped rows are simply left out, their cache rows unread; and
  :meth:`LeanDecoder.compact` gathers the rows still generating into the front of the other
  half of the cache's double buffer (what the fixed-shape step needs);
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
positions filled so far, span by span (fewest operations, the CPU default).
:meth:`LeanDecoder.decode_static` keeps every shape fixed (positions are a tensor, attention runs
over the whole capacity under a mask built on the device), which is what a CUDA graph can
capture and replay and what ``torch.compile`` turns into one set of fused kernels for every
position (:mod:`aligner.generation.decode_steps`).

Only architectures that :func:`aligner.models.local_spec.unsupported_reason` accepts take
this path (the local layer spec ``aligner.models.gpt`` builds: pre-norm, RMSNorm/LayerNorm,
RoPE (plain or scaled) or learned absolute positions, MHA/GQA/MQA of any head width, optional
q/k norms per head, optional biases, gated or plain MLP, tied or untied head, TP without
sequence parallelism); anything else uses Megatron's own forward. The tests compare both with
a full-recompute forward, and owned weights with the module's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aligner.generation.weights import ModuleWeights, OwnedWeights
from aligner.models.attention import causal_attention, grouped_attention, heads_last
from aligner.models.rope import apply_rope, rotary_tables

__all__ = ["LeanDecoder", "attention_spans", "onednn_linear_available"]

_ONEDNN_OK: bool | None = None

#: A span of the eager decode step (:func:`attention_spans`): rows ``[l0, l1)`` of the batch,
#: cache rows ``[c0, c0 + l1 - l0)``, attend over slots ``[0, end)``, under a per-row mask when
#: ``masked`` (some row of it ends before ``end``).
Span = tuple[int, int, int, int, bool]


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


def attention_spans(
    ends: Sequence[int], rows: Sequence[int] | None = None, ratio: float = 0.9, max_spans: int = 16
) -> list[Span] | None:
    """Cut a batch into spans of consecutive rows for the eager decode step: ``ends[i]`` is how
    many slots row ``i`` attends over, ``rows[i]`` its row in the cache (increasing; None: row
    ``i``). A span is rows ``[l0, l1)`` of the batch, cache rows ``[c0, c0 + l1 - l0)``, and
    attends over its longest row's range, masking the rest: ``(l0, l1, c0, end, masked)``.

    A span grows while every row in it reads at least ``ratio`` of the span's range (so at most
    ``1 - ratio`` of what it reads is masked out) and its cache rows follow one another; the
    last of ``max_spans`` takes the remaining rows (each span is one attention call per layer).
    Returns None when gaps between cache rows alone need more than ``max_spans`` spans (the
    caller gathers its rows together first: :meth:`LeanDecoder.compact`). Rows sorted by
    length, longest first, give the fewest spans; any order is correct."""
    spans: list[Span] = []
    n, i = len(ends), 0
    while i < n:
        hi = lo = ends[i]
        j = i + 1
        last = len(spans) == max_spans - 1
        while j < n:
            if rows is not None and rows[j] != rows[j - 1] + 1:
                if last:
                    return None
                break
            e = ends[j]
            new_hi, new_lo = max(hi, e), min(lo, e)
            if not last and new_lo < ratio * new_hi:
                break
            hi, lo = new_hi, new_lo
            j += 1
        spans.append((i, j, i if rows is None else rows[i], hi, lo != hi))
        i = j
    return spans


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
    """Prefill + one-token decode steps of a ``GPTModel``'s weights with a private KV cache,
    each row of the batch at its own position.

    Usage per generation call: :meth:`begin` (binds the current weights, makes the cache ready
    for ``batch`` rows of up to ``max_len`` positions), :meth:`prefill` of each row's prompt,
    then :meth:`decode` (or :meth:`decode_static`) one position per row at a time, optionally
    :meth:`compact` to drop rows, :meth:`end` (unbinds; frees the cache unless it is kept).

    A row's cache slot is its position. The cache of a layer holds keys and values as
    ``[b, groups, capacity, d]``, contiguous. ``capacity`` grows in steps of ``chunk`` positions
    as the sequence does (re-laid out into the other half of a double buffer, a fraction of a
    step's reading every ``chunk`` steps). :meth:`decode` attends each row over its filled
    positions; :meth:`decode_static` over the whole capacity reserved so far (all of
    ``max_len`` unless told otherwise), each row's unfilled tail masked out.

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
        # The decode steps' masks: 0 at the positions up to a row's current one, -inf after.
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
        self._relayout(None, self.batch, min(self.max_len, -(-end // self.chunk) * self.chunk))

    def compact(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (``[b']`` int64 on the cache's device, ``b' <= batch``; a row may
        appear twice) as rows ``0..b'-1``: each layer's cache is gathered into the other half of
        the double buffer, a read of the kept rows' filled capacity, once."""
        b = int(index.numel())
        if b > self.batch:
            raise ValueError(f"compact: {b} rows asked for, the cache holds {self.batch}")
        self._relayout(index, b, self.capacity)

    def _relayout(self, index: torch.Tensor | None, batch: int, capacity: int) -> None:
        """Move the cache into the other half as ``[batch, groups, capacity, d]``: rows
        ``index`` of it (None: every row), the filled capacity copied, the rest zeroed."""
        g, d, old = self.groups, self.d, self.capacity
        half = 1 - self._half
        n = batch * g * capacity * d
        for i, L in enumerate(self.layers):
            moved = []
            for kv, cur in enumerate((L.k, L.v) if old else (None, None)):
                new = self._buffer(i, kv, half)[:n].view(batch, g, capacity, d)
                if cur is None:
                    new.zero_()
                elif index is not None:  # same capacity: a gather straight into the new half
                    torch.index_select(cur, 0, index, out=new)
                else:  # grown: the filled part moves, the tail starts at zero
                    new[:, :, :old].copy_(cur)
                    new[:, :, old:].zero_()
                moved.append(new)
            L.k, L.v = moved
        self._half, self.batch, self.capacity = half, batch, capacity

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

    def _embed_at(self, tokens: torch.Tensor, pos: torch.Tensor) -> tuple:
        """Token embeddings at positions ``pos`` (same shape as ``tokens``, ``[b, n]``): ``x``
        ``[b, n, h]`` (learned positions added) and RoPE's ``(cos, sin)`` ``[b, n, 1, 1, d]``
        (None without RoPE)."""
        x = self._embed(tokens)
        if not self.rope:
            return x + F.embedding(pos, self.pos_weight), None, None
        shape = (*pos.shape, 1, 1, self.d)
        flat = pos.reshape(-1)
        return x, self.cos.index_select(1, flat).view(shape), self.sin.index_select(1, flat).view(shape)

    @staticmethod
    def _attention_reduced(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor
    ) -> torch.Tensor:
        """:func:`~aligner.models.attention.grouped_attention` (``q`` ``[b, g, m, d]``, ``keys``,
        ``values`` ``[b, g, t, d]``, ``mask`` ``[b, t]`` added to each row's scores) written as
        products and sums, accumulated in fp32 as the attention kernels do. Eagerly it
        materialises ``[b, g, m, t, d]`` products; compiled, each sum is one fused loop reading
        the cache once, which for a decode step's few query rows beats many tiny batched
        matmuls."""
        b, t = mask.shape
        scores = (q.float().unsqueeze(3) * keys.float().unsqueeze(2)).sum(-1) * scale  # [b, g, m, t]
        probs = torch.softmax(scores + mask.float().view(b, 1, 1, t), dim=-1)
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

    def prefill(
        self, tokens: torch.Tensor, lengths: Sequence[int] | None = None, first_row: int = 0
    ) -> torch.Tensor:
        """Each row's prompt into the cache: ``tokens`` ``[b, n]`` right-padded, row ``i``'s
        prompt its first ``lengths[i]`` tokens (None: all ``n``), written to cache rows
        ``first_row + i`` at slots ``[0, lengths[i])``. Returns the logits ``[b, v]`` at each
        row's last prompt position.

        The prompts are packed into one sequence of ``sum(lengths)`` tokens, so the linears
        never see padding; attention is causal within each prompt, one kernel call per run of
        consecutive rows of equal length (a sorted batch of equal prompts is one call)."""
        b, n = tokens.shape
        lens = [n] * b if lengths is None else [int(p) for p in lengths]
        if len(lens) != b or min(lens) < 1 or max(lens) > n:
            raise ValueError(f"prefill: lengths {lens} do not fit tokens of shape {tuple(tokens.shape)}")
        g, r, d = self.groups, self.r, self.d
        self.reserve(max(lens))
        dev = tokens.device
        N = sum(lens)
        # Packed index of every prompt token: row, position, offset in `tokens` (no host sync:
        # the sizes are host values).
        lens_t = torch.tensor(lens, device=dev)
        row = torch.repeat_interleave(torch.arange(b, device=dev), lens_t, output_size=N)
        start = torch.cumsum(lens_t, 0) - lens_t  # [b]: where each prompt starts in the packing
        pos = torch.arange(N, device=dev) - start[row]  # [N]
        flat = tokens.reshape(-1)[row * n + pos] if N != b * n else tokens.reshape(-1)
        x, cos, sin = self._embed_at(flat.unsqueeze(0), pos.unsqueeze(0))  # [1, N, h]
        # Runs of consecutive rows with one length: (first row, end row, length, packed start).
        runs, i, s = [], 0, 0
        while i < b:
            j = i + 1
            while j < b and lens[j] == lens[i]:
                j += 1
            runs.append((i, j, lens[i], s))
            s += (j - i) * lens[i]
            i = j

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)  # queries and key of each group
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            out = []
            for i0, i1, p, s0 in runs:
                m = i1 - i0
                part = qk[0, s0 : s0 + m * p].view(m, p, g, r + 1, d)
                k = part[:, :, :, r].transpose(1, 2)  # [m, g, p, d]
                v = qkv[0, s0 : s0 + m * p, :, r + 1].view(m, p, g, d).transpose(1, 2)
                L.k[first_row + i0 : first_row + i1, :, :p].copy_(k)
                L.v[first_row + i0 : first_row + i1, :, :p].copy_(v)
                # Causal attention within each prompt, heads ordered (group, r).
                q = part[:, :, :, :r].permute(0, 2, 3, 1, 4).reshape(m, g * r, p, d)
                out.append(heads_last(causal_attention(q, k, v, L.scale), g * r).reshape(m * p, g * r * d))
            return (out[0] if len(out) == 1 else torch.cat(out)).unsqueeze(0)

        x = self._layer_stack(x, attend)
        return self._logits(x[0].index_select(0, start + lens_t - 1))

    def decode(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor | int,
        spans: Sequence[Span] | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One position per row: row ``i``'s token ``tokens[i]`` (``[b, 1]``) at position
        ``pos[i]`` (``[b]`` int64 on the device, or an int for every row) into its cache row
        ``rows[i]`` (``[b]`` int64 on the device, increasing; None: row ``i``, ``b`` the whole
        cache), attending to its slots ``[0, pos[i]]``; the logits ``[b, v]``.

        Cache rows left out (rows that stopped) cost nothing: no copy, no reading. ``spans``
        (:func:`attention_spans` of ``pos + 1`` and the cache rows, made on the host where the
        positions are known) cut the rows into groups attended separately, each over its
        longest row's range under a per-row mask; None: made here from ``pos`` (a host sync;
        only without ``rows``)."""
        b = tokens.shape[0]
        g, r, d = self.groups, self.r, self.d
        if isinstance(pos, int):
            spans = [(0, b, 0, pos + 1, False)] if spans is None else spans
            pos = torch.full((b,), pos, dtype=torch.int64, device=tokens.device)
        if spans is None:
            spans = attention_spans([p + 1 for p in pos.tolist()], max_spans=b)
        self.reserve(max(s[3] for s in spans))
        x, cos, sin = self._embed_at(tokens, pos.view(b, 1))
        # Where each row's new key goes in a layer's cache viewed as [batch * g * capacity, d]:
        # one index_copy_ per layer (2.5x faster than scatter_ on a CPU).
        row = torch.arange(b, device=pos.device) if rows is None else rows
        at = ((row * g).view(b, 1) + torch.arange(g, device=pos.device)) * self.capacity + pos.view(b, 1)
        at = at.view(-1)
        masks = [
            torch.where(self._t_index[:end] <= pos[l0:l1, None], self._open, self._shut).view(
                l1 - l0, 1, 1, end
            )
            if masked
            else None
            for l0, l1, _, end, masked in spans
        ]

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            L.k.view(-1, d).index_copy_(0, at, qk[:, 0, :, r].reshape(b * g, d))  # slot pos[i] of row i
            L.v.view(-1, d).index_copy_(0, at, qkv[:, 0, :, r + 1].reshape(b * g, d))
            # One query position: the r query heads of a group attend to the same cached keys,
            # so they are the rows of one query per group (grouped-query for free).
            q = qk[:, 0, :, :r]  # [b, g, r, d]
            out = [
                grouped_attention(
                    q[l0:l1], L.k[c0 : c0 + l1 - l0, :, :end], L.v[c0 : c0 + l1 - l0, :, :end], L.scale, mask
                )
                for (l0, l1, c0, end, _), mask in zip(spans, masks)
            ]
            return (out[0] if len(out) == 1 else torch.cat(out)).reshape(b, 1, g * r * d)

        return self._logits(self._layer_stack(x, attend)[:, -1])

    def decode_static(
        self, tokens: torch.Tensor, pos: torch.Tensor, reduced: bool = False, grow: bool = True
    ) -> torch.Tensor:
        """:meth:`decode` with every shape fixed: ``pos`` (``[b]`` int64 on the model's device,
        or ``[1]`` for every row) as a tensor, the new keys/values written with ``scatter_`` and
        attention over the whole capacity under a per-row mask. Nothing in it depends on host
        values, so a CUDA graph can capture it once and replay it for every position, and a
        compiled version serves every position of a capacity. ``reduced``: attention as products
        and sums (:meth:`_attention_reduced`, for compiled code). ``grow``: first grow the
        capacity to ``max_len`` (a CUDA graph needs the cache's final addresses); False: attend
        over the capacity reserved so far, which the caller has made cover ``pos``."""
        b = tokens.shape[0]
        if grow:
            self.reserve(self.max_len)
        g, r, d, T = self.groups, self.r, self.d, self.capacity
        pos = pos.expand(b)
        x, cos, sin = self._embed_at(tokens, pos.view(b, 1))
        at = pos.view(b, 1, 1, 1).expand(b, g, 1, d)
        mask = torch.where(self._t_index[:T] <= pos.view(b, 1), self._open, self._shut)  # [b, T]: 0 / -inf

        def attend(qkv: torch.Tensor, L: _Layer) -> torch.Tensor:
            qk = self._queries_keys(qkv, L)
            if self.rope:
                qk = apply_rope(qk, cos, sin)
            L.k.scatter_(2, at, qk[:, :, :, r].transpose(1, 2))  # [b, g, 1, d]
            L.v.scatter_(2, at, qkv[:, :, :, r + 1].transpose(1, 2))
            q = qk[:, 0, :, :r]  # [b, g, r, d]
            if reduced:
                ctx = self._attention_reduced(q, L.k, L.v, L.scale, mask)
            else:
                ctx = grouped_attention(q, L.k, L.v, L.scale, mask.view(b, 1, 1, T))
            return ctx.reshape(b, 1, g * r * d)

        return self._logits(self._layer_stack(x, attend)[:, -1])
