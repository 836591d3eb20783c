"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the
attention and MLP linears of a Megatron-core ``GPTModel``, tensor-parallel aware.

:func:`apply_lora` freezes every weight of the model and gives each targeted linear (by
default ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) two trainable
matrices, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``; the linear's output becomes
``W x + (alpha / r) * B (A x)``. ``B`` starts at zero, so the adapted model starts as the base
model exactly; ``A`` is Kaiming-uniform as peft initialises it. Under tensor parallelism the
adapters are laid out like their linear's weight:

- column-parallel (``linear_qkv``, ``linear_fc1``; ``W`` ``[out/tp, in]``): ``A`` ``[r, in]``
  replicated, ``B`` ``[out/tp, r]`` sharded like ``W``'s rows (a gated fc1's ``[gate; up]``
  halves each sharded, as ``W``'s). Every rank computes ``A x`` and its own rows of the output.
  ``A`` is used by every rank, so its gradient is summed over the TP group in the backward
  (``A`` enters through Megatron's ``copy_to_tensor_model_parallel_region``), and so is the
  gradient of ``x`` (the same mapping on ``x``, as Megatron's own column-parallel linear does).
- row-parallel (``linear_proj``, ``linear_fc2``; ``W`` ``[out, in/tp]``): ``A`` ``[r, in/tp]``
  sharded like ``W``'s columns, ``B`` ``[out, r]`` replicated. Each rank's ``A x`` is a partial
  sum, all-reduced over the TP group (an ``[s, b, r]`` tensor) before ``B`` is applied, the same
  way Megatron's ``RowParallelLinear`` all-reduces its partial products; the result is added to
  the linear's all-reduced output, before its bias. ``B``'s gradient is then whole on every rank.

Replicated adapters carry ``tensor_model_parallel=False`` and sharded ones ``True``, so the
TP-aware gradient norm (:func:`aligner.optim.clip_grad_norm`) counts each once. ``A`` is drawn
from a generator seeded by ``(seed, global layer, target)`` over its full shape and then cut,
so every TP rank holds the same replicated ``A`` and a model built at TP=2 holds exactly the
shards of the same model at TP=1.

The module forward (Megatron's, and the pipeline schedule's) runs the low-rank path through a
forward hook on each targeted linear; the fused forward (:mod:`aligner.models.fused`) runs the
same arithmetic in the same order. The parameter names of the base weights do not change, and
the adapters are ``<linear>.lora_A`` / ``<linear>.lora_B``.

Outside training the adapters never travel on their own: the weight stream
(:func:`aligner.models.layout.iter_megatron_tensors`, used by every refit, our checkpoints and the
HF export) carries each adapted weight merged, ``W + (alpha / r) * B @ A`` computed per shard
in fp32 (:func:`merged_weight`). The adapters at their full (TP=1) shapes, gathered, sharded
and in files of their own (ours, and peft's), are :mod:`aligner.models.lora_io`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aligner.config_checks import Problems
from aligner.models.config import ConversionError
from aligner.models.gpt import unwrap

__all__ = [
    "TARGETS",
    "TARGET_PATHS",
    "LoraConfig",
    "apply_lora",
    "lora_config_of",
    "is_lora_name",
    "lora_modules",
    "lora_parameters",
    "column_delta",
    "row_delta",
    "merged_weight",
    "merged_weights",
]

#: The linears LoRA can adapt, and how tensor parallelism splits each.
TARGETS: dict[str, str] = {
    "linear_qkv": "column",
    "linear_proj": "row",
    "linear_fc1": "column",
    "linear_fc2": "row",
}
#: Where each target lives in a transformer layer.
TARGET_PATHS: dict[str, str] = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
_SUFFIXES = (".lora_A", ".lora_B")


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy's linears (the actor's ``lora`` section)."""

    rank: int = 0
    """The adapters' rank r; 0 turns LoRA off (every weight trains, as without this section)."""
    alpha: float = 16.0
    """Scale numerator: the low-rank update is multiplied by alpha / rank (as peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (the base path has none of it); above 0 the
    fused forward does not apply and model_forward=auto runs Megatron's."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """Which linears of every layer get adapters: linear_qkv, linear_proj, linear_fc1, linear_fc2."""

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the low-rank update."""
        return self.alpha / self.rank

    def problems(self, prefix: str = "lora") -> Problems:
        """Every value out of range, each named ``<prefix>.<key>``."""
        p = Problems()
        p.non_negative_ints(self, prefix, ("rank",))
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0):
            return p  # off (or a bad rank, reported above): the other keys do not matter
        p.expect(
            isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0,
            f"{prefix}.alpha",
            self.alpha,
            "a finite number > 0",
        )
        p.expect(
            isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1,
            f"{prefix}.dropout",
            self.dropout,
            "a value in [0, 1)",
        )
        targets = list(self.targets or [])
        p.expect(
            bool(targets) and all(t in TARGETS for t in targets) and len(set(targets)) == len(targets),
            f"{prefix}.targets",
            self.targets,
            f"a non-empty list of distinct names from {list(TARGETS)}",
        )
        return p

    def to_dict(self) -> dict[str, Any]:
        """As JSON (targets in their canonical order)."""
        d = dataclasses.asdict(self)
        d["targets"] = [t for t in TARGETS if t in self.targets]
        return d


@dataclass
class _Site:
    """What the hook of one adapted linear needs (``module.aligner_lora``)."""

    kind: str  # "column" or "row"
    scale: float
    dropout: float
    tp: int
    group: Any


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The :class:`LoraConfig` :func:`apply_lora` applied to ``model``, or None."""
    return getattr(unwrap(model), "aligner_lora", None)


def is_lora_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...lora_A`` / ``...lora_B``)."""
    return name.endswith(_SUFFIXES)


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(local name, module)`` of every adapted linear, in the model's order."""
    m = unwrap(model)
    return [(n, mod) for n, mod in m.named_modules() if isinstance(getattr(mod, "aligner_lora", None), _Site)]


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every adapter parameter by its local name (``decoder.layers.<i>.<path>.lora_A``)."""
    return {n: p for n, p in unwrap(model).named_parameters() if is_lora_name(n)}


def _kaiming_a(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, cols]`` as peft initialises ``lora_A`` (``kaiming_uniform_(a=sqrt(5))``: uniform
    in +-1/sqrt(cols)), from ``generator``."""
    a = torch.empty(rows, cols, dtype=torch.float32)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def _mark(p: nn.Parameter, sharded: bool, dim: int) -> None:
    """Megatron's attributes (as its linears set them, at any TP size): ``tensor_model_parallel``
    for a tensor split over the TP group, which the TP-aware gradient norm counts on every rank."""
    p.tensor_model_parallel = sharded
    p.partition_dim = dim if sharded else -1
    p.partition_stride = 1
    p.sequence_parallel = False


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int = 0) -> list[str]:
    """Freeze every weight of ``model`` (a policy, critic or reward model built by
    :mod:`aligner.models.gpt`, one pipeline stage or whole, on the current TP layout) and add
    rank-``cfg.rank`` adapters to ``cfg.targets`` in every layer it holds. Call it after
    anything that copies the base weights out (the reference model) and before the optimizer
    is built. Returns the adapted linears' local names."""
    cfg.problems().raise_if_any("lora config", ConversionError)
    if not cfg.enabled:
        raise ConversionError("lora.rank=0: LoRA is off; apply_lora needs a rank >= 1")
    m = unwrap(model)
    if lora_config_of(m) is not None:
        raise ConversionError("apply_lora: the model already has LoRA adapters")
    if type(m).__name__ != "GPTModel" or not hasattr(m, "decoder"):
        raise ConversionError(f"apply_lora: expected a megatron GPTModel, got {type(m).__name__}")
    if getattr(m, "aligner_fused", None) is not None:
        # Its parameter list was fixed without adapters: it would run the base model.
        raise ConversionError(
            "apply_lora: the model's fused forward is already set up; apply LoRA before "
            "aligner.models.forward.set_forward"
        )
    mcfg = m.config
    if getattr(mcfg, "sequence_parallel", False):
        raise ConversionError("apply_lora: sequence parallelism is not supported with LoRA")
    tp = int(mcfg.tensor_model_parallel_size or 1)
    tp_rank, group = 0, None
    if tp > 1:
        from megatron.core import parallel_state as mpu

        tp_rank = mpu.get_tensor_model_parallel_rank()
        group = mpu.get_tensor_model_parallel_group()
    for p in m.parameters():
        p.requires_grad_(False)
    r, names = cfg.rank, []
    order = list(TARGETS)
    for lname, layer in _named_layers(m):
        number = int(layer.layer_number) - 1  # Megatron's layer numbers are global and 1-based
        for target in order:
            if target not in cfg.targets:
                continue
            module = layer.get_submodule(TARGET_PATHS[target])
            kind = TARGETS[target]
            w = module.weight
            out_local, in_local = w.shape
            in_full = in_local * tp if kind == "row" else in_local
            g = torch.Generator().manual_seed((seed * 1_000_003 + number * 16 + order.index(target)) % 2**63)
            a = _kaiming_a(r, in_full, g)
            if kind == "row" and tp > 1:
                a = a.chunk(tp, 1)[tp_rank]
            a_param = nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
            b_param = nn.Parameter(torch.zeros(out_local, r, device=w.device, dtype=w.dtype))
            _mark(a_param, sharded=kind == "row", dim=1)
            _mark(b_param, sharded=kind == "column", dim=0)
            module.register_parameter("lora_A", a_param)
            module.register_parameter("lora_B", b_param)
            module.aligner_lora = _Site(
                kind, cfg.scale, float(cfg.dropout), tp, getattr(module, "tp_group", group)
            )
            module.register_forward_hook(_hook)
            names.append(f"{lname}.{TARGET_PATHS[target]}")
    m.aligner_lora = LoraConfig(**cfg.to_dict())
    return names


