"""What the actor's policy and the server's critic share about optimisation: the AdamW and
clipping settings (:class:`OptimConfig`, the ``optim`` section of both roles' configs), and the
gradient plumbing: data-parallel averaging and global-norm clipping over tensor-parallel shards
(replicated weights counted once). The optimizer itself is
:class:`aligner.precision.MixedPrecisionAdamW`, which applies these to its fp32 master gradients."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner.config_checks import Problems

__all__ = ["OptimConfig", "allreduce_gradients", "clip_grad_norm"]


@dataclass
class OptimConfig:
    """AdamW with global-norm gradient clipping. Each role's ``optim`` section extends it with
    what only that role has (the policy's learning-rate schedule, the critic's value loss)."""

    lr: float = 1e-3
    """Learning rate (the peak of the schedule, where there is one)."""
    adam_eps: float = 1e-5
    """Adam epsilon (1e-5 as in the N+ implementation details, not torch's 1e-8)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW); 0 disables it."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; null or 0 disables clipping (the norm is still
    measured and logged)."""

    def adamw(self) -> dict[str, Any]:
        """The keyword arguments of :func:`aligner.precision.make_optimizer` these settings give."""
        return {
            "lr": self.lr,
            "betas": (self.adam_beta1, self.adam_beta2),
            "eps": self.adam_eps,
            "weight_decay": self.weight_decay,
        }

    def problems(self, prefix: str = "optim") -> Problems:
        """Every value out of range, each named ``<prefix>.<key>``."""
        p = Problems()
        p.expect(self.lr > 0, f"{prefix}.lr", self.lr, "> 0")
        p.expect(self.adam_eps > 0, f"{prefix}.adam_eps", self.adam_eps, "> 0")
        for key in ("adam_beta1", "adam_beta2"):
            v = getattr(self, key)
            p.expect(0 <= v < 1, f"{prefix}.{key}", v, "a value in [0, 1)")
        p.expect(self.weight_decay >= 0, f"{prefix}.weight_decay", self.weight_decay, ">= 0")
        p.expect(
            self.grad_clip is None or self.grad_clip >= 0,
            f"{prefix}.grad_clip",
            self.grad_clip,
            ">= 0, or null/0 to disable clipping",
        )
        return p


def allreduce_gradients(params: list[torch.nn.Parameter], group, world: int) -> None:
    """Average gradients over the data-parallel group (one flat buffer, one collective).

    The sum is taken in fp32 (fp64 gradients stay fp64) even when the gradients are bf16, and
    cast back; pass fp32 master gradients (``MixedPrecisionAdamW.allreduce_grads``) to keep the
    mean itself in fp32.
    """
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    tp_group,
    tp_size: int,
    tp_rank: int,
    *,
    pp_group=None,
) -> float:
    """Global L2 norm of the gradients of a tensor- (and pipeline-) parallel model, then clip in
    place.

    Weights split over TP (``tensor_model_parallel``) contribute their shard's squares from
    every rank; replicated weights (norms, scalar heads) hold the same gradient on every TP
    rank and are counted once, from TP rank 0. Under pipeline parallelism (``pp_group``) each
    stage's sum is added over the stages; the last stage's copy of a tied embedding (marked
    ``shared`` by Megatron) is not counted again. Accumulates in float64 on the gradients'
    device, so NCCL reduces CUDA tensors. ``max_norm`` None or 0 only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        # The norm in float64 without a float64 copy of the gradient (eight times faster than
        # ``double().pow(2).sum()`` on a CPU), squared back for the global sum.
        sq = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64).square()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    total_sq = sharded + replicated if tp_rank == 0 else sharded
    if tp_size > 1:
        dist.all_reduce(total_sq, group=tp_group)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    norm = float(total_sq.sqrt())
    if max_norm and math.isfinite(norm) and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
