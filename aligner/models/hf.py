"""Hugging Face <-> Megatron-core conversion for the Llama family (Llama, Mistral, Qwen2,
Qwen3) and GPT-2.

Built on three modules, each written once and shared by every consumer:
:mod:`aligner.models.layout` (the canonical Megatron tensors, their TP/PP layout and the weight
stream), :mod:`aligner.models.hf_names` (how each is named and shaped in HF) and
:mod:`aligner.models.hf_config` (HF configs <-> :class:`ModelConfig`). This module holds the
consumers: :func:`iter_hf_tensors` (the stream an inference engine can take as ``(name,
tensor)`` pairs), :func:`export_hf` (an HF folder), :class:`HFTensorSource`,
:func:`validate_hf_folder`, :func:`load_hf_into_megatron` and :func:`import_hf` (an HF folder
or state dict into a Megatron model).

:func:`iter_hf_tensors` keeps the collective contract of
:func:`aligner.models.layout.iter_megatron_tensors`: every rank iterates it to the end, in the
same order, and every rank yields every full tensor.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from aligner.config_checks import ConfigError
from aligner.distributed import barrier, is_writer
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.gpt import build_model, config_of, head_of, role_head, unwrap
from aligner.models.hf_config import (
    SUPPORTED_ARCHITECTURES,
    architecture_for,
    check_hf_folder,
    export_problems,
    hf_architecture,
    hf_config_from_model_config,
    model_config_from_hf,
    resolve_architecture,
)
from aligner.models.hf_names import HFRule, hf_rules, hf_tensor_specs
from aligner.models.layout import (
    ParallelLayout,
    check_local_model,
    iter_megatron_tensors,
    load_megatron_tensors,
    weight_layout_diff,
)
from aligner.models.model_files import (
    as_dtype,
    atomic_output_dir,
    check_output_dir,
    parse_size,
    read_json_object,
    write_sharded_tensor_stream,
)

__all__ = [
    "HFTensorSource",
    "iter_hf_tensors",
    "export_hf",
    "validate_hf_folder",
    "load_hf_into_megatron",
    "import_hf",
]


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def _export_arch(arch: str, head: str) -> tuple[str, str, str]:
    family, _ = resolve_architecture(arch)
    full = architecture_for(arch, head)
    return full, family, SUPPORTED_ARCHITECTURES[full][1]


def iter_hf_tensors(
    model: torch.nn.Module, cfg: ModelConfig | None, arch: str, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(HF name, full tensor)`` pairs of ``model`` as ``arch`` (a family or an
    architecture name; a critic/reward model becomes the family's sequence classifier).

    Collective like :func:`iter_megatron_tensors`: every rank iterates to the end and every rank
    yields every tensor. Export-time problems (a config HF cannot express) are raised before
    any communication, identically on every rank.
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    full_arch, family, hf_head = _export_arch(arch, head)
    problems = export_problems(cfg, family)
    if problems:
        raise ConversionError(f"cannot export this model as {full_arch}:\n  " + "\n  ".join(problems))
    rules = hf_rules(cfg, family, head, hf_head)
    for name, tensor in iter_megatron_tensors(m, cfg, dtype=dtype):
        rule = rules[name]
        if rule is None:
            continue
        parts = rule.to_hf(tensor)
        for hf_name, shape, t in zip(rule.hf_names, rule.hf_shapes, parts):
            if tuple(t.shape) != shape:  # pragma: no cover - a bug in a rule
                raise AssertionError(f"{hf_name}: produced {tuple(t.shape)}, expected {shape}")
            yield hf_name, t


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _copy_tokenizer(src: Path, dst: Path, base_dir: Path | None) -> None:
    """The tokenizer files, chat template and ``generation_config.json`` of ``src``; the
    generation config from ``base_dir`` when ``src`` has none."""
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
        elif name == "generation_config.json" and base_dir is not None and (base_dir / name).is_file():
            shutil.copy2(base_dir / name, dst / name)


def export_hf(
    model: torch.nn.Module,
    cfg: ModelConfig | None,
    out_dir: str | os.PathLike,
    arch: str,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    hf_config: Any = None,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
    base_dir: str | os.PathLike | None = None,
    model_card: str | None = None,
) -> Path:
    """Write ``model`` as an HF folder. Collective: call on every rank; global rank 0 writes, into
    a temporary folder renamed into place. Returns ``out_dir``.

    - ``config.json``: ``hf_config`` (the HF config the model came from: a dict, folder or
      ``config.json``) with only what the model defines overwritten, so its token ids, context
      length, RoPE settings and other fields are kept (:func:`hf_config_from_model_config`);
    - the weights in ``dtype`` (None: the parameters'), as ``model.safetensors``, or as shards of
      at most ``max_shard_size`` (``"5GB"`` or bytes) with ``model.safetensors.index.json``;
    - the tokenizer files, chat template and ``generation_config.json`` of ``tokenizer_dir`` (the
      tokenizer the model was trained with; None: none), the generation config from ``base_dir``
      (the base model's HF folder) when ``tokenizer_dir`` has none;
    - ``README.md``: ``model_card`` when given.
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    dtype = as_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    full_arch, family, hf_head = _export_arch(arch, head)
    out_dir = Path(out_dir)
    wire = dtype or next(iter(m.parameters())).dtype
    hf_conf = hf_config_from_model_config(
        cfg, full_arch, base=hf_config, dtype=wire
    )  # raises before any comm.
    check_output_dir(out_dir, overwrite)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok_dir is not None and not tok_dir.is_dir():
        raise ConversionError(f"tokenizer folder {tok_dir} does not exist")
    barrier()  # every rank has checked before the writer can create the folder
    entries = [(n, s, wire) for n, s in hf_tensor_specs(cfg, full_arch, head)]
    stream = iter_hf_tensors(m, cfg, full_arch, dtype=wire)
    if is_writer():
        with atomic_output_dir(out_dir, overwrite) as tmp:
            write_sharded_tensor_stream(stream, tmp, entries, max_bytes, {"format": "pt"})
            hf_conf.save_pretrained(tmp)
            if tok_dir is not None:
                _copy_tokenizer(tok_dir, tmp, Path(base_dir) if base_dir is not None else None)
            if model_card is not None:
                (tmp / "README.md").write_text(model_card, encoding="utf-8")
    else:
        write_sharded_tensor_stream(stream, None, entries, max_bytes)
    barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------


class HFTensorSource:
    """HF tensors by name, read one at a time: from a folder (``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards) or from an in-memory state dict.

    GPT-2 checkpoints saved without the ``transformer.`` prefix are accepted.
    """

    def __init__(self, src: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._state: dict[str, torch.Tensor] | None
        self.folder: Path | None
        if isinstance(src, Mapping):
            self.folder = None
            self._state = {k: v for k, v in src.items() if isinstance(v, torch.Tensor)}
            self._where = dict.fromkeys(self._state, "the given state dict")
            return
        self._state = None
        folder = check_hf_folder(src)
        self.folder = folder
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if index.is_file():
            idx = read_json_object(index, "safetensors index")
            wm = idx.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise ConversionError(f"{index}: no 'weight_map' of tensor names to files")
            files = sorted(set(wm.values()))
            absent = [f for f in files if not (folder / f).is_file()]
            if absent:
                raise ConversionError(f"{index} names files that do not exist: {absent[:5]}")
            self._where = {k: str(folder / v) for k, v in wm.items()}
        elif single.is_file():
            self._where = {k: str(single) for k in self._open(str(single)).keys()}
        else:
            others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt")
            )
            hint = f" (found {others[:3]}: only safetensors are read, never pickles)" if others else ""
            raise ConversionError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")

    def _open(self, path: str):
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:
                raise ConversionError(f"{path}: cannot be read as safetensors: {e}") from e
        return self._handles[path]

    def resolve(self, name: str) -> str | None:
        if name in self._where:
            return name
        for prefix in ("transformer.",):
            if name.startswith(prefix) and name[len(prefix) :] in self._where:
                return name[len(prefix) :]
        return None

    def where(self, name: str) -> str:
        key = self.resolve(name)
        return self._where[key] if key else (str(self.folder) if self.folder else "the given state dict")

    def shape(self, name: str) -> tuple[int, ...]:
        key = self.resolve(name)
        if key is None:
            raise KeyError(name)
        if self._state is not None:
            return tuple(self._state[key].shape)
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def get(self, name: str) -> torch.Tensor:
        key = self.resolve(name)
        if key is None:
            raise ConversionError(f"tensor {name} is not in {self.folder or 'the given state dict'}")
        if self._state is not None:
            return self._state[key]
        return self._open(self._where[key]).get_tensor(key)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFTensorSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _validate_source(src: HFTensorSource, rules: dict[str, HFRule | None], arch: str) -> None:
    problems = []
    for rule in rules.values():
        if rule is None:
            continue
        for name, shape in zip(rule.hf_names, rule.hf_shapes):
            if src.resolve(name) is None:
                problems.append(f"missing tensor {name} (expected shape {shape})")
                continue
            got = src.shape(name)
            if got != tuple(shape):
                problems.append(
                    f"tensor {name} in {src.where(name)}: expected shape {tuple(shape)}, got {got}"
                )
    if problems:
        where = src.folder or "the given state dict"
        raise ConversionError(
            f"{where} does not hold a {arch} of the expected shape:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )


def validate_hf_folder(
    folder: str | os.PathLike,
    role: str = "policy",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **overrides: Any,
) -> tuple[ModelConfig, str]:
    """Check an HF folder before any work: config.json, the architecture, the TP/PP layout,
    and every tensor's presence and shape. Returns ``(cfg, architecture)``."""
    folder = check_hf_folder(folder)
    arch = hf_architecture(folder)
    cfg = model_config_from_hf(folder, **overrides)
    head = role_head(role)
    _check_role(arch, head, folder)
    try:
        cfg.check_parallel(tensor_parallel_size, pipeline_parallel_size)
    except ConfigError as e:
        raise ConversionError(f"{folder / 'config.json'}: {e}") from e
    family, hf_head = resolve_architecture(arch)
    with HFTensorSource(folder) as src:
        _validate_source(src, hf_rules(cfg, family, head, hf_head), arch)
    return cfg, arch


def _check_role(arch: str, head: str, where: Any) -> None:
    _, hf_head = resolve_architecture(arch)
    if head == "lm" and hf_head == "score":
        raise ConversionError(
            f"{where}: {arch} has a sequence-classification head, not an LM head; "
            "it can be imported as a reward model or critic, not as a policy"
        )


def load_hf_into_megatron(
    model: torch.nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    cfg: ModelConfig | None = None,
    arch: str | None = None,
) -> None:
    """Load full HF tensors (a folder, or a state dict with ``arch`` given) into this rank's
    TP shard and PP stage of ``model``. Validates everything first (one error naming the
    file/tensor/field, expected vs got).

    A critic/reward model loaded from a causal LM keeps its fresh scalar head; from a
    sequence classifier it takes ``score.weight`` (bias 0).
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    lay = ParallelLayout.current()
    try:
        cfg.check_parallel(lay.tp, lay.pp)
    except ConfigError as e:
        raise ConversionError(str(e)) from e
    if isinstance(source, Mapping):
        if arch is None:
            raise ConversionError("loading from a state dict needs arch (e.g. 'LlamaForCausalLM')")
    else:
        folder = check_hf_folder(source)
        file_arch = hf_architecture(folder)
        if arch is None:
            arch = file_arch
        elif resolve_architecture(arch)[0] != resolve_architecture(file_arch)[0]:
            raise ConversionError(
                f"{folder / 'config.json'}: architecture {file_arch!r} is not the family of "
                f"the requested {arch!r}"
            )
        else:
            arch = file_arch
        diff = weight_layout_diff(cfg, model_config_from_hf(folder), head)
        if diff:
            raise ConversionError(
                f"{folder / 'config.json'} does not describe the given model config "
                f"(given != file): " + "; ".join(diff)
            )
    family, hf_head = resolve_architecture(arch)
    _check_role(arch, head, source if not isinstance(source, Mapping) else "state dict")
    rules = hf_rules(cfg, family, head, hf_head)
    check_local_model(m, cfg, head, lay)
    with HFTensorSource(source) as src:
        _validate_source(src, rules, arch)

        def get(name: str) -> torch.Tensor:
            rule = rules[name]
            assert rule is not None
            return rule.from_hf([src.get(n) for n in rule.hf_names])

        load_megatron_tensors(m, cfg, get, skip={n for n, r in rules.items() if r is None})


def import_hf(
    folder: str | os.PathLike,
    role: str = "policy",
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> tuple[torch.nn.Module, ModelConfig]:
    """Build our ``role`` model from an HF folder on the current TP/PP layout (call after
    :func:`aligner.distributed.initialize` on every rank). ``overrides``: ModelConfig fields
    such as ``make_vocab_size_divisible_by``. Returns ``(model, cfg)``."""
    lay = ParallelLayout.current()
    cfg, arch = validate_hf_folder(folder, role, lay.tp, lay.pp, **overrides)
    model = build_model(cfg, role, params_dtype)
    load_hf_into_megatron(model, folder, cfg, arch)
    return model, cfg
