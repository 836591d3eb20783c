"""Runs of a trainer and its rollout workers (real worker processes joining the trainer's store;
the trainer in this process, against the toy critic or a server), shared by the rollout
workers' tests (tests/actor/test_rollout_workers.py, test_rollout_dynamic.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _toy_critic import ToyCritic
from safetensors.torch import load_file

from aligner.actor.run import build_actor
from aligner.checkpoint import step_dir_name
from aligner.distributed import spare_port
from aligner.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "data.task=copy",
    "data.num_digits=3",
    "data.num_prompts=256",
    "generation.max_new_tokens=4",
    "ppo.global_batch_size=16",
    "ppo.mini_batch_size=16",
    "ppo.micro_batch_size=16",
    "ppo.tis_cap=2.0",
    "precision=fp32",
    "optim.lr=1e-3",
    "optim.min_lr=1e-4",
    "optim.warmup_steps=1",
    "validation.interval=0",
    "validation.before_train=false",
]
"""What the trainer and its workers are both given (the workers read the same config)."""
VARYING = ("timers/", "perf/", "time", "throughput/", "refit/", "rollout/worker", "rollout/trainer", "push/")
"""Metrics that measure time, or exist on one side only: every other one must be equal."""


def compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
        return OmegaConf.to_object(compose("actor", overrides=overrides))


def start_workers(
    n: int,
    address: str,
    extra: list[str],
    log_dir: Path,
    env: dict[int, dict[str, str]] | None = None,
    ranks: list[int] | None = None,
    log_name: str = "worker{w}.log",
    tp: int = 1,
    entry: tuple[str, ...] = ("-m", "aligner.rollout.worker"),
) -> list[subprocess.Popen]:
    """``n`` worker processes, or those of ``ranks`` alone (``env``: worker -> variables of its
    own, e.g. a fault point); ``tp`` > 1: each a torchrun of that many processes; ``entry``: what
    the interpreter runs (a script that wraps the worker's entry point, e.g. to slow it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable]
    if tp > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    return [
        subprocess.Popen(
            [
                *launch,
                *entry,
                *COMMON,
                *extra,
                f"rollout.workers={n}",
                f"rollout.worker_rank={w}",
                f"rollout.address={address}",
                f"rollout.tensor_parallel_size={tp}",
            ],
            stdout=open(log_dir / log_name.format(w=w), "w"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            cwd=str(log_dir),
            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {}).get(w, {})),
        )
        for w in (ranks or range(1, n + 1))
    ]


def run_actor(
    root: Path,
    steps: int,
    *,
    workers=0,
    k=0,
    worker_extra=(),
    resume=False,
    on_step=None,
    critic=None,
    extra=(),
    worker_env=None,
    address=None,
    worker_tp=1,
    remote=False,
    worker_entry=("-m", "aligner.rollout.worker"),
):
    """A run of ``steps`` steps (its metrics rows, the worker processes' exit codes); ``critic``:
    the toy critic to use (a resumed run's must be the one its first part saved to); ``remote``:
    the server at ``critic.url`` (in ``extra``) instead."""
    address = address or f"127.0.0.1:{spare_port()}"
    rollout = [f"rollout.workers={workers}", f"rollout.max_staleness={k}", f"rollout.address={address}"]
    rollout = [*rollout, *extra] if workers else list(extra)
    cfg = compose(
        [
            *COMMON,
            *rollout,
            "ppo.num_steps=4",  # the schedule's length; the run stops after ``steps``
            f"checkpoint.dir={root / 'ckpt'}",
            "checkpoint.save_interval=2",
            f"checkpoint.resume={'auto' if resume else 'none'}",
            f"logging.run_dir={root / 'run'}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
        ]
    )
    cfg.rollout.timeout_s = 60.0
    procs = (
        start_workers(
            workers,
            address,
            [*rollout, *worker_extra],
            root / "workers",
            worker_env,
            tp=worker_tp,
            entry=worker_entry,
        )
        if workers
        else []
    )
    try:
        actor = build_actor(cfg) if remote else build_actor(cfg, critic=critic or ToyCritic())
        if on_step is not None:
            actor.trainer.on_step = on_step(procs)
        try:
            actor.trainer.train(steps)
        finally:
            actor.close()
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [r for r in read_metrics(str(root / "run" / "metrics.jsonl")) if "objective/scores" in r], codes


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(VARYING)}
        diff = {k: (ra[k], rb.get(k)) for k in sorted(keys) if ra[k] != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"


def policy_weights(root: Path, step: int) -> dict:
    return load_file(str(root / "ckpt" / step_dir_name(step) / "actor" / "policy" / "model.safetensors"))


def same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()]
