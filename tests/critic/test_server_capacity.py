"""How much work the server takes on (:mod:`aligner.critic.budget`): a bounded critic_infer queue
whose overflow the client reads as "overloaded" and resends, a memory budget that refuses work
(naming the budget, the memory in use and the estimate) with nothing changed, free memory handed
back, and the settings checked naming their keys.

One real PyTriton server for the module, with a queue of 2 and a long batching delay so that
concurrent requests overflow it; the memory budget in process, on a service whose measure is
set by the test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _critic_service import concurrently
from tritonclient.utils import InferenceServerException

from aligner.config_checks import ConfigError
from aligner.critic import budget as B
from aligner.critic.config import build_config
from aligner.critic.errors import OverloadedError, for_the_wire
from aligner.critic.launch import start_server
from aligner.critic.server import CriticTritonServer
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, raw_infer, raw_info, tiny_config, tiny_overrides, train_arrays
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient
from aligner.wire.transport import classify

TOK = build_tokenizer("char")
PAD = 10


def _infer_inputs(b: int, seed: int) -> dict[str, np.ndarray]:
    tokens, lengths, pl, *_ = digit_batch(TOK, b, seed=seed, pad_to=PAD)
    return P.InferRequest(tokens, lengths, pl).to_wire()


def _train_inputs(b: int, seed: int, step: int, expected: int) -> dict[str, np.ndarray]:
    tokens, lengths, pl, *_ = digit_batch(TOK, b, seed=seed, pad_to=PAD)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed)
    return P.TrainRequest(tokens, lengths, returns, old_values, mask, step, expected).to_wire(None)


# ----------------------------------------------------------------------------------------------
# The queue, on a real server
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    overrides = {
        "server.max_queue_size": 2,
        "server.max_queue_delay_us": 300000,  # requests wait in the queue for a batch of 64 rows
        "server.preferred_batch_size": "[64]",
    }
    s = start_server(tiny_overrides(root, **overrides), log_path=root / "server.stderr")
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.server
def test_a_full_queue_refuses_as_overloaded_and_the_client_resends(server):
    before = raw_info(server.url)
    want = raw_infer(server.url, P.INFER, _infer_inputs(2, 1))
    got = concurrently([lambda: raw_infer(server.url, P.INFER, _infer_inputs(2, 1)) for _ in range(8)])
    refused = [g for g in got if isinstance(g, Exception)]
    assert refused, "8 requests at once never overflowed a queue of 2"
    for e in refused:
        assert isinstance(e, InferenceServerException) and "Exceeds maximum queue size" in str(e), str(e)
        assert classify(e) == "overloaded", str(e)
    for g in got:
        if not isinstance(g, Exception):
            np.testing.assert_allclose(g["values"], want["values"], rtol=0, atol=1e-5)
    # The actor's client backs off and resends within its deadline, with no retries to use up.
    with RemoteCriticClient(server.url, timeout_s=30, retries=0, backoff_s=0.05, max_workers=8) as c:
        inputs = _infer_inputs(2, 1)
        futures = [c.infer(inputs["tokens"], inputs["lengths"], inputs["prompt_lengths"]) for _ in range(8)]
        for f in futures:
            values, _ = f.result()
            np.testing.assert_allclose(values, want["values"], rtol=0, atol=1e-5)
    after = raw_info(server.url)
    assert server.returncode is None and after.critic_step == before.critic_step
    capacity = after.extra["capacity"]  # the queue bound, no budget (no container limit here)
    assert capacity["max_queue_size"] == 2 and capacity["refused_for_memory"] == 0
    assert capacity["memory_used_bytes"] > 50 << 20
    assert after.instance_id == before.instance_id


def test_a_forged_queue_full_text_is_not_read_as_overloaded():
    echoed = "[StatusCode.INTERNAL] Traceback ...\nValueError: x\\nExceeds maximum queue size"
    assert classify(InferenceServerException(echoed)) == "server"
    assert classify(InferenceServerException("[StatusCode.UNAVAILABLE] Exceeds maximum queue size")) == (
        "overloaded"
    )
    text = f"Traceback ...\naligner.critic.errors.OverloadedError: {P.OVERLOADED_MARK}critic_train: ..."
    assert classify(InferenceServerException(text)) == "overloaded"
    assert P.neutralize(P.OVERLOADED_MARK).startswith("(critic-overloaded]")  # a request cannot forge it


# ----------------------------------------------------------------------------------------------
# The memory budget, in process
# ----------------------------------------------------------------------------------------------


class _Measure:
    def __init__(self, used: int) -> None:
        self.used = used

    def __call__(self) -> int:
        return self.used


def test_work_over_the_memory_budget_is_refused_naming_it_and_changes_nothing(pstate, tmp_path):
    cfg = build_config(tiny_config(tmp_path, server={"memory_budget_gb": 1.0}))
    svc = CriticService(cfg, pstate)
    server = CriticTritonServer(svc, svc.cfg, tmp_path)
    measure = _Measure(900 << 20)  # 900 MiB in use of a 1 GiB budget
    server.budget.measure = measure
    assert server.budget.budget == 1 << 30
    small = _train_inputs(4, 1, step=1, expected=svc.critic_step)
    big = {**small, "tokens": np.zeros((4, 200_000), np.int64)}  # estimated far over the 124 MiB left
    with pytest.raises(OverloadedError) as e:
        server.train_fn([big])
    message = str(for_the_wire(e.value, P.TRAIN))
    assert message.startswith(P.OVERLOADED_MARK + "critic_train: the server's memory budget")
    assert "1024 MiB" in message and "900 MiB are in use" in message and "estimated at" in message
    assert classify(InferenceServerException(f"Traceback ...\nOverloadedError: {message}")) == "overloaded"
    assert svc.critic_step == -1 and server.budget.refused == 1  # nothing applied
    with pytest.raises(OverloadedError):  # critic_infer too, and the execution as a whole
        server.infer_fn([{**_infer_inputs(2, 2), "tokens": np.zeros((2, 2_000_000), np.int64)}])
    info = P.ServerInfo.from_json(
        server.info_fn([{}])[0]["info"].reshape(-1)[0]
    )  # never refused: probes ask it
    assert info.critic_step == -1
    # server_info tells the budget, the memory in use and the refusals (the refused infer counted).
    assert info.extra["capacity"] == {
        "max_queue_size": 64,
        "max_batch_size": cfg.server.max_batch_size,
        "memory_budget_bytes": 1 << 30,
        "memory_used_bytes": 900 << 20,
        "refused_for_memory": 2,
    }
    # The same train, once memory is free again, is applied once.
    measure.used = 100 << 20
    out = server.train_fn([small])[0]
    assert int(out["applied_step"].reshape(-1)[0]) == 1 and svc.critic_step == 1
    assert server.train_fn([small])[0]["applied_step"].reshape(-1)[0] == 1 and svc.critic_step == 1
    svc.close()


def test_the_budget_defaults_to_the_containers_limit(monkeypatch):
    monkeypatch.setattr(B, "memory_limit_bytes", lambda: 10 << 30)
    assert B.MemoryBudget(None).budget == int(0.9 * (10 << 30))
    assert B.MemoryBudget(0).budget is None and B.MemoryBudget(2).budget == 2 << 30
    monkeypatch.setattr(B, "memory_limit_bytes", lambda: None)
    assert B.MemoryBudget(None).budget is None
    B.MemoryBudget(None).admit(P.TRAIN, 8 << 20)  # no budget: no check


def test_the_process_tree_is_measured_and_free_memory_handed_back():
    used = B.tree_memory_bytes()
    assert 10 << 20 < used < 64 << 30
    blob = np.ones(64 << 20, np.uint8)  # 64 MiB, touched
    assert B.tree_memory_bytes() > used + (32 << 20)
    del blob
    B.release_free_memory()
    assert B.request_bytes([{"a": np.zeros((2, 3), np.int64), "t": P.text_array(["ab", "c"])}]) == 48 + 16 + 3


def test_the_capacity_settings_are_checked_naming_the_key(tmp_path):
    cfg = build_config(tiny_config(tmp_path))
    assert cfg.server.max_queue_size == 64 and cfg.server.memory_budget_gb is None
    with pytest.raises(ConfigError) as e:
        build_config(tiny_config(tmp_path, server={"max_queue_size": -1, "memory_budget_gb": -2.0}))
    assert "server.max_queue_size=-1: expected an integer >= 0" in str(e.value)
    assert "server.memory_budget_gb=-2.0: expected GiB >= 0" in str(e.value)


# ----------------------------------------------------------------------------------------------
# Memory after a flood, on the real server
# ----------------------------------------------------------------------------------------------


@pytest.mark.server
def test_a_flood_of_refused_requests_leaves_the_servers_memory_where_it_was(server):
    """Refused requests (over critic_infer's row limit, refused by Triton itself; over the queue)
    leave the server's process tree within 300 MiB of where it was once idle."""
    for _ in range(2):  # warm: Triton's buffers for requests of this size exist once
        concurrently([lambda: raw_infer(server.url, P.INFER, _infer_inputs(2, 1)) for _ in range(4)])
    time.sleep(1.0)
    start = B.tree_memory_bytes(server.pid)
    huge = _infer_inputs(2, 1)
    huge["tokens"] = np.zeros((300, 30_000), np.int64)  # 69 MiB, 300 rows: over max_batch_size
    huge["lengths"] = np.full((300, 1), 5, np.int64)
    huge["prompt_lengths"] = np.full((300, 1), 2, np.int64)
    for _ in range(15):
        with pytest.raises(InferenceServerException):
            raw_infer(server.url, P.INFER, huge)
    time.sleep(2.0)
    grown = B.tree_memory_bytes(server.pid) - start
    assert grown < 300 << 20, f"{grown >> 20} MiB more after 15 refused requests of 69 MiB"
    assert server.returncode is None
