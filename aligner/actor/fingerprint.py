"""Which run a command continues (docs/design.md, "Checkpoints"): the config fingerprint, the
guard of ``checkpoint.resume=auto``, and the run directory's record of its run.

- The **config fingerprint** is a digest of the resolved actor config less the keys a resume may
  change (:data:`FINGERPRINT_IGNORES`). Every actor checkpoint records it
  (``trainer_state.json``: ``config_fingerprint``, beside the whole ``config``), and so does the run
  directory's ``run_config.json``.
- ``checkpoint.resume=auto`` continues the newest actor checkpoint only when its config is this
  command's, those keys aside (:func:`aligner.actor.resume.check_resume`, before anything is
  built); otherwise it stops with the keys that differ and how to go on: another
  ``logging.run_dir`` (or ``checkpoint.dir``), ``checkpoint.resume=force``, or
  ``checkpoint.resume=<dir>/step_XXXXXXXX``. A checkpoint from before fingerprints resumes as it
  did, with a warning.
- A **run id**, drawn at a fresh start and carried by every checkpoint of the run, tells whether a
  run directory belongs to the run resumed (:func:`run_dir_continues`): only then are its
  metrics rows and its W&B run (``wandb_run_id.txt``) continued; a run resumed into another run's
  directory logs there as a new run.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from aligner.checkpoint import CheckpointError, read_json, write_json

__all__ = [
    "FINGERPRINT_IGNORES",
    "RUN_RECORD",
    "config_dict",
    "config_fingerprint",
    "config_changes",
    "changes_listed",
    "new_run_id",
    "read_run_record",
    "write_run_record",
    "run_dir_continues",
]


FINGERPRINT_IGNORES: tuple[str, ...] = (
    "ppo.num_steps",  # a longer (or shorter) budget continues the same run
    "checkpoint",  # where and how often it saves, what it exports, and resume itself
    "logging",  # where and how it reports: run dir, console, TensorBoard, W&B
    "critic",  # how the server is reached: address, timeouts, retries, run token, restarts
    "validation.interval",
    "validation.before_train",
    "validation.num_samples",
    "generation.num_threads",  # how fast, not what: threads, decode step, recompute, forward,
    "generation.decode_step",  # micro-batches (the loss is the minibatch's whatever the cut)
    "model.recompute",
    "model_forward",
    "ppo.reference_on_cpu",
    "ppo.micro_batch_size",
    "ppo.max_tokens_per_micro_batch",
    "optim.use_distributed_optimizer",  # where the optimizer state lives (ZeRO-1), not its values
    "generation.engine",  # how rollouts are generated: the engine, its layout and its settings
    "generation.tensor_parallel_size",
    "generation.trtllm",
    "rollout.workers",  # where rollouts are generated (rollout.max_staleness is the run's)
    "rollout.address",
    "rollout.worker_rank",
    "rollout.tensor_parallel_size",
    "rollout.timeout_s",
    "rollout.bucket_mb",
    "rollout.weights_backend",
    "rollout.on_worker_loss",
    "rollout.overlap_push",  # when the push runs, not what it sends
    "rollout.score_on_workers",  # who asks the server for the scores, not what they are
)
"""Config keys (and whole sections) left out of the fingerprint: what may change when a run is
continued. Every other key, the learning rate among them, is the run's."""

RUN_RECORD = "run_config.json"
"""``<logging.run_dir>/run_config.json``: the run id, the config and its fingerprint of the run that
last started in the directory."""
MAX_LISTED = 10


def config_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain JSON-able containers (what checkpoints record)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in FINGERPRINT_IGNORES)


def _fingerprinted(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in _flatten(config).items() if not _ignored(k)}


def config_fingerprint(config: dict[str, Any]) -> str:
    """A digest of ``config`` (from :func:`config_dict`) less :data:`FINGERPRINT_IGNORES`;
    independent of key order."""
    text = json.dumps(_fingerprinted(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` of the fingerprinted keys both configs have and that differ,
    by key. Keys one side lacks (another version of this code added or removed them) are not
    changes."""
    a, b = _fingerprinted(old), _fingerprinted(new)
    return [(k, a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]


def changes_listed(changes: list[tuple[str, Any, Any]]) -> str:
    lines = [f"  {k}: {o!r} -> {n!r}" for k, o, n in changes[:MAX_LISTED]]
    if len(changes) > MAX_LISTED:
        lines.append(f"  ... and {len(changes) - MAX_LISTED} more")
    return "\n".join(lines)


def new_run_id() -> str:
    """The id of a run started fresh, carried by all its checkpoints."""
    return secrets.token_hex(6)


def read_run_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run directory's ``run_config.json``; None when it has none (or it is unreadable)."""
    try:
        record = read_json(Path(run_dir) / RUN_RECORD)
    except CheckpointError:
        return None
    return record if isinstance(record, dict) else None


def write_run_record(
    run_dir: str | os.PathLike, config: dict[str, Any], run_id: str | None, resumed_from: str | None
) -> None:
    """``run_config.json``: the run id, the fingerprint and the config of the run starting now."""
    os.makedirs(run_dir, exist_ok=True)
    record = {
        "run_id": run_id,
        "config_fingerprint": config_fingerprint(config),
        "fingerprint_ignores": list(FINGERPRINT_IGNORES),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resumed_from": resumed_from,
        "config": config,
    }
    tmp = Path(run_dir) / f".{RUN_RECORD}.tmp"
    write_json(tmp, record)
    os.replace(tmp, Path(run_dir) / RUN_RECORD)


def run_dir_continues(run_dir: str | os.PathLike, run_id: str | None) -> bool:
    """Whether ``run_dir`` belongs to the run of ``run_id`` (the checkpoint resumed; None: one from
    before run ids), so its metrics and W&B run go on: its record names that run, or neither has an
    id (a directory and a checkpoint from before run ids, continued as they were)."""
    record = read_run_record(run_dir)
    return (record.get("run_id") if record else None) == run_id
