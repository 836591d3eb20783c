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

The results equal Megatron's attention (scaled ``baddbmm``, fp32 softmax, ``bmm``) to the
kernels' round-off, not bit for bit: the kernels accumulate in another order and, in bf16, keep
the scores in fp32 where Megatron rounds them to bf16. ``tests/models/test_fused_forward.py``
states the measured gaps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_attention", "grouped_attention", "queries_by_group", "heads_last"]


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
