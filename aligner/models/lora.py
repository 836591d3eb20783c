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
in fp32 (:func:`merged_weight`). Adapter-only files: :func:`save_lora_adapter` /
:func:`load_lora_adapter` (the adapters gathered to their full, TP=1 shapes, so any TP size
loads them), and :func:`export_peft_adapter` (peft's ``adapter_config.json`` +
``adapter_model.safetensors``, applying to the base model in its HF form).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aligner.config_checks import Problems
from aligner.models.config import ConversionError, ModelConfig

__all__ = [
    "TARGETS",
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
    "lora_tensor_specs",
    "iter_lora_tensors",
    "load_lora_tensors",
    "lora_master_values",
    "save_lora_adapter",
    "load_lora_adapter",
    "export_peft_adapter",
    "ADAPTER_FORMAT",
]

#: The linears LoRA can adapt, and how tensor parallelism splits each.
TARGETS: dict[str, str] = {
    "linear_qkv": "column",
    "linear_proj": "row",
    "linear_fc1": "column",
    "linear_fc2": "row",
}
# Where each target lives in a transformer layer.
_PATHS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
_SUFFIXES = (".lora_A", ".lora_B")
ADAPTER_FORMAT = "aligner-lora"
"""The ``format`` of an adapter folder's ``adapter.json`` (:func:`save_lora_adapter`)."""
_ADAPTER_VERSION = 1


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


def _unwrap(model: nn.Module) -> nn.Module:
    from aligner.models.gpt import unwrap

    return unwrap(model)


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The :class:`LoraConfig` :func:`apply_lora` applied to ``model``, or None."""
    return getattr(_unwrap(model), "aligner_lora", None)


def is_lora_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...lora_A`` / ``...lora_B``)."""
    return name.endswith(_SUFFIXES)


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(local name, module)`` of every adapted linear, in the model's order."""
    m = _unwrap(model)
    return [(n, mod) for n, mod in m.named_modules() if isinstance(getattr(mod, "aligner_lora", None), _Site)]


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every adapter parameter by its local name (``decoder.layers.<i>.<path>.lora_A``)."""
    return {n: p for n, p in _unwrap(model).named_parameters() if is_lora_name(n)}


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
    m = _unwrap(model)
    if lora_config_of(m) is not None:
        raise ConversionError("apply_lora: the model already has LoRA adapters")
    if type(m).__name__ != "GPTModel" or not hasattr(m, "decoder"):
        raise ConversionError(f"apply_lora: expected a megatron GPTModel, got {type(m).__name__}")
    if getattr(m, "aligner_fused", None) is not None:
        # Its parameter list was fixed without adapters: it would run the base model.
        raise ConversionError(
            "apply_lora: the model's fused forward is already set up; apply LoRA before "
            "aligner.models.gpt.set_forward"
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
            module = layer.get_submodule(_PATHS[target])
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
            names.append(f"{lname}.{_PATHS[target]}")
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


# ----------------------------------------------------------------------------------------------
# The adapters at their full (TP=1) shapes: gathered, sharded, saved
# ----------------------------------------------------------------------------------------------


def lora_tensor_specs(cfg: ModelConfig, lcfg: LoraConfig, head: str = "lm"):
    """Every adapter tensor of the full model (:class:`aligner.models.layout.TensorSpec`, global
    layer numbers, TP=1 shapes), in a fixed order: per layer, per target, ``lora_A`` then
    ``lora_B``. Each is split like its linear's weight (``B`` of a column-parallel linear: its
    rows, a gated fc1's halves each; ``A`` of a row-parallel one: its columns); the other is
    replicated."""
    from aligner.models.layout import TensorSpec, megatron_tensor_specs

    weights = {s.name: s for s in megatron_tensor_specs(cfg, head)}
    out = []
    for i in range(cfg.num_layers):
        for target, kind in TARGETS.items():
            if target not in lcfg.targets:
                continue
            p = f"decoder.layers.{i}.{_PATHS[target]}"
            w = weights[p + ".weight"]
            rows, cols = w.shape
            a_split = "row" if kind == "row" else "replicated"
            b_split = w.split if kind == "column" else "replicated"
            out.append(TensorSpec(p + ".lora_A", (lcfg.rank, cols), a_split, "layer", i))
            out.append(TensorSpec(p + ".lora_B", (rows, lcfg.rank), b_split, "layer", i))
    return out


def _require_lora(model: nn.Module) -> tuple[nn.Module, ModelConfig, LoraConfig]:
    from aligner.models.gpt import config_of

    m = _unwrap(model)
    lcfg = lora_config_of(m)
    if lcfg is None:
        raise ConversionError("the model has no LoRA adapters (apply_lora was not called)")
    return m, config_of(m), lcfg


def lora_master_values(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Each adapter's value by local name, its fp32 master where ``optimizer`` (a
    :class:`aligner.precision.MixedPrecisionAdamW`, or None) keeps one: what a checkpoint of a
    bf16 policy should hold."""
    params = lora_parameters(model)
    if optimizer is None or not hasattr(optimizer, "master_params"):
        return dict(params)
    by_id = {id(p): mp for p, mp in zip(optimizer.model_params, optimizer.master_params)}
    return {n: by_id.get(id(p), p) for n, p in params.items()}


