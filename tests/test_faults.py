"""The fault suite: real critic servers and real actors, killed, hung, starved of disk and
flooded, and what each must survive: a restarted server never resets the critic silently, and
every wait on the server is bounded (README, "When the critic server restarts or hangs").

One shared server and one uninterrupted reference run for the module (both roles in one
checkpoint folder, docs/design.md "Checkpoints"); every case that can compare does, tensor for
tensor: the actor's policy and the server's critic (weights and optimizer state) of the final
step against the reference's. Cases that kill the server start their own, on fixed ports, and
start it again there with ``checkpoint.resume=auto`` on the same folder. Every server runs the
same settings (``_faults.SERVER_SETTINGS``: batching, and packed micro-batches): a run is the
reference's bit for bit only against a server that cuts and packs its rows alike.

Run alone with ``make faults`` (``pytest -m faults``). ``ALIGNER_FAULTS_LOAD_S`` sets how long the
concurrency case runs (:data:`LOAD_S`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _faults import (
    MALFORMED,
    MAX_BATCH,
    POISON_PROMPT,
    REWARD_FN,
    SAVE_INTERVAL,
    STEPS,
    ActorProcess,
    actor_env,
    assert_same_weights,
    final_weights,
    infer_request,
    infer_together,
    judge,
    kill_server_mid_run,
    last_error,
    limit_file_size,
    metrics_steps,
    rollbacks,
    rss_mib,
    run_actor,
    same_metrics,
    samples_batch,
    send_infer,
    serving_critic,
    tensors_equal,
)

from aligner.checkpoint import complete_steps, load_tensors, read_json, step_dir_name
from aligner.metrics import read_metrics
from aligner.tokenizers import build_tokenizer

pytestmark = [pytest.mark.faults, pytest.mark.server, pytest.mark.subprocess]

LOAD_S = float(os.environ.get("ALIGNER_FAULTS_LOAD_S", "60"))
"""How long the 8 concurrent clients of the load case send requests (60 in ``make faults`` and
``make test``)."""
LOAD_CLIENTS = 8
WARM_S = min(20.0, LOAD_S / 3)
"""When the load case takes the server's "warm" resident memory (see :data:`RSS_WARMUP_MIB`)."""
RSS_WARMUP_MIB = 384
"""How much the server's resident memory may grow from before the load to its end. It grows at
first (some 200 MiB within 10-20 s here, then flat): glibc gives each of the threads serving
concurrent requests an arena (up to 8 per core), and the server keeps freed memory in them
(``aligner.cpu_memory.tune_allocator``) for the merged batches of every size it computes. A leak
grows without end instead, which :data:`RSS_GROWTH_MIB` catches."""
RSS_GROWTH_MIB = 64
"""How much it may grow once warm (from :data:`WARM_S` to the end). Measured: 10-40 MiB more over
two minutes, levelling off (not a leak's straight line), with half the requests malformed; the
server keeps nothing per request beyond counters. What this bound
catches: a leak of some 10 KiB or more per request over the thousands of requests after the
warm-up, such as a kept forward's activations, a kept merged batch, or a kept exception with its
traceback. Smaller leaks (a request's own arrays, 0.1-1 KiB) need a longer run than a test."""
VALUES_ATOL = 1e-3
"""How far a request's values may move when the batcher merges it with others: matrix products
may round differently for another number of rows (measured here: 2.4e-7; the rewards, from the
reward function, must not move at all)."""
TOK = build_tokenizer("char")


# ----------------------------------------------------------------------------------------------
# Fixtures: the shared server and the reference run
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def shared(root):
    """One server for the cases that do not kill it (the reference run's). Its settings are every
    server's of the suite (``_faults.SERVER_SETTINGS``): a queue delay, so that concurrent infer
    requests merge into one execution (no number of a single client's request changes), and
    packed micro-batches."""
    with serving_critic(root / "shared") as critic:
        yield critic


