"""The critic wire contract and config checks, in-process (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from aligner.critic import protocol as P
from aligner.critic.client import DEFAULT_URL, ENV_URL, resolve_critic_url
from aligner.critic.config import ConfigError, build_config
from aligner.critic.testing import tiny_config

LIM = P.Limits(vocab_size=14, max_seq_len=16, max_batch=4, max_train_batch=4)


def _good():
    tokens = np.array([[1, 2, 11, 3, 0, 14 - 1], [4, 5, 11, 6, 7, 0]], dtype=np.int64)
    lengths = np.array([5, 6], dtype=np.int64)
    prompt_lengths = np.array([3, 3], dtype=np.int64)
    return tokens, lengths, prompt_lengths


def _train():
    tokens, lengths, _ = _good()
    mask = np.zeros((2, 5), np.float32)
    mask[0, 2:4] = 1
    mask[1, 2:5] = 1
    return tokens, lengths, np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32), mask


def test_good_requests_pass_and_are_typed():
    tokens, lengths, pl = _good()
    req = P.validate_infer(tokens, lengths.reshape(-1, 1), pl, LIM)
    assert req.lengths.shape == (2,) and req.to_wire()["lengths"].shape == (2, 1)
    t = P.validate_train(*_train(), np.array([[3]], np.int64), LIM)
    assert t.step == 3 and t.to_wire()["step"].shape == (1, 1)


@pytest.mark.parametrize(
    "change, field, words",
    [
        (lambda t, n, p: (t.astype(np.int32), n, p), "tokens", "dtype int64"),
        (lambda t, n, p: (t[None], n, p), "tokens", "rank 2"),
        (lambda t, n, p: (t + 20, n, p), "tokens", "[0, 14)"),
        (lambda t, n, p: (-t, n, p), "tokens", "[0, 14)"),
        (lambda t, n, p: (t[:0], n[:0], p[:0]), "tokens", "at least one row"),
        (
            lambda t, n, p: (np.concatenate([t] * 3), np.concatenate([n] * 3), np.concatenate([p] * 3)),
            "tokens",
            "at most 4 rows",
        ),
        (lambda t, n, p: (np.zeros((2, 20), np.int64), n, p), "tokens", "max_seq_len=16"),
        (lambda t, n, p: (t, np.array([1, 6]), p), "lengths", "2 <= length"),
        (lambda t, n, p: (t, np.array([5, 7]), p), "lengths", "<= padded length 6"),
        (lambda t, n, p: (t, n[:1], p), "lengths", "shape [2, 1]"),
        (lambda t, n, p: (t, n.astype(np.float32), p), "lengths", "dtype int64"),
        (lambda t, n, p: (t, n, np.array([0, 3])), "prompt_lengths", "1 <= prompt_length < length"),
        (lambda t, n, p: (t, n, np.array([3, 6])), "prompt_lengths", "1 <= prompt_length < length"),
    ],
)
def test_bad_infer_requests_name_the_field(change, field, words):
    with pytest.raises(P.ProtocolError) as e:
        P.validate_infer(*change(*_good()), LIM)
    assert e.value.field == field
    msg = str(e.value)
    assert msg.startswith(P.ERROR_MARK) and f"field {field!r}" in msg and words in msg, msg
    assert P.extract_error("Traceback ...\\n ProtocolError: " + msg + "\\n\\nAt: x") == msg


def _with(i, value):
    args = list(_train())
    args[i] = value
    return args


@pytest.mark.parametrize(
    "args, step, field, words",
    [
        (_with(2, np.full((2, 5), np.nan, np.float32)), 1, "returns", "finite"),
        (_with(3, np.full((2, 5), np.inf, np.float32)), 1, "old_values", "finite"),
        (_with(2, np.zeros((2, 5), np.float64)), 1, "returns", "dtype float32"),
        (_with(2, np.zeros((2, 6), np.float32)), 1, "returns", "shape [2, 5]"),
        (_with(4, np.full((2, 5), 0.5, np.float32)), 1, "mask", "{0, 1}"),
        (_with(4, np.zeros((2, 5), np.float32)), 1, "mask", "at least one response token"),
        (_with(4, np.ones((2, 5), np.float32)), 1, "mask", "t >= length-1"),
        (list(_train()), -1, "step", "step >= 0"),
        (list(_train()), np.array([[1, 2]], np.int64), "step", "shape [1, 1]"),
        (list(_train()), np.array([[1]], np.int32), "step", "dtype int64"),
    ],
)
def test_bad_train_requests_name_the_field(args, step, field, words):
    with pytest.raises(P.ProtocolError) as e:
        P.validate_train(*args, step, LIM)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_validation_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    tokens, lengths, pl = _good()
    req = P.validate_infer(torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(pl), LIM)
    np.testing.assert_array_equal(req.tokens, tokens)


def test_server_info_round_trip_ignores_unknown_fields():
    info = P.ServerInfo(P.PROTOCOL_VERSION, 14, 32, "char", "char:abc", -1, 8, 16, extra={"pid": 1})
    blob = info.to_json().replace(b"{", b'{"future_field": 1, ', 1)
    back = P.ServerInfo.from_json(blob)
    assert back == info and back.limits == P.Limits(14, 32, 8, 16)


def test_every_model_spec_is_consistent():
    assert set(P.MODELS) == set(P.MODEL_NAMES)
    assert [m for m, s in P.MODELS.items() if s.batched] == [P.INFER]
    assert P.MODELS[P.TRAIN].input("step").shape == (1, 1)


def test_resolve_critic_url(monkeypatch):
    monkeypatch.delenv(ENV_URL, raising=False)
    assert resolve_critic_url(None) == DEFAULT_URL
    monkeypatch.setenv(ENV_URL, "http://critic.ns.svc:8000")
    assert resolve_critic_url(None) == "http://critic.ns.svc:8000"
    assert resolve_critic_url("grpc://10.0.0.1:9001") == "grpc://10.0.0.1:9001"
    with pytest.raises(ValueError, match="grpc://host:port"):
        resolve_critic_url("ftp://x:1")


# ------------------------------------------------------------------------------------------------
# Config: every problem reported together, each naming its key.
# ------------------------------------------------------------------------------------------------


def test_default_and_tiny_configs_are_valid(tmp_path):
    build_config({})
    build_config(tiny_config(tmp_path))


def test_config_collects_every_problem(tmp_path):
    d = tiny_config(
        tmp_path,
        reward={"fn": "nope:missing"},
        optim={"lr": -1.0, "loss_agg": "sum"},
        server={"max_batch_size": 0, "grpc_port": 70000},
        parallel={"tensor_model_parallel_size": 3},
    )
    d["model"]["hidden_sze"] = 3
    d["extra_section"] = {}
    with pytest.raises(ConfigError) as e:
        build_config(d)
    msg = str(e.value)
    for needle in (
        "reward.fn='nope:missing': cannot import module 'nope'",
        "optim.lr=-1.0",
        "optim.loss_agg='sum'",
        "server.max_batch_size=0",
        "server.grpc_port=70000",
        "model.hidden_sze: unknown key",
        "extra_section: unknown key",
        "tensor_model_parallel_size=3",
    ):
        assert needle in msg, (needle, msg)


def test_config_reward_and_init_sources(tmp_path):
    with pytest.raises(ConfigError, match="no reward source"):
        build_config(tiny_config(tmp_path, reward={"fn": None}))
    with pytest.raises(ConfigError, match="aligner.tasks.digits:nothing"):
        build_config(tiny_config(tmp_path, reward={"fn": "aligner.tasks.digits:nothing"}))
    with pytest.raises(ConfigError, match="init.source='reward' needs a reward model"):
        build_config(tiny_config(tmp_path, init={"source": "reward"}))
    with pytest.raises(ConfigError, match="reward.model_path='/does/not/exist'"):
        build_config(tiny_config(tmp_path, reward={"model_path": "/does/not/exist"}))
    with pytest.raises(ConfigError, match="model.vocab_size=8 is smaller than the tokenizer"):
        build_config(tiny_config(tmp_path, model={"vocab_size": 8}))


def test_client_error_classes():
    """What the client retries (after waiting for readiness), what it reports as the caller's
    mistake, and what it reports as a server failure."""
    from tritonclient.utils import InferenceServerException

    from aligner.critic.client import _classify

    unhealthy = InferenceServerException(
        "[StatusCode.INTERNAL] Stub process 'critic_infer_0_0' is not healthy."
    )
    assert _classify(unhealthy) == "unavailable"
    assert _classify(ConnectionRefusedError("connection refused")) == "unavailable"
    assert _classify(InferenceServerException(f"{P.ERROR_MARK} tokens: expected int64")) == "request"
    crash = InferenceServerException("Traceback (most recent call last):\n  ...\nRuntimeError: boom")
    assert _classify(crash) == "server"
