"""Mixed precision: bf16 weights and compute, fp32 master weights, gradients and Adam state.

One optimizer serves both roles (the actor's policy and the server's critic) and both
precisions: :class:`MixedPrecisionAdamW` is a ``torch.optim.AdamW`` whose parameters are
fp32 *master* copies of the model's weights. When the model is fp32 the master copies are
the model's own parameters and the class is exactly torch's AdamW (same arithmetic, bit for
bit); when the model is bf16 each master is a separate fp32 tensor, gradients are moved into
fp32 as soon as backward produces them (so micro-batches accumulate in fp32, and the
data-parallel all-reduce, the norm and the clipping all see fp32), Adam updates the fp32
masters, and the bf16 weights are re-rounded from them after every step. This is the scheme
of Megatron's ``Float16OptimizerWithFloat16Params`` (Micikevicius et al., 2018, "Mixed
Precision Training") with bf16, which needs no loss scaling. Megatron's own class is not
used: it is not a ``torch.optim.Optimizer`` (so ``LambdaLR`` refuses it), it clips with a
CUDA-only kernel, and its state dict is shaped for ``torch.save``; ours reuses the project's
TP-aware clipping and saves through safetensors + JSON.

How to use it (the actor's trainer and the critic service do exactly this)::

    from aligner.precision import make_optimizer, precision_dtype, resolve_precision

    prec = resolve_precision(cfg.precision)                       # "auto" -> "bf16" | "fp32"
    model = build_policy(mcfg, params_dtype=precision_dtype(prec))      # or build fp32, see below
    opt = make_optimizer(model, lr, betas=(b1, b2), eps=eps, weight_decay=wd, precision=prec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)    # opt is a torch Optimizer

    opt.zero_grad()                                  # model grads and master grads
    for micro in micro_batches:
        loss = ...                                   # losses, logprobs, KL in fp32: the model
        (loss / n_micro).backward()                  # helpers in aligner.models.forward return fp32
    opt.allreduce_grads(dp_group, dp_size)           # DP mean of the fp32 master grads (op="sum":
                                                     # their sum, for losses over a global count)
    norm = opt.clip_grad_norm(max_norm, tp_group, tp_size, tp_rank)   # fp32, TP-aware
    stepped = opt.step()                             # False (nothing applied) if norm was not finite
    sched.step()

    tensors, meta = opt.state_tensors()              # fp32 masters + Adam moments + steps
    save_tensors(dir / "optim.safetensors", tensors); write_json(dir / "optim.json", meta)
    model_tensors = mp.master_state_dict(model, opt)  # the model's weights at fp32 (the truth)
    ...
    opt.load_state_tensors(tensors, meta)            # masters, moments, steps; re-rounds weights
    mp.load_master_state_dict(model, opt, model_tensors)   # weights (cast) and their masters

Rules that matter:

- After ``backward`` a bf16 model's ``p.grad`` is None: the gradient has moved to the master.
  Use the optimizer's ``allreduce_grads`` / ``clip_grad_norm`` (or pass ``opt.master_params``
  to :mod:`aligner.optim`), never the model's parameters.
- ``make_optimizer(model, precision="bf16")`` on a model whose weights are still fp32 (built or
  loaded in fp32, e.g. from an fp32 checkpoint or a HF import) keeps those fp32 values as the
  masters and casts the model to bf16 in place: the starting point is not rounded.
- Resume is bit-exact: ``state_tensors``/``load_state_tensors`` carry the fp32 masters, both
  Adam moments and the step counts; the bf16 weights are re-derived from the masters. The LR
  scheduler's ``state_dict()`` holds only numbers (JSON).
- The newest optimizer built over a parameter owns its gradient (an older one's hook is removed).

The distributed optimizer (``optim.use_distributed_optimizer``, ZeRO-1): ``make_optimizer(...,
dp_group=group)`` gives a :class:`ShardedAdamW` (:mod:`aligner.sharded_optim`), the same
interface over a 1/DP slice of the masters and moments, with the same numbers bit for bit. Code
that serves both reads gradients through ``opt.grad_params`` (the masters here) and whole masters
through ``opt.full_masters()``; only this class has ``master_params``. The sharded one's
``step``, ``state_tensors`` and ``full_masters`` are collective over its DP group.

How the actor uses it:

- :func:`aligner.actor.optimizer.make_policy_optimizer` builds it with :func:`make_optimizer`
  (``optim.*`` as its keyword arguments) after freezing layers (``freeze_all_but_last_layers``):
  only trainable weights get masters. Passing the module casts all of it, frozen weights included.
- :class:`aligner.actor.policy_update.PolicyUpdate` sums the masters' gradients over data
  parallelism (``optimizer.allreduce_grads``) and clips them (``optimizer.clip_grad_norm`` over
  the TP group) before each step.
- The reference model and the generation engine run in the policy's dtype (the reference is
  built with ``params_dtype=precision_dtype(prec)``); ``policy_logits`` returns fp32 either way.
- Checkpoints: ``opt.state_tensors()`` / ``opt.load_state_tensors()`` carry the masters and the
  moments (they read the older layout of ``optimizer_to_safe`` too; both optimizers write and
  read one layout), and ``master_state_dict`` / ``load_master_state_dict`` the model's weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from aligner.checkpoint import CheckpointError, optimizer_from_safe, optimizer_to_safe
from aligner.models.gpt import load_state_dict_strict, tensor_state_dict
from aligner.optim import (
    PARALLEL_ATTRS,
    STATE_FORMAT,
    FP32Gradients,
    adamw_arithmetic,
    allreduce_gradients,
    optimizer_meta,
    route_grads,
    state_problems,
)
from aligner.sharded_optim import ShardedAdamW

__all__ = [
    "PRECISIONS",
    "precision_dtype",
    "bf16_supported",
    "resolve_precision",
    "MixedPrecisionAdamW",
    "ShardedAdamW",
    "Optimizer",
    "make_optimizer",
    "master_state_dict",
    "load_master_state_dict",
    "STATE_FORMAT",
]

PRECISIONS = ("bf16", "fp32")
"""Precisions a model can train in; config keys also accept 'auto' (see resolve_precision)."""

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def precision_dtype(name: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16, 'fp32' -> torch.float32 (resolve 'auto' first)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"precision={name!r}: expected one of {list(PRECISIONS)} (resolve 'auto' with resolve_precision)"
        ) from None


@functools.cache
def _cpu_has_native_bf16() -> bool:
    capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    if "AMX" in capability or "BF16" in capability:
        return True
    # torch reports only "AVX512" on CPUs with AVX512-BF16 (e.g. AMD Zen 4/5); oneDNN still
    # uses the instructions, so read the flags the kernel reports.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def bf16_supported(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` (default: CUDA if present, else the CPU) computes bf16 natively."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        if torch.cuda.is_available():
            return bool(torch.cuda.is_bf16_supported())
        if device is not None:
            return False
    return _cpu_has_native_bf16()


def resolve_precision(name: str, device: torch.device | str | None = None) -> str:
    """'bf16' | 'fp32' | 'auto' -> 'bf16' or 'fp32'.

    'auto' is bf16 where the hardware has it (a CUDA GPU with bf16; a CPU with AVX512-BF16 or
    AMX), else fp32 (bf16 without hardware support is emulated and slower than fp32).
    """
    if name == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r}: expected 'auto' or one of {list(PRECISIONS)}")
    return name


class MixedPrecisionAdamW(FP32Gradients, torch.optim.AdamW):
    """AdamW over fp32 master copies of a model's weights (the weights themselves when fp32).

    Args:
        params: the model's trainable parameters (bf16 and/or fp32; frozen ones are skipped).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.

    Attributes:
        model_params: the model's parameters, in order.
        master_params: their fp32 masters (``master_params[i] is model_params[i]`` for fp32).
        last_grad_norm: the norm measured by the latest :meth:`clip_grad_norm` of this step.
    """

    sharded = False
    """Every data-parallel rank holds the whole state (see :class:`ShardedAdamW` for the other)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        model_params = [p for p in params if p.requires_grad]
        if not model_params:
            raise ValueError("MixedPrecisionAdamW: no trainable parameters")
        masters = []
        for p in model_params:
            if not p.is_floating_point():
                raise ValueError(f"MixedPrecisionAdamW: a parameter of dtype {p.dtype} cannot be trained")
            if p.dtype == torch.float32:
                masters.append(p)
                continue
            m = p.detach().to(torch.float32).clone()
            for a in PARALLEL_ATTRS:
                if hasattr(p, a):
                    setattr(m, a, getattr(p, a))
            masters.append(m)
        # foreach: the same arithmetic as the per-tensor loop (bit-identical results) in a few
        # multi-tensor kernels; torch picks the loop on a CPU by default, twice as slow here.
        super().__init__(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
        self.model_params: list[nn.Parameter] = model_params
        self.master_params: list[torch.Tensor] = masters
        self._pairs = [(p, m) for p, m in zip(model_params, masters) if p is not m]
        self.last_grad_norm: float | None = None
        for p, m in self._pairs:
            route_grads(p, m)  # backward's bf16 gradient lands in the master's fp32 one

    @property
    def grad_params(self) -> list[torch.Tensor]:
        """What holds each model parameter's fp32 gradient (``.grad``): its master."""
        return self.master_params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients and any the model still holds."""
        super().zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            p.grad = None
        self.last_grad_norm = None

    def allreduce_grads(self, group, world: int, *, op: str = "mean") -> None:
        """Average (``op="mean"``) or sum (``op="sum"``: for losses already divided by the global
        batch's normaliser) the fp32 master gradients over the data-parallel ``group`` of size
        ``world`` (:func:`aligner.optim.allreduce_gradients`)."""
        self.copy_grads_to_master()
        allreduce_gradients(self.master_params, group, world, op=op)

    @torch.no_grad()
    def step(self, closure=None) -> bool:  # type: ignore[override]
        """One AdamW update of the masters, then the model's weights rounded from them.

        Returns False, changing nothing, when this step's :meth:`clip_grad_norm` measured a
        non-finite norm (every TP rank sees the same reduced norm, so all skip together).
        """
        if closure is not None:
            raise ValueError("MixedPrecisionAdamW.step takes no closure")
        self.copy_grads_to_master()
        norm, self.last_grad_norm = self.last_grad_norm, None
        if norm is not None and not math.isfinite(norm):
            return False
        adamw_arithmetic()(self)  # the hooks ran already
        self.copy_master_to_model()
        return True

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """Round the fp32 masters into the model's weights."""
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def full_masters(self) -> list[torch.Tensor]:
        """Every parameter's fp32 master (the masters themselves)."""
        return [m.detach() for m in self.master_params]

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor | None], *, to_model: bool = True) -> None:
        """Set the masters from fp32 values, one per parameter (None: the model's current
        weight), and (``to_model``) round the model's weights from them."""
        for p, m, v in zip(self.model_params, self.master_params, values):
            if v is not None:
                m.copy_(v)
            elif m is not p:
                m.copy_(p)
        if to_model:
            self.copy_master_to_model()

    # -- checkpoints: safetensors + JSON --------------------------------------------------------

    def state_meta(self) -> dict[str, Any]:
        """The JSON half of :meth:`state_tensors`."""
        return optimizer_meta(self.model_params, optimizer_to_safe(self)[1])

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The full state: tensors (``master.<i>`` fp32 weights, ``<i>.exp_avg``,
        ``<i>.exp_avg_sq``, ``<i>.step``) for safetensors and JSON metadata."""
        tensors, adam = optimizer_to_safe(self)
        for i, m in enumerate(self.master_params):
            tensors[f"master.{i}"] = m.detach()
        return tensors, optimizer_meta(self.model_params, adam)

    def state_problems(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> list[str]:
        """What stops ``(tensors, meta)`` from loading here (empty when it fits)."""
        return state_problems(self.model_params, tensors, meta)

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Inverse of :meth:`state_tensors`. Restores masters, moments and step counts, then
        re-rounds the model's weights. State saved without masters (fp32 AdamW state written
        by :func:`aligner.checkpoint.optimizer_to_safe`) takes the masters from the model's
        current weights, so load the model first."""
        problems = self.state_problems(tensors, meta)
        if problems:
            raise CheckpointError("cannot load optimizer state: " + "; ".join(problems))
        adam = meta.get("adam", meta)
        optimizer_from_safe(self, {k: v for k, v in tensors.items() if not k.startswith("master.")}, adam)
        for group in self.param_groups:  # how to compute, not what: this optimizer's own choice
            group["foreach"] = self.defaults["foreach"]
        self.load_masters([tensors.get(f"master.{i}") for i in range(len(self.model_params))])