class Reference:
    """The uninterrupted run: its folder, its final weights (both roles) and its metrics."""

    def __init__(self, run_dir: Path, ckpt: Path, keep: Path) -> None:
        self.run_dir, self.ckpt = run_dir, ckpt
        # A copy of the final step and of the first save: later runs on the shared server write
        # the same steps of the critic into its folder again.
        for step in (SAVE_INTERVAL, STEPS):
            shutil.copytree(ckpt / step_dir_name(step), keep / step_dir_name(step))
        self.keep = keep
        self.weights = final_weights(keep)
        self.metrics = read_metrics(str(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def reference(shared, root) -> Reference:
    run = run_actor(shared.url, root / "reference", shared.ckpt)
    assert "starting fresh" in run.stdout, run.tail()
    assert complete_steps(shared.ckpt, role="actor") == list(range(SAVE_INTERVAL, STEPS + 1, SAVE_INTERVAL))
    return Reference(root / "reference", shared.ckpt, root / "reference-kept")


# ----------------------------------------------------------------------------------------------
# The server killed (SIGKILL at a fault point) and started again
# ----------------------------------------------------------------------------------------------


def _say(capsys, text: str) -> None:
    """One line of the suite's report (what a case saw), shown whatever pytest captures."""
    with capsys.disabled():
        print(f"\n[faults] {text}")


def _assert_rolled_back_and_equal(reference, critic, run, rolled_to: int) -> dict[str, int]:
    assert run.returncode == 0, run.tail()
    done = rollbacks(run.stdout)  # the actor's console (its log has the same line)
    assert len(done) == 1, run.tail()
    (r,) = done
    assert r["to"] == rolled_to and r["server_step"] == rolled_to and r["first"] == rolled_to + 1, r
    assert rolled_to < r["last"] <= STEPS and r["expected"] >= rolled_to, r
    # Nothing completed is lost: every save of both roles is there.
    saves = list(range(SAVE_INTERVAL, STEPS + 1, SAVE_INTERVAL))
    assert complete_steps(critic.ckpt, role="actor") == saves
    assert set(saves) <= set(complete_steps(critic.ckpt, role="critic"))
    assert_same_weights(final_weights(critic.ckpt), reference.weights)
    same_metrics(read_metrics(str(critic.root.parent / "actor" / "metrics.jsonl")), reference.metrics)
    return r


def _report_rollback(capsys, fault: str, r: dict[str, int], run) -> None:
    _say(
        capsys,
        f"server killed at {fault}: back with critic step {r['server_step']} (the actor expected "
        f"{r['expected']}); rolled back to step {r['to']}, steps {r['first']}..{r['last']} redone; "
        f"final weights of both roles equal the uninterrupted run's; actor {run.wall_s:.0f} s",
    )


def test_server_killed_during_critic_infer_rolls_back_and_ends_as_the_uninterrupted_run(
    reference, tmp_path, capsys
):
    # critic step 3 is held while step 4's rollout is scored: the newest critic checkpoint is 2.
    critic, run, newest = kill_server_mid_run(tmp_path, "infer@3", "critic.on_restart=resume")
    assert newest == 2
    _report_rollback(
        capsys, "infer@3", _assert_rolled_back_and_equal(reference, critic, run, rolled_to=2), run
    )


def test_server_killed_during_critic_train_rolls_back_and_ends_as_the_uninterrupted_run(
    reference, tmp_path, capsys
):
    # Killed after step 5's backward, before its optimizer step: the newest checkpoint is 4.
    critic, run, newest = kill_server_mid_run(tmp_path, "train@5", "critic.on_restart=resume")
    assert newest == 4
    _report_rollback(
        capsys, "train@5", _assert_rolled_back_and_equal(reference, critic, run, rolled_to=4), run
    )


def test_server_killed_during_critic_save_rolls_back_and_ends_as_the_uninterrupted_run(
    reference, tmp_path, capsys
):
    # Step 4's shards are written, its folder not committed: step 4 does not count, 2 does.
    critic, run, newest = kill_server_mid_run(tmp_path, "save@4", "critic.on_restart=resume")
    assert newest == 2
    _report_rollback(
        capsys, "save@4", _assert_rolled_back_and_equal(reference, critic, run, rolled_to=2), run
    )


def test_server_killed_with_on_restart_fail_stops_the_actor_naming_both_steps(tmp_path, capsys):
    critic, run, newest = kill_server_mid_run(tmp_path, "train@3", "critic.on_restart=fail")
    assert newest == 2
    assert run.returncode not in (0, -signal.SIGKILL), run.tail()
    assert not rollbacks(run.stdout), run.tail()
    # Killed during step 3's update, the server comes back with critic step 2; the actor's error
    # (the last line of its traceback, not the command line that named the setting) says so.
    error = last_error(run.stderr)
    assert "critic server restarted" in error and "on_restart=fail" in error, run.tail()
    # The server's critic step, and the actor's: step 3 completed, or step 4 in progress.
    assert re.search(r"holds critic step 2\b", error), error
    assert re.search(r"(?<!critic )step [34]\b", error), error
    # It stopped without touching what was saved: step 2 of both roles, nothing after.
    assert complete_steps(critic.ckpt, role="actor") == [2]
    _say(capsys, f"server killed at train@3, on_restart=fail: actor exit {run.returncode}: {error[:300]}")


# ----------------------------------------------------------------------------------------------
# The actor killed mid-step
# ----------------------------------------------------------------------------------------------


def test_actor_killed_mid_step_resumes_and_ends_as_the_uninterrupted_run(shared, reference, tmp_path, capsys):
    """SIGKILL after step 3's generation, before its critic_train is sent; started again with
    resume=auto it continues from step 2 and ends with the reference's weights, the critic's
    included. (Every kill point of the actor, mid-step and each point of a save, is in
    tests/actor/test_actor_resume.py, which compares the policy and the metrics; this one compares
    both roles' final checkpoints, tensor for tensor.)"""
    ckpt = tmp_path / "ckpt"
    run = run_actor(shared.url, tmp_path, ckpt, env=actor_env(ALIGNER_FAULT_AT="mid_step@3"), ok=False)
    assert run.returncode == -signal.SIGKILL, run.tail()
    assert complete_steps(ckpt, role="actor") == [2]
    assert metrics_steps(tmp_path) == [1, 2]
    run = run_actor(shared.url, tmp_path, ckpt)
    assert "resuming from step 2" in run.stdout, run.tail()
    assert_same_weights(final_weights(ckpt, shared.ckpt), reference.weights)
    same_metrics(read_metrics(str(tmp_path / "metrics.jsonl")), reference.metrics)
    _say(capsys, "actor killed at mid_step@3: resumed from step 2 (step 3 redone); final weights equal")


# ----------------------------------------------------------------------------------------------
# A full disk during a checkpoint write
# ----------------------------------------------------------------------------------------------

DISK_LIMIT = 64 * 1024
"""Largest file either role may write in the full-disk cases: above every log and JSON file a
short run writes, below every tensor file of a checkpoint (a width-64 model's weights alone are
hundreds of KiB), so the first checkpoint tensor file fails, as it would on a full disk."""


def test_actor_checkpoint_write_on_a_full_disk_fails_cleanly_and_keeps_the_earlier_step(
    shared, reference, tmp_path, capsys
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference.keep / step_dir_name(2), ckpt / step_dir_name(2))
    files = {p: p.read_bytes() for p in (ckpt / step_dir_name(2)).rglob("*") if p.is_file()}
    assert (
        min(len(b) for p, b in files.items() if p.suffix == ".safetensors" and "policy" in str(p))
        > DISK_LIMIT
    )
    run = run_actor(shared.url, tmp_path, ckpt, ok=False, max_file_size=DISK_LIMIT)
    assert "resuming from step 2" in run.stdout, run.tail()
    # Failed with an error (not killed by SIGXFSZ, not hung) naming the file it could not write.
    assert run.returncode > 0, run.tail()
    step4 = str(ckpt / step_dir_name(4))
    assert re.search(re.escape(step4) + r"/\S+", run.stderr), run.tail()
    assert "File too large" in run.stderr or "No space left" in run.stderr, run.tail()
    # Step 4 was not committed; step 2 is byte for byte what it was, and a resume loads it.
    assert complete_steps(ckpt, role="actor") == [2]
    assert not (ckpt / step_dir_name(4) / "actor").exists()
    assert all(p.read_bytes() == b for p, b in files.items())
    error = last_error(run.stderr)
    run = run_actor(shared.url, tmp_path, ckpt)
    assert "resuming from step 2" in run.stdout, run.tail()
    assert_same_weights(final_weights(ckpt, shared.ckpt), reference.weights)
    _say(capsys, f"actor's step-4 save on a full disk: exit 1, {error[:240]}; step 2 intact, resumed, equal")


def test_server_checkpoint_write_on_a_full_disk_fails_cleanly_and_keeps_the_earlier_step(
    shared, reference, capsys
):
    from aligner.critic.testing import digit_batch, train_arrays
    from aligner.wire.client import RemoteCriticClient
    from aligner.wire.errors import CriticServerError

    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=7, num_digits=3)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=7)
    with RemoteCriticClient(shared.url, timeout_s=60) as client:
        # From the initial critic (kept whatever the runs before pruned), two step ids of its own.
        client.load(0)
        first, second = 1000, 1001
        client.train(tokens, lengths, returns, old_values, mask, first).result()
        client.save(first)
        saved = shared.ckpt / step_dir_name(first) / "critic"
        before = {name: load_tensors(saved / name) for name in ("model_tp00_pp00.safetensors",)}
        assert (saved / "model_tp00_pp00.safetensors").stat().st_size > DISK_LIMIT
        logs = [p for p in shared.root.rglob("*") if p.is_file() and "ckpt" not in p.parts]
        assert max(p.stat().st_size for p in logs) < DISK_LIMIT // 2, "the server's logs outgrew the limit"
        client.train(tokens, lengths, returns, old_values, mask, second).result()
        at_second, _ = client.infer(tokens, lengths, pl).result()
        limit_file_size(shared.pid, DISK_LIMIT)
        try:
            with pytest.raises(CriticServerError) as failed:
                client.save(second)
        finally:
            limit_file_size(shared.pid, None)
        msg = str(failed.value)
        assert str(shared.ckpt / step_dir_name(second)) in msg, msg
        assert "File too large" in msg or "No space left" in msg, msg
        # Nothing of step 1001 counts; the server goes on serving with its weights unchanged.
        info = client.server_info()
        assert second not in info.checkpoint_steps and first in info.checkpoint_steps
        assert info.critic_step == second
        assert not (shared.ckpt / step_dir_name(second) / "critic").exists()
        again, _ = client.infer(tokens, lengths, pl).result()
        np.testing.assert_array_equal(again, at_second)
        # The earlier step is intact and loads; with room again, the failed step saves.
        assert all(tensors_equal(load_tensors(saved / n), t) for n, t in before.items()), (
            "step 1000 changed on disk"
        )
        client.load(first)
        assert client.server_info().critic_step == first
        client.train(tokens, lengths, returns, old_values, mask, second).result()
        client.save(second)
        assert second in client.server_info().checkpoint_steps
    _say(capsys, f"server's critic_save on a full disk: {msg[:240]}; step {first} intact and loads")


