"""What the actor's policy and the server's critic share about optimisation: the AdamW and
clipping settings (:class:`OptimConfig`, the ``optim`` section of both roles' configs), and the
gradient plumbing: data-parallel sums (or means) and global-norm clipping over tensor-parallel shards
(replicated weights counted once), and what the two optimizers share about gradients and state.
The optimizers themselves are :class:`aligner.precision.MixedPrecisionAdamW` (every
data-parallel rank holds the whole state) and :class:`aligner.sharded_optim.ShardedAdamW`
(``use_distributed_optimizer``: each rank holds a slice of it); both apply these to their fp32
gradients."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner.config_checks import Problems

__all__ = [
    "FP32Gradients",
    "GRAD_REDUCTIONS",
    "OptimConfig",
    "PARALLEL_ATTRS",
    "STATE_FORMAT",
    "adamw_arithmetic",
    "allreduce_gradients",
    "clip_grad_norm",
    "move_grad",
    "optimizer_meta",
    "route_grads",
    "state_problems",
]

STATE_FORMAT = "aligner.adamw/1"
"""Tag in the optimizer's JSON metadata (older checkpoints without it load as fp32 AdamW state).
Both optimizers save this one layout: whole tensors per parameter, whatever the sharding."""
# Attributes megatron-core and clip_grad_norm read from a parameter; an fp32 copy or a gradient
# holder of it carries them.
PARALLEL_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "shared",
)


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
    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights and both Adam moments over the data-parallel ranks (ZeRO
    stage 1, Megatron's option of the same name): each rank keeps a 1/DP slice of them, steps
    it, and the ranks all-gather the updated weights. The same numbers as without it, bit for
    bit; checkpoints hold the whole state and load at any DP size, with or without it. A no-op
    at DP=1."""

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
        p.expect(
            isinstance(self.use_distributed_optimizer, bool),
            f"{prefix}.use_distributed_optimizer",
            self.use_distributed_optimizer,
            "true or false",
        )
        return p


def move_grad(p: torch.Tensor, holder: torch.Tensor) -> None:
    """Add ``p``'s gradient (if any) into ``holder``'s fp32 gradient and clear it on ``p``."""
    if p.grad is None:
        return
    if holder.grad is None:
        holder.grad = p.grad.to(torch.float32)
    else:
        holder.grad.add_(p.grad)
    p.grad = None


def adamw_arithmetic() -> Any:
    """torch's ``AdamW.step`` itself: torch wraps a class's step with its hook runner when the
    class is first instantiated, and our optimizers run the hooks themselves."""
    base = torch.optim.AdamW.step
    while getattr(base, "hooked", False):
        base = base.__wrapped__
    return base


class FP32Gradients:
    """What both optimizers (:class:`aligner.precision.MixedPrecisionAdamW`,
    :class:`aligner.sharded_optim.ShardedAdamW`) do with gradients: each trained parameter's
    gradient accumulates in fp32 on its holder in ``grad_params``; ``_pairs`` are the
    ``(low-precision parameter, holder)`` pairs whose gradients move over."""

    grad_params: list[torch.Tensor]
    _pairs: list[tuple[torch.Tensor, torch.Tensor]]
    last_grad_norm: float | None

    @property
    def precision(self) -> str:
        """'bf16' when the model's weights are bf16 (separate fp32 masters), else 'fp32'."""
        return "bf16" if any(p.dtype == torch.bfloat16 for p, _ in self._pairs) else "fp32"

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """Move gradients still on the model's low-precision weights (set by hand, or produced
        with the hooks removed) into their fp32 holders. Called by every method below."""
        for p, holder in self._pairs:
            move_grad(p, holder)

    def clip_grad_norm(
        self, max_norm: float | None, tp_group=None, tp_size: int = 1, tp_rank: int = 0, *, pp_group=None
    ) -> float:
        """Global L2 norm of the whole fp32 gradients over the TP group (and the pipeline stages,
        given ``pp_group``); clip to ``max_norm`` (None or 0: measure only). A non-finite norm
        makes the next ``step`` a no-op."""
        self.copy_grads_to_master()
        self.last_grad_norm = clip_grad_norm(
            self.grad_params, max_norm, tp_group, tp_size, tp_rank, pp_group=pp_group
        )
        return self.last_grad_norm


