"""The forwards of the models :mod:`aligner.models.gpt` builds: a policy's logits, a critic's
values per token, a reward model's scores per sample, each run either by Megatron's module
forward or by the fused forward over the model's own parameters (:mod:`aligner.models.fused`),
as :func:`set_forward` chose for that model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aligner.models import fused
from aligner.models.gpt import position_ids_for

__all__ = ["set_forward", "set_forwards", "policy_logits", "token_values", "sequence_scores"]


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