# ----------------------------------------------------------------------------------------------
# A reward function that raises on one request of a merged batch
# ----------------------------------------------------------------------------------------------


def test_a_reward_function_raising_on_one_request_of_a_merged_batch_fails_that_request_alone(shared, capsys):
    from aligner.tasks.digits import copy_reward
    from aligner.wire.client import RemoteCriticClient
    from aligner.wire.errors import CriticServerError

    s = 12  # one padded length: the batcher merges only requests of the same shape
    good = [(["123:", "456:"], ["123", "45"]), (["789:"], ["789"]), (["012:", "345:"], ["0", "345"])]
    work = [*good, (["321:", POISON_PROMPT], ["321", "9"])]
    blame = f"reward function {REWARD_FN!r} failed on sample 1 of the request"
    for _ in range(5):  # until the batcher merged them (a 20 ms queue delay: nearly always at once)
        results = infer_together(shared.url, work, s)
        for i, (prompts, responses) in enumerate(good):
            assert isinstance(results[i], dict), (i, results[i])
            assert results[i]["error"].reshape(-1).tolist() == [b""] * len(prompts), results[i]["error"]
            np.testing.assert_array_equal(
                results[i]["rewards"].reshape(-1), np.float32(copy_reward(prompts, responses))
            )
        bad = results[-1]
        if isinstance(bad, dict):  # merged: the failure is in its own rows, the others were served
            errors = [e.decode() for e in bad["error"].reshape(-1)]
            assert len(errors) == 2 and all(blame in e for e in errors), errors
            break
        assert blame in str(bad), bad  # served alone: its own Triton error
    else:
        raise AssertionError(f"the batcher never merged the {len(work)} requests")
    # Through the client: the request fails with the message, once (not retried as a peer's).
    with RemoteCriticClient(shared.url, timeout_s=60) as client:
        with pytest.raises(CriticServerError, match=re.escape(blame)):
            client.infer(*samples_batch(*work[-1], s)).result()
        _, rewards = client.infer(*samples_batch(*good[0], s)).result()
        np.testing.assert_array_equal(rewards, np.float32(copy_reward(*good[0])))
    _say(
        capsys,
        f"reward function raising in a merged batch of {len(work)} requests: {errors[0][:200]}; the others served",
    )


