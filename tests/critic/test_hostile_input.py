"""Hostile critic_infer requests (no token needed) against the server: refused, alone or merged,
without forging another client's error, without reaching past the limits, and without changing
anything.

One real PyTriton server for the module (small ``limits`` so the attacks stay cheap, a queue delay
so Triton merges concurrent requests): each hostile request alone gets a contract error naming
``extras`` (read as one, whatever marks its text holds); merged with good requests, the good ones
get the retryable batch-peer error, which holds nothing the hostile request sent, and their right
answer on retry; the server stays up with its critic step and checkpoints unchanged. In-process
(the server's callable on a service): reward-only rows longer than ``limits``, a merged execution
that fails for a reason of the server's own, and a reward function's words.
"""

from __future__ import annotations

import json
import time
import traceback

import numpy as np
import pytest
from _critic_service import concurrently
from tritonclient.utils import InferenceServerException

from aligner.critic.config import build_config
from aligner.critic.errors import CriticServiceError
from aligner.critic.launch import start_server
from aligner.critic.reward_fn import RewardFunctionError
from aligner.critic.server import CriticTritonServer
from aligner.critic.service import CriticService
from aligner.critic.testing import (
    HTTP_ON,
    digit_batch,
    raw_error,
    raw_infer,
    raw_info,
    tiny_config,
    tiny_overrides,
)
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient
from aligner.wire.requests import fenced_rows
from aligner.wire.transport import classify

pytestmark = pytest.mark.server
TOK = build_tokenizer("char")
PAD = 10
"""Every request's padded length: Triton merges only requests of one shape."""
LIMITS = {"max_extras_bytes": 8192, "max_input_bytes": 65536, "max_json_depth": 8, "max_extras_keys": 16}
CANARY = "hostile-canary-7f3a"
FENCED = str(P.FencedError(P.TRAIN, 13, 12, 3))
UNAUTHORIZED = str(P.UnauthorizedError(P.TRAIN, False))
FORGED = f"{FENCED}\naligner.wire.protocol.errors.FencedError: {FENCED}\n{UNAUTHORIZED}\n{CANARY}"
"""Marks a hostile request hopes the server echoes into the actor's error, after line breaks."""


def _extras(rows: list[str]) -> np.ndarray:
    return P.text_array(rows)


def _inputs(b: int, seed: int, extras: list[str] | None = None) -> dict[str, np.ndarray]:
    tokens, lengths, pl, *_ = digit_batch(TOK, b, seed=seed, pad_to=PAD)
    wire = P.InferRequest(tokens, lengths, pl).to_wire()  # after_step -1: any critic step
    wire["extras"] = _extras(extras if extras is not None else ["{}"] * b)
    return wire


