"""critic_infer after critic_train: an infer names the critic step its values must come from
(``after_step``), and the server answers it only once it holds that step (aligner.critic.ordering).

- In process (the service, threads for the callers): requests merged into one execution that ask
  different steps each get the values of their own step, bit for bit what they get alone; a
  waiting request is woken by the train, or by a load, that brings its step; the wait ends in an
  error naming both steps; a step the server has moved past is refused naming both; closing the
  service releases the waiting requests.

Through a real PyTriton server (the wait while Triton's critic_train thread applies the step, the
errors as the client gets them, a request of protocol 3): tests/critic/test_critic_server.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _critic_service import _batch, _service

from aligner.critic.errors import ServiceClosedError
from aligner.critic.ordering import StepWaitError
from aligner.critic.testing import digit_batch
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P

TOK = build_tokenizer("char")


def _until(cond, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _in_thread(fn, *args):
    """Run ``fn(*args)`` on a thread; returns (thread, box) where box holds 'out' or 'error'."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn(*args)
        except Exception as e:  # looked at by the test
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


# ----------------------------------------------------------------------------------------------
# In process: the service and its gate
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def svc(pstate, tmp_path_factory):
    return _service(pstate, tmp_path_factory.mktemp("ordering"), precision="fp32")


def _request(svc, after_step: int, b: int, seed: int) -> P.InferRequest:
    tokens, lengths, pl, *_ = digit_batch(svc.tokenizer, b, seed=seed, pad_to=10)
    return P.validate_infer(tokens, lengths, pl, svc.limits, after_step=after_step)


def _train(svc, step: int, seed: int = 0):
    tokens, lengths, _, returns, old_values, mask, *_ = _batch(svc, b=4, seed=seed)
    return svc.train(tokens, lengths, returns, old_values, mask, step, svc.critic_step)


def _alone(svc, req: P.InferRequest) -> np.ndarray:
    return svc.infer(req.tokens, req.lengths, req.prompt_lengths, req.after_step).values


def test_merged_requests_each_get_their_own_critic_steps_values_bit_for_bit(svc):
    """One execution holds a request the server can answer now (step 1) and one whose step (2)
    has not been trained: the first is computed at once, the second once the train of step 2 is
    applied, which runs while it waits; each gets exactly the values it gets alone at its step
    (every request is its own forward, whatever it was merged with)."""
    if svc.critic_step < 1:
        _train(svc, 1)
    held = svc.critic_step
    ready = _request(svc, held, b=3, seed=11)
    waiting = _request(svc, held + 1, b=5, seed=12)
    either = _request(svc, P.ANY_CRITIC_STEP, b=2, seed=13)
    before = svc.order.stats()
    th, box = _in_thread(svc.infer_many, [waiting, ready, either])
    _until(lambda: svc.order.waiting == 1, "the request to wait for its step")
    # While it waits, the lock is free: an infer of the step held runs, and so does the train.
    ready_alone, either_alone = _alone(svc, ready), _alone(svc, either)
    assert th.is_alive()
    _train(svc, held + 1, seed=3)
    th.join(30)
    assert not th.is_alive() and "error" not in box, box
    got = box["out"]
    np.testing.assert_array_equal(got[1].values, ready_alone)  # the values of step `held`
    np.testing.assert_array_equal(got[2].values, either_alone)  # any step: the one held then
    np.testing.assert_array_equal(got[0].values, _alone(svc, waiting))  # of step held + 1
    assert not np.array_equal(
        got[1].values, _alone(svc, P.InferRequest(ready.tokens, ready.lengths, ready.prompt_lengths))
    )
    after = svc.order.stats()
    assert after["waited"] == before["waited"] + 1 and after["waiting"] == 0
    # A merged execution's requests are the values they get alone, wherever they sit in it.
    a, b = _request(svc, P.ANY_CRITIC_STEP, b=7, seed=21), _request(svc, P.ANY_CRITIC_STEP, b=2, seed=22)
    for order in ([a, b], [b, a]):
        for got, req in zip(svc.infer_many(order), order):
            np.testing.assert_array_equal(got.values, _alone(svc, req))


def test_a_step_that_does_not_come_or_is_past_is_an_error_naming_both_steps(svc):
    if svc.critic_step < 1:
        _train(svc, 1)
    held = svc.critic_step
    tokens, lengths, pl, *_ = _batch(svc, b=2)
    svc.order.wait_s = 0.3
    try:
        t0 = time.monotonic()
        with pytest.raises(StepWaitError) as e:
            svc.infer(tokens, lengths, pl, held + 5)
        assert time.monotonic() - t0 >= 0.3
    finally:
        svc.order.wait_s = 600.0
    msg = str(e.value)
    assert msg.startswith(
        f"critic_infer needs critic step {held + 5} applied; the server holds critic step {held} after waiting 0."
    )
    assert "(server.infer_wait_s=0.3)" in msg
    # Past: the server holds a later step than the one asked, whose values are gone.
    with pytest.raises(P.ProtocolError) as e:
        svc.infer(tokens, lengths, pl, held - 1)
    assert e.value.field == "after_step"
    msg = str(e.value)
    assert (
        f"got after_step={held - 1}: the server has applied critic steps past it and holds critic step {held}"
        in msg
    )
    # Merged with a good request, each fails alone: the good one gets its values.
    good = _request(svc, held, b=2, seed=5)
    out = svc.infer_many([_request(svc, held - 1, b=2, seed=4), good])
    assert isinstance(out[0], P.ProtocolError)
    np.testing.assert_array_equal(out[1].values, _alone(svc, good))
    stats = svc.info().extra["infer_after_step"]
    assert stats["timed_out"] >= 1 and stats["refused_passed"] >= 2 and stats["infer_wait_s"] == 600.0


def test_a_load_wakes_the_requests_that_wait_for_its_step(svc):
    """Rolled back to step N by a load, the server answers a request that waits for step N+1
    when the load of N+1 brings it (as a train would)."""
    if svc.critic_step < 1:
        _train(svc, 1)
    n = svc.critic_step
    svc.save(n)
    _train(svc, n + 1, seed=7)
    svc.save(n + 1)
    values = _alone(svc, _request(svc, n + 1, b=3, seed=8))
    svc.load(n)
    th, box = _in_thread(svc.infer_many, [_request(svc, n + 1, b=3, seed=8)])
    _until(lambda: svc.order.waiting == 1, "the request to wait for its step")
    svc.load(n + 1)
    th.join(30)
    assert "error" not in box, box
    np.testing.assert_array_equal(box["out"][0].values, values)


def test_closing_releases_the_waiting_requests(pstate, tmp_path):
    svc = _service(pstate, tmp_path, precision="fp32")
    th, box = _in_thread(svc.infer_many, [_request(svc, 3, b=2, seed=1)])
    _until(lambda: svc.order.waiting == 1, "the request to wait for its step")
    svc.close()
    th.join(30)
    assert isinstance(box.get("error"), ServiceClosedError), box
    assert svc.order.waiting == 0
