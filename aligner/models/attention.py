"""Attention for the forwards written over a ``GPTModel``'s own parameters: the fused
full-sequence forward (:mod:`aligner.models.fused`) and the lean KV-cache decoder
(:mod:`aligner.generation.decoder`).

Both call :func:`torch.nn.functional.scaled_dot_product_attention` (SDPA), which picks a kernel
per device: on a GPU flash attention (causal, no mask) or the memory-efficient kernel (with a
mask), on a CPU its own flash kernel. None of them keeps the ``[b, heads, s, s]`` probabilities
for the backward, as Megatron's local-spec ``DotProductAttention`` does: the backward recomputes
them block by block from the queries, keys and the softmax's row statistics.

Grouped-query attention (``g`` key/value groups of ``r = heads / g`` query heads each, heads
ordered ``(group, r)`` as Megatron lays them out) never repeats the keys and values ``r`` times:

- :func:`causal_attention` (every query position against every key position, under the causal
  mask) passes ``enable_gqa``, which the flash kernels read group by group;
- :func:`grouped_attention` (queries at some positions only, under a mask of the caller's) lays
  the ``r`` query heads of a group out as rows of one "head" per group: ``q [b, g, r * m, d]``
  against ``k, v [b, g, t, d]`` is plain multi-head attention with ``g`` heads, whichever kernel
  SDPA picks (the memory-efficient kernel, which a mask needs on a GPU, takes no ``enable_gqa``).

Packed rows (:mod:`aligner.models.packing`: rows laid end to end in one sequence, ``cu_seqlens``
their bounds) go through :func:`varlen_causal_attention`, causal within each row and never across
rows: on a GPU, in fp16/bf16, PyTorch's varlen flash kernel (``torch.nn.attention.varlen``)
where the installed torch has it; elsewhere one causal SDPA per row. (On a CPU the per-row loop
beats one SDPA over the whole packed sequence under a block-diagonal mask: that costs ``T^2``
scores, the loop ``sum(length^2)``; ``benchmarks/bench_packing.py`` measures both.)

The results equal Megatron's attention (scaled ``baddbmm``, fp32 softmax, ``bmm``) to the
kernels' round-off, not bit for bit: the kernels accumulate in another order and, in bf16, keep
the scores in fp32 where Megatron rounds them to bf16. ``tests/models/test_fused_forward.py``
states the measured gaps.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

__all__ = [
    "causal_attention",
    "grouped_attention",
    "queries_by_group",
    "heads_last",
    "varlen_causal_attention",
    "block_causal_mask",
]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention: ``q`` ``[b, h, n, d]``, ``k``, ``v`` ``[b, g, n, d]`` (``g``
    divides ``h``; query head ``i`` reads group ``i // (h / g)``) -> ``[b, h, n, d]``. Position
    ``i`` attends to positions ``0..i``."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of each group's query rows to that group's keys: ``q`` ``[b, g, m, d]`` (the
    ``r`` query heads of a group times their positions, as :func:`queries_by_group` lays them
    out), ``k``, ``v`` ``[b, g, t, d]`` -> ``[b, g, m, d]``. ``mask``: broadcastable to ``[b, g,
    m, t]``, bool (True: attend) or additive in ``q``'s dtype (0 or -inf); None: every row
    attends to all ``t`` keys."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def queries_by_group(q: torch.Tensor) -> torch.Tensor:
    """Queries ``[b, m, g, r, d]`` (positions, then heads as ``(group, r)``) -> ``[b, g, r * m,
    d]``, the rows of :func:`grouped_attention`: row ``j * m + i`` is head ``j`` of the group at
    position ``i``."""
    b, m, g, r, d = q.shape
    return q.permute(0, 2, 3, 1, 4).reshape(b, g, r * m, d)


def heads_last(ctx: torch.Tensor, heads: int) -> torch.Tensor:
    """An attention context ``[b, h, m, d]``, or :func:`grouped_attention`'s ``[b, g, r * m, d]``
    (the same memory), -> ``[b, m, h * d]``, the input of the output projection."""
    b, d = ctx.shape[0], ctx.shape[-1]
    m = ctx.shape[1] * ctx.shape[2] // heads
    return ctx.reshape(b, heads, m, d).transpose(1, 2).reshape(b, m, heads * d)


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bounds: list[int],
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal self-attention within each of the packed rows: ``q`` ``[T, h, d]``, ``k``, ``v``
    ``[T, g, d]`` (``g`` divides ``h``, query head ``i`` reads group ``i // (h / g)``) ->
    ``[T, h, d]``. Row ``i`` is positions ``bounds[i]..bounds[i+1]-1``; ``cu_seqlens`` ``[n+1]``
    int32 holds the same bounds on ``q``'s device (for the kernel, without a device sync),
    ``max_len`` the longest row. A position attends to the positions of its row up to itself.
    """
    kernel = _varlen_kernel(q, k)
    if kernel is not None:
        return kernel(q, k, v, cu_seqlens, max_len, scale)
    gqa = k.shape[1] != q.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first: [h|g, T, d]
    out = [
        F.scaled_dot_product_attention(
            qh[None, :, a:e], kh[None, :, a:e], vh[None, :, a:e], is_causal=True, scale=scale, enable_gqa=gqa
        )[0]  # [h, length, d]
        for a, e in zip(bounds[:-1], bounds[1:])
    ]
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).transpose(0, 1)


def block_causal_mask(bounds: list[int], device: torch.device | None = None) -> torch.Tensor:
    """``[T, T]`` bool, True where packed position ``i`` may attend to ``j``: the same row and
    ``j <= i``. One SDPA under it is the alternative to :func:`varlen_causal_attention`'s loop
    (``T^2`` scores, not ``sum(length^2)``); kept for ``benchmarks/bench_packing.py``."""
    lengths = torch.tensor([e - a for a, e in zip(bounds[:-1], bounds[1:])])
    row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return (row[:, None] == row[None, :]).tril_().to(device)  # [T, T]


@functools.lru_cache(maxsize=1)
def _varlen_api():
    """``(varlen_attn, how it is told "causal", whether it takes enable_gqa)`` of the installed
    torch, or None (then the per-row loop): the function is new (torch 2.9+) and its signature
    moved (``is_causal=True`` at first, later ``window_size=(-1, 0)``); ``scale``, which the
    model's softmax scale needs, and ``enable_gqa`` came later."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def _varlen_applies(q: torch.Tensor) -> bool:
    """Whether the flash kernel takes queries like ``q`` ``[T, h, d]``: on a GPU, fp16 or bf16,
    a head dim that is a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _varlen_kernel(q: torch.Tensor, k: torch.Tensor):
    """The varlen flash kernel as ``(q, k, v, cu_seqlens, max_len, scale) -> [T, h, d]`` where
    it applies (CUDA, fp16/bf16, a head dim flash takes, the API present), else None (the
    per-row loop)."""
    if not _varlen_applies(q):
        return None
    api = _varlen_api()
    if api is None:
        return None
    varlen_attn, causal, takes_gqa = api
    r = q.shape[1] // k.shape[1]

    def run(q, k, v, cu, max_len, scale):
        gqa = {}
        if r > 1:
            if takes_gqa:
                gqa = {"enable_gqa": True}
            else:  # an older kernel: every query head its own keys (head i reads group i // r)
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        return varlen_attn(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu,
            cu,
            max_len,
            max_len,
            scale=scale,
            **causal,
            **gqa,
        )

    return run