def _named_layers(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"decoder.layers.{i}", layer) for i, layer in enumerate(m.decoder.layers)]


def column_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, tp: int, group=None):
    """The low-rank part of a column-parallel linear: ``(x A^T) B^T * scale`` for this rank's
    output rows. ``x`` is the input as the base product sees it (its gradient summed over the
    TP group); ``A`` is replicated, so its gradient is summed over the group too."""
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        a = copy_to_tensor_model_parallel_region(a, group=group)
    return F.linear(F.linear(x, a), b) * scale


def row_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, tp: int, group=None):
    """The low-rank part of a row-parallel linear: this rank's partial ``x A^T`` (its input
    columns), all-reduced over the TP group as the base product's partial sums are, then
    ``B^T * scale`` (replicated ``B``: every rank computes the whole output)."""
    h = F.linear(x, a)
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        h = reduce_from_tensor_model_parallel_region(h, group=group)
    return F.linear(h, b) * scale


def _hook(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of an adapted Megatron linear: ``(out, bias)`` -> ``(out + delta, bias)``.
    Column-parallel ``linear_qkv`` adds its bias inside (the delta comes after it); every other
    target returns its bias apart and the layer adds it after the delta."""
    site: _Site = module.aligner_lora
    out, bias = output
    x = args[0]
    if site.kind == "column":
        if site.tp > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            x = copy_to_tensor_model_parallel_region(x, group=site.group)
        if site.dropout and module.training:
            x = F.dropout(x, site.dropout, True)
        delta = column_delta(x, module.lora_A, module.lora_B, site.scale, site.tp, site.group)
    else:
        if site.dropout and module.training:
            x = F.dropout(x, site.dropout, True)
        delta = row_delta(x, module.lora_A, module.lora_B, site.scale, site.tp, site.group)
    return out + delta, bias


# ----------------------------------------------------------------------------------------------
# Merged weights: what the weight stream carries
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def merged_weight(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's shard of an adapted linear's weight with its adapter merged in:
    ``W + scale * B @ A``, computed in fp32 and cast to ``dtype`` (default: ``W``'s). Per shard:
    a column-parallel ``B`` holds this rank's rows and a row-parallel ``A`` its columns, so the
    product is exactly this rank's shard of the full merged weight."""
    site: _Site = module.aligner_lora
    w, a, b = module.weight, module.lora_A, module.lora_B
    merged = w.float() + site.scale * (b.float() @ a.float())
    return merged.to(dtype or w.dtype)


def merged_weights(model: nn.Module) -> dict[str, Callable[[torch.dtype | None], torch.Tensor]]:
    """Local weight name (``decoder.layers.<i>.<path>.weight``) -> a function giving that
    shard merged (:func:`merged_weight`), for every adapted linear; empty without LoRA."""
    return {
        f"{name}.weight": (lambda dtype, mod=mod: merged_weight(mod, dtype))
        for name, mod in lora_modules(model)
    }
