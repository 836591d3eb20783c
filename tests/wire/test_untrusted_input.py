"""What a request sends cannot forge an error's kind, nor slip past the size checks (no server).

- Errors: the server echoes a request's values only neutralized (no line break, no mark, cut),
  and the client reads a mark only where the server's message starts in Triton's text (as
  tritonclient hands it over: a traceback whose last line is ``module.Error: message``), so a
  request's text holding ``[critic-fenced] ...`` is read as what it is: a contract error, or a
  server failure, never a fenced or unauthorized one. The error every request of a merged
  execution gets holds only counts and field names.
- Limits (``InputLimits``): a row's bytes, an input's bytes, the JSON nesting depth (counted,
  never recursed into), the keys of a row and the columns of a request; each refusal names the
  field, the row, the limit and what came.
- The client resends a batch-peer refusal until its deadline without using up its retries.
"""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from aligner.wire import protocol as P
from aligner.wire.transport import classify, error_detail

LIM = P.Limits(vocab_size=14, max_seq_len=16, max_batch=4, max_train_batch=8)
SMALL = P.InputLimits(
    max_extras_bytes=200, max_text_bytes=100, max_input_bytes=300, max_json_depth=4, max_extras_keys=3
)
FORGED = (
    "x\n\naligner.wire.protocol.errors.FencedError: [critic-fenced] critic_train step 13: the request "
    "expects the server at critic step 12, but it holds critic step 3 (restarted or rolled back?); "
    "nothing applied\n[critic-unauthorized] critic_train: the run token is wrong\u2028[critic-batch-peer] "
)
"""Text a hostile request puts where the server might echo it: every mark, after line breaks."""


def triton_text(qualname: str, message: str, status: str = "[StatusCode.INTERNAL]") -> str:
    """An error as tritonclient hands over one a PyTriton callable raised (seen on gRPC; HTTP
    says ``[500]``): Triton's words, two tracebacks, and the exception's name and message."""
    return (
        f"{status} Failed to process the request(s) for model 'critic_infer_0_0', message: "
        "TritonModelException: Model execute error: Traceback (most recent call last):\n"
        '  File "/tmp/folderX/1/model.py", line 492, in execute\n    raise triton_responses_or_error\n'
        "c_python_backend_utils.TritonModelException: Traceback (most recent call last):\n"
        '  File "/x/pytriton/proxy/inference.py", line 393, in _handle_requests\n'
        "    async for responses in self._model_callable(requests):\n"
        f"{qualname}: {message}\n\n\n\nAt:\n  /tmp/folderX/1/model.py(501): execute\n"
    )


def _good(b: int = 2):
    tokens = np.array([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 11]], np.int64)[:b]
    return tokens, np.array([5, 6], np.int64)[:b], np.array([2, 3], np.int64)[:b]


def _refused(limits: P.InputLimits = SMALL, **texts) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as e:
        P.validate_infer(*_good(len(next(iter(texts.values())))), LIM, input_limits=limits, **texts)
    return e.value


# ----------------------------------------------------------------------------------------------
# Errors a request cannot forge
# ----------------------------------------------------------------------------------------------


def test_neutralize_leaves_no_line_break_no_mark_and_cuts():
    text = P.neutralize(FORGED, 100)
    assert "\n" not in text and "\u2028" not in text and "[critic" not in text.lower()
    assert text.startswith("x\\n\\naligner.wire") and text.endswith(
        f"...({len(FORGED) - 100} more characters)"
    )
    assert P.neutralize("[CRITIC-fenced] a\x00b", None) == "(CRITIC-fenced] a\\x00b"
    assert P.neutralize("plain words [1, 2]") == "plain words [1, 2]"  # what is harmless stays
    assert P.quote(FORGED, 20) == repr(FORGED[:20] + "...").replace("[critic", "(critic")
    # A contract error echoes a request's values neutralized, whatever part holds them.
    err = P.ProtocolError(P.INFER, "extras\n[critic] ", FORGED, FORGED)
    assert str(err).count("[critic") == 1 and str(err).startswith(P.ERROR_MARK) and "\n" not in str(err)


@pytest.mark.parametrize("status", ["[StatusCode.INTERNAL]", "[500]"])
def test_a_forged_mark_in_an_echoed_value_is_read_as_the_request_error_it_is(status):
    """The hostile text, refused and echoed by the checks, then wrapped by Triton as it is."""
    rows = [json.dumps([str(P.FencedError(P.TRAIN, 13, 12, 3)) + FORGED]), "{}"]
    err = _refused(P.InputLimits(), extras=rows)
    assert err.field == "extras" and "a JSON list" in str(err) and "(critic-fenced] critic_train" in str(err)
    text = triton_text("aligner.wire.protocol.errors.ProtocolError", str(err), status)
    assert classify(InferenceServerException(text)) == "request"
    assert P.extract_fenced(text) is None and P.extract_unauthorized(text) is None
    assert error_detail(InferenceServerException(text)) == P.server_message(text) == str(err)
    # Invalid JSON (cut, so the parser's own message names a position) is echoed the same way.
    err = _refused(extras=['{"a": "' + FORGED.replace("\n", " ")[:150], "{}"])
    assert "[critic" not in str(err)[len(P.ERROR_MARK) :]
    assert P.error_kind(triton_text("ProtocolError", str(err))) == "request"


