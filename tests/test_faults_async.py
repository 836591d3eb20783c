"""The fault suite for asynchronous runs (a rollout worker of its own, one version stale:
docs/design.md, "Rollout workers"): the trainer, the worker and the server each killed mid-run
(SIGKILL at a fault point), and the run started again, ends as the uninterrupted asynchronous
run: both roles' final checkpoints tensor for tensor (the policy, the critic and its optimizer
state) and every logged number.

- the trainer killed mid-step: its worker sees it go and exits 1; the trainer and a worker
  started again resume from the last checkpoint, which kept the batch asked for and not yet
  trained on;
- the worker killed mid-generation (``rollout.on_worker_loss=stop``): the trainer stops naming
  it; both started again resume likewise;
- the server killed during a critic update: the trainer rolls back with its worker, which drops
  what it generated for the abandoned continuation.

The same server settings and actor run as tests/test_faults.py (``_faults``), at
``rollout.max_staleness=1`` on one worker.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _faults import (
    ACTOR_RUN,
    ROOT,
    STEPS,
    actor_env,
    assert_same_weights,
    final_weights,
    kill_server_mid_run,
    rollbacks,
    run_actor,
    same_metrics,
    serving_critic,
)

from aligner.checkpoint import complete_steps, step_dir_name
from aligner.distributed import spare_port
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.faults, pytest.mark.server, pytest.mark.subprocess]

ASYNC = ("rollout.workers=1", "rollout.max_staleness=1", "ppo.tis_cap=2.0", "rollout.timeout_s=120")
"""One worker, one version stale (the trainer and its worker are both given these)."""


class Worker:
    """A rollout worker process joining the store at ``address`` (output in ``log``)."""

    def __init__(self, log: Path, address: str, **env: str) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in wait()
        cmd = [
            sys.executable,
            "-m",
            "aligner.rollout.worker",
            *ACTOR_RUN,
            *ASYNC,
            f"rollout.address={address}",
        ]
        self.proc = subprocess.Popen(
            cmd, env=actor_env(**env), stdout=self._out, stderr=subprocess.STDOUT, cwd=str(ROOT)
        )

    def wait(self, timeout_s: float = 150) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker did not exit:\n{self.text()[-3000:]}") from None
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill it if it still runs; close its log."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_worker():
    """Start workers (:class:`Worker`); any still running when the case ends is killed."""
    started: list[Worker] = []

    def start(log: Path, address: str, **env: str) -> Worker:
        started.append(Worker(log, address, **env))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def _rollout() -> tuple[list[str], str]:
    address = f"127.0.0.1:{spare_port()}"
    return [*ASYNC, f"rollout.address={address}"], address


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults-async")


@pytest.fixture(scope="module")
def shared(root):
    with serving_critic(root / "shared") as critic:
        yield critic


@pytest.fixture(scope="module")
def reference(shared, root):
    """The uninterrupted asynchronous run: its final checkpoints (copied: later runs on the shared
    server write the same critic steps) and its metrics."""
    rollout, address = _rollout()
    worker = Worker(root / "reference" / "worker.log", address)
    try:
        run = run_actor(shared.url, root / "reference", shared.ckpt, *rollout)
    finally:
        code = worker.wait()  # stopped if it does not exit
    assert code == 0, worker.text()[-3000:]
    rows = read_metrics(str(root / "reference" / "metrics.jsonl"))
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [1.0] * (STEPS - 1), run.tail()
    keep = root / "reference-kept"
    shutil.copytree(shared.ckpt / step_dir_name(STEPS), keep / step_dir_name(STEPS))
    return final_weights(keep), rows


def _same_as(reference, run_dir: Path, ckpt: Path, critic_ckpt: Path) -> None:
    weights, rows = reference
    assert_same_weights(final_weights(ckpt, critic_ckpt), weights)
    same_metrics(
        _without_worker_times(read_metrics(str(run_dir / "metrics.jsonl"))), _without_worker_times(rows)
    )


def _without_worker_times(rows: list[dict]) -> list[dict]:
    """The rows less what measures the worker's or the push's time (not the run's numbers)."""
    timing = ("rollout/worker", "rollout/trainer_wait", "push/")
    return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]


def _say(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n[faults] {text}")


def test_trainer_killed_mid_step_resumes_with_a_new_worker_and_ends_as_the_uninterrupted_run(
    shared, reference, tmp_path, capsys, start_worker
):
    rollout, address = _rollout()
    worker = start_worker(tmp_path / "worker-1.log", address)
    ckpt = tmp_path / "ckpt"
    run = run_actor(
        shared.url, tmp_path, ckpt, *rollout, env=actor_env(ALIGNER_FAULT_AT="mid_step@3"), ok=False
    )
    assert run.returncode == -signal.SIGKILL, run.tail()
    assert worker.wait() == 1, worker.text()[-3000:]  # its trainer went away
    assert complete_steps(ckpt, role="actor") == [2]

    rollout, address = _rollout()  # a new store: the trainer's start hosts it again
    worker = start_worker(tmp_path / "worker-2.log", address)
    run = run_actor(shared.url, tmp_path, ckpt, *rollout)
    assert "resuming from step 2" in run.stdout, run.tail()
    assert worker.wait() == 0, worker.text()[-3000:]
    _same_as(reference, tmp_path, ckpt, shared.ckpt)
    _say(
        capsys,
        "async trainer killed at mid_step@3: resumed from step 2 with a new worker; final weights equal",
    )


def test_worker_killed_mid_generation_stops_the_trainer_and_both_resume_to_the_uninterrupted_run(
    shared, reference, tmp_path, capsys, start_worker
):
    rollout, address = _rollout()
    worker = start_worker(tmp_path / "worker-1.log", address, ALIGNER_ROLLOUT_FAULT_AT="generate@4")
    ckpt = tmp_path / "ckpt"
    run = run_actor(shared.url, tmp_path, ckpt, *rollout, ok=False)
    assert worker.wait() == -signal.SIGKILL, worker.text()[-3000:]
    assert run.returncode != 0 and "rollout worker 1" in run.stdout + run.stderr, run.tail()
    saved = complete_steps(ckpt, role="actor")
    assert saved and saved[-1] < STEPS, saved

    rollout, address = _rollout()
    worker = start_worker(tmp_path / "worker-2.log", address)
    run = run_actor(shared.url, tmp_path, ckpt, *rollout)
    assert f"resuming from step {saved[-1]}" in run.stdout, run.tail()
    assert worker.wait() == 0, worker.text()[-3000:]
    _same_as(reference, tmp_path, ckpt, shared.ckpt)
    _say(
        capsys, f"async worker killed at generate@4: both resumed from step {saved[-1]}; final weights equal"
    )


def test_server_killed_during_a_critic_update_rolls_the_trainer_and_its_worker_back(
    reference, tmp_path, capsys, start_worker
):
    rollout, address = _rollout()
    worker = start_worker(tmp_path / "worker.log", address)
    critic, run, newest = kill_server_mid_run(tmp_path, "train@4", *rollout)
    assert worker.wait() == 0, worker.text()[-3000:]
    assert run.returncode == 0, run.tail()
    (r,) = rollbacks(run.stdout)
    assert r["to"] == newest, r
    _same_as(reference, tmp_path / "actor", critic.ckpt, critic.ckpt)
    _say(
        capsys,
        f"server killed at train@4 under an async run: rolled back to step {newest}; final weights equal",
    )
