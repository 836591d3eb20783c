"""The policy's Hugging Face exports during and after a run (``checkpoint.export_*``).

With ``checkpoint.export_hf=<folder>`` (say ``runs/qwen_hf``)::

    runs/qwen_hf/                  the final policy, after the last step
    runs/qwen_hf-best/             checkpoint.export_best: the step with the best validation/scores, written
                                   when it becomes the best (replacing the previous best's)
    runs/qwen_hf-step_00000100/    checkpoint.export_interval=100: every 100 steps (the newest
                                   checkpoint.export_keep_last of them kept; 0: all)

The step and best exports sit beside the final one, not inside it, so each folder is exactly
what ``from_pretrained`` and the Hub take, and replacing one never touches another. Each is
written atomically (a temporary folder renamed into place) and holds:

- ``config.json``: the base model's (``init_from``: an HF folder's ``config.json``, or our
  checkpoint's recorded ``hf_config``) with only what the model defines overwritten, so its
  token ids, context length (``max_position_embeddings``, not the run's ``model.max_seq_len``)
  and RoPE settings are kept;
- the weights in ``checkpoint.export_dtype`` (bf16 by default): ``model.safetensors``, or shards
  of at most ``checkpoint.export_max_shard_size`` and ``model.safetensors.index.json``;
- the tokenizer files, chat template and ``generation_config.json`` of the run's tokenizer folder
  (``tokenizer: auto`` is ``init_from``'s), the generation config from ``init_from`` when that
  folder has none (none of them with the built-in ``char`` tokenizer);
- ``README.md``: a model card naming the run's recipe, overrides and settings and its metrics at
  the exported step (:func:`aligner.models.model_card.model_card`);
- with LoRA, the merged weights, and ``peft_adapter/``: the adapters alone in peft's format.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from aligner.actor.checkpointing import BEST_KEY
from aligner.actor.config import ActorConfig
from aligner.actor.fingerprint import config_dict
from aligner.checkpoint import step_dir_name
from aligner.metrics import read_metrics
from aligner.models.export_source import BaseModel, read_base_model
from aligner.models.hf import export_hf
from aligner.models.hf_config import default_architecture
from aligner.models.lora_io import export_peft_adapter
from aligner.models.model_card import model_card
from aligner.tokenizers import has_tokenizer_files

__all__ = ["export_dir", "base_model_of", "PolicyExporter", "export_policy"]

log = logging.getLogger(__name__)


def export_dir(cfg: ActorConfig, kind: str = "final", step: int | None = None) -> Path:
    """Where an export goes: ``final`` (``checkpoint.export_hf``), ``best``
    (``<export_hf>-best``) or ``step`` (``<export_hf>-step_XXXXXXXX``)."""
    root = str(cfg.checkpoint.export_hf).rstrip("/\\")
    if kind == "final":
        return Path(root)
    if kind == "best":
        return Path(root + "-best")
    if kind == "step" and step is not None:
        return Path(f"{root}-{step_dir_name(step)}")
    raise ValueError(f"export_dir: kind={kind!r}, step={step!r}")


def base_model_of(cfg: ActorConfig) -> BaseModel:
    """The run's base model (``init_from``), as far as the export needs it; empty without one."""
    return read_base_model(cfg.init_from) if cfg.init_from else BaseModel()


