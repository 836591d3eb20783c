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
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from _actor_runs import digit_server
from _toy_critic import ToyCritic
from _worker_runs import VARYING, policy_weights, run_actor, same_rows, same_weights, start_workers

from aligner.actor.rollout_workers import RolloutWorkerError
from aligner.distributed import destroy, spare_port
from aligner.generation.weight_push import PushFault, WeightPusher

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


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
    rows, _ = run_actor(root, 4)
    return rows, policy_weights(root, 4)


def test_k0_on_a_worker_is_the_in_process_run(tmp_path: Path, in_process, monkeypatch):
    ours, weights = in_process
    threads = _pushes(monkeypatch)
    theirs, codes = run_actor(tmp_path / "worker", 4, workers=1, k=0, extra=["rollout.overlap_push=true"])
    assert threads == ["MainThread"] * 4  # the step's batch needs the version: nothing to overlap
    assert all(r["push/hidden_frac"] == 0.0 and r["push/wait_s"] == r["push/seconds"] for r in theirs)
    assert codes == [0]  # told to stop at the end
    same_rows(ours, theirs)
    same_weights(weights, policy_weights(tmp_path / "worker", 4))
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
    theirs, codes = run_actor(tmp_path, 4, workers=1, k=0, worker_tp=2)
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
        run_actor(tmp_path, 3, workers=1, k=0, worker_tp=2)
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
    run = functools.partial(run_actor, workers=1, k=1, remote=True)
    ours, codes = run(tmp_path / "trainer", 4, extra=grpo)
    assert codes == [0] and not any("rollout/worker_score_s" in r for r in ours)
    scored = [*grpo, "rollout.score_on_workers=true"]
    theirs, codes = run(tmp_path / "workers", 2, extra=scored)
    assert codes == [0] and all(r["rollout/worker_score_s"] > 0 for r in theirs)
    same_rows(ours[:2], theirs)
    theirs, codes = run(tmp_path / "workers", 4, extra=scored, resume=True)
    assert codes == [0]
    same_rows(ours, theirs)
    same_weights(policy_weights(tmp_path / "trainer", 4), policy_weights(tmp_path / "workers", 4))
    assert len({r["objective/scores"] for r in theirs}) > 1  # the scores are the reward's, not a constant


def test_workers_that_ask_for_the_critic_s_values_give_the_gae_run_the_trainer_asking_gives(
    tmp_path: Path,
):
    """GAE at k = 1 with ``rollout.score_on_workers``: each worker asks a critic server for its
    batch's values and scores, naming the critic step the trainer would (the update of the step
    before: the server waits for it), and the run is the trainer-asked one on a server of its
    own, every number and weight, also through a checkpoint that keeps a batch with its values."""
    servers = [digit_server(tmp_path / f"server{i}", "copy") for i in (1, 2)]
    try:
        gae = ["ppo.advantage=gae", "model.max_seq_len=16"]  # the servers' critic's
        run = functools.partial(run_actor, workers=1, k=1, remote=True)
        ours, codes = run(tmp_path / "trainer", 4, extra=[*gae, f"critic.url={servers[0].url}"])
        assert codes == [0]
        scored = [*gae, f"critic.url={servers[1].url}", "rollout.score_on_workers=true"]
        theirs, codes = run(tmp_path / "workers", 2, extra=scored)
        assert codes == [0] and all(r["rollout/worker_score_s"] > 0 for r in theirs)
        same_rows(ours[:2], theirs)
        theirs, codes = run(tmp_path / "workers", 4, extra=scored, resume=True)
        assert codes == [0]
    finally:
        for server in servers:
            server.stop()
    same_rows(ours, theirs)
    same_weights(policy_weights(tmp_path / "trainer", 4), policy_weights(tmp_path / "workers", 4))
    assert all(r["critic/vf_loss"] > 0 for r in theirs[1:])  # a critic trained on the workers' values


def test_a_worker_that_cannot_reach_the_server_it_scores_with_stops_the_run_at_once(tmp_path: Path):
    """Told to score its batches against a server nobody serves, the worker says why in place of
    its hello: the trainer stops naming it and the address, instead of waiting for it."""
    url = f"grpc://127.0.0.1:{spare_port()}"
    scored = ["ppo.advantage=grpo", "ppo.samples_per_prompt=4", "rollout.score_on_workers=true"]
    nowhere = [f"critic.url={url}", "critic.ready_timeout_s=2"]
    with pytest.raises(RolloutWorkerError, match=rf"rollout worker 1 could not start: cannot score .*{url}"):
        run_actor(tmp_path, 2, workers=1, extra=[*scored, *nowhere])


@pytest.fixture(scope="module")
def whole_k1(tmp_path_factory):
    """Four steps at k = 1 on one worker, uninterrupted: its rows and final weights."""
    root = tmp_path_factory.mktemp("whole-k1")
    rows, codes = run_actor(root, 4, workers=1, k=1, extra=["rollout.overlap_push=true"])
    assert codes == [0]
    return rows, policy_weights(root, 4)


