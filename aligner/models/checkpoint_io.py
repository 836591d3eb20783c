"""Our own model checkpoint: full tensors, independent of TP/PP and of Hugging Face.

A checkpoint is a folder holding

- ``model.safetensors``: every tensor of :func:`aligner.models.layout.megatron_tensor_specs` in its
  full TP=1/PP=1 layout, under Megatron's names with global layer numbers, the vocabulary
  un-padded (so a checkpoint saved at TP=2 loads at TP=1, or with another vocab padding);
- ``meta.json``: ``{"format": "aligner-model", "version": 1, "model_config": {...},
  "role": "policy" | "critic" | "reward", "hf_architecture": str | null}`` and, when the model
  came from an HF folder, ``"hf_config"`` (that folder's config.json, used again on export).

Saving streams the tensors (gathered over TP, broadcast over PP) into a file written by global
rank 0 in a temporary folder that then replaces the target (``os.replace``). Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from aligner.config_checks import ConfigError
from aligner.distributed import barrier, is_writer
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.gpt import ROLES, build_model, config_of, head_of, unwrap
from aligner.models.hf import load_hf_into_megatron
from aligner.models.hf_config import model_config_from_hf
from aligner.models.layout import (
    iter_megatron_tensors,
    load_megatron_tensors,
    megatron_tensor_specs,
    weight_layout_diff,
)
from aligner.models.model_files import (
    as_dtype,
    atomic_output_dir,
    check_output_dir,
    read_json_object,
    write_tensor_stream,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "save_model_checkpoint",
    "read_checkpoint_meta",
    "load_model_checkpoint",
    "build_from_checkpoint",
    "load_weights_from",
]

FORMAT = "aligner-model"
VERSION = 1
_HEAD_ROLE = {head: role for role, head in ROLES.items()}


def save_model_checkpoint(
    model: torch.nn.Module,
    cfg: ModelConfig | None,
    out_dir: str | os.PathLike,
    role: str | None = None,
    *,
    hf_architecture: str | None = None,
    hf_config: dict | None = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (sharded over the current TP/PP layout) as a full checkpoint.

    Collective: call on every rank; global rank 0 writes. ``role`` defaults to the model's head.
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    role = role or _HEAD_ROLE[head]
    if ROLES.get(role) != head and not (head in ("value", "reward") and role in ("critic", "reward")):
        raise ConversionError(f"role={role!r} does not match the model's {head!r} head")
    dtype = as_dtype(dtype)
    wire = dtype or next(iter(m.parameters())).dtype
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    # Every rank has checked before the writer can create the folder: a stream with no collective
    # in it (data-parallel ranks at TP=PP=1) lets the writer finish before a slower rank checks.
    barrier()
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model_config": cfg.to_dict(),
        "role": role,
        "hf_architecture": hf_architecture,
    }
    if hf_config is not None:
        meta["hf_config"] = hf_config
    entries = [(s.name, s.shape, wire) for s in megatron_tensor_specs(cfg, head)]
    stream = iter_megatron_tensors(m, cfg, dtype=wire)
    if is_writer():
        with atomic_output_dir(out_dir, overwrite) as tmp:
            write_tensor_stream(
                stream, tmp / "model.safetensors", entries, {"format": "pt", "producer": FORMAT}
            )
            with open(tmp / "meta.json", "w", encoding="utf-8") as fh:
                json.dump(meta, fh, indent=2, sort_keys=True)
                fh.write("\n")
    else:
        write_tensor_stream(stream, None, entries)
    barrier()
    return out_dir


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict:
    """Validated ``meta.json`` of a checkpoint folder; ``meta["model_config"]`` becomes a
    :class:`ModelConfig`."""
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        raise ConversionError(f"checkpoint folder {folder} does not exist")
    path = folder / "meta.json"
    meta = read_json_object(path, "checkpoint meta")
    if meta.get("format") != FORMAT:
        raise ConversionError(f"{path}: field 'format'={meta.get('format')!r}: expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ConversionError(f"{path}: field 'version'={meta.get('version')!r}: expected {VERSION}")
    if meta.get("role") not in ROLES:
        raise ConversionError(f"{path}: field 'role'={meta.get('role')!r}: expected one of {sorted(ROLES)}")
    mc = meta.get("model_config")
    if not isinstance(mc, dict):
        raise ConversionError(f"{path}: field 'model_config' is missing or not an object")
    try:
        meta["model_config"] = ModelConfig.from_dict(mc)
    except (ConfigError, TypeError) as e:
        raise ConversionError(f"{path}: field 'model_config': {e}") from e
    if not (folder / "model.safetensors").is_file():
        raise ConversionError(f"{folder / 'model.safetensors'} does not exist")
    return meta


def load_model_checkpoint(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> dict:
    """Load a checkpoint into this rank's shard of ``model`` (any TP/PP layout). Validates the
    folder, the config and every tensor's shape first. Returns the meta (see
    :func:`read_checkpoint_meta`). A reward-model checkpoint loads into a critic and back."""
    from safetensors import safe_open

    m = unwrap(model)
    head = head_of(m)
    folder = Path(ckpt_dir)
    meta = read_checkpoint_meta(folder)
    saved: ModelConfig = meta["model_config"]
    cfg: ModelConfig = getattr(m, "aligner_config", saved)
    saved_head = ROLES[meta["role"]]
    if (saved_head == "lm") != (head == "lm"):
        raise ConversionError(
            f"{folder / 'meta.json'}: role {meta['role']!r} cannot be loaded into a model "
            f"with a {head!r} head"
        )
    diff = weight_layout_diff(cfg, saved, head)
    if diff:
        raise ConversionError(
            f"{folder / 'meta.json'}: model_config does not match the model (model != file): "
            + "; ".join(diff)
        )
    path = folder / "model.safetensors"
    specs = megatron_tensor_specs(cfg, head)
    try:
        fh_ctx = safe_open(str(path), framework="pt")
    except Exception as e:
        raise ConversionError(f"{path}: cannot be read as safetensors: {e}") from e
    with fh_ctx as fh:
        names = set(fh.keys())
        problems = []
        for s in specs:
            if s.name not in names:
                problems.append(f"missing tensor {s.name} (expected shape {s.shape})")
            elif tuple(fh.get_slice(s.name).get_shape()) != s.shape:
                problems.append(
                    f"tensor {s.name}: expected shape {s.shape}, "
                    f"got {tuple(fh.get_slice(s.name).get_shape())}"
                )
        if problems:
            raise ConversionError(f"{path} does not match the model:\n  " + "\n  ".join(problems[:20]))
        load_megatron_tensors(m, cfg, fh.get_tensor)
    return meta


def build_from_checkpoint(
    ckpt_dir: str | os.PathLike,
    role: str | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """Build a model of the checkpoint's config (``overrides``: e.g. ``make_vocab_size_divisible_by``)
    on the current TP/PP layout and load it. Returns ``(model, cfg, meta)``."""
    meta = read_checkpoint_meta(ckpt_dir)
    cfg: ModelConfig = meta["model_config"]
    if overrides:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **overrides})
    model = build_model(cfg, role or meta["role"], params_dtype)
    load_model_checkpoint(model, ckpt_dir)
    return model, cfg, meta


def load_weights_from(model: torch.nn.Module, cfg: ModelConfig, path: str | os.PathLike) -> str:
    """Load initial weights into ``model`` from our checkpoint folder (``meta.json``) or a HF
    folder (``config.json``), after checking the saved architecture equals ``cfg``'s.
    Returns which kind of folder it was ("aligner" or "hf")."""
    folder = Path(path)
    if (folder / "meta.json").is_file():
        saved = read_checkpoint_meta(folder)["model_config"]
        if saved.position_embedding == "rope" and cfg.max_seq_len < saved.max_seq_len:
            # A rope model's context may be shortened (its weights do not depend on it), as an
            # HF folder's may.
            saved = dataclasses.replace(saved, max_seq_len=cfg.max_seq_len)
        kind = "aligner"
    elif (folder / "config.json").is_file():
        saved = model_config_from_hf(folder, max_seq_len=cfg.max_seq_len)
        kind = "hf"
    else:
        raise ConversionError(
            f"init_from={str(path)!r}: expected a checkpoint folder with meta.json "
            "(aligner-convert import) or a Hugging Face folder with config.json"
        )
    diff = cfg.architecture_diff(saved)
    if diff:
        raise ConversionError(
            f"init_from={str(path)!r} holds a different architecture than the config "
            f"(config vs checkpoint): {'; '.join(diff)}"
        )
    if kind == "aligner":
        load_model_checkpoint(model, folder)
    else:
        load_hf_into_megatron(model, folder, cfg)
    return kind