def test_a_mark_counts_only_where_the_servers_message_starts():
    """Even text the server did not neutralize (a reward function's words, an unexpected
    exception) holds no mark unless it starts the message: a mark later in a line, or in a line
    that is no exception's, is text."""
    for message in (
        f"reward function 'f' failed on sample 0 of the request: ValueError: {FORGED}",
        f"critic_infer failed on the critic server: RecursionError: {P.FENCED_MARK}x",
    ):
        text = triton_text("aligner.critic.errors.CriticServiceError", message.replace("\n", " "))
        assert classify(InferenceServerException(text)) == "server", text
        assert P.extract_fenced(text) is None and P.server_message(text) is None
    for inside in ("  File 'x', line 1\n    [critic-fenced] x", "Failed, message: [critic-unauthorized] x"):
        assert P.error_kind(f"{triton_text('RuntimeError', 'boom')}{inside}\n") is None
    # What the server does mark is found, rebuilt, and classified by its mark.
    fenced = P.FencedError(P.TRAIN, 13, 12, 3)
    text = triton_text("aligner.wire.protocol.errors.FencedError", str(fenced))
    assert classify(InferenceServerException(text)) == "fenced"
    assert P.extract_fenced(text).critic_step == 3
    wrong = P.UnauthorizedError(P.SAVE, False)
    text = triton_text("aligner.wire.protocol.errors.UnauthorizedError", str(wrong))
    assert classify(InferenceServerException(text)) == "unauthorized"
    assert P.extract_unauthorized(text).missing is False
    closing = triton_text("aligner.critic.errors.ServiceClosedError", f"{P.UNAVAILABLE_MARK}shutting down")
    assert classify(InferenceServerException(closing)) == "unavailable"
    # A bare message (in-process, or an older text form) starts with its mark.
    assert P.error_kind(f"[StatusCode.INTERNAL] {P.BATCH_PEER_MARK}merged") == "peer"
    assert P.error_kind(f"[StatusCode.INTERNAL] Failed ... {P.BATCH_PEER_MARK}merged") is None


def test_the_batch_peer_error_holds_only_counts_and_field_names():
    err = P.BatchPeerError(P.INFER, [(2, "extras"), (0, "tokens"), (5, "x'[critic-fenced] \n")], 7)
    text = str(err)
    assert text.startswith(P.BATCH_PEER_MARK + "critic_infer: 3 of 7 requests")
    assert "request 2: field 'extras'" in text and "request 5: field '?'" in text
    assert text.count("[critic") == 1 and "\n" not in text
    assert isinstance(err, P.ProtocolError) and err.field == "extras" and err.merged == 7
    assert P.error_kind(triton_text("aligner.wire.protocol.errors.BatchPeerError", text)) == "peer"


def test_wire_text_keeps_only_the_mark_the_type_chose():
    assert (
        P.wire_text(f"{P.ERROR_MARK}x {P.FENCED_MARK}", P.ERROR_MARK) == f"{P.ERROR_MARK}x (critic-fenced] "
    )
    assert P.wire_text(f"{P.FENCED_MARK}forged", "") == "(critic-fenced] forged"
    assert P.mark_of(P.FencedError(P.SAVE, 1, 1, 0)) == P.FENCED_MARK
    assert P.mark_of(P.BatchPeerError(P.INFER, [], 2)) == P.BATCH_PEER_MARK
    assert P.mark_of(P.ProtocolError(P.INFER, "a", "b", "c")) == P.ERROR_MARK
    assert P.mark_of(ValueError(P.FENCED_MARK)) == ""
    assert len(P.wire_text("y" * 10_000, "")) < P.errors.MESSAGE_MOST + 40


# ----------------------------------------------------------------------------------------------
# Limits
# ----------------------------------------------------------------------------------------------


def _naive_depth(x) -> int:
    if isinstance(x, dict):
        return 1 + max((_naive_depth(v) for v in x.values()), default=0)
    if isinstance(x, list):
        return 1 + max((_naive_depth(v) for v in x), default=0)
    return 0


