"""The client's bounded waits and fencing against a real server (PyTriton, fixed loopback ports).

- A server that hangs (its process group stopped with SIGSTOP, continued afterwards): every
  wait (an infer or train future, save, load) ends within ``wait_timeout_s`` with a
  CriticTimeoutError naming the call, the step and the address; a listener that never answers
  does the same for the readiness wait at connection.
- Fencing: a client whose expected critic step the server no longer holds is refused, and
  raises CriticRestartedError with the server's state until it has the server load a step.
- A server killed and started again on the same ports is another instance: the reconnect
  raises CriticRestartedError. That second server requires a run token: a client without it
  is refused at once (UnauthorizedError, no retries), one with it trains.
- A server killed and started again *between* two requests (no request fails: gRPC reconnects
  quietly): the next infer names the instance the client trained with and is refused at once
  (CriticRestartedError), where one that names none waits for a critic step that never comes.

The actor's side (rolling back) is tests/actor/test_actor_recovery.py; real restarts under a running
actor are the fault suite's.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from aligner.critic.launch import start_server
from aligner.critic.testing import digit_batch, tiny_overrides, train_arrays
from aligner.distributed import free_port
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient
from aligner.wire.errors import CriticRestartedError, CriticTimeoutError

TOK = build_tokenizer("char")
FAST = {"timeout_s": 1.0, "ready_timeout_s": 2.0, "wait_timeout_s": 3.0, "backoff_s": 0.1}
"""Client settings under which a hung server is given up on within seconds."""
PATIENT = {"timeout_s": 60.0, "ready_timeout_s": 60.0, "wait_timeout_s": 120.0, "backoff_s": 0.2}
"""Client settings for a server that answers (slowly, on a loaded machine) or is restarting."""


class Server:
    """A tiny critic server on fixed ports, that can be killed and started again there."""

    def __init__(self, root, **overrides: object) -> None:
        self.root = root
        self.overrides = overrides
        self.ports = {"server.grpc_port": free_port()}
        self.url = f"grpc://127.0.0.1:{self.ports['server.grpc_port']}"
        self.process = None
        self.starts = 0

    def start(self, **env: str) -> None:
        self.starts += 1
        overrides = tiny_overrides(
            self.root, **self.ports, **{"reward.fn": "aligner.tasks.digits:copy_reward"}, **self.overrides
        )
        self.process = start_server(overrides, log_path=self.root / f"server-{self.starts}.log", env=env)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)  # Triton and the backend stubs too

    def kill(self) -> None:
        self.process.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("critic_client"))
    s.start()
    try:
        yield s
    finally:
        s.kill()


def _batch(b: int = 4, seed: int = 0):
    tokens, lengths, prompt_lengths, _, _ = digit_batch(TOK, b, seed=seed)
    returns, old_values, mask = train_arrays(lengths, prompt_lengths, tokens.shape[1], seed=seed)
    return tokens, lengths, prompt_lengths, returns, old_values, mask


def test_a_listener_that_never_answers_times_out_the_connection_naming_the_address():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel does), never says a word
    url = f"grpc://127.0.0.1:{listener.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        with pytest.raises(CriticTimeoutError) as e:
            RemoteCriticClient(url, **FAST)
        assert time.monotonic() - t0 < 15
    finally:
        listener.close()
    msg = str(e.value)
    assert msg.startswith(f"connecting to the critic server at {url}: no answer within 2 s"), msg


@pytest.mark.server
def test_a_hung_server_times_out_every_wait_naming_the_call_step_and_address(server):
    tokens, lengths, prompt_lengths, returns, old_values, mask = _batch()
    # One client per call, each connected while the server still answers.
    clients = [RemoteCriticClient(server.url, **FAST) for _ in range(4)]
    calls = {
        "critic_infer of step 1": lambda c: c.infer(tokens, lengths, prompt_lengths, step=1).result(),
        "critic_train of step 1": lambda c: c.train(tokens, lengths, returns, old_values, mask, 1).result(),
        "critic_save of step 0": lambda c: c.save(0),
        "critic_load of step 0": lambda c: c.load(0),
    }
    errors: dict[str, BaseException | None] = {}

    def attempt(name, client):
        try:
            calls[name](client)
            errors[name] = None
        except BaseException as e:  # noqa: BLE001 - what the call raised is the result
            errors[name] = e

    server.signal_group(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(calls)) as pool:
            for name, client in zip(calls, clients):
                pool.submit(attempt, name, client)
        took = time.monotonic() - t0
    finally:
        server.signal_group(signal.SIGCONT)
        time.sleep(0.5)  # what was queued while it was stopped runs now, before the next test
    assert took < 20, took  # 3 s of wait_timeout_s, plus a readiness probe's overrun
    for name, error in errors.items():
        assert isinstance(error, CriticTimeoutError), (name, error)
        assert str(error).startswith(f"{name} to the critic server at {server.url}: no answer within"), error
    # Continued, the same server serves the same clients again.
    for c in clients:
        assert c.server_info().instance_id == c.instance_id
        c.close()


@pytest.mark.server
def test_a_client_whose_expected_step_the_server_no_longer_holds_is_fenced(server):
    tokens, lengths, prompt_lengths, returns, old_values, mask = _batch(seed=1)
    with RemoteCriticClient(server.url, **PATIENT) as a, RemoteCriticClient(server.url, **PATIENT) as b:
        a.load(0)  # both roles' reset point: critic step 0
        b.load(0)
        assert a.expected_step == b.expected_step == 0
        assert a.train(tokens, lengths, returns, old_values, mask, 1).result().applied_step == 1
        assert a.expected_step == 1
        with pytest.raises(CriticRestartedError) as e:  # b still expects critic step 0
            b.train(tokens, lengths, returns, old_values, mask, 2).result()
        assert (e.value.critic_step, e.value.expected_step) == (1, 0)
        assert e.value.instance_id == a.instance_id and 0 in e.value.checkpoint_steps
        assert "[critic-fenced] critic_train step 2" in str(e.value)
        # Until it has the server load a step, b sends nothing that depends on the critic.
        with pytest.raises(CriticRestartedError, match="has not had it load a step"):
            b.infer(tokens, lengths, prompt_lengths)
        with pytest.raises(CriticRestartedError):
            b.save(1)
        assert b.server_info().critic_step == 1  # reading the state is allowed
        b.load(0)
        assert b.train(tokens, lengths, returns, old_values, mask, 1).result().applied_step == 1
        assert b.infer(tokens, lengths, prompt_lengths).result()[0].shape == (4, tokens.shape[1] - 1)


@pytest.mark.server
def test_a_server_started_again_is_another_instance_and_enforces_its_run_token(server, tmp_path):
    tokens, lengths, prompt_lengths, returns, old_values, mask = _batch(seed=2)
    client = RemoteCriticClient(server.url, **PATIENT)
    first = client.instance_id
    client.load(0)
    server.kill()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    started = threading.Thread(target=server.start, kwargs={"ALIGNER_RUN_TOKEN": "s3cret"})
    started.start()  # the client retries, waiting for readiness, while it starts
    try:
        with pytest.raises(CriticRestartedError) as e:
            client.infer(tokens, lengths, prompt_lengths).result()
    finally:
        started.join()
    assert e.value.instance_id != first and e.value.instance_id == client.instance_id
    assert "reconnected to server instance" in str(e.value) and e.value.expected_step == 0
    assert client.server_info().run_token_required

    # Without the token: refused at once, not retried.
    t0 = time.monotonic()
    with pytest.raises(P.UnauthorizedError, match=r"critic_load: the run token is missing"):
        client.load(0)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(CriticRestartedError):  # still not loaded: the restart stands
        client.train(tokens, lengths, returns, old_values, mask, 1)
    client.close()

    # With it, the same calls go through.
    run_token = P.resolve_run_token(str(token), "critic.run_token_file")
    with RemoteCriticClient(server.url, **PATIENT, run_token=run_token) as c:
        c.load(0)
        assert c.train(tokens, lengths, returns, old_values, mask, 1).result().applied_step == 1
        c.save(1)
        assert 1 in c.server_info().checkpoint_steps


@pytest.mark.server
def test_a_server_restarted_between_two_requests_refuses_the_next_infer_at_once(tmp_path):
    """The client trains step 1; the server is killed and another starts on the same port
    (holding an older critic step) while no request is in flight. The next infer, naming
    after_step 1, would wait server.infer_wait_s (600 s) for a train that never comes: it names
    the instance the client trained with, and the new server refuses it at once, fenced. A client
    that does not watch for restarts names none, and its infer is held waiting."""
    tokens, lengths, prompt_lengths, returns, old_values, mask = _batch(seed=3)
    server = Server(tmp_path, **{"server.infer_wait_s": 600})
    server.start()
    try:
        trainer = RemoteCriticClient(server.url, **PATIENT)
        blind = RemoteCriticClient(server.url, **{**PATIENT, "wait_timeout_s": 3.0}, watch_restarts=False)
        first = trainer.instance_id
        trainer.load(0)
        assert trainer.train(tokens, lengths, returns, old_values, mask, 1).result().applied_step == 1
        assert trainer.infer(tokens, lengths, prompt_lengths, after_step=1).result()[0].shape[0] == 4
        assert blind.infer(tokens, lengths, prompt_lengths, after_step=1).result()[0].shape[0] == 4
        server.kill()
        server.start()  # between two requests: no request of the clients' failed
        t0 = time.monotonic()
        with pytest.raises(CriticRestartedError) as e:
            trainer.infer(tokens, lengths, prompt_lengths, step=2, after_step=1).result()
        assert time.monotonic() - t0 < 10
        assert e.value.instance_id != first and e.value.instance_id == trainer.instance_id
        assert e.value.critic_step < 1 and e.value.expected_step == 1
        assert "[critic-fenced] critic_infer: the request is for server instance " + first in str(e.value)
        with pytest.raises(CriticRestartedError, match="has not had it load a step"):
            trainer.infer(tokens, lengths, prompt_lengths, after_step=1)
        # Without the id the same infer waits on the server for a train that never comes (until
        # the client's own wait_timeout_s here; server.infer_wait_s, 600 s, on the server).
        t0 = time.monotonic()
        with pytest.raises(CriticTimeoutError, match="critic_infer of step 2 "):
            blind.infer(tokens, lengths, prompt_lengths, step=2, after_step=1).result()
        assert time.monotonic() - t0 >= 2.5
        waits = trainer.info()["extra"]["infer_after_step"]
        assert waits["waiting"] == 1 and waits["timed_out"] == 0, waits
        blind.close()
        trainer.close()
    finally:
        server.kill()


@pytest.mark.server
def test_a_load_after_a_restart_whose_server_info_was_not_read_follows_the_new_instance(tmp_path):
    """A client that found a restart but could not read the new server's info (so it still names
    the old instance) and then loads a step itself: its infers name the process that loaded it,
    and go through instead of being refused, fenced, for the old id."""
    tokens, lengths, prompt_lengths, *_ = _batch(seed=4)
    server = Server(tmp_path)
    server.start()
    try:
        client = RemoteCriticClient(server.url, **PATIENT)
        first = client.instance_id
        client.load(0)
        server.kill()
        server.start()
        client._restart(P.INFER, "the connection was lost", None)  # no server_info came back
        assert client.instance_id == first
        client.load(0)
        assert client.instance_id not in (None, first)
        assert client.infer(tokens, lengths, prompt_lengths, after_step=0).result()[0].shape[0] == 4
        client.close()
    finally:
        server.kill()


def test_a_merged_infer_refused_for_another_instance_raises_restarted_and_sends_the_id():
    """No server: the client's infer task, answered as a merged execution answers. It sends the
    instance it works with (not when it does not watch for restarts); a request refused
    alone in a merged execution (fenced error rows) raises CriticRestartedError, and the restart
    stands until a load."""
    tokens, lengths, prompt_lengths, *_ = _batch(b=2, seed=4)
    info = P.ServerInfo(P.PROTOCOL_VERSION, TOK.vocab_size, 64, "char", "", 3, 8, 8, instance_id="a" * 32)
    client = object.__new__(RemoteCriticClient)
    client.url, client.timeout_s, client.wait_timeout_s, client._info = "grpc://127.0.0.1:1", 1.0, 1.0, info
    client._state_lock, client._restarted, client._expected_step = threading.Lock(), None, 3
    client.instance_id, client.watch_restarts = info.instance_id, True
    client._read_info = lambda timeout_s: None
    refusal = str(P.OtherInstanceError(P.INFER, "a" * 32, "b" * 32))
    sent: list[dict] = []

    def answer(model, inputs, outputs, **kw):
        sent.append(inputs)
        return P.infer_error_wire(refusal, inputs["tokens"].shape[0])

    client._call = answer
    req = P.InferRequest(tokens, lengths, prompt_lengths, after_step=3)
    with pytest.raises(CriticRestartedError, match=r"\[critic-fenced\] critic_infer: the request is for"):
        client._infer_task(req, None, 4)
    assert list(sent[0]["instance_id"].ravel()) == [b"a" * 32] * 2
    with pytest.raises(CriticRestartedError, match="has not had it load a step"):
        client._infer_task(req, None, 4)
    client.follow("b" * 32)  # the rollback's: the new process is this client's
    client.watch_restarts = False  # a critic-free run's: sends no id
    client._call = lambda model, inputs, outputs, **kw: (
        sent.append(inputs)
        or P.InferResponse(np.zeros((2, tokens.shape[1] - 1), np.float32), np.ones(2, np.float32)).to_wire()
    )
    values, rewards = client._infer_task(req, None, 5)
    assert "instance_id" not in sent[-1] and list(rewards) == [1.0, 1.0]