# ----------------------------------------------------------------------------------------------
# 8 clients, LOAD_S seconds, 10% malformed requests
# ----------------------------------------------------------------------------------------------


LOAD_STEP = 2000
"""The step id the load case trains and saves its critic at (no run of the suite reaches it)."""


def test_eight_clients_with_malformed_requests_change_nothing_and_leak_nothing(shared, reference, capsys):
    import tritonclient.grpc as grpcclient

    from aligner.critic.testing import digit_batch, train_arrays
    from aligner.tasks.digits import copy_reward
    from aligner.wire.client import RemoteCriticClient

    # Valid batches of 1-4 samples, 3 padded lengths; what each gets alone is what it must get.
    pool = [digit_batch(TOK, 1 + i % 4, seed=300 + i, num_digits=3, pad_to=8 + i % 3) for i in range(16)]
    with RemoteCriticClient(shared.url, timeout_s=60) as client:
        # A trained critic of its own step id, saved: the weights the load must leave alone.
        client.load(0)
        tokens, lengths, pl, *_ = digit_batch(TOK, 8, seed=8, num_digits=3)
        client.train(tokens, lengths, *train_arrays(lengths, pl, tokens.shape[1], seed=8), LOAD_STEP).result()
        client.save(LOAD_STEP)
        critic_dir = shared.ckpt / step_dir_name(LOAD_STEP) / "critic"
        expected = [client.infer(*b[:3]).result() for b in pool]
        for (*_, prompts, responses), (_, rewards) in zip(pool, expected):
            np.testing.assert_array_equal(rewards, np.float32(copy_reward(prompts, responses)))
        saved_before = {
            n: load_tensors(critic_dir / n)
            for n in ("model_tp00_pp00.safetensors", "optim_tp00_pp00.safetensors")
        }
        info_before = client.server_info()
    rss_start = rss_mib(shared.pid)

    stop_at = time.monotonic() + LOAD_S
    counts = {k: 0 for k in ("good", "peer_retries", *MALFORMED)}
    unexpected: list[str] = []
    moved = [0.0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = grpcclient.InferenceServerClient(shared.url.split("://", 1)[1])
        try:
            while time.monotonic() < stop_at:
                i = int(rng.integers(len(pool)))
                kind = MALFORMED[int(rng.integers(len(MALFORMED)))] if rng.random() < 0.1 else "good"
                inputs, needle = infer_request(kind, *pool[i][:3], max_batch=MAX_BATCH)
                for _ in range(20):  # resent while it failed only as the peer of a bad request
                    try:
                        got = send_infer(conn, inputs)
                    except Exception as e:  # noqa: BLE001 - judged below
                        got = e
                    problem = judge(kind, needle, got, expected[i], atol=VALUES_ATOL)
                    if problem != "retry":
                        break
                    with lock:
                        counts["peer_retries"] += 1
                with lock:
                    counts[kind] += 1
                    if problem:
                        unexpected.append(problem)
                    elif kind == "good":  # how far merging moved the values (VALUES_ATOL)
                        moved[0] = max(moved[0], float(np.abs(got["values"] - expected[i][0]).max()))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(400 + i,)) for i in range(LOAD_CLIENTS)]
    for th in threads:
        th.start()
    time.sleep(max(0.0, stop_at - LOAD_S + WARM_S - time.monotonic()))
    rss_warm = rss_mib(shared.pid)
    for th in threads:
        th.join()
    rss_end = rss_mib(shared.pid)
    _say(
        capsys,
        f"{LOAD_CLIENTS} clients x {LOAD_S:.0f} s: {counts}, values within {moved[0]:.2g} of a request's "
        f"alone; server RSS {rss_start:.1f} MiB before, "
        f"{rss_warm:.1f} MiB after {WARM_S:.0f} s, {rss_end:.1f} MiB at the end ({rss_end - rss_start:+.1f} "
        f"MiB in all, {rss_end - rss_warm:+.1f} MiB once warm)",
    )
    assert not unexpected, f"{len(unexpected)} unexpected outcome(s), first: {unexpected[:5]}"
    assert all(counts[k] > 0 for k in MALFORMED), counts
    assert counts["good"] >= 10 * LOAD_CLIENTS, counts
    with RemoteCriticClient(shared.url, timeout_s=60) as client:
        info_after = client.server_info()
        probe, _ = client.infer(*pool[0][:3]).result()
        client.save(LOAD_STEP)
    assert info_after.critic_step == info_before.critic_step
    np.testing.assert_array_equal(probe, expected[0][0])
    saved_after = {n: load_tensors(critic_dir / n) for n in saved_before}
    assert all(tensors_equal(saved_after[n], saved_before[n]) for n in saved_before), "a weight changed"
    assert rss_end - rss_start <= RSS_WARMUP_MIB, (rss_start, rss_warm, rss_end)
    if LOAD_S - WARM_S >= 20:  # long enough after the warm-up to tell a leak from noise
        assert rss_end - rss_warm <= RSS_GROWTH_MIB, (rss_start, rss_warm, rss_end)