def _random_json(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([1, "a[{", 'q"}]\\', None, 2.5, "[critic]"])
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{{": _random_json(rng, depth - 1) for i in range(rng.randint(0, 3))}


def test_json_depth_counts_like_a_recursive_walk_without_one():
    rng = random.Random(0)
    for _ in range(300):
        value = {"row": _random_json(rng, rng.randint(0, 8))}
        assert P.json_depth(json.dumps(value)) == _naive_depth(value), value
    assert P.json_depth("[" * 200_000) == 200_000  # far deeper than Python's recursion limit


@pytest.mark.parametrize(
    "texts, field, words",
    [
        ({"extras": ["{}", '{"a": "' + "x" * 200 + '"}']}, "extras", "at most 200 bytes per row"),
        ({"extras": ["{}", '{"a": "' + "x" * 200 + '"}']}, "extras", "limits.max_extras_bytes"),
        ({"extras": ["{}", '{"a": "' + "x" * 200 + '"}']}, "extras", "row 1: 209 bytes"),
        ({"prompt_text": ["ab", "é" * 51]}, "prompt_text", "row 1: 102 bytes"),
        ({"response_text": ["x" * 100, "y" * 101]}, "response_text", "limits.max_text_bytes"),
        ({"extras": ['{"a": "' + "x" * 150 + '"}'] * 2}, "extras", "at most 300 bytes in all rows"),
        ({"extras": ["{}", '{"a": [[[[1]]]]}']}, "extras", "row 1: nested 5 deep"),
        ({"extras": ["{}", '{"a": [[[[1]]]]}']}, "extras", "limits.max_json_depth"),
        ({"extras": ['{"a":1,"b":2,"c":3,"d":4}', "{}"]}, "extras", "row 0: 4 keys"),
        ({"extras": ['{"a":1,"b":2}', '{"c":3,"d":4}']}, "extras", "4 columns"),
        ({"extras": ['{"a":1,"b":2}', '{"c":3,"d":4}']}, "extras", "limits.max_extras_keys"),
    ],
)
def test_inputs_over_a_limit_are_refused_naming_the_field_the_row_and_the_limit(texts, field, words):
    err = _refused(**texts)
    assert err.field == field and words in str(err), str(err)


def test_limits_hold_on_the_wire_arrays_and_without_limits_deep_json_is_still_refused():
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    wire = P.text_array([deep, "{}"])  # BYTES [b, 1], as Triton hands them to the server
    err = _refused(extras=wire)
    assert f"row 0: {len(deep)} bytes" in str(err)  # the size, before the depth: nothing was parsed
    limits = P.InputLimits(max_extras_bytes=1 << 20)
    with pytest.raises(P.ProtocolError, match=r"row 0: nested 5000 deep"):
        P.validate_infer(*_good(), LIM, extras=wire, input_limits=limits)
    deeper = '{"a":' * 100_000 + "1" + "}" * 100_000
    with pytest.raises(P.ProtocolError, match="field 'extras'.*nested deeper"):  # no RecursionError
        P.validate_infer(*_good(), LIM, extras=[deeper, "{}"])
    # Defaults: generous for real data sets, far below what the attacks sent.
    d = P.InputLimits()
    assert (d.max_extras_bytes, d.max_json_depth, d.max_extras_keys) == (65536, 32, 256)
    ok = P.validate_infer(*_good(), LIM, extras=['{"a": [1, {"b": "[["}]}', "{}"], input_limits=d)
    assert ok.extras[0] == '{"a": [1, {"b": "[["}]}'


# ----------------------------------------------------------------------------------------------
# The client
# ----------------------------------------------------------------------------------------------


class _PeerRefusals:
    """A connection refused ``n`` times as a batch peer, then answering."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def infer(self, model, inputs, outputs, timeout_s=None, attempt_s=None):
        self.calls += 1
        if self.calls <= self.n:
            text = triton_text(
                "aligner.wire.protocol.errors.BatchPeerError", str(P.BatchPeerError(model, [], 2))
            )
            raise InferenceServerException(text)
        return {"ok": np.ones((1, 1), np.int64)}


def test_batch_peer_refusals_are_resent_without_using_up_the_retries():
    from aligner.wire.client import RemoteCriticClient
    from aligner.wire.errors import CriticTimeoutError

    client = RemoteCriticClient.__new__(RemoteCriticClient)  # no server: only _call's bookkeeping
    client.url, client.retries, client.timeout_s, client.backoff_s = "grpc://127.0.0.1:1", 1, 1.0, 0.1
    client.wait_timeout_s, client._closed, client._local = 30.0, False, threading.local()
    client._local.conn = conn = _PeerRefusals(12)
    assert client._call(P.SAVE, {}, ["ok"])["ok"].item() == 1 and conn.calls == 13
    client.wait_timeout_s = 0.3
    client._local.conn = _PeerRefusals(10**6)
    with pytest.raises(CriticTimeoutError, match="critic_save"):
        client._call(P.SAVE, {}, ["ok"])
