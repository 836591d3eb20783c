"""The forwards of the models :mod:`aligner.models.gpt` builds: a policy's logits, a critic's
values per token, a reward model's scores per sample, each run either by Megatron's module
forward or by the fused forward over the model's own parameters (:mod:`aligner.models.fused`),
as :func:`set_forward` chose for that model.

Each has a packed variant (``*_packed``) over :class:`~aligner.models.packing.PackedRows`: the
rows laid end to end without padding, attention within each row only, positions restarting at
0 in each, results per packed position (``[1, T, ...]``), equal to the padded forward's at the
rows' real positions. The fused forward runs them packed (varlen attention). Megatron's module
forward cannot keep rows apart in one sequence without Transformer Engine's fused attention, so
with it the packed variants unpack the rows into a padded batch of their own longest length,
run the padded forward and pack the results: the same numbers, the padding of one micro-batch
instead of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aligner.models import fused
from aligner.models.gpt import position_ids_for
from aligner.models.packing import PackedRows

__all__ = [
    "set_forward",
    "set_forwards",
    "policy_logits",
    "token_values",
    "sequence_scores",
    "policy_logits_packed",
    "token_values_packed",
    "sequence_scores_packed",
]


def set_forward(
    model: nn.Module, mode: str = "auto", tensor_parallel_size: int = 1
) -> tuple[str, str | None]:
    """Choose how :func:`policy_logits`, :func:`token_values` and :func:`sequence_scores` run
    ``model``: ``megatron`` (its own module forward), ``fused`` (:mod:`aligner.models.fused`:
    the same arithmetic in fewer ops, on the same parameters), ``compiled`` (fused under
    ``torch.compile``) or ``auto`` (fused where the architecture allows, else megatron).

    Returns the mode taken and, for ``auto`` falling back to megatron, why.
    """
    taken, why = fused.resolve_forward(mode, model, tensor_parallel_size)
    model.aligner_fused = (
        None
        if taken == "megatron"
        else fused.FusedForward(model, compiled=taken == "compiled", tp_size=tensor_parallel_size)
    )
    return taken, why


def set_forwards(
    models: dict[str, nn.Module | None], mode: str, tensor_parallel_size: int = 1, log=None
) -> dict[str, str]:
    """:func:`set_forward` for each named model (None entries skipped); a fallback to megatron
    is reported through ``log`` (a logger; None: silent). Returns name -> the mode taken."""
    taken: dict[str, str] = {}
    for name, model in models.items():
        if model is None:
            continue
        taken[name], why = set_forward(model, mode, tensor_parallel_size)
        if why and log is not None:
            log.info("%s forward: megatron (the fused forward does not apply: %s)", name, why)
    return taken


def _forward(model: nn.Module, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The model's output at positions ``start..s-1``."""
    fast = getattr(model, "aligner_fused", None)
    if fast is not None:
        return fast(tokens, start)
    out = model(tokens, position_ids_for(tokens), attention_mask=None)
    return out[:, start:] if start else out


def policy_logits(model: nn.Module, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Causal LM forward. tokens [b, s] -> logits [b, s - start, v] at positions ``start..s-1``
    (v: this TP rank's vocab shard).

    Right padding needs no attention mask: causal attention never lets a real position see a
    later pad. fp32 whatever the model's dtype, so logprobs, KL and the losses are fp32. With
    ``start`` > 0 the fused forward computes the last layer's queries, MLP and head only from
    ``start`` on (the positions before it feed later ones only through keys and values).
    """
    return _forward(model, tokens, start).float()


def token_values(model: nn.Module, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Critic forward. tokens [b, s] -> values [b, s-1]; element t is V(tokens 0..t), computed
    for t >= ``start`` (0 before it: for losses that mask those positions out)."""
    out = _forward(model, tokens, start)[:, :-1, 0].float()  # [b, s-1-start]
    return F.pad(out, (start, 0)) if start else out


def sequence_scores(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reward model forward. tokens [b, s], lengths [b] -> scores [b], read at position length-1
    (the fused forward runs the last layer only there)."""
    idx = (lengths.to(tokens.device).long() - 1).clamp(min=0)
    fast = getattr(model, "aligner_fused", None)
    if fast is not None:
        return fast.at(tokens, idx)[:, 0, 0].float()
    out = _forward(model, tokens)[..., 0]  # [b, s]
    return out.gather(1, idx.unsqueeze(1)).squeeze(1).float()


def _forward_packed(model: nn.Module, rows: PackedRows, at: torch.Tensor | None = None) -> torch.Tensor:
    """The model's output at the packed positions ``at`` (``[T']``; None: all): ``[1, T or T',
    ...]``. Megatron's forward: the rows padded to their longest, the padded forward, packed."""
    fast = getattr(model, "aligner_fused", None)
    if fast is not None:
        return fast.packed(rows, at)
    out = rows.repack(_forward(model, rows.padded()))  # [1, T, ...]
    return out if at is None else out[:, at]


def policy_logits_packed(model: nn.Module, rows: PackedRows, start: int = 0) -> torch.Tensor:
    """Causal LM forward of packed rows -> logits ``[1, T, v]`` fp32 (``v``: this TP rank's
    vocab shard); position ``p`` predicts ``rows.next_tokens()[0, p]`` (nothing at a row's
    last position: :meth:`~aligner.models.packing.PackedRows.unpack_shifted` drops it). With
    ``start`` > 0, only the positions at or past ``start`` in their row: ``[1, T', v]`` at
    ``rows.positions_from(start)`` (the fused forward runs the last layer's MLP and head only
    there), as :func:`policy_logits` does per row."""
    return _forward_packed(model, rows, rows.positions_from(start)).float()


def token_values_packed(model: nn.Module, rows: PackedRows, start: int = 0) -> torch.Tensor:
    """Critic forward of packed rows -> values ``[1, T]`` fp32: position ``p`` is V(its row's
    tokens up to ``p``), so ``rows.unpack(values, s)[:, :-1]`` is :func:`token_values`' ``[b,
    s-1]`` at every real position (0 past each row's length). With ``start`` > 0, computed only
    at positions at or past ``start`` in their row (0 before it), as :func:`token_values`."""
    at = rows.positions_from(start)
    out = _forward_packed(model, rows, at)[..., 0].float()  # [1, T or T']
    if at is None:
        return out
    return out.new_zeros(rows.total).index_put((at,), out[0]).unsqueeze(0)


def sequence_scores_packed(model: nn.Module, rows: PackedRows) -> torch.Tensor:
    """Reward model forward of packed rows -> scores ``[n]`` fp32, read at each row's last
    token, as :func:`sequence_scores` reads them (the fused forward runs the last layer's MLP
    and head only there)."""
    fast = getattr(model, "aligner_fused", None)
    if fast is None:
        return sequence_scores(model, rows.padded(), rows.lengths)
    return fast.packed(rows, rows.last_positions())[0, :, 0].float()
