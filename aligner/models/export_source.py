"""What an export starts from: which folder holds the weights, and the base model whose Hugging
Face files (``config.json`` fields, tokenizer, chat template, ``generation_config.json``) the
export carries.

:func:`find_export_source` reads any of this project's checkpoints, by their files:

- a model checkpoint (``meta.json`` + ``model.safetensors``: ``aligner-convert import``, or an
  actor checkpoint's ``actor/policy``);
- an actor training checkpoint (:mod:`aligner.actor.checkpointing`'s layout): its ``actor``
  folder, a step folder ``<dir>/step_XXXXXXXX``, the ``<dir>/best`` link, or the checkpoint
  folder ``<dir>`` itself (its newest complete step). A full fine-tune's step holds
  ``actor/policy``; a LoRA run's holds ``actor/policy_lora`` (the adapters alone), merged onto
  the run's base model (its ``init_from``) on export.

:func:`read_base_model` reads the base model folder a run started from (``init_from``): an HF
folder, or our model checkpoint, whose ``meta.json`` records the HF config it was imported from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aligner.checkpoint import COMPLETE_MARKER, complete_steps, step_dir_name
from aligner.models.config import ConversionError
from aligner.models.hf_config import hf_architecture, read_hf_config
from aligner.models.model_files import read_json_object

__all__ = ["BaseModel", "ExportSource", "read_base_model", "find_export_source"]

ACTOR = "actor"
"""The actor's half of a step folder (``aligner.actor.checkpointing.ROLE``)."""
POLICY = "policy"
LORA = "policy_lora"
"""A LoRA run's adapters, in place of ``policy`` (``aligner.actor.checkpointing.LORA_DIR``)."""


@dataclass
class BaseModel:
    """The model a policy was trained from, as far as an export needs it."""

    path: str | None = None
    """The folder (``init_from``); None: unknown, or a random initialisation."""
    architecture: str | None = None
    """Its HF architecture (``LlamaForCausalLM``), when recorded."""
    hf_config: dict[str, Any] | None = None
    """Its HF ``config.json``, when recorded: the export keeps its fields."""
    files_dir: Path | None = None
    """An HF folder whose tokenizer files, chat template and ``generation_config.json`` go along."""


def read_base_model(path: str | os.PathLike) -> BaseModel:
    """The base model in ``path``: an HF folder (``config.json``) or our model checkpoint
    (``meta.json``, with the ``hf_config`` it was imported from, if any)."""
    folder = Path(path)
    if (folder / "meta.json").is_file():
        meta = read_json_object(folder / "meta.json", "checkpoint meta")
        conf = meta.get("hf_config")
        return BaseModel(
            str(path), meta.get("hf_architecture"), conf if isinstance(conf, dict) else None, None
        )
    if (folder / "config.json").is_file():
        return BaseModel(str(path), hf_architecture(folder), read_hf_config(folder), folder)
    raise ConversionError(
        f"base model {str(path)!r}: expected a Hugging Face folder (config.json) or a model checkpoint "
        "(meta.json)" + ("" if folder.is_dir() else "; it does not exist")
    )


@dataclass
class ExportSource:
    """A checkpoint to export, found by :func:`find_export_source`."""

    path: Path
    """What was named."""
    model_dir: Path | None = None
    """A model checkpoint folder (``meta.json`` + ``model.safetensors``) holding the weights."""
    lora_dir: Path | None = None
    """A LoRA run's adapters (``adapter.json`` + ``adapter.safetensors``); the weights are its base's."""
    actor_dir: Path | None = None
    """The actor folder of a training checkpoint."""
    step: int | None = None
    """The training step (from ``trainer_state.json``)."""
    training: dict[str, Any] = field(default_factory=dict)
    """The actor's ``trainer_state.json`` (its ``config``: the run's resolved config)."""

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved config (empty for a bare model checkpoint)."""
        c = self.training.get("config")
        return c if isinstance(c, dict) else {}

    def base(self, override: str | os.PathLike | None = None) -> BaseModel:
        """The base model: ``override``, else the run's ``init_from``, else the model checkpoint's
        own record (its ``meta.json``'s HF config). A LoRA checkpoint needs one that exists (its
        adapters apply to it)."""
        where = override or self.config.get("init_from")
        if where is not None:
            if override is None and not Path(where).exists():
                if self.lora_dir is not None:
                    raise ConversionError(
                        f"{self.lora_dir} holds LoRA adapters of a run whose base model init_from={where!r} "
                        "does not exist here; name the base model folder with --base"
                    )
                return self._own_record()
            return read_base_model(where)
        if self.lora_dir is not None:
            raise ConversionError(
                f"{self.lora_dir} holds LoRA adapters of a run without init_from (a random base model, "
                "which no checkpoint stores); name the base model folder with --base"
            )
        return self._own_record()

    def _own_record(self) -> BaseModel:
        if self.model_dir is not None:
            b = read_base_model(self.model_dir)
            return BaseModel(None, b.architecture, b.hf_config, None)
        return BaseModel()


def _actor_source(path: Path, actor: Path) -> ExportSource:
    if not (actor / COMPLETE_MARKER).is_file():
        raise ConversionError(
            f"{actor} is an unfinished actor checkpoint (no {COMPLETE_MARKER}: its save was interrupted); "
            "export another step"
        )
    state = read_json_object(actor / "trainer_state.json", "actor checkpoint state")
    step = (state.get("trainer") or {}).get("step") if isinstance(state.get("trainer"), dict) else None
    src = ExportSource(path, actor_dir=actor, step=step if isinstance(step, int) else None, training=state)
    if (actor / POLICY / "meta.json").is_file():
        src.model_dir = actor / POLICY
    elif (actor / LORA / "adapter.json").is_file():
        src.lora_dir = actor / LORA
    else:
        raise ConversionError(
            f"{actor}: neither {POLICY}/meta.json (a full policy) nor {LORA}/adapter.json (LoRA adapters)"
        )
    return src


def find_export_source(path: str | os.PathLike) -> ExportSource:
    """The checkpoint ``path`` names (see the module's docstring), or a :class:`ConversionError`
    naming the path and what was expected."""
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"checkpoint folder {p} does not exist")
    if not p.is_dir():
        raise ConversionError(f"checkpoint {p} is not a folder")
    if (p / "meta.json").is_file():
        return ExportSource(p, model_dir=p)
    if (p / "trainer_state.json").is_file():
        return _actor_source(p, p)
    if (p / ACTOR).is_dir():
        return _actor_source(p, p / ACTOR)
    steps = complete_steps(p, role=ACTOR)
    if steps:
        step_dir = p / step_dir_name(steps[-1])
        return _actor_source(step_dir, step_dir / ACTOR)
    raise ConversionError(
        f"{p} is none of this project's checkpoints: expected a model checkpoint (meta.json + "
        "model.safetensors), an actor checkpoint step (<dir>/step_XXXXXXXX holding actor/, or <dir>/best), "
        "or a checkpoint folder holding complete step_XXXXXXXX/actor folders"
    )