def iter_lora_tensors(
    model: nn.Module,
    *,
    values: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the full adapter tensors (:func:`lora_tensor_specs`' names and shapes). Collective
    like :func:`aligner.models.layout.iter_megatron_tensors`: gathered over the TP group of the
    stage that holds each, broadcast over the PP group; every rank must iterate to the end and
    every rank yields every tensor. ``values``: local name -> tensor to stream instead of the
    parameter (the fp32 masters); ``dtype`` casts (default: each tensor's own)."""
    from aligner.models.gpt import head_of
    from aligner.models.layout import ParallelLayout

    m, cfg, lcfg = _require_lora(model)
    lay = ParallelLayout.current()
    local: dict[str, torch.Tensor] = dict(lora_parameters(m))
    if values:
        local.update(values)
    some = next(iter(local.values()))
    for spec in lora_tensor_specs(cfg, lcfg, head_of(m)):
        owner = lay.owner(spec, cfg)
        wire = dtype or some.dtype
        if owner == lay.pp_rank:
            t = local[lay.local_name(spec, cfg)]
            wire = dtype or t.dtype
            full = lay.gather(t.detach().to(wire), spec, cfg)
        else:
            full = torch.empty(spec.shape, dtype=wire, device=some.device)
        if lay.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, group=lay.pp_group, group_src=owner)
        yield spec.name, full


@torch.no_grad()
def load_lora_tensors(model: nn.Module, get: Callable[[str], torch.Tensor]) -> None:
    """Load full adapter tensors (``get(name)``, :func:`lora_tensor_specs`' names) as this rank's
    shards; only this rank's stage's are requested. A wrong shape is a ConversionError naming
    the tensor."""
    from aligner.models.gpt import head_of
    from aligner.models.layout import ParallelLayout

    m, cfg, lcfg = _require_lora(model)
    lay = ParallelLayout.current()
    local = lora_parameters(m)
    for spec in lora_tensor_specs(cfg, lcfg, head_of(m)):
        if lay.owner(spec, cfg) != lay.pp_rank:
            continue
        full = get(spec.name)
        if tuple(full.shape) != spec.shape:
            raise ConversionError(
                f"adapter tensor {spec.name}: expected shape {spec.shape}, got {tuple(full.shape)}"
            )
        local[lay.local_name(spec, cfg)].copy_(lay.shard(full, spec, cfg))


def save_lora_adapter(
    model: nn.Module,
    out_dir: str | Path,
    *,
    optimizer=None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write the adapters (full shapes, fp32: the optimizer's masters when it keeps them) as
    ``adapter.safetensors`` and ``adapter.json`` (the LoRA and model configs, and ``meta``) into
    ``out_dir``, which global rank 0 creates if needed. Collective: call on every rank. No base
    weight is written."""
    from aligner.checkpoint import save_tensors, write_json
    from aligner.distributed import barrier, is_writer

    m, cfg, lcfg = _require_lora(model)
    values = lora_master_values(m, optimizer)
    tensors = {n: t.cpu() for n, t in iter_lora_tensors(m, values=values, dtype=torch.float32)}
    out = Path(out_dir)
    if is_writer():
        out.mkdir(parents=True, exist_ok=True)
        save_tensors(
            out / "adapter.safetensors", tensors, metadata={"format": "pt", "producer": ADAPTER_FORMAT}
        )
        write_json(
            out / "adapter.json",
            {
                "format": ADAPTER_FORMAT,
                "version": _ADAPTER_VERSION,
                "lora": lcfg.to_dict(),
                "model_config": cfg.to_dict(),
                **(meta or {}),
            },
        )
    barrier()
    return out


def load_lora_adapter(model: nn.Module, in_dir: str | Path) -> dict[str, Any]:
    """Load the adapters :func:`save_lora_adapter` wrote into ``model``'s (this rank's shards;
    any TP/PP layout). The rank, alpha and targets must be the model's; every tensor's name
    and shape are checked before any is copied (CheckpointError naming what differs). Returns
    the folder's ``adapter.json``."""
    from aligner.checkpoint import CheckpointError, load_tensors, read_json
    from aligner.models.gpt import head_of, shape_mismatches

    m, cfg, lcfg = _require_lora(model)
    d = Path(in_dir)
    meta = read_json(d / "adapter.json")
    if meta.get("format") != ADAPTER_FORMAT:
        raise CheckpointError(
            f"{d / 'adapter.json'}: format={meta.get('format')!r}, expected {ADAPTER_FORMAT!r}"
        )
    saved = meta.get("lora", {})
    mine = lcfg.to_dict()
    diff = [
        f"lora.{k}: adapter {saved.get(k)!r}, model {mine[k]!r}"
        for k in ("rank", "alpha", "targets")
        if saved.get(k) != mine[k]
    ]
    if diff:
        raise CheckpointError(f"cannot load the adapters in {d}: " + "; ".join(diff))
    tensors = load_tensors(d / "adapter.safetensors")
    expected = {s.name: s.shape for s in lora_tensor_specs(cfg, lcfg, head_of(m))}
    problems = shape_mismatches(expected, {k: tuple(v.shape) for k, v in tensors.items()})
    if problems:
        raise CheckpointError(f"cannot load the adapters in {d}: " + ", ".join(problems))
    load_lora_tensors(m, tensors.__getitem__)
    return meta


def export_peft_adapter(
    model: nn.Module,
    out_dir: str | Path,
    arch: str,
    *,
    base_model: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the adapters as a peft LoRA folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, peft's tensor names) for the base model in its HF form
    (``arch``: a family or causal-LM architecture, as :func:`aligner.models.hf.export_hf`
    takes). Megatron's fused linears become HF's separate ones, each with the same ``A`` and its
    rows of ``B``: ``q_proj``/``k_proj``/``v_proj`` from ``linear_qkv`` (split per query group),
    ``gate_proj``/``up_proj`` from a gated ``linear_fc1``; GPT-2's Conv1D modules take
    ``fan_in_fan_out``. Collective: call on every rank; global rank 0 writes. An LM head only."""
    from aligner.checkpoint import save_tensors
    from aligner.distributed import barrier, is_writer
    from aligner.models.gpt import head_of
    from aligner.models.hf_config import resolve_architecture
    from aligner.models.hf_names import hf_rules
    from aligner.models.model_files import atomic_output_dir, check_output_dir

    m, cfg, lcfg = _require_lora(model)
    if head_of(m) != "lm":
        raise ConversionError(
            f"export_peft_adapter: the model has a {head_of(m)!r} head; expected an LM head"
        )
    family, _ = resolve_architecture(arch)
    rules = hf_rules(cfg, family, "lm", "lm")
    gpt2 = family == "gpt2"
    out = Path(out_dir)
    check_output_dir(out, overwrite)
    barrier()
    full = dict(iter_lora_tensors(m, dtype=torch.float32))
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for name in full:
        if not name.endswith(".lora_A"):
            continue
        base = name[: -len(".lora_A")]
        a, b = full[name], full[base + ".lora_B"]
        rule = rules[base + ".weight"]
        parts = rule.to_hf(b)
        if gpt2:  # Conv1D stores its weight transposed; an adapter's B is [out, r] as peft's
            parts = [x.t() for x in parts]
        for hf_name, part in zip(rule.hf_names, parts):
            mod = hf_name[: -len(".weight")]
            tensors[f"base_model.model.{mod}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{mod}.lora_B.weight"] = part.contiguous()
            modules.add(".".join(mod.split(".")[-2:]) if gpt2 else mod.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lcfg.rank,
        "lora_alpha": lcfg.alpha,
        "lora_dropout": lcfg.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": gpt2,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    if is_writer():
        with atomic_output_dir(out, overwrite) as tmp:
            save_tensors(tmp / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
            with open(tmp / "adapter_config.json", "w", encoding="utf-8") as fh:
                json.dump(config, fh, indent=2, sort_keys=True)
                fh.write("\n")
    barrier()
    return out
