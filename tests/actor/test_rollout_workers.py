"""Rollout workers of their own (``aligner-rollout``, :mod:`aligner.actor.rollout_workers`): real
worker processes joining the trainer's store, the trainer in this process against the toy critic
(:class:`ToyCritic`: values that depend on every update).

- k = 0 on a worker is the in-process run, every number and every final weight; on a worker of
  two tensor-parallel processes, the same run but for rounding;
- k = 1 is stale by one version from step 2 on, and a run of two steps resumed to four (on two
  workers) ends equal to four steps in one go (on one worker): the checkpoint keeps the batch
  asked for and not yet trained on;
- at k = 1 the push overlapped with the step (``rollout.overlap_push=true``) is the serial
  push's run, every number and weight, also when the push is slowed until the optimizer step
  would have changed the weights under it; at k = 0 it stays serial;
- a worker that serves another model is refused by name; a worker killed mid-run stops the run
  with an error naming it, and one lost during a push stops it with the same error whether the
  push was overlapped or not;
- with ``rollout.on_worker_loss=continue`` a lost worker's batches go to the others, and a worker
  started again in its place joins the run under way: the run ends as the uninterrupted one.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _actor_runs import digit_server
from _toy_critic import ToyCritic
from safetensors.torch import load_file

from aligner.actor.rollout_workers import RolloutWorkerError
from aligner.actor.run import build_actor
from aligner.checkpoint import step_dir_name
from aligner.distributed import destroy, spare_port
from aligner.generation.weight_push import PushFault, WeightPusher
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
        return OmegaConf.to_object(compose("actor", overrides=overrides))


def _workers(
    n: int,
    address: str,
    extra: list[str],
    log_dir: Path,
    env: dict[int, dict[str, str]] | None = None,
    ranks: list[int] | None = None,
    log_name: str = "worker{w}.log",
    tp: int = 1,
) -> list[subprocess.Popen]:
    """``n`` worker processes, or those of ``ranks`` alone (``env``: worker -> variables of its
    own, e.g. a fault point); ``tp`` > 1: each a torchrun of that many processes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable]
    if tp > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    return [
        subprocess.Popen(
            [
                *launch,
                "-m",
                "aligner.rollout.worker",
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


def _run(
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
):
    """A run of ``steps`` steps (its metrics rows, the worker processes' exit codes); ``critic``:
    the toy critic to use (a resumed run's must be the one its first part saved to); ``remote``:
    the server at ``critic.url`` (in ``extra``) instead."""
    address = address or f"127.0.0.1:{spare_port()}"
    rollout = [f"rollout.workers={workers}", f"rollout.max_staleness={k}", f"rollout.address={address}"]
    rollout = [*rollout, *extra] if workers else list(extra)
    cfg = _compose(
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
        _workers(workers, address, [*rollout, *worker_extra], root / "workers", worker_env, tp=worker_tp)
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


def _same(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(VARYING)}
        diff = {k: (ra[k], rb.get(k)) for k in sorted(keys) if ra[k] != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"


def _weights(root: Path, step: int) -> dict:
    return load_file(str(root / "ckpt" / step_dir_name(step) / "actor" / "policy" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()]


def _pushes(monkeypatch, delay_s: float = 0.0) -> list[str]:
    """The threads the trainer's pushes run on, in order (``delay_s``: each push held back that
    long first, off the main thread: what an optimizer step would overtake without the join)."""
    threads, push = [], WeightPusher.push

    def spied(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay_s)
        return push(self, *args, **kwargs)

    monkeypatch.setattr(WeightPusher, "push", spied)
    return threads


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """Four steps generated in process: their rows and final weights."""
    root = tmp_path_factory.mktemp("in-process")
    rows, _ = _run(root, 4)
    return rows, _weights(root, 4)


def test_k0_on_a_worker_is_the_in_process_run(tmp_path: Path, in_process, monkeypatch):
    ours, weights = in_process
    threads = _pushes(monkeypatch)
    theirs, codes = _run(tmp_path / "worker", 4, workers=1, k=0, extra=["rollout.overlap_push=true"])
    assert threads == ["MainThread"] * 4  # the step's batch needs the version: nothing to overlap
    assert all(r["push/hidden_frac"] == 0.0 and r["push/wait_s"] == r["push/seconds"] for r in theirs)
    assert codes == [0]  # told to stop at the end
    _same(ours, theirs)
    _same_weights(weights, _weights(tmp_path / "worker", 4))
    assert [r["rollout/staleness"] for r in theirs] == [0.0] * 4
    assert all(r["push/mbytes"] > 0 and 0 <= r["rollout/trainer_wait_frac"] <= 1 for r in theirs)
    assert all(0 < r["push/step_frac"] < 1 for r in theirs)


def test_a_worker_of_two_tensor_parallel_processes_generates_what_one_process_does(
    tmp_path: Path, in_process
):
    """``rollout.tensor_parallel_size=2``: the worker's lead takes each version and relays it to
    its peer, each keeps its shard, and the two generate together. fp32: the tensor-parallel
    sums differ from one process's by rounding only, so the trainer's log-probs of the tokens
    (one process) are the engine's, and the tokens are the in-process run's."""
    ours, _ = in_process
    theirs, codes = _run(tmp_path, 4, workers=1, k=0, worker_tp=2)
    assert codes == [0]
    assert all(r["rollout/logprob_mismatch_max"] < 1e-5 for r in theirs)
    for a, b in zip(ours, theirs, strict=True):
        for key in (x for x in a if not x.startswith(VARYING)):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)
    assert "2 processes, tensor-parallel" in (tmp_path / "workers" / "worker1.log").read_text()


def test_a_tensor_parallel_worker_refuses_a_corrupted_version_before_relaying_it_and_the_run_stops(
    tmp_path: Path, monkeypatch
):
    """Version 1 reaches the worker's lead with a payload byte flipped: the lead refuses it before
    relaying anything (its peer is told to exit), and the trainer's push stops the run."""
    push = WeightPusher.push

    def corrupting(self, version, stream, fault=None):
        return push(self, version, stream, fault=PushFault("corrupt", 0) if version == 1 else fault)

    monkeypatch.setattr(WeightPusher, "push", corrupting)
    with pytest.raises(
        RolloutWorkerError, match=r"1 rollout worker\(s\) refused version 1 .*nothing was swapped"
    ):
        _run(tmp_path, 3, workers=1, k=0, worker_tp=2)
    log = (tmp_path / "workers" / "worker1.log").read_text()
    assert "refused: version 1, bucket 0: checksum" in log, log[-3000:]


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    server = digit_server(tmp_path_factory.mktemp("server"), "copy", "mode=reward_only")
    yield server
    server.stop()


def test_workers_that_score_their_batches_give_the_run_the_trainer_scoring_them_gives(
    tmp_path: Path, reward_server
):
    """``rollout.score_on_workers`` (GRPO at k = 1, a reward function reading the prompt and
    response texts): each worker asks the server for its batch's scores; the trainer asks for
    none, and the run is the one where it asks, every number and weight, also resumed from a
    checkpoint that keeps a scored batch asked for and not yet trained on."""
    grpo = ["ppo.advantage=grpo", "ppo.samples_per_prompt=4", f"critic.url={reward_server.url}"]
    run = functools.partial(_run, workers=1, k=1, remote=True)
    ours, codes = run(tmp_path / "trainer", 4, extra=grpo)
    assert codes == [0] and not any("rollout/worker_score_s" in r for r in ours)
    scored = [*grpo, "rollout.score_on_workers=true"]
    theirs, codes = run(tmp_path / "workers", 2, extra=scored)
    assert codes == [0] and all(r["rollout/worker_score_s"] > 0 for r in theirs)
    _same(ours[:2], theirs)
    theirs, codes = run(tmp_path / "workers", 4, extra=scored, resume=True)
    assert codes == [0]
    _same(ours, theirs)
    _same_weights(_weights(tmp_path / "trainer", 4), _weights(tmp_path / "workers", 4))
    assert len({r["objective/scores"] for r in theirs}) > 1  # the scores are the reward's, not a constant


def test_a_worker_that_cannot_reach_the_server_it_scores_with_stops_the_run_at_once(tmp_path: Path):
    """Told to score its batches against a server nobody serves, the worker says why in place of
    its hello: the trainer stops naming it and the address, instead of waiting for it."""
    url = f"grpc://127.0.0.1:{spare_port()}"
    scored = ["ppo.advantage=grpo", "ppo.samples_per_prompt=4", "rollout.score_on_workers=true"]
    nowhere = [f"critic.url={url}", "critic.ready_timeout_s=2"]
    with pytest.raises(RolloutWorkerError, match=rf"rollout worker 1 could not start: cannot score .*{url}"):
        _run(tmp_path, 2, workers=1, extra=[*scored, *nowhere])


@pytest.fixture(scope="module")
def whole_k1(tmp_path_factory):
    """Four steps at k = 1 on one worker, uninterrupted: its rows and final weights."""
    root = tmp_path_factory.mktemp("whole-k1")
    rows, codes = _run(root, 4, workers=1, k=1, extra=["rollout.overlap_push=true"])
    assert codes == [0]
    return rows, _weights(root, 4)


def test_k1_is_one_version_stale_and_resumes_exactly_on_another_number_of_workers(tmp_path: Path, whole_k1):
    whole, weights = whole_k1
    assert [r["rollout/staleness"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    # The importance weight is in use: the trainer's log-probs differ from the behaviour's.
    assert any(r["policy/tis_weight_mean"] != 1.0 for r in whole[1:])

    split, critic = tmp_path / "split", ToyCritic()
    first, _ = _run(split, 2, workers=2, k=1, critic=critic)
    _same(whole[:2], first)
    second, codes = _run(split, 4, workers=2, k=1, resume=True, critic=critic)
    assert codes == [0, 0]
    _same(whole, second)
    _same_weights(weights, _weights(split, 4))


def test_the_overlapped_push_is_the_serial_push_s_run(tmp_path: Path, whole_k1, monkeypatch):
    """Overlapped or not, the push sends the weights the step began with: the same rollouts, every
    number and weight (``whole_k1`` overlapped its pushes). Each overlapped push here is held back
    0.3 s, time for the step's optimizer step to overtake it, were it not waited for first."""
    whole, weights = whole_k1
    serial, codes = _run(tmp_path / "serial", 4, workers=1, k=1, extra=["rollout.overlap_push=false"])
    assert codes == [0]
    _same(whole, serial)
    _same_weights(weights, _weights(tmp_path / "serial", 4))
    assert all(r["push/hidden_frac"] == 0.0 for r in serial)

    threads = _pushes(monkeypatch, delay_s=0.3)
    held, codes = _run(tmp_path / "held", 4, workers=1, k=1, extra=["rollout.overlap_push=true"])
    assert codes == [0]
    assert threads == ["MainThread", "push-1", "push-2", "push-3"]  # step 1's batch needs version 0
    assert max(r["push/wait_s"] for r in held[1:]) > 0.1  # a step waited for its held push
    _same(whole, held)
    _same_weights(weights, _weights(tmp_path / "held", 4))


def test_a_restarted_server_rolls_the_asynchronous_run_back_and_it_ends_as_the_uninterrupted_one(
    tmp_path: Path, whole_k1, capsys
):
    """The server restarts during step 4's critic update: both roles go back to step 2, the batch
    of step 5 already asked for is received and dropped, step 3's comes back from the checkpoint."""
    whole, weights = whole_k1
    rows, codes = _run(tmp_path, 4, workers=1, k=1, critic=ToyCritic(restart_in_train=4))
    assert "rolled both roles back to step 2" in capsys.readouterr().out
    assert codes == [0]
    _same(whole, rows)
    _same_weights(weights, _weights(tmp_path, 4))


def test_a_worker_serving_another_model_is_refused(tmp_path: Path):
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker 1 serves something else.*model.hidden_size: trainer 64, worker 32",
    ):
        _run(tmp_path, 2, workers=1, worker_extra=["model.hidden_size=32"])


def test_a_worker_killed_mid_run_stops_the_run_naming_it(tmp_path: Path):
    def kill_after_step_1(procs):
        def on_step(step, _metrics):
            if step == 1:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()

        return on_step

    with pytest.raises(RolloutWorkerError, match="rollout worker"):
        _run(tmp_path, 4, workers=1, k=0, on_step=kill_after_step_1)


@pytest.mark.parametrize("overlap,on_loss", [("true", "stop"), ("false", "stop"), ("true", "continue")])
def test_a_worker_lost_during_a_push_stops_the_run_overlapped_or_not(
    tmp_path: Path, overlap, on_loss, monkeypatch
):
    """The worker dies when told version 2 follows (step 3's push, k = 1): the run stops naming the
    push, whatever ``rollout.on_worker_loss`` says (a collective lost a member)."""
    threads = _pushes(monkeypatch)
    extra = [f"rollout.overlap_push={overlap}", f"rollout.on_worker_loss={on_loss}"]
    fault = {1: {"ALIGNER_ROLLOUT_FAULT_AT": "weights@2"}}
    with pytest.raises(
        RolloutWorkerError, match="the push of version 2 failed: a rollout worker went away"
    ) as e:
        _run(tmp_path, 4, workers=1, k=1, extra=extra, worker_env=fault)
    assert threads[-1] == ("push-2" if overlap == "true" else "MainThread")
    if on_loss == "continue":
        assert "stops the run whatever rollout.on_worker_loss says" in str(e.value)


def test_a_worker_lost_mid_step_hands_its_batches_to_the_others_and_the_run_is_unchanged(
    tmp_path: Path, in_process, whole_k1, capsys
):
    """``rollout.on_worker_loss=continue``: a worker dies holding a step's prompts (its fault point,
    SIGKILL); the other meets the trainer again in channels of their own, is asked for that step
    and for every later one, and the run ends as the uninterrupted one, at k = 0 and at k = 1 (the
    share it owed is asked again at the version it was asked at)."""
    go_on = ["rollout.on_worker_loss=continue"]
    cases = [  # k, the worker lost, at which step's prompts, the uninterrupted run
        (0, 2, 2, in_process),  # step 2 is worker 2's, asked and lost in the same step
        (1, 1, 3, whole_k1),  # step 3 is worker 1's, asked during step 2 from version 1
    ]
    for k, lost, at, (whole, weights) in cases:
        root = tmp_path / f"k{k}"
        fault = {lost: {"ALIGNER_ROLLOUT_FAULT_AT": f"generate@{at}"}}
        rows, codes = _run(root, 4, workers=2, k=k, extra=go_on, worker_env=fault)
        assert codes[lost - 1] == -signal.SIGKILL and codes[2 - lost] == 0, codes
        out = capsys.readouterr().out
        assert f"rollout: worker {lost} went away" in out and f"going on with worker(s) [{3 - lost}]" in out
        assert "asking them for 1 share(s) it owed" in out  # the step it died holding
        assert "regrouped: 1 worker(s) left" in (root / "workers" / f"worker{3 - lost}.log").read_text()
        _same(whole, rows)
        _same_weights(weights, _weights(root, 4))
        assert [r["rollout/workers"] for r in rows][-1] == 1.0


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {path} within {timeout_s:g} s"
        time.sleep(0.2)


def test_a_worker_started_in_place_of_a_lost_one_joins_the_run_under_way(tmp_path: Path, in_process, capsys):
    """``rollout.on_worker_loss=continue``, k = 0: worker 2 dies holding step 2's prompts, and the
    run goes on with worker 1. After step 2 the same command starts worker 2 again (as a retried
    pod would) and, first, a worker 2 that serves another model: both ask to join the run under
    way, and at step 3's push the trainer refuses the second by name and admits the first. Steps 3
    and 4 are generated by both workers again, and the run ends as the uninterrupted one."""
    address = f"127.0.0.1:{spare_port()}"
    rollout = ["rollout.workers=2", "rollout.max_staleness=0", f"rollout.address={address}"]
    go_on = ["rollout.on_worker_loss=continue"]
    started: list[subprocess.Popen] = []
    logs = tmp_path / "workers"

    def start_replacements(_procs):
        def on_step(step, _metrics):
            if step != 2:
                return
            for extra, name in ((["model.ffn_hidden_size=96"], "other{w}.log"), ([], "again{w}.log")):
                (p,) = _workers(2, address, [*rollout, *go_on, *extra], logs, ranks=[2], log_name=name)
                started.append(p)
                _wait_for(logs / name.format(w=2), "asked the trainer to join as worker 2", p)

        return on_step

    fault = {2: {"ALIGNER_ROLLOUT_FAULT_AT": "generate@2"}}
    try:
        rows, codes = _run(
            tmp_path, 4, workers=2, extra=go_on, worker_env=fault, on_step=start_replacements, address=address
        )
        other, again = (p.wait(timeout=60) for p in started)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, -signal.SIGKILL] and (other, again) == (1, 0), (codes, other, again)
    out = capsys.readouterr().out
    assert "refused a worker asking to join as worker 2: it serves something else" in out
    assert "model.ffn_hidden_size: trainer" in out
    assert "rollout: worker(s) [2] joined; 2 worker(s)" in out
    assert "the trainer refused this worker" in (logs / "other2.log").read_text()
    again_log = (logs / "again2.log").read_text()
    assert "in the run under way" in again_log and "stopped by the trainer after 1 batch(es)" in again_log
    assert [r["rollout/workers"] for r in rows] == [2.0, 1.0, 2.0, 2.0]
    whole, weights = in_process
    _same(whole, rows)
    _same_weights(weights, _weights(tmp_path, 4))


@pytest.mark.gpu
def test_on_a_gpu_a_worker_generates_what_the_in_process_engine_does_and_k1_runs(tmp_path: Path):
    """Both processes on the one GPU (so the push goes over gloo: NCCL takes one rank per GPU)."""
    assert torch.cuda.is_available()
    gloo = ["rollout.weights_backend=gloo"]
    ours, _ = _run(tmp_path / "in-process", 2)
    theirs, codes = _run(tmp_path / "worker", 2, workers=1, k=0, extra=gloo)
    assert codes == [0]
    for a, b in zip(ours, theirs):
        for key in (x for x in a if not x.startswith(VARYING)):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    stale, codes = _run(tmp_path / "k1", 2, workers=1, k=1, extra=gloo)
    assert codes == [0] and [r["rollout/staleness"] for r in stale] == [0.0, 1.0]
