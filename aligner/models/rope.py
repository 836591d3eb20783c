"""Rotary position embeddings (RoPE): their frequencies, and their tables in Megatron's order
of rounding.

:func:`inverse_frequencies` computes a model's RoPE frequencies from its :class:`ModelConfig`
(plain, or with Llama 3.1's ``llama3`` scaling computed exactly as ``transformers`` does);
:mod:`aligner.models.gpt` installs them in the model's rotary embedding
(``model.rotary_pos_emb.inv_freq``), where every forward reads them.

The tables are shared by the forwards written over a ``GPTModel``'s own parameters (the lean
KV-cache decoder in :mod:`aligner.generation.decoder`, the fused forward in
:mod:`aligner.models.fused`), so both compute bit for bit what Megatron's rotary embedding
does: :func:`rope_tables` builds ``(cos, sin)`` from the model's own ``rotary_pos_emb``,
:func:`apply_rope` applies them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["inverse_frequencies", "llama3_scaled", "rope_tables", "rotary_tables", "apply_rope"]


def llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3``), the formula of
    ``transformers.modeling_rope_utils._compute_llama3_parameters`` op for op.

    With wavelength ``w = 2*pi/f`` of each frequency ``f``: where ``w`` is below
    ``original_max_position / high_freq_factor``, ``f`` is kept; above
    ``original_max_position / low_freq_factor``, it becomes ``f / factor``; in between,
    ``(1 - s) * f / factor + s * f`` with ``s = (original_max_position / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)``. (Megatron's own ``rope_scaling`` fixes the last three
    parameters at 1, 4 and 8192.)
    """
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inverse_frequencies(cfg, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies for ``cfg`` (a :class:`~aligner.models.config.ModelConfig`),
    ``[head_dim / 2]`` fp32: ``1 / rotary_base ** (2i / head_dim)`` as Megatron's and
    transformers' rotary embeddings compute them, then ``cfg.rope_scaling``'s scaling
    (:func:`llama3_scaled`)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    if cfg.rope_scaling is None:
        return inv_freq
    if cfg.rope_scaling == "llama3":
        return llama3_scaled(
            inv_freq,
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_position,
        )
    raise ValueError(f"rope_scaling={cfg.rope_scaling!r}: expected None or 'llama3'")


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
