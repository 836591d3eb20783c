"""The LoRA adapters (:mod:`aligner.models.lora`) at their full (TP=1) shapes: gathered out of a
TP/PP-sharded model and sharded back into one, and in files of their own.

:func:`lora_tensor_specs` lists every adapter tensor of the full model, as
:func:`aligner.models.layout.megatron_tensor_specs` lists the base weights;
:func:`iter_lora_tensors` streams them (collective, as the weight stream) and
:func:`load_lora_tensors` puts them back as this rank's shards. Adapter-only files:
:func:`save_lora_adapter` / :func:`load_lora_adapter` (``adapter.safetensors`` +
``adapter.json``, full shapes, so any TP size loads them), and :func:`export_peft_adapter`
(peft's ``adapter_config.json`` + ``adapter_model.safetensors``, applying to the base model in
its HF form).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aligner.checkpoint import CheckpointError, load_tensors, read_json, save_tensors, write_json
from aligner.distributed import barrier, is_writer
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.gpt import config_of, head_of, shape_mismatches, unwrap
from aligner.models.hf_config import resolve_architecture
from aligner.models.hf_names import hf_rules
from aligner.models.layout import ParallelLayout, WeightSpec, megatron_tensor_specs
from aligner.models.lora import TARGET_PATHS, TARGETS, LoraConfig, lora_config_of, lora_parameters
from aligner.models.model_files import atomic_output_dir, check_output_dir

__all__ = [
    "ADAPTER_FORMAT",
    "lora_tensor_specs",
    "iter_lora_tensors",
    "load_lora_tensors",
    "lora_master_values",
    "save_lora_adapter",
    "load_lora_adapter",
    "export_peft_adapter",
]

ADAPTER_FORMAT = "aligner-lora"
"""The ``format`` of an adapter folder's ``adapter.json`` (:func:`save_lora_adapter`)."""
_ADAPTER_VERSION = 1


def lora_tensor_specs(cfg: ModelConfig, lcfg: LoraConfig, head: str = "lm"):
    """Every adapter tensor of the full model (:class:`aligner.models.layout.WeightSpec`, global
    layer numbers, TP=1 shapes), in a fixed order: per layer, per target, ``lora_A`` then
    ``lora_B``. Each is split like its linear's weight (``B`` of a column-parallel linear: its
    rows, a gated fc1's halves each; ``A`` of a row-parallel one: its columns); the other is
    replicated."""
    weights = {s.name: s for s in megatron_tensor_specs(cfg, head)}
    out = []
    for i in range(cfg.num_layers):
        for target, kind in TARGETS.items():
            if target not in lcfg.targets:
                continue
            p = f"decoder.layers.{i}.{TARGET_PATHS[target]}"
            w = weights[p + ".weight"]
            rows, cols = w.shape
            a_split = "row" if kind == "row" else "replicated"
            b_split = w.split if kind == "column" else "replicated"
            out.append(WeightSpec(p + ".lora_A", (lcfg.rank, cols), a_split, "layer", i))
            out.append(WeightSpec(p + ".lora_B", (rows, lcfg.rank), b_split, "layer", i))
    return out


def _require_lora(model: nn.Module) -> tuple[nn.Module, ModelConfig, LoraConfig]:
    m = unwrap(model)
    lcfg = lora_config_of(m)
    if lcfg is None:
        raise ConversionError("the model has no LoRA adapters (apply_lora was not called)")
    return m, config_of(m), lcfg


def lora_master_values(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Each adapter's value by local name, its fp32 master where ``optimizer`` (a
    :class:`aligner.precision.MixedPrecisionAdamW` or :class:`aligner.sharded_optim.ShardedAdamW`,
    or None) keeps one: what a checkpoint of a bf16 policy should hold. With a sharded optimizer
    the masters are gathered: collective over its data-parallel group."""
    params = lora_parameters(model)
    if optimizer is None or not hasattr(optimizer, "full_masters"):
        return dict(params)
    by_id = {id(p): mp for p, mp in zip(optimizer.model_params, optimizer.full_masters())}
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