Optimizer = MixedPrecisionAdamW | ShardedAdamW
"""Either optimizer: the same interface (see :class:`ShardedAdamW` for what differs)."""


def make_optimizer(
    params_or_model: nn.Module | Iterable[nn.Parameter],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    precision: str | None = None,
    *,
    dp_group: Any = None,
) -> Optimizer:
    """AdamW for a model in ``precision`` ('bf16' | 'fp32' | 'auto'; None: the weights' dtype).

    fp32: torch's AdamW on the model's own weights (no copies). bf16: fp32 masters as
    described in this module's docstring. Given a module whose weights are fp32 and
    ``precision='bf16'``, the fp32 weights become the masters and the module is cast to bf16 in
    place. Given a parameter list, its dtype must already match ``precision``.

    ``dp_group``: shard the masters and moments over this data-parallel group
    (:class:`ShardedAdamW`, ``optim.use_distributed_optimizer``); None: every rank holds them
    whole (:class:`MixedPrecisionAdamW`). The numbers are the same either way.
    """
    is_module = isinstance(params_or_model, nn.Module)
    if is_module:
        params = [p for p in params_or_model.parameters() if p.requires_grad]
    else:
        params = [p for p in params_or_model if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if precision is None:
        precision = "bf16" if torch.bfloat16 in dtypes else "fp32"
    precision = resolve_precision(precision)
    want = precision_dtype(precision)
    masters_from: list[torch.Tensor] | None = None
    if dtypes - {want}:
        if is_module and want == torch.bfloat16 and dtypes == {torch.float32}:
            masters_from = [p.detach().clone() for p in params]
            params_or_model.to(dtype=want)
        else:
            raise ValueError(
                f"make_optimizer(precision={precision!r}): the trainable weights are "
                f"{sorted(str(d) for d in dtypes)}; build the model with "
                f"params_dtype={want} (or pass the module itself to cast an fp32 model to bf16)"
            )
    if dp_group is not None:
        opt: Optimizer = ShardedAdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, dp_group=dp_group
        )
    else:
        opt = MixedPrecisionAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if masters_from is not None:
        # The model was cast from these very values: its weights are their rounding already.
        opt.load_masters(masters_from, to_model=False)
    return opt


