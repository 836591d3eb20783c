"""Rotary position embeddings (RoPE) as tables, in Megatron's order of rounding.

Shared by the forwards written over a ``GPTModel``'s own parameters (the lean KV-cache
decoder in :mod:`aligner.generation.lean`, the fused forward in :mod:`aligner.models.fused`),
so both compute bit for bit what Megatron's rotary embedding does: :func:`rope_tables` builds
``(cos, sin)`` from the model's own ``rotary_pos_emb``, :func:`apply_rope` applies them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["rope_tables", "rotary_tables", "apply_rope"]


def rope_tables(
    model: nn.Module, n: int, d: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_tables` of the model's own rotary embedding (``model.rotary_pos_emb``)."""
    return rotary_tables(model.rotary_pos_emb, n, d, dtype, device)


def rotary_tables(
    rotary: nn.Module, n: int, d: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``(cos, sin)`` for positions ``[0, n)`` of head dim ``d`` from Megatron's
    ``RotaryEmbedding`` ``rotary``, each ``[1, n, 1, 1, d]`` in ``dtype``, with sin's first half
    negated: then ``RoPE(x) = x*cos + roll(x, d/2)*sin``.

    Megatron's ``emb`` is ``cat(freqs, freqs)`` and RoPE is ``x*cos + rotate_half(x)*sin`` with
    ``rotate_half([x1, x2]) = [-x2, x1] = swap_halves(x) * [-1, 1]``; the sign folded into sin
    is exact (negation commutes with rounding), and cos/sin are rounded to the model dtype as
    Megatron rounds them.
    """
    emb = rotary.get_emb(n).reshape(n, d).float().to(device)
    cos, sin = emb.cos(), emb.sin()
    sin = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1)
    return cos.to(dtype).view(1, n, 1, 1, d), sin.to(dtype).view(1, n, 1, 1, d)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` (head dim last) with :func:`rope_tables`' ``(cos, sin)``, in Megatron's
    order of rounding: ``t*cos + rotate_half(t)*sin``, three ops."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