def route_grads(p: torch.Tensor, holder: torch.Tensor) -> None:
    """From now on, move every gradient backward leaves on ``p`` into ``holder``'s fp32 gradient
    (:func:`move_grad`, run once per backward after autograd has summed ``p``'s gradient), so
    that micro-batches accumulate in fp32, not bf16. The newest optimizer built over a
    parameter owns its gradient: an older route of ``p`` is removed."""
    old = getattr(p, "_aligner_master_grad_hook", None)
    if old is not None:
        old.remove()
    p._aligner_master_grad_hook = p.register_post_accumulate_grad_hook(lambda q: move_grad(q, holder))


def optimizer_meta(model_params: list[torch.Tensor], adam: dict[str, Any]) -> dict[str, Any]:
    """The JSON half of an optimizer's state (:data:`STATE_FORMAT`): the model's dtypes and
    shapes, and ``adam`` (param groups, scalar state, which parameters have state)."""
    return {
        "format": STATE_FORMAT,
        "precision": "bf16" if any(p.dtype == torch.bfloat16 for p in model_params) else "fp32",
        "model_dtypes": [str(p.dtype).removeprefix("torch.") for p in model_params],
        "shapes": [list(p.shape) for p in model_params],
        "adam": adam,
    }


def state_problems(
    model_params: list[torch.Tensor], tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> list[str]:
    """What stops a saved optimizer state ``(tensors, meta)`` (one group over ``model_params``)
    from loading (empty when it fits)."""
    adam = meta.get("adam", meta)
    groups = adam.get("param_groups")
    if not isinstance(groups, list):
        return ["optimizer metadata has no param_groups"]
    problems = []
    got = [len(g["params"]) for g in groups]
    if got != [len(model_params)]:
        problems.append(f"optimizer parameter groups of sizes {got}, expected {[len(model_params)]}")
    shapes = meta.get("shapes")
    want = [list(p.shape) for p in model_params]
    if shapes is not None and shapes != want:
        bad = [i for i, (a, b) in enumerate(zip(shapes, want)) if a != b]
        problems.append(
            f"optimizer saved for {len(shapes)} parameters, expected {len(want)}; shape mismatch at {bad[:8]}"
        )
    for i, p in enumerate(model_params):
        t = tensors.get(f"master.{i}")
        if t is not None and tuple(t.shape) != tuple(p.shape):
            problems.append(f"master.{i}: expected shape {tuple(p.shape)}, got {tuple(t.shape)}")
    return problems


GRAD_REDUCTIONS = ("mean", "sum")
"""What :func:`allreduce_gradients` makes of the data-parallel ranks' gradients."""


def allreduce_gradients(params: list[torch.nn.Parameter], group, world: int, *, op: str = "mean") -> None:
    """Sum (``op="sum"``) or average (``op="mean"``) gradients over the data-parallel group of
    size ``world`` (one flat buffer, one collective).

    Which one follows from the loss: ``"sum"`` when each rank's loss is already its share of
    the global batch's (divided by the whole batch's normaliser, as the actor's PPO loss is),
    ``"mean"`` when each rank's loss is a mean over its own rows (equal shares).

    The sum is taken in fp32 (fp64 gradients stay fp64) even when the gradients are bf16, and
    cast back; pass fp32 master gradients (``MixedPrecisionAdamW.allreduce_grads``) to keep the
    result itself in fp32.
    """
    if op not in GRAD_REDUCTIONS:
        raise ValueError(f"unknown gradient reduction {op!r}; allowed: {', '.join(GRAD_REDUCTIONS)}")
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat, group=group)
    if op == "mean":
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