class PolicyExporter:
    """Writes the policy's exports (the module's docstring). Collective: every rank calls
    :meth:`after_step` and :meth:`at_end` (the checkpointer and :func:`aligner.actor.run.run`
    do)."""

    def __init__(
        self,
        cfg: ActorConfig,
        policy: Any,
        *,
        log_rank: bool,
        overrides: list[str] | None = None,
    ) -> None:
        self.cfg, self.policy, self.log_rank = cfg, policy, log_rank
        self.overrides = list(overrides or [])
        self.base = base_model_of(cfg)
        c = cfg.checkpoint
        self.arch = c.export_arch or self.base.architecture or default_architecture(cfg.model)
        tok = cfg.tokenizer  # resolved by read_inputs; 'auto' here too: init_from's, when it has one
        if tok == "auto" and cfg.init_from and has_tokenizer_files(cfg.init_from):
            tok = cfg.init_from
        self.tokenizer_dir = tok if os.path.isdir(tok) else None
        self.latest: dict[str, float] = {}
        """The latest value of each metric seen (this process's steps)."""
        self.last_step = 0
        self.exported: list[Path] = []

    def after_step(self, step: int, metrics: dict[str, Any], new_best: bool) -> None:
        """After step ``step``: the step export when ``checkpoint.export_interval`` says so, the
        best export when ``new_best`` (a new best validation/scores) and ``checkpoint.export_best``."""
        self.latest.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        self.last_step = step
        c = self.cfg.checkpoint
        if c.export_interval and step % c.export_interval == 0:
            self.export(export_dir(self.cfg, "step", step), step, f"The policy at step {step}.")
            if c.export_keep_last and self.log_rank:  # global rank 0, which writes them
                self.prune_step_exports(c.export_keep_last)
        if new_best and c.export_best:
            score = metrics.get(BEST_KEY)
            of = f" ({BEST_KEY} {float(score):.6g})" if isinstance(score, (int, float)) else ""
            self.export(
                export_dir(self.cfg, "best", step),
                step,
                f"The policy at step {step}, the best validation score of the run so far{of}.",
            )

    def prune_step_exports(self, keep: int) -> list[Path]:
        """Remove all but the newest ``keep`` step exports (``<export_hf>-step_XXXXXXXX``, by step
        number; a folder of another name beside them is left alone); the folders removed."""
        root = export_dir(self.cfg)
        prefix = root.name + "-step_"
        steps = []
        for p in root.parent.iterdir() if root.parent.is_dir() else []:
            tail = p.name[len(prefix) :] if p.name.startswith(prefix) else ""
            if tail.isdigit() and p.is_dir():
                steps.append((int(tail), p))
        removed = [p for _, p in sorted(steps)[: max(len(steps) - keep, 0)]]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
            log.info("removed the step export %s (checkpoint.export_keep_last=%d)", p, keep)
        return removed

    def at_end(self, step: int | None = None) -> Path:
        """The final export (``checkpoint.export_hf``)."""
        step = self.last_step if step is None else step
        return self.export(export_dir(self.cfg), step, f"The final policy of the run (step {step}).")

    def export(self, out: Path, step: int, what: str) -> Path:
        """``self.policy`` as an HF folder in ``out`` (replaced if it exists)."""
        c = self.cfg.checkpoint
        card = self._card(out, step, what) if self.log_rank else None
        path = export_hf(
            self.policy,
            self.cfg.model,
            out,
            self.arch,
            tokenizer_dir=self.tokenizer_dir,
            dtype=c.export_dtype,
            hf_config=self.base.hf_config,
            overwrite=True,
            max_shard_size=c.export_max_shard_size,
            base_dir=self.base.files_dir,
            model_card=card,
        )
        if self.log_rank:
            print(f"exported the policy as a Hugging Face folder: {path}", flush=True)
        if self.cfg.lora.enabled:
            # The merged model is the folder itself; the adapters alone apply to the base model.
            peft_dir = export_peft_adapter(
                self.policy, path / "peft_adapter", self.arch, base_model=self.cfg.init_from, overwrite=True
            )
            if self.log_rank:
                print(f"exported the LoRA adapters (peft format, for the base model): {peft_dir}", flush=True)
        self.exported.append(path)
        return path

    def _metrics(self, step: int) -> dict[str, float]:
        """The latest value of each metric up to ``step``: the run dir's ``metrics.jsonl`` (steps
        of earlier processes of the run), then this process's own."""
        out: dict[str, float] = {}
        path = os.path.join(self.cfg.logging.run_dir, "metrics.jsonl")
        try:
            for row in read_metrics(path) if os.path.isfile(path) else []:
                if int(row.get("step", 0)) <= step:
                    out.update(row)
        except (OSError, ValueError, TypeError) as e:  # a card without them, never a failed export
            log.warning("model card: cannot read %s: %s", path, e)
        out.update(self.latest)
        return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not math.isinf(v)}

    def _card(self, out: Path, step: int, what: str) -> str:
        cfg = self.cfg
        tags = [t for t in (cfg.ppo.advantage if cfg.ppo.advantage != "gae" else None,) if t]
        if cfg.lora.enabled:
            tags.append("lora")
        notes = []
        if cfg.lora.enabled:
            notes.append(
                "The weights are the base model's with the LoRA adapters merged; `peft_adapter/` holds "
                "the adapters alone, in peft's format, for the base model."
            )
        return model_card(
            title=out.name,
            base_model=cfg.init_from,
            what=what,
            config=config_dict(cfg),
            overrides=self.overrides,
            metrics=self._metrics(step),
            step=step,
            extra_tags=tags,
            notes=notes,
        )


def export_policy(cfg: ActorConfig, policy: Any, log: bool, overrides: list[str] | None = None) -> Path:
    """The final policy as a Hugging Face folder (``checkpoint.export_hf``), as
    :meth:`PolicyExporter.at_end` writes it."""
    return PolicyExporter(cfg, policy, log_rank=log, overrides=overrides).at_end()
