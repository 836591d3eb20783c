"""Rollout workers for multi-process trainers (critic-free GRPO against a reward-only server,
which every run shares: it holds no state):

- a DP=2 actor (torchrun) whose rank 0 asks one worker for both ranks' shares and hands rank 1 its
  own ends equal, every metric and weight, to the DP=2 actor generating in process;
- a TP=2 actor pushes its shards whole: its first batch is a TP=1 actor's, bit for bit;
- at k = 1 a DP=2 actor's rank 0 pushes on a thread while both ranks go on (the wait for it and the
  asks after it are collective): the run is the one with the push first, every metric and weight.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _actor_runs import FAST, digit_server, run_actor, torchrun_actor
from safetensors.torch import load_file

from aligner.checkpoint import step_dir_name
from aligner.distributed import spare_port
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.subprocess, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
COMMON = [
    *FAST,
    "data.task=copy",
    "ppo.global_batch_size=32",
    "ppo.mini_batch_size=32",
    "ppo.micro_batch_size=16",
    "ppo.advantage=grpo",
    "ppo.samples_per_prompt=4",
    "ppo.tis_cap=2.0",
    f"ppo.num_steps={STEPS}",
    "precision=fp32",
    "validation.interval=0",
    "validation.before_train=false",
    "checkpoint.save_interval=0",
    "checkpoint.resume=none",
]


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    server = digit_server(tmp_path_factory.mktemp("server"), "copy", "mode=reward_only")
    yield server
    server.stop()


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if "objective/scores" in r]


def test_dp2_trainer_on_a_worker_is_the_dp2_in_process_run(reward_server, tmp_path: Path):
    url = reward_server.url
    ckpt = lambda d: f"checkpoint.dir={d / 'ckpt'}"  # noqa: E731
    torchrun_actor(2, url, tmp_path / "in-process", [*COMMON, ckpt(tmp_path / "in-process")])

    address = f"127.0.0.1:{spare_port()}"
    rollout = ["rollout.workers=1", f"rollout.address={address}"]
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "aligner.rollout.worker", "+recipe=digits", *COMMON, *rollout],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(tmp_path),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        torchrun_actor(2, url, tmp_path / "worker", [*COMMON, *rollout, ckpt(tmp_path / "worker")])
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        log.close()
    assert f"stopped by the trainer after {2 * STEPS} batch(es)" in (tmp_path / "worker.log").read_text()

    _same_runs(tmp_path / "in-process", tmp_path / "worker")


def _same_runs(one: Path, two: Path) -> None:
    """Two runs' every metric but the timed ones, and their final weights, equal."""
    ours, theirs = _rows(one), _rows(two)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    varying = (
        "timers/",
        "perf/",
        "time",
        "throughput/",
        "refit/",
        "rollout/worker",
        "rollout/trainer",
        "push/",
    )
    for a, b in zip(ours, theirs):
        diff = {k: (a[k], b.get(k)) for k in a if not k.startswith(varying) and a[k] != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"
    folder = lambda d: d / "ckpt" / step_dir_name(STEPS) / "actor" / "policy" / "model.safetensors"  # noqa: E731
    want, got = load_file(str(folder(one))), load_file(str(folder(two)))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)


def _with_worker(tmp_path: Path, name: str, run, *extra: str) -> Path:
    """``run(rollout_overrides)`` against one worker started for it (with the trainer's ``extra``
    overrides, as ``aligner-launch`` gives them); the worker's log."""
    address = f"127.0.0.1:{spare_port()}"
    rollout = ["rollout.workers=1", f"rollout.address={address}", "rollout.max_staleness=1"]
    log_path = tmp_path / f"{name}-worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "aligner.rollout.worker", "+recipe=digits", *COMMON, *rollout, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(tmp_path),
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        try:
            run(rollout)
            assert worker.wait(timeout=60) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return log_path


def test_a_tp2_trainer_pushes_what_a_tp1_trainer_pushes(reward_server, tmp_path: Path):
    """A TP=2 trainer streams its shards whole to the worker: its first step (version 0) is the
    TP=1 trainer's exactly, and the later ones (versions its own updates made) agree closely."""
    url = reward_server.url
    _with_worker(
        tmp_path,
        "tp1",
        lambda rollout: run_actor(
            url, tmp_path / "tp1", [*COMMON, *rollout, f"checkpoint.dir={tmp_path / 'c1'}"]
        ),
    )
    log = _with_worker(
        tmp_path,
        "tp2",
        lambda rollout: torchrun_actor(
            2,
            url,
            tmp_path / "tp2",
            [*COMMON, *rollout, "parallel.tensor_model_parallel_size=2", f"checkpoint.dir={tmp_path / 'c2'}"],
        ),
        "parallel.tensor_model_parallel_size=2",  # the worker itself is one process whatever the trainer's layout
    )
    assert f"stopped by the trainer after {STEPS + 1} batch(es)" in log.read_text()
    one, two = _rows(tmp_path / "tp1"), _rows(tmp_path / "tp2")
    assert [r["rollout/staleness"] for r in two] == [0.0] + [1.0] * (STEPS - 1)
    for key in ("objective/scores", "response_length/mean"):
        assert one[0][key] == two[0][key], key
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=0.05), key


def test_a_dp2_trainer_s_overlapped_push_is_its_serial_push_s_run(reward_server, tmp_path: Path):
    url = reward_server.url
    for name in ("overlap", "serial"):
        flags = [
            f"rollout.overlap_push={name == 'overlap'}".lower(),
            f"checkpoint.dir={tmp_path / name / 'ckpt'}",
        ]
        _with_worker(
            tmp_path,
            name,
            lambda rollout, name=name, flags=flags: torchrun_actor(
                2, url, tmp_path / name, [*COMMON, *rollout, *flags]
            ),
        )
    _same_runs(tmp_path / "overlap", tmp_path / "serial")
    rows = _rows(tmp_path / "overlap")
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert all(r["push/hidden_frac"] == 0.0 for r in _rows(tmp_path / "serial"))