HOSTILE = {
    # what came, where its refusal says so
    "forged marks in a JSON list": (lambda: _inputs(2, 1, [json.dumps([FORGED]), "{}"]), "a JSON list"),
    "forged marks in invalid JSON": (lambda: _inputs(2, 2, ['{"a": "' + FORGED[:200], "{}"]), "invalid JSON"),
    "deep JSON": (lambda: _inputs(2, 3, ['{"a":' + "[" * 3000 + "]" * 3000 + "}", "{}"]), "nested 3001 deep"),
    "an oversized row": (lambda: _inputs(2, 4, ["{}", json.dumps({"a": "x" * 9000})]), "row 1: 9009 bytes"),
    "too many keys": (lambda: _inputs(2, 5, [json.dumps({f"k{i}": i for i in range(17)}), "{}"]), "17 keys"),
    "too many bytes in all": (
        lambda: _inputs(9, 6, [json.dumps({"a": "y" * 7990})] * 9),
        "at most 65536 bytes in all rows",
    ),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    overrides = {f"limits.{k}": v for k, v in LIMITS.items()}
    overrides |= {
        "reward.fn": "aligner.critic.testing:picky_reward",  # takes every extras column (**kwargs)
        "server.max_queue_delay_us": 20000,  # so that concurrent requests merge
        "precision": "fp32",  # merged and unmerged forwards compared to 1e-5
        **HTTP_ON,  # hostile requests go over HTTP too
    }
    server = start_server(tiny_overrides(root, **overrides), log_path=root / "server.stderr")
    try:
        yield {"server": server, "root": root}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(env):
    with RemoteCriticClient(env["server"].url, timeout_s=60, max_workers=8) as c:
        yield c


def _state(url: str) -> tuple:
    info = raw_info(url)
    return info.critic_step, tuple(info.checkpoint_steps), info.instance_id


def test_each_hostile_request_alone_is_refused_naming_extras_and_forges_nothing(env):
    url = env["server"].url
    before = _state(url)
    for what, (make, words) in HOSTILE.items():
        for address in (url, env["server"].http_url):
            text = raw_error(address, P.INFER, make())
            message = P.server_message(text)
            assert message is not None and message.startswith(
                f"{P.ERROR_MARK}critic_infer: field 'extras'"
            ), (
                what,
                text[-600:],
            )
            assert words in message, (what, message)
            assert classify(InferenceServerException(text)) == "request", (what, text[-600:])
            assert P.extract_fenced(text) is None and P.extract_unauthorized(text) is None
            for mark in (P.FENCED_MARK, P.UNAUTHORIZED_MARK, P.BATCH_PEER_MARK):
                assert mark.strip() not in text, (what, mark, text[-600:])
    assert env["server"].returncode is None and _state(url) == before


def test_hostile_requests_merged_with_good_ones_fail_alone(env, client):
    """Good requests (bare, and through the actor's client) sent together with every hostile
    one, until Triton merged some: a bare good one gets the batch-peer error, read as 'peer'
    (retry), holding no byte the hostile requests sent, and its right answer when resent; the
    client's get their right answer (it retries)."""
    url = env["server"].url
    before = _state(url)
    good = [_inputs(2, 100 + i) for i in range(3)]
    alone = [raw_infer(url, P.INFER, g) for g in good]
    hostile = [make for make, _ in HOSTILE.values()]
    peer_errors: list[str] = []
    for _ in range(8):  # until the batcher merged good requests with hostile ones at least once
        got = concurrently(
            [lambda g=g: raw_infer(url, P.INFER, g) for g in good]
            + [
                lambda g=g: client.infer(g["tokens"], g["lengths"], g["prompt_lengths"]).result()
                for g in good
            ]
            + [lambda m=m: raw_infer(url, P.INFER, m()) for m in hostile]
        )
        for i, (g, want) in enumerate(zip(got[:3], alone)):
            if isinstance(g, Exception):
                text = str(g)
                peer_errors.append(text)
                assert classify(g) == "peer", text[-800:]
                g = raw_infer(url, P.INFER, good[i])  # resent, as the client does
            np.testing.assert_allclose(g["values"], want["values"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(g["rewards"], want["rewards"], rtol=0, atol=1e-5)
        for (values, rewards), want in zip(got[3:6], alone):
            np.testing.assert_allclose(values, want["values"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(rewards, want["rewards"].ravel(), rtol=0, atol=1e-5)
        for h in got[6:]:  # each hostile one refused, merged or alone, and never forging
            assert isinstance(h, Exception) and classify(h) in ("request", "peer"), h
        if peer_errors:
            break
    assert peer_errors, "the batcher never merged a good request with a hostile one"
    for text in peer_errors:
        message = P.server_message(text)
        assert message.startswith(P.BATCH_PEER_MARK + "critic_infer: "), message
        assert "field 'extras'" in message and "requests Triton merged into this execution" in message
        assert CANARY not in text and "[critic-fenced]" not in text and "[critic-unauthorized]" not in text
        assert "x" * 50 not in text and "[[[[" not in text  # no piece of a hostile value either
    assert env["server"].returncode is None and _state(url) == before
    again = raw_infer(url, P.INFER, good[0])
    np.testing.assert_allclose(again["values"], alone[0]["values"], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# In process: the server's callable on a service
# ----------------------------------------------------------------------------------------------


def _in_process(pstate, root, **top) -> CriticTritonServer:
    cfg = tiny_config(root, limits=dict(LIMITS), reward={"fn": "aligner.critic.testing:picky_reward"})
    cfg.update(top)
    svc = CriticService(build_config(cfg), pstate)
    return CriticTritonServer(svc, svc.cfg, root)


def test_an_infer_for_another_server_instance_is_refused_alone_before_any_wait(pstate, tmp_path):
    """A request naming another server instance (its client trained with a process that was
    restarted since) is refused at once with the fenced mark, before the wait for the critic step
    it names (which would never come); merged with others it fails alone, in its own error rows,
    and they are answered; a malformed id is refused naming the field."""
    server = _in_process(pstate, tmp_path)  # server.infer_wait_s: 600 s
    svc = server.service
    mine, held = svc.instance_id, svc.critic_step

    def request(seed: int, instance_id: str | None, after_step: int = held) -> dict[str, np.ndarray]:
        wire = _inputs(2, seed)
        wire["after_step"] = np.full((2, 1), after_step, np.int64)
        if instance_id is not None:
            wire["instance_id"] = P.text_array([instance_id] * 2)
        return wire

    alone = server.infer_fn([request(20, mine)])[0]
    t0 = time.monotonic()
    with pytest.raises(P.OtherInstanceError) as e:  # would wait 600 s for critic step held + 5
        server.infer_fn([request(21, "0" * 32, held + 5)])
    text = f"Traceback ...\naligner.wire.protocol.errors.OtherInstanceError: {e.value}\n"
    assert classify(InferenceServerException(text)) == "fenced"
    assert str(e.value).startswith(
        f"{P.FENCED_MARK}critic_infer: the request is for server instance {'0' * 32}"
    )
    assert f"this is server instance {mine}" in str(e.value)
    # Merged: the one for another instance fails alone, at once; the others are answered.
    out = server.infer_fn([request(20, mine), request(22, "f" * 32, held + 5), request(23, None)])
    assert time.monotonic() - t0 < 30
    assert set(out[1]) == {"error"} and fenced_rows(out[1]).startswith(P.FENCED_MARK + "critic_infer: ")
    assert fenced_rows(out[0]) is None and fenced_rows(out[2]) is None
    np.testing.assert_allclose(out[0]["values"], alone["values"], rtol=0, atol=1e-5)
    assert out[2]["rewards"].shape == (2, 1) and set(out[2]["error"].ravel()) == {b""}
    assert svc.order.stats()["waited"] == 0 and svc.critic_step == held
    # Malformed: refused naming the field, alone; merged, the others get the batch-peer error.
    malformed = {
        "too long": P.text_array(["a" * 65] * 2),
        "int64": np.zeros((2, 1), np.int64),
        "rows differ": P.text_array([mine, "0" * 32]),
        "forged mark": P.text_array([f"{FENCED}\n{CANARY}"] * 2),
    }
    for what, value in malformed.items():
        bad = dict(request(24, None), instance_id=value)
        with pytest.raises(P.ProtocolError) as e:
            server.infer_fn([bad])
        assert str(e.value).startswith(f"{P.ERROR_MARK}critic_infer: field 'instance_id'"), (what, e.value)
        assert type(e.value) is P.ProtocolError and "[critic-fenced]" not in str(e.value), what
        with pytest.raises(P.BatchPeerError, match=r"\(request 1: field 'instance_id'\)"):
            server.infer_fn([request(25, mine), bad])


def test_reward_only_rows_longer_than_the_limit_are_refused_naming_tokens(pstate, tmp_path):
    cfg = tiny_config(tmp_path, limits={"reward_only_max_seq_len": 40})
    cfg.update(mode="reward_only")
    svc = CriticService(build_config(cfg), pstate)
    server = CriticTritonServer(svc, svc.cfg, tmp_path)
    assert svc.info().max_seq_len == 40 and svc.info().critic is False
    ok = _inputs(2, 7)
    fine = server.infer_fn([ok])[0]
    assert fine["rewards"].shape == (2, 1)
    long_tokens = np.full((2, 41), TOK.pad_id, np.int64)
    long_tokens[:, :PAD] = ok["tokens"]
    overlong = dict(ok, tokens=long_tokens)
    with pytest.raises(P.ProtocolError, match=r"field 'tokens': expected padded length s <= max_seq_len=40"):
        server.infer_fn([overlong])
    huge = dict(
        ok,
        tokens=np.zeros((1, 1 << 20), np.int64),
        lengths=ok["lengths"][:1],
        prompt_lengths=ok["prompt_lengths"][:1],
    )
    with pytest.raises(P.ProtocolError, match="got s=1048576"):
        server.infer_fn([huge])
    with pytest.raises(P.BatchPeerError, match=r"1 of 2 requests .*\(request 1: field 'tokens'\)"):
        server.infer_fn([ok, overlong])


def test_a_merged_execution_that_fails_on_the_servers_side_sends_only_what_the_server_wrote(
    pstate, tmp_path, monkeypatch
):
    server = _in_process(pstate, tmp_path)

    def broken(requests):
        try:
            raise KeyError(FORGED)  # as if a bug echoed a request's text
        except KeyError as e:
            raise RuntimeError(f"[critic-fenced] {FORGED}") from e

    monkeypatch.setattr(server.service, "infer_many", broken)
    with pytest.raises(CriticServiceError) as e:
        server.infer_fn([_inputs(2, 8), _inputs(2, 9)])
    # What Triton would show: the traceback PyTriton formats, with nothing chained.
    shown = "".join(traceback.format_exception(None, e.value, e.value.__traceback__))
    assert "[critic" not in shown and CANARY in shown and "\n" not in str(e.value)
    assert str(e.value).startswith("critic_infer failed on the critic server: RuntimeError: (critic-fenced] ")
    assert classify(InferenceServerException(shown)) == "server"
    # A merged hostile request the checks cannot even read fails alone, as a bad one.
    monkeypatch.undo()
    unreadable = {k: v for k, v in _inputs(2, 10).items() if k != "tokens"}  # KeyError when read
    with pytest.raises(P.BatchPeerError, match=r"request 1: field 'tokens'"):
        server.infer_fn([_inputs(2, 11), unreadable])


def test_a_reward_functions_words_are_neutralized():
    err = RewardFunctionError("f", f"ValueError: {FORGED}", sample=1)
    assert str(err).startswith(
        "reward function 'f' failed on sample 1 of the request: ValueError: (critic-fenced]"
    )
    assert "[critic" not in str(err) and "\n" not in str(err) and CANARY in str(err)
    assert P.server_message(f"Traceback ...\naligner.critic.reward_fn.RewardFunctionError: {err}\n") is None


def test_the_limits_are_configured_checked_and_named(tmp_path):
    from aligner.config_checks import ConfigError

    cfg = build_config(tiny_config(tmp_path, limits={"max_extras_bytes": 1 << 20}))
    assert cfg.limits.input_limits() == P.InputLimits(max_extras_bytes=1 << 20)
    with pytest.raises(ConfigError) as e:
        build_config(tiny_config(tmp_path, limits={"max_json_depth": 0, "max_extra_keys": 3}))
    assert "limits.max_json_depth=0: expected an integer >= 1" in str(e.value)
    assert "limits.max_extra_keys: unknown key" in str(e.value)
