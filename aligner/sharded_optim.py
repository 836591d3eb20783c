"""The distributed optimizer (``optim.use_distributed_optimizer``, ZeRO stage 1): AdamW whose fp32
master weights and both Adam moments are sharded over the data-parallel ranks.

The trainable parameters are laid end to end in one flat index space (:class:`ShardLayout`:
each parameter starts at a multiple of :data:`ALIGN` elements, the whole padded to ``DP x
shard_size``); data-parallel rank ``r`` owns the contiguous slice ``[r * shard_size, (r + 1) *
shard_size)`` and keeps, for that slice alone, the fp32 masters, ``exp_avg`` and ``exp_avg_sq``
(one ``[3, shard_size]`` buffer). Per rank that is ``12 N / DP`` bytes for ``N`` trainable
weights, against ``12 N`` (bf16 weights) or ``8 N`` (fp32: the weights are their own masters)
for :class:`aligner.precision.MixedPrecisionAdamW`. One step::

    backward                     bf16 gradients move into fp32 holders as they are produced
    allreduce_grads(dp, DP)      the DP mean (op="sum": the sum) of the whole fp32 gradients (the
                                 same call, on the same flat buffer, as the unsharded optimizer's)
    clip_grad_norm(...)          the same norm over the same whole gradients, TP-aware
    step()                       AdamW on this rank's slice (torch's arithmetic, element-wise),
                                 then the updated weights all-gathered into the model, in the
                                 model's dtype (bf16: rounded once, as the unsharded step rounds)

Why the gradients are all-reduced and not reduce-scattered (which would halve the gradient
traffic; gloo and NCCL both have it): the global norm would then be summed from the slices,
which cut parameters where the shard boundaries fall, in another order than the unsharded
optimizer's per-parameter norms; its float64 rounding, and so the clip coefficient, could
differ in the last bit. With the all-reduce every rank holds the DP mean (or sum) of the whole
gradient (as ZeRO-1 does: only the optimizer state is sharded), measures the norm exactly as the
unsharded optimizer does, and Adam, being element-wise, gives each element of the slice the
bits it gives that element whole. So an update is bit-identical to the unsharded one at any DP
size, on gloo and NCCL alike; the cost is the weights' all-gather on top of the all-reduce.

Checkpoints: :meth:`ShardedAdamW.state_tensors` (collective over the DP group) gathers the
whole state, in the unsharded optimizer's format (``master.<i>``, ``<i>.exp_avg``,
``<i>.exp_avg_sq``, ``<i>.step`` at each parameter's own shape, and the same JSON), so a
checkpoint does not depend on the layout: it resumes at any DP size, sharded or not, and either
optimizer's checkpoint loads into the other. :meth:`ShardedAdamW.load_state_tensors` takes the
whole state (every rank reads the file) and keeps its slice; it needs no collective.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aligner.checkpoint import CheckpointError
from aligner.distributed import comm_device
from aligner.optim import (
    PARALLEL_ATTRS,
    FP32Gradients,
    adamw_arithmetic,
    allreduce_gradients,
    optimizer_meta,
    route_grads,
    state_problems,
)

__all__ = ["ALIGN", "GATHER_BUCKET", "ShardLayout", "ShardedAdamW"]

ALIGN = 64
"""Each parameter starts at a multiple of this many elements of the flat layout, and the shard
size is one too: the slices of a parameter start 256-byte aligned (vectorised kernels), and a
shard boundary cuts a parameter only at a multiple of it (as Megatron aligns its buffers)."""
GATHER_BUCKET = 1 << 26
"""Elements (all ranks' together) gathered per collective: bounds the transient buffers."""

# The three rows of a rank's state buffer.
_MASTER, _EXP_AVG, _EXP_AVG_SQ = 0, 1, 2


@dataclass(frozen=True)
class ShardLayout:
    """Where each trainable parameter lies in the flat index space, and each rank's slice.

    Attributes:
        offsets: each parameter's first element (a multiple of ``align``).
        numels: each parameter's number of elements.
        dp_size: how many slices.
        shard_size: elements per slice (a multiple of ``align``); ``dp_size * shard_size`` covers
            every parameter.
    """

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    dp_size: int
    shard_size: int

    @classmethod
    def of(cls, numels: Iterable[int], dp_size: int, align: int = ALIGN) -> ShardLayout:
        """The layout of parameters of ``numels`` elements, in order, over ``dp_size`` ranks."""
        offsets, end = [], 0
        numels = tuple(int(n) for n in numels)
        for n in numels:
            offsets.append(end)
            end += -(-n // align) * align
        shard = -(-max(end, 1) // (dp_size * align)) * align
        return cls(tuple(offsets), numels, dp_size, shard)

    @property
    def total(self) -> int:
        """Elements of the padded flat space: ``dp_size * shard_size``."""
        return self.dp_size * self.shard_size

    def overlaps(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(i, lo, hi)``: parameter ``i``'s flattened elements ``[lo, hi)`` lie in the flat
        range ``[start, stop)`` (at ``offsets[i] + lo``), for every parameter it touches."""
        first = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        for i in range(first, len(self.offsets)):
            a = self.offsets[i]
            if a >= stop:
                return
            lo, hi = max(start - a, 0), min(stop - a, self.numels[i])
            if lo < hi:
                yield i, lo, hi

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(i, lo, hi)`` of every parameter part in ``rank``'s slice, in order."""
        return list(self.overlaps(rank * self.shard_size, (rank + 1) * self.shard_size))


def _gradient_holder(p: nn.Parameter) -> torch.Tensor:
    """An fp32 tensor of ``p``'s shape that stores nothing (one element, expanded) and carries
    ``p``'s fp32 gradient as its ``.grad`` and its parallel attributes: what the gradient
    plumbing (:mod:`aligner.optim`) reads in place of a full fp32 master."""
    h = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
    for a in PARALLEL_ATTRS:
        if hasattr(p, a):
            setattr(h, a, getattr(p, a))
    return h


class ShardedAdamW(FP32Gradients, torch.optim.AdamW):
    """AdamW whose fp32 masters and moments are sharded over a data-parallel group (ZeRO-1).

    The same interface as :class:`aligner.precision.MixedPrecisionAdamW` (gradients moved to
    fp32, ``allreduce_grads``, ``clip_grad_norm``, ``step`` returning False on a non-finite
    norm, ``state_tensors`` / ``load_state_tensors``), with these differences: there are no
    whole fp32 masters (no ``master_params``; :meth:`full_masters` gathers them), ``step``,
    :meth:`state_tensors`, :meth:`full_masters` and :meth:`copy_master_to_model` are collective
    over ``dp_group``, and ``state_dict`` / ``load_state_dict`` (the slice's own) are refused.

    Args:
        params: the model's trainable parameters (bf16 and/or fp32, contiguous, on one device;
            frozen ones are skipped).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        dp_group: the data-parallel group to shard over; None: one rank holds everything.
        bucket_numel: elements (all ranks' together) per all-gather.

    Attributes:
        model_params: the model's parameters, in order.
        grad_params: what holds each one's fp32 gradient (``.grad``): the parameter itself when
            fp32, else a holder that stores no values (:func:`_gradient_holder`).
        layout: the flat layout and the slices.
        last_grad_norm: the norm measured by the latest :meth:`clip_grad_norm` of this step.
    """

    sharded = True
    """The state is sharded: saving it is collective over the data-parallel group."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        dp_group: Any = None,
        bucket_numel: int = GATHER_BUCKET,
    ) -> None:
        model_params = [p for p in params if p.requires_grad]
        if not model_params:
            raise ValueError("ShardedAdamW: no trainable parameters")
        for p in model_params:
            if not p.is_floating_point():
                raise ValueError(f"ShardedAdamW: a parameter of dtype {p.dtype} cannot be trained")
            if not p.is_contiguous():
                raise ValueError(f"ShardedAdamW: a parameter of shape {tuple(p.shape)} is not contiguous")
        devices = {p.device for p in model_params}
        if len(devices) != 1:
            raise ValueError(
                f"ShardedAdamW: the parameters are on several devices {sorted(map(str, devices))}"
            )
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.layout = ShardLayout.of((p.numel() for p in model_params), self.dp_size)
        self.bucket_numel = max(int(bucket_numel), 1)
        device = model_params[0].device
        # This rank's slice: [masters, exp_avg, exp_avg_sq] x shard_size, fp32.
        self._state = torch.zeros(3, self.layout.shard_size, dtype=torch.float32, device=device)
        base = self.dp_rank * self.layout.shard_size
        self._pieces: list[tuple[int, int, int, torch.Tensor]] = []
        """``(i, lo, hi, view)``: parameter ``i``'s elements ``[lo, hi)`` are this rank's, their
        master at ``view`` (a slice of ``_state[0]``: what torch's AdamW steps)."""
        for i, lo, hi in self.layout.pieces(self.dp_rank):
            a = self.layout.offsets[i] + lo - base
            self._pieces.append((i, lo, hi, self._state[_MASTER, a : a + hi - lo]))
        # A rank whose slice holds only padding steps an empty tensor (torch wants a parameter).
        views = [v for *_, v in self._pieces] or [self._state[_MASTER, :0]]
        # foreach: as MixedPrecisionAdamW (the same arithmetic as the per-tensor loop).
        super().__init__(views, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
        for i, lo, hi, view in self._pieces:
            # torch keeps the moments it finds: here, slices of the one state buffer.
            a = self.layout.offsets[i] + lo - base
            self.state[view] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": self._state[_EXP_AVG, a : a + hi - lo],
                "exp_avg_sq": self._state[_EXP_AVG_SQ, a : a + hi - lo],
            }
        self.model_params: list[nn.Parameter] = model_params
        self.grad_params: list[torch.Tensor] = [
            p if p.dtype == torch.float32 else _gradient_holder(p) for p in model_params
        ]
        self._pairs = [(p, h) for p, h in zip(model_params, self.grad_params) if p is not h]
        self._steps = [0] * len(model_params)
        """Each parameter's Adam step count (the same on every rank)."""
        self.last_grad_norm: float | None = None
        for p, h in self._pairs:
            route_grads(p, h)
        self.load_masters([None] * len(model_params), to_model=False)

    def memory_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (masters and moments of its slice)."""
        return self._state.numel() * self._state.element_size()

    # -- gradients: as MixedPrecisionAdamW ----------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the fp32 gradients and any the model still holds."""
        super().zero_grad(set_to_none=True)  # the slices' views of them
        for h in self.grad_params:
            if set_to_none or h.grad is None:
                h.grad = None
            else:
                h.grad.zero_()
        for p, _ in self._pairs:
            p.grad = None
        self.last_grad_norm = None

    def allreduce_grads(self, group, world: int, *, op: str = "mean") -> None:
        """Average (``op="mean"``) or sum (``op="sum"``) the whole fp32 gradients over the
        data-parallel ``group`` of size ``world`` (this optimizer's own group): each rank then
        steps its slice of the result."""
        if world != self.dp_size:
            raise ValueError(
                f"allreduce_grads over {world} ranks: this optimizer is sharded over {self.dp_size}"
            )
        self.copy_grads_to_master()
        allreduce_gradients(self.grad_params, group, world, op=op)

    @torch.no_grad()
    def step(self, closure=None) -> bool:  # type: ignore[override]
        """AdamW on this rank's slice, then the model's weights all-gathered from every slice
        (collective). Returns False, changing nothing, after a non-finite norm."""
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        self.copy_grads_to_master()
        norm, self.last_grad_norm = self.last_grad_norm, None
        if norm is not None and not math.isfinite(norm):
            return False
        for i, lo, hi, view in self._pieces:
            g = self.grad_params[i].grad
            view.grad = None if g is None else g.reshape(-1)[lo:hi]
        adamw_arithmetic()(self)  # the hooks ran already
        for i, g in enumerate(self.grad_params):
            if g.grad is not None:  # torch's AdamW steps (and counts) what has a gradient
                self._steps[i] += 1
        for *_, view in self._pieces:
            view.grad = None
        self.copy_master_to_model()
        return True

    # -- gathering the slices -------------------------------------------------------------------

    def _gather(
        self, rows: tuple[int, ...], dtype: torch.dtype, sink: Callable[[int, int, torch.Tensor], None]
    ) -> None:
        """All-gather the ``rows`` of every rank's state slice in ``dtype``, bucket by bucket;
        ``sink(row, flat_start, values)`` receives each rank's part of each bucket."""
        S, dp, k = self.layout.shard_size, self.dp_size, len(rows)
        step = max(self.bucket_numel // (dp * k), 1)
        dev = comm_device(self.dp_group) if self.dp_group is not None else self._state.device
        for c in range(0, S, step):
            n = min(step, S - c)
            part = self._state[list(rows), c : c + n].to(dev, dtype).reshape(-1)  # [k * n]
            if dp > 1:
                out = torch.empty(dp * k * n, dtype=dtype, device=dev)
                dist.all_gather_single(out, part, group=self.dp_group)  # gloo and NCCL
            else:
                out = part
            out = out.view(dp, k, n)
            for r in range(dp):
                for j, row in enumerate(rows):
                    sink(row, r * S + c, out[r, j])

    def _to_params(self, targets: list[torch.Tensor]) -> Callable[[int, int, torch.Tensor], None]:
        """A sink for :meth:`_gather` that copies flat values into ``targets`` (one per parameter)."""

        def sink(_row: int, start: int, values: torch.Tensor) -> None:
            for i, lo, hi in self.layout.overlaps(start, start + values.numel()):
                a = self.layout.offsets[i] + lo - start
                targets[i].view(-1)[lo:hi].copy_(values[a : a + hi - lo])

        return sink

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """The model's weights from every rank's masters: all-gathered in the model's dtype
        (rounded once, as ``p.copy_(master)`` rounds), collective over the DP group."""
        dtypes = {p.dtype for p in self.model_params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self._gather((_MASTER,), dtype, self._to_params(self.model_params))

    @torch.no_grad()
    def full_masters(self) -> list[torch.Tensor]:
        """Every parameter's whole fp32 master, on the CPU (collective over the DP group)."""
        out = [torch.empty(p.shape, dtype=torch.float32) for p in self.model_params]
        self._gather((_MASTER,), torch.float32, self._to_params(out))
        return out

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor | None], *, to_model: bool = True) -> None:
        """Set the masters from whole fp32 values, one per parameter (None: the model's current
        weight), and (``to_model``) round the model's weights from them. Needs no collective:
        every rank is given the whole values and keeps its slice."""
        sources = [p if v is None else v for p, v in zip(self.model_params, values)]
        for i, lo, hi, view in self._pieces:
            view.copy_(sources[i].detach().reshape(-1)[lo:hi])
        if to_model:
            for p, v in zip(self.model_params, values):
                if v is not None:
                    p.copy_(v)

    # -- checkpoints: the unsharded optimizer's format --------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        raise TypeError("ShardedAdamW holds a slice of the state: use state_tensors() (collective)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("ShardedAdamW holds a slice of the state: use load_state_tensors()")

    def state_meta(self) -> dict[str, Any]:
        """The JSON half of :meth:`state_tensors` (no collective): what the unsharded optimizer's
        would be after the same steps."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.model_params)))
        adam = {
            "param_groups": [group],
            "scalars": {},
            "param_ids": [str(i) for i, n in enumerate(self._steps) if n > 0],
        }
        return optimizer_meta(self.model_params, adam)

    @torch.no_grad()
    def state_tensors(self, *, keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The whole state, gathered from every rank (collective over the DP group), on the CPU:
        ``master.<i>``, and for each parameter that has stepped ``<i>.exp_avg``,
        ``<i>.exp_avg_sq``, ``<i>.step``; and the JSON metadata. ``keep=False`` on a rank that
        only takes part (it holds no copy: 12 bytes a weight of host memory spared; its tensors
        come back empty)."""
        rows = (_MASTER, _EXP_AVG, _EXP_AVG_SQ)
        if not keep:
            self._gather(rows, torch.float32, lambda row, start, v: None)
            return {}, self.state_meta()
        out = {row: [torch.empty(p.shape, dtype=torch.float32) for p in self.model_params] for row in rows}
        sinks = {row: self._to_params(out[row]) for row in rows}
        self._gather(rows, torch.float32, lambda row, start, v: sinks[row](row, start, v))
        tensors = {f"master.{i}": m for i, m in enumerate(out[_MASTER])}
        for i, n in enumerate(self._steps):
            if n > 0:
                tensors[f"{i}.exp_avg"] = out[_EXP_AVG][i]
                tensors[f"{i}.exp_avg_sq"] = out[_EXP_AVG_SQ][i]
                tensors[f"{i}.step"] = torch.tensor(float(n), dtype=torch.float32)
        return tensors, self.state_meta()

    def state_problems(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> list[str]:
        """What stops ``(tensors, meta)`` from loading here (empty when it fits)."""
        return state_problems(self.model_params, tensors, meta)

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Inverse of :meth:`state_tensors`, from either optimizer's state (no collective): this
        rank's slice of the masters, moments and step counts, the saved hyperparameters, and
        the model's weights rounded from the masters. State saved without masters takes them
        from the model's current weights, so load the model first."""
        problems = self.state_problems(tensors, meta)
        if problems:
            raise CheckpointError("cannot load optimizer state: " + "; ".join(problems))
        adam = meta.get("adam", meta)
        group = self.param_groups[0]
        for k, v in adam["param_groups"][0].items():
            if k != "params":  # JSON turns tuples (Adam's betas) into lists
                group[k] = tuple(v) if isinstance(v, list) else v
        group["foreach"] = self.defaults["foreach"]  # how to compute: this optimizer's own choice
        scalars = adam.get("scalars", {})
        for i in range(len(self.model_params)):
            step = tensors.get(f"{i}.step", scalars.get(str(i), {}).get("step", 0))
            self._steps[i] = int(float(step))
        for i, lo, hi, view in self._pieces:
            st = self.state[view]
            st["step"] = torch.tensor(float(self._steps[i]), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                t = tensors.get(f"{i}.{key}")
                if t is None or self._steps[i] == 0:
                    st[key].zero_()
                else:
                    st[key].copy_(t.reshape(-1)[lo:hi])
        self.load_masters([tensors.get(f"master.{i}") for i in range(len(self.model_params))])
