"""The critic wire contract and config checks, in-process (no server)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from aligner.config_checks import ConfigError
from aligner.critic.config import build_config
from aligner.critic.testing import tiny_config
from aligner.wire import protocol as P
from aligner.wire.client import DEFAULT_URL, ENV_URL, resolve_critic_url

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
    t = P.validate_train(*_train(), np.array([[3]], np.int64), np.array([[2]], np.int64), LIM)
    assert (t.step, t.expected_step) == (3, 2)
    wire = t.to_wire("tok")
    assert wire["step"].shape == wire["expected_step"].shape == (1, 1) and wire["expected_step"][0, 0] == 2
    assert wire["run_token"].shape == (1,) and P.validate_run_token(P.TRAIN, wire["run_token"]) == "tok"
    assert P.validate_run_token(P.TRAIN, t.to_wire()["run_token"]) == ""  # no token: sent empty
    # In-process callers of the service may leave expected_step out; the wire may not.
    assert P.validate_train(*_train(), 3, None, LIM).expected_step is None
    with pytest.raises(ValueError, match="expected_step"):
        P.validate_train(*_train(), 3, None, LIM).to_wire()
    assert set(P.save_inputs(4, 4, "tok")) == {t.name for t in P.MODELS[P.SAVE].inputs}
    assert set(P.load_inputs(4)) == {t.name for t in P.MODELS[P.LOAD].inputs}
    assert P.critic_step_after_load(0) == 0 and P.critic_step_after_load(7) == 7


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
    # As tritonclient hands it over: the traceback's last line is the exception's name and message.
    text = f"[StatusCode.INTERNAL] Traceback ...\n  ...\naligner.wire.protocol.errors.ProtocolError: {msg}\n\n\n\nAt:\n"
    assert P.extract_error(text) == msg


def test_after_step_names_the_critic_step_the_values_must_come_from():
    """critic_infer's after_step: one step per request, [b, 1] on the wire (every input of a
    batched model is per row), -1 for any; the client's request carries it, each chunk too; a
    request without it (a bare tritonclient) asks for none."""
    from aligner.wire.requests import infer_chunks, infer_request

    tokens, lengths, pl = _good()
    assert P.ANY_CRITIC_STEP == -1
    assert P.validate_infer(tokens, lengths, pl, LIM).after_step == P.ANY_CRITIC_STEP  # in-process: any
    req = P.validate_infer(tokens, lengths, pl, LIM, after_step=np.array([[7], [7]], np.int64))
    assert req.after_step == 7
    wire = req.to_wire()
    assert wire["after_step"].dtype == np.int64 and wire["after_step"].tolist() == [[7], [7]]
    back = P.validate_infer(
        *(wire[k] for k in ("tokens", "lengths", "prompt_lengths")),
        LIM,
        after_step=wire["after_step"],
    )
    assert back.after_step == 7 and req.rows(1, 2).after_step == 7
    assert P.validate_infer(tokens, lengths, pl, LIM, after_step=3).after_step == 3
    assert P.validate_infer(tokens, lengths, pl, LIM, after_step=None).after_step == P.ANY_CRITIC_STEP
    info = P.ServerInfo(P.PROTOCOL_VERSION, 14, 16, "char", "char:abc", -1, 1, 4)
    sent = infer_request(info, "grpc://127.0.0.1:1", tokens, lengths, pl, after_step=5)
    assert [c.to_wire()["after_step"].tolist() for c in infer_chunks(sent, 1)] == [[[5]], [[5]]]
    assert infer_request(info, "grpc://127.0.0.1:1", tokens, lengths, pl).after_step == -1


@pytest.mark.parametrize(
    "value, words",
    [
        (
            np.array([[4], [5]], np.int64),
            "the same step in every row (one request, one critic step), got 4 in row 0 and 5 in row 1",
        ),
        (np.array([[-2], [-2]], np.int64), "a critic step >= 0, or -1 for any, got after_step=-2"),
        (-5, "got after_step=-5"),
        (np.array([[4], [4]], np.int32), "dtype int64"),
        (np.array([[4]], np.int64), "shape [2, 1] (or [2]) to match tokens' batch"),
    ],
)
def test_a_bad_after_step_is_refused_naming_the_field_value_and_expectation(value, words):
    with pytest.raises(P.ProtocolError) as e:
        P.validate_infer(*_good(), LIM, after_step=value)
    assert e.value.field == "after_step"
    msg = str(e.value)
    assert msg.startswith(f"{P.ERROR_MARK}critic_infer: field 'after_step': expected ") and words in msg, msg


def test_a_client_refuses_a_server_of_another_protocol_naming_both_versions():
    """This client (version 5) against a server of version 3, or the other way: the client
    refuses at connection and in check_compatible, naming both versions (a client of an older
    protocol makes the same check, and refuses a newer server the same way)."""
    from aligner.wire.client import RemoteCriticClient, protocol_mismatch
    from aligner.wire.errors import CriticIncompatibleError

    url = "grpc://127.0.0.1:1"
    msg = protocol_mismatch(url, 3)
    assert msg.startswith(f"critic server at {url} speaks protocol version 3, this client 6: ")
    assert "protocol 6: critic_infer carries instance_id" in msg
    client = object.__new__(RemoteCriticClient)  # no server: server_info answers as an old one would
    client.url = url
    client.server_info = lambda: P.ServerInfo(3, 14, 16, "char", "char:abc", -1, 1, 4)
    with pytest.raises(CriticIncompatibleError, match="protocol_version: server 3, client 6 "):
        client.check_compatible(14, 16, "char:abc")


def test_optional_infer_inputs_pass_typed_and_go_on_the_wire_per_row():
    tokens, lengths, pl = _good()
    texts = {"prompt_text": ["12:", "45:"], "response_text": ["Ω,", ""], "extras": ['{"answer":"1"}', "{}"]}
    req = P.validate_infer(tokens, lengths, pl, LIM, **texts)
    assert (req.prompt_texts, req.response_texts, req.extras) == tuple(texts.values())
    wire = req.to_wire()
    for name, rows in texts.items():  # BYTES [b, 1] of UTF-8, as Triton hands them to the server
        assert wire[name].shape == (2, 1) and wire[name].dtype == np.object_
        assert [x.decode("utf-8") for x in wire[name].ravel()] == rows
    back = P.validate_infer(
        *(wire[k] for k in ("tokens", "lengths", "prompt_lengths")), LIM, **{k: wire[k] for k in texts}
    )
    assert back.texts() == texts
    # A chunk of a request takes its rows of every input; inputs left out stay out.
    one = req.rows(1, 2)
    assert one.tokens.shape == (1, 6) and one.texts() == {k: v[1:] for k, v in texts.items()}
    plain = P.validate_infer(tokens, lengths, pl, LIM)
    assert plain.texts() == {} and set(plain.to_wire()) == {
        "tokens",
        "lengths",
        "prompt_lengths",
        "after_step",
    }
    # Optional to Triton: the texts, after_step (which the server's own checks require) and
    # instance_id (sent by a client that watches for restarts: protocol 6).
    optional = {t.name for t in P.MODELS[P.INFER].inputs if t.optional}
    assert optional == set(P.OPTIONAL_INFER_INPUTS) | {"after_step", "instance_id"}
    assert set(P.TEXT_INPUTS) < set(P.OPTIONAL_INFER_INPUTS)


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("extras", ["{}"], "2 rows (one string per sample, shape [2, 1])"),
        ("extras", np.array([[b"{}", b"{}"]], np.object_), "shape [2, 1]"),
        ("extras", ["{}", '{"a": 1'], "row 1: invalid JSON"),
        ("extras", ["[1, 2]", "{}"], "row 0: a JSON list"),
        ("extras", ["{}", '"text"'], "row 1: a JSON str"),
        ("prompt_text", np.array([[b"ok"], [b"\xff\xfe"]], np.object_), "valid UTF-8 in every row"),
        ("response_text", ["ok", 3], "row 1: int 3"),
    ],
)
def test_bad_optional_infer_inputs_name_the_input_and_the_row(name, value, words):
    tokens, lengths, pl = _good()
    with pytest.raises(P.ProtocolError) as e:
        P.validate_infer(tokens, lengths, pl, LIM, **{name: value})
    assert e.value.field == name and words in str(e.value), str(e.value)


def test_an_input_the_server_needs_is_refused_when_left_out_saying_why():
    tokens, lengths, pl = _good()
    why = "this server's reward model reads text with its own tokenizer"
    require = dict.fromkeys(P.TEXT_INPUTS, why)
    with pytest.raises(P.ProtocolError) as e:
        P.validate_infer(tokens, lengths, pl, LIM, prompt_text=["a", "b"], require=require)
    assert e.value.field == "response_text" and why in str(e.value) and "a request without it" in str(e.value)
    P.validate_infer(
        tokens, lengths, pl, LIM, prompt_text=["a", "b"], response_text=["c", "d"], require=require
    )


def _with(i, value):
    args = list(_train())
    args[i] = value
    return args


@pytest.mark.parametrize(
    "args, step, expected_step, field, words",
    [
        (_with(2, np.full((2, 5), np.nan, np.float32)), 1, 0, "returns", "finite"),
        (_with(3, np.full((2, 5), np.inf, np.float32)), 1, 0, "old_values", "finite"),
        (_with(2, np.zeros((2, 5), np.float64)), 1, 0, "returns", "dtype float32"),
        (_with(2, np.zeros((2, 6), np.float32)), 1, 0, "returns", "shape [2, 5]"),
        (_with(4, np.full((2, 5), 0.5, np.float32)), 1, 0, "mask", "{0, 1}"),
        (_with(4, np.zeros((2, 5), np.float32)), 1, 0, "mask", "at least one response token"),
        (_with(4, np.ones((2, 5), np.float32)), 1, 0, "mask", "t >= length-1"),
        (list(_train()), -1, 0, "step", "step >= 0"),
        (list(_train()), np.array([[1, 2]], np.int64), 0, "step", "shape [1, 1]"),
        (list(_train()), np.array([[1]], np.int32), 0, "step", "dtype int64"),
        (list(_train()), 1, -2, "expected_step", "expected_step >= -1"),
        (list(_train()), 1, np.array([[0]], np.int32), "expected_step", "dtype int64"),
        (list(_train()), 1, np.array([0], np.int64), "expected_step", "shape [1, 1]"),
    ],
)
def test_bad_train_requests_name_the_field(args, step, expected_step, field, words):
    with pytest.raises(P.ProtocolError) as e:
        P.validate_train(*args, step, expected_step, LIM)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_fenced_and_unauthorized_errors_are_marked_and_come_back_from_triton_text():
    fenced = P.FencedError(P.TRAIN, 13, 12, 3)
    assert str(fenced) == (
        "[critic-fenced] critic_train step 13: the request expects the server at critic step 12, but it "
        "holds critic step 3 (restarted or rolled back?); nothing applied"
    )
    assert isinstance(fenced, P.ProtocolError) and fenced.field == "expected_step"
    for err in (fenced, P.FencedError(P.SAVE, 4, 4, -1)):
        # Triton wraps the message in a traceback with escaped newlines.
        text = (
            f"[StatusCode.INTERNAL] Traceback (most recent call last):\\n  ...\\nFencedError: {err}\\n\\nAt:"
        )
        back = P.extract_fenced(text)
        assert (back.model, back.step, back.expected_step, back.critic_step) == (
            err.model,
            err.step,
            err.expected_step,
            err.critic_step,
        )
        assert P.extract_error(text) == str(err)
    for missing, how in ((True, "missing"), (False, "wrong"), (None, "missing or wrong")):
        err = P.UnauthorizedError(P.LOAD, missing)
        assert str(err).startswith(f"{P.UNAUTHORIZED_MARK}critic_load: the run token is {how}")
        back = P.extract_unauthorized(f"...\nUnauthorizedError: {err}\n\nAt:")
        assert (back.model, back.missing) == (P.LOAD, missing) and P.extract_error(str(err)) == str(err)
    plain = str(P.ProtocolError(P.TRAIN, "mask", "x", "y"))
    assert P.extract_fenced(plain) is None and P.extract_unauthorized(plain) is None
    assert P.extract_error("no mark at all") is None


def test_run_token_is_read_checked_and_never_shown(tmp_path):
    secret = "s3cret-Token-42"
    env = {P.RUN_TOKEN_ENV: f"  {secret}\n"}
    assert P.resolve_run_token(None, "server.run_token_file", env) == secret
    assert P.resolve_run_token(None, "server.run_token_file", {P.RUN_TOKEN_ENV: " "}) is None
    assert P.resolve_run_token(None, "server.run_token_file", {}) is None
    f = tmp_path / "token"
    f.write_text("from-the-file\n")  # the file wins over the variable; a trailing newline does not count
    assert P.resolve_run_token(f, "server.run_token_file", env) == "from-the-file"
    f.write_text(" \n")
    with pytest.raises(ValueError, match=r"server.run_token_file=.*token' is empty"):
        P.resolve_run_token(f, "server.run_token_file", env)
    with pytest.raises(ValueError, match=r"critic.run_token_file='/no/such/file' cannot be read"):
        P.resolve_run_token("/no/such/file", "critic.run_token_file", env)

    P.check_run_token(P.TRAIN, None, "")  # no token configured: anyone may write
    P.check_run_token(P.TRAIN, secret, secret)
    for given, missing in (("", True), ("s3cret-Token-4", False), (secret + "x", False)):
        with pytest.raises(P.UnauthorizedError) as e:
            P.check_run_token(P.SAVE, secret, given)
        assert (
            e.value.missing is missing
            and secret not in str(e.value)
            and (not given or given not in str(e.value))
        )
    wire = P.run_token_array(secret)
    assert P.validate_run_token(P.LOAD, wire) == secret
    assert (
        P.validate_run_token(P.LOAD, np.array([secret.encode()], np.bytes_)) == secret
    )  # as Triton gives it
    for bad, words in (
        (np.array([1], np.int64), "BYTES of shape [1]"),
        (np.array([b"a", b"b"], np.object_), "BYTES of shape [1]"),
        (np.array([b"\xff\xfe"], np.object_), "UTF-8"),
    ):
        with pytest.raises(P.ProtocolError, match=r"field 'run_token'.*" + re.escape(words)):
            P.validate_run_token(P.LOAD, bad)


def test_validation_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    tokens, lengths, pl = _good()
    req = P.validate_infer(torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(pl), LIM)
    np.testing.assert_array_equal(req.tokens, tokens)


def test_server_info_round_trip_ignores_unknown_fields():
    info = P.ServerInfo(
        P.PROTOCOL_VERSION,
        14,
        32,
        "char",
        "char:abc",
        -1,
        8,
        16,
        instance_id="ab12",
        run_token_required=True,
        infer_inputs=["extras", "prompt_text", "response_text"],
    )
    blob = info.to_json().replace(b"{", b'{"future_field": 1, ', 1)
    back = P.ServerInfo.from_json(blob)
    assert back == info and back.limits == P.Limits(14, 32, 8, 16)
    old = json.loads(info.to_json())
    del old["infer_inputs"]  # a server older than protocol 3 needs none
    assert P.ServerInfo.from_json(json.dumps(old)).infer_inputs == []


def test_every_model_spec_is_consistent():
    assert P.PROTOCOL_VERSION == 6
    assert set(P.MODELS) == set(P.MODEL_NAMES)
    assert [m for m, s in P.MODELS.items() if s.batched] == [P.INFER]
    assert P.MODELS[P.TRAIN].input("step").shape == (1, 1)
    # Who may write, and against which critic step.
    for model, spec in P.MODELS.items():
        names = {t.name for t in spec.inputs}
        required = {t.name for t in spec.inputs if not t.optional}
        assert ("run_token" in required) == (model in P.MUTATING_MODELS), model
        # server_info: optional, for the full info (the probe sends none).
        assert ("run_token" in names) == (model in P.MUTATING_MODELS or model == P.INFO), model
        assert ("expected_step" in names) == (model in (P.TRAIN, P.SAVE)), model
    assert P.MODELS[P.TRAIN].input("expected_step").shape == (1, 1)
    assert P.MODELS[P.LOAD].input("run_token").shape == (1,)
    # critic_infer may name the server instance it is for (protocol 6): optional, one id per row.
    spec = P.MODELS[P.INFER].input("instance_id")
    assert spec.optional and spec.dtype is np.bytes_ and spec.shape == (1,)
    # critic_infer answers each merged request on its own: an error output beside the values.
    assert [t.name for t in P.MODELS[P.INFER].outputs] == ["values", "rewards", "error"]
    ok = P.InferResponse(np.zeros((2, 3), np.float32), np.zeros(2, np.float32)).to_wire()
    assert ok["error"].shape == (2, 1) and set(ok["error"].ravel()) == {b""}
    failed = P.infer_error_wire("reward function 'f' failed on sample 1 of the request: boom", 3)
    assert set(failed) == {"error"} and failed["error"].shape == (3, 1)
    assert failed["error"][1, 0].decode().startswith("reward function 'f' failed on sample 1")


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
    with pytest.raises(ConfigError, match="reward: no reward source"):
        build_config({})  # the packaged defaults name no reward: a user's is never summed with a demo's
    build_config({"reward": {"fn": "aligner.tasks.digits:sort_reward"}})
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


def test_config_resume_modes_and_run_token_file(tmp_path):
    def resume(value):
        return build_config(tiny_config(tmp_path, checkpoint={"resume": value})).checkpoint.resume

    assert [resume(v) for v in ("auto", "none", True, False, "true", "False")] == [
        "auto",
        "none",
        "auto",
        "none",
        "auto",
        "none",
    ]
    assert build_config(tiny_config(tmp_path)).checkpoint.resume == "none"
    token = tmp_path / "token"
    token.write_text("abc\n")
    assert build_config(tiny_config(tmp_path, server={"run_token_file": str(token)})).server.run_token_file
    token.write_text("")
    with pytest.raises(ConfigError) as e:
        build_config(
            tiny_config(tmp_path, server={"run_token_file": str(token)}, checkpoint={"resume": "once"})
        )
    msg = str(e.value)
    assert "server.run_token_file=" in msg and "is empty" in msg
    assert "checkpoint.resume='once': expected one of ['none', 'auto']" in msg


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


def test_config_reward_function_forms_kwargs_and_where_it_is_found(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "h3_cfg_rewards.py").write_text(
        "def trlx(samples, **kwargs):\n    return [0.0] * len(samples)\n"
        "def ours(prompts, responses, clf=None):\n    return [0.0] * len(prompts)\n"
        "def lone(texts):\n    return [0.0] * len(texts)\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # what the loader puts in front goes away after

    def check(fn, **reward):
        return build_config(tiny_config(tmp_path, reward={"fn": fn, **reward})).reward

    with pytest.raises(ConfigError, match="cannot import module 'h3_cfg_rewards'"):
        check("h3_cfg_rewards:trlx")
    assert check("h3_cfg_rewards:trlx", python_path=[str(mods)]).python_path == [str(mods)]
    assert check("h3_cfg_rewards:ours", python_path=[str(mods)], fn_kwargs={"clf": "/m"}).fn_kwargs == {
        "clf": "/m"
    }
    with pytest.raises(ConfigError) as e:
        check("h3_cfg_rewards:lone", python_path=[str(mods)])
    msg = str(e.value)
    assert "reward.fn='h3_cfg_rewards:lone'" in msg and "signature lone(texts) cannot take a batch" in msg
    assert "fn(prompts, responses, **kwargs)" in msg and "fn(samples, prompts, outputs, **kwargs)" in msg
    with pytest.raises(ConfigError, match=r"fn_kwargs key 'model' is not a parameter of reward function"):
        check("h3_cfg_rewards:ours", python_path=[str(mods)], fn_kwargs={"model": "/m"})
    with pytest.raises(ConfigError, match=r"python_path names folders that do not exist: \['/no/such'\]"):
        check("h3_cfg_rewards:ours", python_path=["/no/such"])
    # The server's working directory is searched too: no PYTHONPATH needed.
    monkeypatch.chdir(mods)
    assert check("h3_cfg_rewards:ours").fn == "h3_cfg_rewards:ours"


def test_config_reward_tokenizer_and_policy_sources(tmp_path):
    with pytest.raises(ConfigError, match="reward.tokenizer='char:abc': set without a reward model"):
        build_config(tiny_config(tmp_path, reward={"tokenizer": "char:abc"}))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="reward.chat_template=true: only a reward model that reads text"):
        build_config(
            tiny_config(tmp_path, reward={"model_path": str(tmp_path / "rm"), "chat_template": True})
        )
    with pytest.raises(
        ConfigError, match="reward.chat_template=true: the reward tokenizer 'char:abc' has no chat"
    ):
        build_config(
            tiny_config(
                tmp_path,
                reward={"model_path": str(tmp_path / "rm"), "tokenizer": "char:abc", "chat_template": True},
            )
        )
    with pytest.raises(
        ConfigError, match="reward.tokenizer='/no/tok': cannot load the reward model's tokenizer"
    ):
        build_config(
            tiny_config(tmp_path, reward={"model_path": str(tmp_path / "rm"), "tokenizer": "/no/tok"})
        )
    # init.policy_path: our checkpoint folder or a HF folder.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert build_config(tiny_config(tmp_path, init={"policy_path": str(tmp_path / "hf")})).init.policy_path
    with pytest.raises(ConfigError, match="neither meta.json nor config.json"):
        build_config(tiny_config(tmp_path, init={"policy_path": str(tmp_path)}))


def test_client_error_classes():
    """What the client retries (after waiting for readiness), what it reports as the caller's
    mistake, and what it reports as a server failure."""
    from tritonclient.utils import InferenceServerException

    from aligner.wire.transport import classify

    unhealthy = InferenceServerException(
        "[StatusCode.INTERNAL] Stub process 'critic_infer_0_0' is not healthy."
    )
    assert classify(unhealthy) == "unavailable"
    assert classify(ConnectionRefusedError("connection refused")) == "unavailable"
    assert classify(InferenceServerException(f"{P.ERROR_MARK} tokens: expected int64")) == "request"
    crash = InferenceServerException("Traceback (most recent call last):\n  ...\nRuntimeError: boom")
    assert classify(crash) == "server"


def test_the_clients_requests_carry_what_the_server_needs_in_chunks_it_takes():
    """The client's side of critic_infer, without a server: exactly the optional inputs the
    server names, a ValueError saying why when it needs texts that are not given, a batch cut
    into requests of at most ``max_batch_size`` rows, a request's error rows raised; and a
    critic_train result read back typed, through JSON too (the actor's checkpoint)."""
    from aligner.wire.errors import CriticServerError
    from aligner.wire.requests import infer_chunks, infer_request, infer_result

    url = "grpc://127.0.0.1:1"
    tokens, lengths, pl = _good()
    info = P.ServerInfo(P.PROTOCOL_VERSION, 14, 16, "char", "char:abc", -1, 1, 4, infer_inputs=["extras"])
    req = infer_request(info, url, tokens.astype(np.int32), lengths, pl, prompt_texts=["12", "45"])
    assert req.tokens.dtype == np.int64 and req.texts() == {"extras": ["{}", "{}"]}
    chunks = list(infer_chunks(req, info.max_batch_size))
    assert [c.tokens.shape[0] for c in chunks] == [1, 1] and chunks[1].lengths.tolist() == [6]
    assert chunks[1].extras == ["{}"]
    info.infer_inputs = ["prompt_text", "response_text"]
    with pytest.raises(ValueError, match=r"needs \['prompt_text', 'response_text'\].*pass prompt_texts="):
        infer_request(info, url, tokens, lengths, pl)

    out = {
        "values": np.zeros((2, 5), np.float64),
        "rewards": np.ones((2, 1), np.float64),
        "error": np.full((2, 1), b"", dtype=np.object_),
    }
    values, rewards = infer_result(out, url)
    assert values.dtype == rewards.dtype == np.float32 and rewards.shape == (2,)
    with pytest.raises(CriticServerError, match=f"critic_infer failed on the critic server at {url}: boom"):
        infer_result(P.infer_error_wire("boom", 2), url)
    # An error row without a message (or an answer missing its outputs) is a clear error too.
    with pytest.raises(CriticServerError, match="has no values or rewards output and names no error"):
        infer_result(P.infer_error_wire("", 2), url)

    result = P.TrainResult.from_wire(P.TrainResult(0.5, 1.5, 7, 0.25).to_wire())
    assert (result.loss, result.grad_norm, result.applied_step, result.explained_variance) == (
        0.5,
        1.5,
        7,
        0.25,
    )
    assert P.TrainResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_instance_id_goes_on_the_wire_per_row_and_is_checked_naming_the_field():
    tokens, lengths, pl = _good()
    limits = P.Limits(14, 16, 4, 4)
    req = P.InferRequest(tokens, lengths, pl, after_step=3, instance_id="a1b2" * 8)
    wire = req.to_wire()
    assert wire["instance_id"].shape == (2, 1) and wire["instance_id"][1, 0] == b"a1b2" * 8
    assert req.rows(1, 2).to_wire()["instance_id"].shape == (1, 1)
    assert "instance_id" not in P.InferRequest(tokens, lengths, pl).to_wire()  # none: not sent
    back = P.validate_infer(tokens, lengths, pl, limits, instance_id=wire["instance_id"])
    assert back.instance_id == "a1b2" * 8
    for empty in (None, "", P.text_array(["", ""])):  # names no instance: any server answers
        assert P.validate_infer(tokens, lengths, pl, limits, instance_id=empty).instance_id is None
    bad = {
        "too long": (P.text_array(["x" * 65] * 2), "at most 64 bytes, got row 0: 65 bytes"),
        "int64": (np.zeros((2, 1), np.int64), "got dtype int64 shape [2, 1]"),
        "wrong rows": (P.text_array(["abc"] * 3), "got dtype object shape [3, 1]"),
        "rows differ": (P.text_array(["abc", "abd"]), "the same id in every row"),
        "not an id": (P.text_array(["[critic-fenced] x\n"] * 2), "got '(critic-fenced] x\\n'"),
        "not bytes": (np.array([[1], [2]], dtype=object), "got row 0: int"),
    }
    for what, (value, words) in bad.items():
        with pytest.raises(P.ProtocolError) as e:
            P.validate_infer(tokens, lengths, pl, limits, instance_id=value)
        assert e.value.field == "instance_id" and words in str(e.value), (what, str(e.value))
        assert str(e.value).startswith(f"{P.ERROR_MARK}critic_infer: field 'instance_id'"), what


def test_another_instance_is_refused_with_the_fenced_mark():
    err = P.OtherInstanceError(P.INFER, "old\n[critic] x", "new")
    assert P.mark_of(err) == P.FENCED_MARK and P.wire_text(str(err), P.mark_of(err)) == str(err)
    assert str(err).startswith(f"{P.FENCED_MARK}critic_infer: the request is for server instance ")
    assert "\n" not in str(err) and "[critic]" not in str(err)
    assert P.error_kind(f"Traceback ...\nOtherInstanceError: {err}\n") == "fenced"