def master_state_dict(
    model: nn.Module, optimizer: Optimizer | None, masters: list[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors by name (as :func:`aligner.models.gpt.tensor_state_dict`), with each
    trained weight replaced by its fp32 master: what a checkpoint of a bf16 model should hold.
    Loadable into a model of either precision (loading casts). ``masters``: the optimizer's
    whole masters when at hand (``master.<i>`` of its :meth:`state_tensors`); else they are
    taken from it, which for a :class:`ShardedAdamW` is collective over its DP group."""
    out = tensor_state_dict(model)
    if optimizer is None:
        return out
    values = masters if masters is not None else optimizer.full_masters()
    for name, m in _by_name(model, optimizer, values):
        if name in out:
            out[name] = m.detach()
    return out


@torch.no_grad()
def load_master_state_dict(
    model: nn.Module,
    optimizer: Optimizer | None,
    state: dict[str, torch.Tensor],
    what: str = "model",
) -> None:
    """Inverse of :func:`master_state_dict`: load ``state`` into ``model`` (cast to its dtype,
    names and shapes checked) and its values, unrounded, into the optimizer's masters. Call it
    after :meth:`MixedPrecisionAdamW.load_state_tensors`; with state written before masters were
    saved (an fp32 checkpoint resumed in bf16) this is what keeps the fp32 weights exact."""
    load_state_dict_strict(model, state, what=what)
    if optimizer is None:
        return
    values: list[torch.Tensor | None] = [None] * len(optimizer.model_params)
    for name, i in _by_name(model, optimizer, list(range(len(values)))):
        if values[i] is None:
            values[i] = state.get(name)
    optimizer.load_masters(values)  # None: the weight just loaded (a strict load leaves none)


def _by_name(model: nn.Module, optimizer: Optimizer, values: list[Any]) -> list[tuple[str, Any]]:
    """``(name, value)`` of every name of a trained parameter (tied ones under each of their
    names); ``values`` one per optimizer parameter."""
    by_id = {id(p): v for p, v in zip(optimizer.model_params, values)}
    return [
        (name, by_id[id(p)]) for name, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id
    ]
