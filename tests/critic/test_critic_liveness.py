"""A hung rank of a critic server is found within ``parallel.peer_timeout_s``, and the server ends.

- :class:`~aligner.critic.liveness.PeerWatch` over an in-process store: ranks that beat are never
  taken as hung (over three times the timeout); one that stops beating is named within the
  timeout and a beat; so is a rank that never started.
- A real server at DP=2 under torchrun (``parallel.peer_timeout_s=4``): idle for several times
  the timeout it stays up; with rank 1 stopped (SIGSTOP: alive, silent, as a hung process is)
  and a critic_infer in flight that waits on it, the server exits 1 within the timeout plus its
  bounded shutdown, its log names rank 1, the request ends with an error instead of waiting for
  the collective timeout (``parallel.timeout_s``, 600 s), and no process is left behind (the
  module's leftover check: Triton and its stubs included).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from aligner.critic.launch import start_server
from aligner.critic.liveness import PeerWatch, beat_interval, fatal_collective
from aligner.critic.testing import digit_batch, raw_info, tiny_overrides
from aligner.tokenizers import build_tokenizer
from aligner.wire.client import RemoteCriticClient

TOK = build_tokenizer("char")


class _Found:
    def __init__(self) -> None:
        self.what: list[str] = []
        self.at: list[float] = []
        self.event = threading.Event()

    def __call__(self, what: str) -> None:
        self.what.append(what)
        self.at.append(time.monotonic())
        self.event.set()


def test_ranks_that_beat_are_never_hung_and_a_silent_one_is_named_in_time():
    store = dist.HashStore()
    timeout = 0.6
    found = [_Found() for _ in range(3)]
    watches = [PeerWatch(r, 3, timeout, found[r], store=store) for r in range(3)]
    try:
        time.sleep(3 * timeout)  # every rank beats: nothing found
        assert [f.what for f in found] == [[], [], []]
        watches[2]._stopped.set()  # rank 2 falls silent (its thread stops, as in a stopped process)
        silent_at = time.monotonic()
        assert found[0].event.wait(10) and found[1].event.wait(10)
        for r in (0, 1):
            assert "rank 2" in found[r].what[0] and "rank 0" not in found[r].what[0].split(":", 1)[1]
            assert "parallel.peer_timeout_s=0.6" in found[r].what[0]
            # named within the timeout, a beat and some scheduling slack; and not before the timeout
            assert (
                timeout - beat_interval(timeout)
                <= found[r].at[0] - silent_at
                <= timeout + 2 * beat_interval(timeout) + 1.0
            )
        assert found[2].what == []
    finally:
        for w in watches:
            w.stop()


def test_a_rank_that_was_stopped_itself_does_not_blame_the_others():
    """A watch whose own thread did not run for longer than the timeout (its process stopped, the
    machine frozen) gives the others a new window instead of naming them."""
    store, found = dist.HashStore(), _Found()
    watch = PeerWatch(0, 2, 0.4, found, store=store)
    beats = threading.Event()

    def rank1():  # a live peer that beats, but only once the watch has been "frozen"
        while not beats.wait(0.02):
            pass
        while not watch._stopped.is_set():
            store.add("aligner/critic/liveness/beat/1", 1)
            time.sleep(0.05)

    peer = threading.Thread(target=rank1, daemon=True)
    peer.start()
    try:
        watch._stopped.wait(0.2)
        with _frozen(watch):  # the watch's thread does not run for 1 s
            time.sleep(1.0)
        beats.set()
        time.sleep(1.0)
        assert found.what == []
    finally:
        watch.stop()
        beats.set()


class _frozen:
    """Holds ``watch``'s thread in its next wait, as a stopped process would be held."""

    def __init__(self, watch: PeerWatch) -> None:
        self.watch, self.release = watch, threading.Event()
        self._wait = watch._stopped.wait

    def __enter__(self):
        self.watch._stopped.wait = lambda t: self.release.wait() and False or self._wait(0)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.watch._stopped.wait = self._wait  # type: ignore[method-assign]


def test_a_rank_that_never_beats_is_named():
    found = _Found()
    watch = PeerWatch(1, 2, 0.4, found, store=dist.HashStore())
    try:
        assert found.event.wait(10)
        assert "critic server rank 1: no sign of life from rank 0" in found.what[0]
    finally:
        watch.stop()


def test_only_failed_collectives_end_the_server():
    assert fatal_collective(dist.DistBackendError("timed out"))
    assert fatal_collective(dist.DistNetworkError("connection reset"))
    assert not fatal_collective(RuntimeError("a shape"))
    assert not fatal_collective(ValueError("a value"))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, not yet reaped by torchrun, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _ranks(torchrun_pid: int) -> dict[int, int]:
    """The server's ranks under ``torchrun_pid``: RANK -> pid."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(name)
    return out


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.multiprocess
def test_a_stopped_replica_ends_the_server_within_the_peer_timeout(tmp_path):
    peer_timeout = 4.0
    server = start_server(
        tiny_overrides(
            tmp_path, **{"parallel.data_parallel_size": 2, "parallel.peer_timeout_s": peer_timeout}
        ),
        nproc=2,
        log_path=tmp_path / "server.stderr",
        ready_timeout_s=180,
    )
    stopped = None
    try:
        time.sleep(3 * peer_timeout)  # idle, every rank beating: it stays up
        assert server.returncode is None, server.output_tail()
        assert raw_info(server.url).parallel["data_parallel_size"] == 2

        ranks = _ranks(server.pid)
        assert sorted(ranks) == [0, 1], ranks
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        # An infer whose rows are split over both replicas: rank 0 waits on rank 1 for them.
        tokens, lengths, prompt_lengths, *_ = digit_batch(TOK, 4, seed=3, pad_to=12)
        client = RemoteCriticClient(
            server.url, timeout_s=120.0, ready_timeout_s=10.0, wait_timeout_s=120.0, retries=0
        )
        outcome: list[object] = []

        def infer() -> None:
            try:
                outcome.append(client.infer(tokens, lengths, prompt_lengths).result())
            except Exception as e:  # the server ended under it
                outcome.append(e)

        thread = threading.Thread(target=infer, daemon=True)
        thread.start()
        # The timeout and a beat to find it, then rank 0 kills Triton and exits at once.
        bound = peer_timeout + beat_interval(peer_timeout) + 30.0
        while _alive(ranks[0]) and time.monotonic() - t0 < bound:
            time.sleep(0.2)
        took = time.monotonic() - t0
        assert not _alive(ranks[0]), f"rank 0 still running after {took:.0f} s:\n{server.output_tail()}"
        # torchrun would wait 30 s for the stopped rank to answer SIGTERM before it kills it: not
        # what is tested here.
        os.kill(stopped, signal.SIGKILL)
        server.proc.wait(60)
        assert server.returncode not in (None, 0), server.output_tail()
        thread.join(30)
        assert outcome and isinstance(outcome[0], Exception), outcome
        log = (tmp_path / "server.stderr").read_text()
        assert "no sign of life from rank 1" in log, log[-3000:]
        assert "parallel.peer_timeout_s=4" in log and "exiting (1)" in log
        client.close()
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.kill()