def test_k1_is_one_version_stale_and_resumes_exactly_on_another_number_of_workers(tmp_path: Path, whole_k1):
    whole, weights = whole_k1
    assert [r["rollout/staleness"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    # The importance weight is in use: the trainer's log-probs differ from the behaviour's.
    assert any(r["policy/tis_weight_mean"] != 1.0 for r in whole[1:])

    split, critic = tmp_path / "split", ToyCritic()
    first, _ = run_actor(split, 2, workers=2, k=1, critic=critic)
    same_rows(whole[:2], first)
    second, codes = run_actor(split, 4, workers=2, k=1, resume=True, critic=critic)
    assert codes == [0, 0]
    same_rows(whole, second)
    same_weights(weights, policy_weights(split, 4))


def test_the_dynamic_schedule_on_one_worker_is_the_fixed_one(tmp_path: Path, whole_k1):
    """One worker answers in the order it is asked: the first batch back is the step's own, and
    none is ever past the bound (tests/actor/test_rollout_dynamic.py: several workers)."""
    whole, weights = whole_k1
    extra = ["rollout.overlap_push=true", "rollout.schedule=dynamic"]
    dynamic, codes = run_actor(tmp_path / "dynamic", 4, workers=1, k=1, extra=extra)
    assert codes == [0]
    same_rows(whole, dynamic)
    same_weights(weights, policy_weights(tmp_path / "dynamic", 4))
    assert [(r["rollout/ask"], r["rollout/regenerated"]) for r in dynamic] == [(s, 0.0) for s in (1, 2, 3, 4)]


def test_the_overlapped_push_is_the_serial_push_s_run(tmp_path: Path, whole_k1, monkeypatch):
    """Overlapped or not, the push sends the weights the step began with: the same rollouts, every
    number and weight (``whole_k1`` overlapped its pushes). Each overlapped push here is held back
    0.3 s, time for the step's optimizer step to overtake it, were it not waited for first."""
    whole, weights = whole_k1
    serial, codes = run_actor(tmp_path / "serial", 4, workers=1, k=1, extra=["rollout.overlap_push=false"])
    assert codes == [0]
    same_rows(whole, serial)
    same_weights(weights, policy_weights(tmp_path / "serial", 4))
    assert all(r["push/hidden_frac"] == 0.0 for r in serial)

    threads = _pushes(monkeypatch, delay_s=0.3)
    held, codes = run_actor(tmp_path / "held", 4, workers=1, k=1, extra=["rollout.overlap_push=true"])
    assert codes == [0]
    assert threads == ["MainThread", "push-1", "push-2", "push-3"]  # step 1's batch needs version 0
    assert max(r["push/wait_s"] for r in held[1:]) > 0.1  # a step waited for its held push
    same_rows(whole, held)
    same_weights(weights, policy_weights(tmp_path / "held", 4))


def test_a_restarted_server_rolls_the_asynchronous_run_back_and_it_ends_as_the_uninterrupted_one(
    tmp_path: Path, whole_k1, capsys
):
    """The server restarts during step 4's critic update: both roles go back to step 2, the batch
    of step 5 already asked for is received and dropped, step 3's comes back from the checkpoint."""
    whole, weights = whole_k1
    rows, codes = run_actor(tmp_path, 4, workers=1, k=1, critic=ToyCritic(restart_in_train=4))
    assert "rolled both roles back to step 2" in capsys.readouterr().out
    assert codes == [0]
    same_rows(whole, rows)
    same_weights(weights, policy_weights(tmp_path, 4))


def test_a_worker_serving_another_model_is_refused(tmp_path: Path):
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker 1 serves something else.*model.hidden_size: trainer 64, worker 32",
    ):
        run_actor(tmp_path, 2, workers=1, worker_extra=["model.hidden_size=32"])


def test_a_worker_killed_mid_run_stops_the_run_naming_it(tmp_path: Path):
    def kill_after_step_1(procs):
        def on_step(step, _metrics):
            if step == 1:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()

        return on_step

    with pytest.raises(RolloutWorkerError, match="rollout worker"):
        run_actor(tmp_path, 4, workers=1, k=0, on_step=kill_after_step_1)


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
        run_actor(tmp_path, 4, workers=1, k=1, extra=extra, worker_env=fault)
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
        rows, codes = run_actor(root, 4, workers=2, k=k, extra=go_on, worker_env=fault)
        assert codes[lost - 1] == -signal.SIGKILL and codes[2 - lost] == 0, codes
        out = capsys.readouterr().out
        assert f"rollout: worker {lost} went away" in out and f"going on with worker(s) [{3 - lost}]" in out
        assert "asking them for 1 share(s) it owed" in out  # the step it died holding
        assert "regrouped: 1 worker(s) left" in (root / "workers" / f"worker{3 - lost}.log").read_text()
        same_rows(whole, rows)
        same_weights(weights, policy_weights(root, 4))
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
                (p,) = start_workers(2, address, [*rollout, *go_on, *extra], logs, ranks=[2], log_name=name)
                started.append(p)
                _wait_for(logs / name.format(w=2), "asked the trainer to join as worker 2", p)

        return on_step

    fault = {2: {"ALIGNER_ROLLOUT_FAULT_AT": "generate@2"}}
    try:
        rows, codes = run_actor(
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
    same_rows(whole, rows)
    same_weights(weights, policy_weights(tmp_path, 4))


@pytest.mark.gpu
def test_on_a_gpu_a_worker_generates_what_the_in_process_engine_does_and_k1_runs(tmp_path: Path):
    """Both processes on the one GPU (so the push goes over gloo: NCCL takes one rank per GPU)."""
    assert torch.cuda.is_available()
    gloo = ["rollout.weights_backend=gloo"]
    ours, _ = run_actor(tmp_path / "in-process", 2)
    theirs, codes = run_actor(tmp_path / "worker", 2, workers=1, k=0, extra=gloo)
    assert codes == [0]
    for a, b in zip(ours, theirs):
        for key in (x for x in a if not x.startswith(VARYING)):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    stale, codes = run_actor(tmp_path / "k1", 2, workers=1, k=1, extra=gloo)
    assert codes == [0] and [r["rollout/staleness"] for r in stale] == [0.0, 1.0]