# ----------------------------------------------------------------------------------------------
# A hung server (SIGSTOP) for longer than the actor's timeouts
# ----------------------------------------------------------------------------------------------

HANG_WAIT_S = 6
HANG_TIMEOUTS = (
    "critic.timeout_s=3",
    f"critic.wait_timeout_s={HANG_WAIT_S}",
    "critic.ready_timeout_s=6",
    "critic.retries=1",
)
"""The actor's bounds in the hang case: each request 3 s, each call with its retries 6 s."""


def test_a_hung_server_fails_the_actor_with_a_named_timeout_and_serves_again_after(
    shared, reference, tmp_path, capsys
):
    from aligner.wire.client import RemoteCriticClient

    ckpt = tmp_path / "ckpt"
    actor = ActorProcess(shared.url, tmp_path, ckpt, *HANG_TIMEOUTS)
    stopped = False
    try:
        # Once step 2 is saved (both roles): the hang comes with a checkpoint to keep whole.
        deadline = time.monotonic() + 120
        while not complete_steps(ckpt, "actor") and actor.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        # Freeze the actor, let the server finish what it was doing, note its state, hang it.
        actor.proc.send_signal(signal.SIGSTOP)
        with RemoteCriticClient(shared.url, timeout_s=30) as client:
            info = client.server_info()
            for _ in range(100):  # an update in flight finishes within milliseconds
                time.sleep(0.3)
                now = client.server_info()
                if now.critic_step == info.critic_step:
                    break
                info = now
        os.kill(shared.pid, signal.SIGSTOP)
        stopped = True
        hung_at = time.monotonic()
        actor.proc.send_signal(signal.SIGCONT)
        run = actor.wait(timeout_s=120)
        waited = time.monotonic() - hung_at
    finally:
        if stopped:
            os.kill(shared.pid, signal.SIGCONT)
        actor.kill()
    assert run.returncode not in (0, -signal.SIGKILL), run.tail()
    assert "CriticTimeoutError" in run.stderr, run.tail()
    m = re.search(r"CriticTimeoutError: (.*)", run.stderr)
    assert m and shared.url.split("://", 1)[1] in m.group(1), run.tail()
    call = re.search(r"\b(critic_infer|critic_train|critic_save|critic_load|server_info)\b", m.group(1))
    step = re.search(r"step (\d+)", m.group(1))
    assert call and step, m.group(1)
    assert waited < HANG_WAIT_S + 30, f"the actor gave up only after {waited:.0f} s"
    # Its checkpoints are whole: every complete step loads, and no later step was committed.
    saved = complete_steps(ckpt, role="actor")
    assert saved and saved[-1] < STEPS, saved
    for s in saved:
        d = ckpt / step_dir_name(s) / "actor"
        read_json(d / "trainer_state.json")
        load_tensors(d / "policy" / "model.safetensors")
    assert not any((ckpt / step_dir_name(s) / "actor").exists() for s in range(saved[-1] + 1, STEPS + 1))
    # After SIGCONT the server answers consistently: the critic step it held, plus at most the
    # one train request it had received before it hung (applied once), and serves requests.
    from aligner.critic.testing import digit_batch

    with RemoteCriticClient(shared.url, timeout_s=60) as client:
        after = client.server_info()
        allowed = {info.critic_step}
        if call.group(1) == "critic_train":
            allowed.add(int(step.group(1)))
        assert after.critic_step in allowed, (after.critic_step, allowed, m.group(1))
        assert after.instance_id == info.instance_id
        assert set(info.checkpoint_steps) <= set(after.checkpoint_steps)
        tokens, lengths, pl, *_ = digit_batch(TOK, 3, seed=9, num_digits=3)
        values, rewards = client.infer(tokens, lengths, pl).result()
        assert np.isfinite(values).all() and rewards.shape == (3,)
    # Started again, the run continues from its newest step and ends as the reference.
    run = run_actor(shared.url, tmp_path, ckpt)
    assert f"resuming from step {saved[-1]}" in run.stdout, run.tail()
    assert_same_weights(final_weights(ckpt, shared.ckpt), reference.weights)
    _say(
        capsys,
        f"server stopped (SIGSTOP): the actor gave up after {waited:.1f} s: {m.group(1)[:200]}; after SIGCONT "
        f"critic step {after.critic_step} (held {info.critic_step}); resumed from step {saved[-1]}, equal",
    )
