"""Where the policy's architecture and tokenizer come from.

With ``init_from`` set, the folder decides the architecture: a Hugging Face folder through its
``config.json`` (:func:`aligner.models.hf_config.model_config_from_hf`), this project's
checkpoint folder through its ``meta.json``. The ``model.*`` keys are then overrides, checked
against the folder:

- the keys that do not change the weights (dropouts, the init std, Megatron's vocabulary padding
  multiple, activation recompute) are applied;
- ``model.max_seq_len`` may shorten a rope model's context (never lengthen it), and must equal a
  learned position table's size;
- every other key must equal the folder's value: a different one is refused, naming the key, both
  values and the folder.

A key counts as set when it was named on the command line or when its value differs from the
packaged ``actor.yaml``; the others are the packaged tiny model's and are replaced by the folder's.

``tokenizer: auto`` means the tokenizer files in the ``init_from`` folder when it has them, else
the built-in ``char`` vocabulary (:func:`aligner.tokenizers.resolve_tokenizer_spec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aligner.actor.config import ActorConfig
from aligner.config_checks import ConfigError
from aligner.models.checkpoint_io import read_checkpoint_meta
from aligner.models.config import RUNTIME_KEYS, ModelConfig
from aligner.models.hf_config import model_config_from_hf

__all__ = [
    "TUNABLE_KEYS",
    "packaged_model_config",
    "model_keys_named",
    "resolve_model_config",
]

TUNABLE_KEYS = frozenset(
    {"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by", *RUNTIME_KEYS}
)
"""``model.*`` keys applied on top of a folder's architecture: they do not change the weights."""


def packaged_model_config() -> ModelConfig:
    """The ``model`` section of the packaged ``actor.yaml`` over :class:`ModelConfig`'s defaults
    (what a run that sets no ``model.*`` key gets)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    base = dataclasses.asdict(ActorConfig().model)
    yaml = OmegaConf.load(str(files("aligner.configs").joinpath("actor.yaml")))
    base.update(OmegaConf.to_container(yaml.get("model", {})) or {})
    return ModelConfig(**base)


def model_keys_named(overrides: Iterable[str]) -> set[str]:
    """The ``model.*`` field names in Hydra command-line overrides (``model.num_layers=4``,
    ``+model.x=1``, ``++model.x=1``)."""
    out = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key.startswith("model."):
            out.add(key[len("model.") :])
    return out


def _folder_model_config(path: str) -> tuple[ModelConfig, str]:
    """The architecture saved in ``path`` and which file says it."""
    folder = Path(path)
    if (folder / "meta.json").is_file():
        return read_checkpoint_meta(folder)["model_config"], str(folder / "meta.json")
    if (folder / "config.json").is_file():
        return model_config_from_hf(folder), str(folder / "config.json")
    raise ConfigError(
        f"init_from={path!r}: expected this project's checkpoint folder (meta.json) or a Hugging Face "
        "folder (config.json)" + ("" if folder.is_dir() else "; the folder does not exist")
    )


def resolve_model_config(
    given: ModelConfig, init_from: str | None, named: Iterable[str] = ()
) -> tuple[ModelConfig, list[str]]:
    """The policy's :class:`ModelConfig` and the overrides applied (``"max_seq_len=512"``...).

    Args:
        given: the config's ``model`` section.
        init_from: the folder the policy starts from (None: ``given`` as it is).
        named: ``model.*`` keys named on the command line (:func:`model_keys_named`).

    Raises:
        ConfigError: a set key differs from the folder's architecture (every such key named), or
            the folder holds no model.
    """
    if not init_from:
        return given, []
    packaged = packaged_model_config()
    named = set(named)
    explicit = {
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.name in named or getattr(given, f.name) != getattr(packaged, f.name)
    }
    saved, where = _folder_model_config(init_from)
    rope = saved.position_embedding == "rope"
    problems: list[str] = []
    applied: list[str] = []
    fields: dict[str, Any] = dataclasses.asdict(saved)
    for name in sorted(explicit):
        value, theirs = getattr(given, name), getattr(saved, name)
        if name in TUNABLE_KEYS:
            fields[name] = value
            if value != theirs:
                applied.append(f"{name}={value}")
        elif name == "max_seq_len" and value != theirs:
            if rope and value < theirs:
                fields[name] = value
                applied.append(f"{name}={value}")
            else:
                problems.append(
                    f"model.max_seq_len={value}: {where} allows at most {theirs}"
                    + (
                        " (a rope model's context can be shortened, not lengthened)"
                        if rope
                        else " (the size of its learned position table)"
                    )
                )
        elif name == "ffn_hidden_size" and value is not None and value == saved.ffn_size:
            continue
        elif name == "num_query_groups" and value is not None and value == saved.kv_heads:
            continue
        elif name == "kv_channels" and value is not None and value == saved.head_dim:
            continue
        elif value != theirs:
            problems.append(f"model.{name}={value!r} differs from {theirs!r} in {where}")
    if problems:
        raise ConfigError(
            f"init_from={init_from!r} decides the policy's architecture; drop these model.* keys or set "
            "them to the folder's values:\n  " + "\n  ".join(problems)
        )
    return ModelConfig(**fields), applied
