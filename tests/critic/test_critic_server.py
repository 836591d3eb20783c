"""The critic server end to end: a real PyTriton server (one for the module), real clients.

The server scores the sort task with a reward function *and* a reward model the test wrote, and
its critic starts from that reward model, so every number it returns can be recomputed here. It
has a run token: train, save and load go through bare tritonclients (aligner.critic.testing's
raw_* helpers) that carry it and the critic step they expect; infer and info need none.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from _critic_service import assert_values_of_real_positions, concurrently

from aligner.checkpoint import load_tensors
from aligner.critic.launch import start_server
from aligner.critic.testing import (
    TINY_MODEL,
    digit_batch,
    encode_samples,
    raw_error,
    raw_infer,
    raw_load,
    raw_save,
    raw_train,
    tiny_overrides,
    train_arrays,
)
from aligner.critic.testing import (
    raw_info as _raw_info,
)
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.forward import sequence_scores, token_values
from aligner.models.gpt import (
    build_critic,
    build_reward_model,
)
from aligner.tasks.digits import sort_reward
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient
from aligner.wire.errors import (
    CriticIncompatibleError,
    CriticRequestError,
    CriticServerError,
    CriticTimeoutError,
)

pytestmark = pytest.mark.server
MAX_BATCH = 16
TOK = build_tokenizer("char")
TOKEN = "the-run-token-of-this-module"
REWARD_FN = "aligner.critic.testing:picky_reward"  # the sort reward, and bad samples to fail on
WAIT_S = 4.0


def raw_info(url: str) -> P.ServerInfo:
    """The full server_info (this module's server has a run token)."""
    return _raw_info(url, TOKEN)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(server, reward model, in-process critic builder, root) for the whole module."""
    root = tmp_path_factory.mktemp("critic_server")
    state = initialize(ParallelConfig(), seed=77)
    cfg = ModelConfig(**TINY_MODEL)
    rm = build_reward_model(cfg)
    save_model_checkpoint(rm, cfg, root / "rm", role="reward")
    (root / "token").write_text(TOKEN + "\n")
    server = start_server(
        tiny_overrides(
            root,
            **{
                "reward.model_path": root / "rm",
                "reward.fn": REWARD_FN,
                "server.run_token_file": root / "token",
                "server.http_port": 0,  # some tests compare HTTP with gRPC (a token is set)
                "server.max_batch_size": MAX_BATCH,
                "server.max_request_batch": MAX_BATCH,
                "server.max_queue_delay_us": 3000,
                # fp32: values are compared with an fp32 in-process forward, and merged batches
                # with unmerged ones, to 1e-5.
                "precision": "fp32",
                # An infer waits this long for the critic step it names (after_step).
                "server.infer_wait_s": WAIT_S,
            },
        ),
        log_path=root / "server.stderr",
    )
    try:
        yield {"server": server, "rm": rm, "cfg": cfg, "root": root, "state": state}
    finally:
        server.stop()
        destroy()


@pytest.fixture(scope="module")
def client(env):
    with RemoteCriticClient(env["server"].url, timeout_s=30, max_workers=8, run_token=TOKEN) as c:
        yield c


def _in_process_values(env, tokens):
    """Save the server's critic (at the step it holds: a save is labelled with it, the initial
    critic as step 0), load it here, and run the same forward."""
    url = env["server"].url
    held = raw_info(url).critic_step
    step = max(held, 0)
    raw_save(url, step, held, TOKEN)
    state = load_tensors(env["root"] / "ckpt" / f"step_{step:08d}" / "critic" / "model_tp00_pp00.safetensors")
    critic = build_critic(env["cfg"], init_from=state)
    with torch.no_grad():
        return token_values(critic, torch.from_numpy(tokens)).numpy()


def _train(env, tokens, lengths, returns, old_values, mask, step, expected_step=None, token=TOKEN):
    """critic_train through a bare client; ``expected_step`` defaults to the server's step."""
    url = env["server"].url
    expected = raw_info(url).critic_step if expected_step is None else expected_step
    req = P.TrainRequest(tokens, lengths, returns, old_values, mask, step, expected)
    return P.TrainResult.from_wire(raw_train(url, req, token)).to_dict()


def _next_step(env) -> int:
    return raw_info(env["server"].url).critic_step + 1


def test_server_info_and_compatibility(env, client):
    info = client.info()
    assert info["protocol_version"] == P.PROTOCOL_VERSION
    assert (info["vocab_size"], info["max_seq_len"]) == (TOK.vocab_size, TINY_MODEL["max_seq_len"])
    assert info["tokenizer_fingerprint"] == TOK.fingerprint() and info["tokenizer"] == "char"
    assert info["reward"]["fn"] == REWARD_FN
    assert (
        info["run_token_required"] is True and int(info["instance_id"], 16) and len(info["instance_id"]) == 32
    )
    assert info["reward"]["model_path"] == str(env["root"] / "rm")
    assert (
        info["model"]["hidden_size"] == TINY_MODEL["hidden_size"] and info["extra"]["init_source"] == "reward"
    )
    assert info["max_batch_size"] == MAX_BATCH and info["parallel"]["tensor_model_parallel_size"] == 1
    client.check_compatible(TOK.vocab_size, 24, TOK.fingerprint())
    with pytest.raises(CriticIncompatibleError) as e:
        client.check_compatible(TOK.vocab_size + 1, 64, "char:other")
    msg = str(e.value)
    assert "vocab_size: actor 15, server 14" in msg and "max_seq_len: actor 64 exceeds the server's 32" in msg
    assert "tokenizer_fingerprint" in msg and env["server"].url in msg


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_values_and_rewards_equal_an_in_process_forward(env, client, scheme):
    url = env["server"].url if scheme == "grpc" else env["server"].http_url
    tokens, lengths, pl, prompts, responses = digit_batch(TOK, 6, seed=1)
    with RemoteCriticClient(url, timeout_s=30) as c:
        values, rewards = c.infer(torch.from_numpy(tokens), torch.from_numpy(lengths), pl).result()
    assert values.shape == (6, tokens.shape[1] - 1) and values.dtype == np.float32 and rewards.shape == (6,)
    assert_values_of_real_positions(values, _in_process_values(env, tokens), lengths, atol=1e-5)
    with torch.no_grad():
        scores = sequence_scores(env["rm"], torch.from_numpy(tokens), torch.from_numpy(lengths)).numpy()
    np.testing.assert_allclose(
        rewards, np.asarray(sort_reward(prompts, responses)) + scores, rtol=0, atol=1e-5
    )


def test_train_then_infer_sees_the_update_and_steps_apply_once(env, client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=2)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=2)
    step = _next_step(env)
    v0, _ = client.infer(tokens, lengths, pl).result()
    result = _train(env, tokens, lengths, returns, old_values, mask, step)
    v1, _ = client.infer(tokens, lengths, pl).result()
    assert result["applied_step"] == step and np.isfinite(result["loss"]) and result["grad_norm"] > 0
    assert set(result) >= {"loss", "grad_norm", "applied_step", "explained_variance", "value_clipfrac"}
    assert not np.allclose(v0, v1)
    # Repeating the step (a client retry) returns the first result and changes nothing, whatever
    # critic step the retry expects.
    for expected in (step - 1, step, step + 40):
        assert _train(env, tokens, lengths, returns * 5, old_values, mask, step, expected) == result
    v2, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(v1, v2)
    assert client.info()["critic_step"] == step


def test_a_stale_expected_step_is_refused_naming_both_steps_and_changes_nothing(env, client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 3, seed=6)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=6)
    held = raw_info(env["server"].url).critic_step
    before, _ = client.infer(tokens, lengths, pl).result()
    text = raw_error(
        env["server"].url,
        P.TRAIN,
        P.TrainRequest(tokens, lengths, returns, old_values, mask, held + 9, held + 8).to_wire(TOKEN),
    )
    fenced = P.extract_fenced(text)
    assert fenced is not None, text[-800:]
    assert str(fenced) == str(P.FencedError(P.TRAIN, held + 9, held + 8, held))
    text = raw_error(env["server"].url, P.SAVE, P.save_inputs(held + 8, held + 8, TOKEN))
    want = P.FencedError(P.SAVE, held + 8, held + 8, held)
    assert str(want).startswith(f"[critic-fenced] critic_save step {held + 8}: ") and str(want) in text
    after, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(after, before)
    info = raw_info(env["server"].url)
    assert info.critic_step == held and held + 8 not in info.checkpoint_steps


def test_each_mutating_endpoint_needs_the_run_token_and_never_shows_it(env, client):
    url = env["server"].url
    tokens, lengths, pl, *_ = digit_batch(TOK, 3, seed=7)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=7)
    held = raw_info(url).critic_step
    before, _ = client.infer(tokens, lengths, pl).result()  # infer and info need none
    requests = {
        P.TRAIN: lambda tok: P.TrainRequest(
            tokens, lengths, returns, old_values, mask, held + 1, held
        ).to_wire(tok),
        P.SAVE: lambda tok: P.save_inputs(held + 1, held, tok),
        P.LOAD: lambda tok: P.load_inputs(0, tok),
    }
    for model, inputs in requests.items():
        for tok, how in ((None, "missing"), (TOKEN[:-1], "wrong"), (TOKEN + "x", "wrong")):
            text = raw_error(url, model, inputs(tok))
            refused = P.extract_unauthorized(text)
            assert refused is not None and (refused.model, refused.missing) == (model, how == "missing"), (
                text[-800:]
            )
            assert TOKEN[:-1] not in text
    after, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(after, before)
    info = raw_info(url)
    assert info.critic_step == held and held + 1 not in info.checkpoint_steps
    log = (env["root"] / "log" / "server.log").read_text()
    assert "critic-unauthorized" in log and TOKEN[:-1] not in log


def _bad_requests(tokens, lengths, pl, returns, old_values, mask):
    """(model, inputs, field or message) for every way a request can break the contract."""

    def col(a):
        return np.asarray(a, np.int64).reshape(-1, 1)

    step = np.array([[10_000]], np.int64)

    def infer(**kw):
        any_step = col(np.full(len(lengths), P.ANY_CRITIC_STEP))
        return {
            "tokens": tokens,
            "lengths": col(lengths),
            "prompt_lengths": col(pl),
            "after_step": any_step,
            **kw,
        }

    def train(**kw):
        return {
            "tokens": tokens,
            "lengths": col(lengths),
            "returns": returns,
            "old_values": old_values,
            "mask": mask,
            "step": step,
            "expected_step": np.array([[9_999]], np.int64),
            "run_token": P.run_token_array(TOKEN),
            **kw,
        }

    big = np.concatenate([tokens] * 6)  # 18 rows > MAX_BATCH
    nan = returns.copy()
    nan[0, -1] = np.nan
    half = mask.copy()
    half[mask == 1] = 0.5
    empty_row = mask.copy()
    empty_row[1] = 0
    return [
        (P.INFER, infer(tokens=tokens.astype(np.int32)), "tokens"),
        (P.INFER, infer(tokens=tokens.astype(np.float32)), "tokens"),
        (P.INFER, infer(tokens=tokens[:, :, None]), "tokens"),
        (P.INFER, infer(tokens=tokens + TOK.vocab_size), "tokens"),
        (P.INFER, infer(tokens=-tokens - 1), "tokens"),
        # Triton rejects an over-long batch of a batched model itself, before any Python runs.
        (
            P.INFER,
            infer(
                tokens=big,
                lengths=col(np.tile(lengths, 6)),
                prompt_lengths=col(np.tile(pl, 6)),
                after_step=col(np.full(len(big), P.ANY_CRITIC_STEP)),
            ),
            f"batch-size must be <= {MAX_BATCH}",
        ),
        (P.INFER, infer(lengths=col(np.ones_like(lengths))), "lengths"),
        (P.INFER, infer(lengths=col(lengths + tokens.shape[1])), "lengths"),
        (P.INFER, infer(prompt_lengths=col(np.zeros_like(pl))), "prompt_lengths"),
        (P.INFER, infer(prompt_lengths=col(lengths)), "prompt_lengths"),
        (P.INFER, infer(after_step=col(np.full(len(lengths), -2))), "after_step"),
        (P.INFER, infer(after_step=col(np.arange(len(lengths)))), "after_step"),
        (P.TRAIN, train(returns=nan), "returns"),
        (P.TRAIN, train(old_values=np.full_like(old_values, np.inf)), "old_values"),
        (P.TRAIN, train(mask=half), "mask"),
        (P.TRAIN, train(mask=empty_row), "mask"),
        (P.TRAIN, train(step=np.array([[-1]], np.int64)), "step"),
        (P.TRAIN, train(step=np.array([[1, 2]], np.int64)), "step"),
        # PyTriton 0.7 cannot carry a zero-size array into Python at all: it fails in its own
        # deserialisation ("cannot cast view with zeros in shape"), so the message is PyTriton's.
        (
            P.TRAIN,
            train(
                tokens=tokens[:0],
                lengths=col(lengths[:0]),
                returns=returns[:0],
                old_values=old_values[:0],
                mask=mask[:0],
            ),
            None,
        ),
        (
            P.TRAIN,
            train(
                tokens=big,
                lengths=col(np.tile(lengths, 6)),
                returns=np.tile(returns, (6, 1)),
                old_values=np.tile(old_values, (6, 1)),
                mask=np.tile(mask, (6, 1)),
            ),
            "tokens",
        ),
        (P.TRAIN, train(tokens=tokens + 100), "tokens"),
        (P.TRAIN, train(lengths=col(lengths + 100)), "lengths"),
        (P.TRAIN, train(expected_step=np.array([[-2]], np.int64)), "expected_step"),
        # The contract is checked before the token: a malformed request without one is malformed.
        (P.TRAIN, train(mask=half, run_token=P.run_token_array(None)), "mask"),
        # Triton itself rejects a request without the inputs of protocol 2.
        (P.TRAIN, {k: v for k, v in train().items() if k not in ("expected_step", "run_token")}, None),
        (P.SAVE, P.save_inputs(0, 0, TOKEN) | {"step": np.array([[-3]], np.int64)}, "step"),
        (P.SAVE, P.save_inputs(0, 0, TOKEN) | {"expected_step": np.array([[-7]], np.int64)}, "expected_step"),
        (P.LOAD, P.load_inputs(0, TOKEN) | {"step": np.array([[-3]], np.int64)}, "step"),
        (P.LOAD, P.load_inputs(123456, TOKEN), "step"),
    ]


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_bad_requests_get_an_error_naming_the_field_and_change_nothing(env, client, scheme):
    url = env["server"].url if scheme == "grpc" else env["server"].http_url
    tokens, lengths, pl, *_ = digit_batch(TOK, 3, seed=3)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=3)
    before, rewards_before = client.infer(tokens, lengths, pl).result()
    step_before = client.info()["critic_step"]
    for model, inputs, field in _bad_requests(tokens, lengths, pl, returns, old_values, mask):
        text = raw_error(url, model, inputs)
        if field is not None:
            needle = field if " " in field else f"'{field}'"
            assert needle in text, (model, field, text[-600:])
    # The server is up, answers correctly, and applied nothing.
    after, rewards_after = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(rewards_after, rewards_before)
    assert client.info()["critic_step"] == step_before
    good = raw_infer(url, P.INFER, P.InferRequest(tokens, lengths, pl).to_wire())
    np.testing.assert_allclose(good["values"], before, rtol=0, atol=1e-6)


def test_client_validates_before_sending(client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=4)
    with pytest.raises(P.ProtocolError, match="field 'prompt_lengths'"):
        client.infer(tokens, lengths, lengths)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1])
    with pytest.raises(P.ProtocolError, match="field 'mask'"):
        client.train(tokens, lengths, returns, old_values, mask * 2, 1)


def test_concurrent_threads_each_get_their_own_rows(env, client):
    batches = [digit_batch(TOK, 3, seed=100 + i, pad_to=12) for i in range(8)]
    expected = [client.infer(t, n, p).result() for t, n, p, *_ in batches]  # one at a time
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(8)

    def worker(i):
        t, n, p, *_ = batches[i]
        barrier.wait()
        results[i] = client.infer(t, n, p).result()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(8):
        np.testing.assert_allclose(results[i][0], expected[i][0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(results[i][1], expected[i][1], rtol=0, atol=1e-5)
    # Different samples really got different answers (rows were not swapped or shared).
    assert len({results[i][1].tobytes() for i in range(8)}) == 8


def test_a_bad_request_merged_with_good_ones_fails_alone(env, client):
    """With a queue delay the batcher merges concurrent requests; the valid ones still succeed
    (the client retries what PyTriton could only fail as a whole), the bad one gets its error."""
    batches = [digit_batch(TOK, 2, seed=200 + i, pad_to=10) for i in range(6)]
    expected = [client.infer(t, n, p).result() for t, n, p, *_ in batches]
    bad_tokens, bad_lengths, bad_pl, *_ = batches[0]
    errors: list[str] = []
    barrier = threading.Barrier(7)

    def bad():
        barrier.wait()
        errors.append(
            raw_error(
                env["server"].url,
                P.INFER,
                P.InferRequest(bad_tokens + 50, bad_lengths, bad_pl).to_wire(),
            )
        )

    futures: dict[int, object] = {}

    def good(i):
        t, n, p, *_ = batches[i]
        barrier.wait()
        futures[i] = client.infer(t, n, p)

    threads = [threading.Thread(target=bad)] + [threading.Thread(target=good, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(6):
        values, rewards = futures[i].result()
        np.testing.assert_allclose(values, expected[i][0], rtol=0, atol=1e-5)
    assert len(errors) == 1 and "field 'tokens'" in errors[0]


def test_one_clients_bad_sample_fails_only_that_client(env):
    """Concurrent clients, one of them with a sample the reward function fails on (it raises, or
    answers NaN): that client gets an error naming the reward function and the sample's index in
    its request; the others get what they get alone, merged or not."""
    url = env["server"].url

    def inputs(prompts, responses):
        return P.InferRequest(*encode_samples(TOK, prompts, responses, pad_to=10)).to_wire()

    good = [inputs([f"{i}{i + 1}:", "35:"], [f"{i}{i + 1}", "53"]) for i in range(3)]
    alone = [raw_infer(url, P.INFER, g) for g in good]
    bad = {
        "raises": (inputs(["12:", "34", "5:"], ["12", "34", "5"]), 1, "ValueError: prompt '34' has no ':'"),
        "nan": (inputs(["9:"], [","]), 0, "its score is nan"),
    }
    merged = 0
    for what, (bad_inputs, sample, words) in bad.items():
        for _ in range(4):  # until the batcher merged the bad request with good ones at least once
            got = concurrently(
                [lambda g=g: raw_infer(url, P.INFER, g) for g in good]
                + [lambda b=bad_inputs: raw_infer(url, P.INFER, b)]
            )
            for g, want in zip(got[:-1], alone):
                assert not isinstance(g, Exception), g
                # A merged forward rounds differently in the last bits (see the env fixture).
                np.testing.assert_allclose(g["values"], want["values"], rtol=0, atol=1e-5)
                np.testing.assert_allclose(g["rewards"], want["rewards"], rtol=0, atol=1e-5)
                assert set(g["error"].ravel()) == {b""}
            prefix = f"reward function {REWARD_FN!r} failed on sample {sample} of the request: "
            if isinstance(got[-1], Exception):  # served alone: its own Triton error
                text = str(got[-1])
                assert prefix in text and words in text, (what, text[-800:])
            else:  # merged with the others: no values, its error in its error output
                merged += 1
                assert got[-1]["values"] is None and got[-1]["rewards"] is None
                errors = {e.decode() for e in got[-1]["error"].ravel()}
                assert len(errors) == 1 and errors.pop().startswith(prefix + words), (what, errors)
                break
    assert merged, "the batcher never merged the bad request with the good ones"
    # Alone it fails the same way.
    text = raw_error(url, P.INFER, bad["raises"][0])
    assert f"reward function {REWARD_FN!r} failed on sample 1 of the request" in text


def test_save_train_load_restores_the_saved_values(env, client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=5)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=5)
    url = env["server"].url
    k = _next_step(env)
    _train(env, tokens, lengths, returns, old_values, mask, k)
    raw_save(url, k, k, TOKEN)
    at_k, _ = client.infer(tokens, lengths, pl).result()
    for step in (k + 1, k + 2):
        _train(env, tokens, lengths, returns, old_values, mask, step)
    later, _ = client.infer(tokens, lengths, pl).result()
    assert not np.allclose(later, at_k)
    raw_load(url, k, TOKEN)
    restored, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(restored, at_k)
    info = raw_info(url)
    assert info.critic_step == P.critic_step_after_load(k) == k and info.last_saved_step == k
    assert (env["root"] / "ckpt" / f"step_{k:08d}" / "critic" / "complete.json").is_file()
    # The next train expects the loaded step.
    assert _train(env, tokens, lengths, returns, old_values, mask, k + 1, k)["applied_step"] == k + 1


# ----------------------------------------------------------------------------------------------
# critic_infer after critic_train (aligner.critic.ordering; in process: test_critic_ordering.py)
# ----------------------------------------------------------------------------------------------


def _until(cond, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_an_infer_sent_before_its_train_waits_for_it_and_gets_the_values_after_it(env, client):
    """As a data-parallel rank's infer of step N+1 reaches the server before the critic_train of
    step N that another rank sent: it waits (Triton runs critic_train on a thread of its own
    meanwhile), then answers with the critic after that train: the values a later infer of the
    same step gets."""
    url = env["server"].url
    tokens, lengths, pl, *_ = digit_batch(TOK, 3, seed=8)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=8)
    held = raw_info(url).critic_step
    before, _ = client.infer(tokens, lengths, pl, after_step=held).result()
    waited = raw_info(url).extra["infer_after_step"]["waited"]
    future = client.infer(tokens, lengths, pl, after_step=held + 1)
    _until(lambda: raw_info(url).extra["infer_after_step"]["waiting"] == 1, "the infer to wait")
    assert not future.done()
    _train(env, tokens, lengths, returns, old_values, mask, held + 1)  # while the infer waits
    values, _ = future.result()
    again, _ = client.infer(tokens, lengths, pl, after_step=held + 1).result()
    np.testing.assert_array_equal(values, again)
    assert not np.allclose(values, before)
    stats = raw_info(url).extra["infer_after_step"]
    assert stats["waited"] == waited + 1 and stats["waiting"] == 0 and stats["infer_wait_s"] == WAIT_S


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_an_infer_waiting_longer_than_the_client_timeout_is_not_resent(env, scheme):
    """The server may hold an infer for its step up to server.infer_wait_s, which it tells every
    caller (with or without the token): a client whose own per-request timeout is shorter gives
    such a request that much more, so it is sent once and answered, not resent while held."""
    url = env["server"].url if scheme == "grpc" else env["server"].http_url
    assert raw_info(url).infer_wait_s == WAIT_S
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=6)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=6)
    with RemoteCriticClient(url, timeout_s=1.0, retries=0) as short:  # infer-only: no token
        assert short.server_info().infer_wait_s == WAIT_S
        held = raw_info(url).critic_step
        waited = raw_info(url).extra["infer_after_step"]["waited"]
        future = short.infer(tokens, lengths, pl, after_step=held + 1)
        _until(lambda: raw_info(url).extra["infer_after_step"]["waiting"] == 1, "the infer to wait")
        time.sleep(1.5)  # past the client's 1 s timeout: without the server's wait added, it fails
        _train(env, tokens, lengths, returns, old_values, mask, held + 1)
        values, _ = future.result()
    assert values.shape == (2, tokens.shape[1] - 1)
    assert raw_info(url).extra["infer_after_step"]["waited"] == waited + 1  # one request, no resend


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_a_wait_on_the_server_ends_with_the_clients_deadline(env, scheme):
    """An attempt never outlasts what is left of the client's wait_timeout_s, over HTTP (whose
    timeout is its socket's) as over gRPC: a step that never comes costs the deadline (1.5 s),
    not the server's longer wait (4 s)."""
    url = env["server"].url if scheme == "grpc" else env["server"].http_url
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=5)
    with RemoteCriticClient(url, timeout_s=30, wait_timeout_s=1.5, retries=0) as short:
        held = raw_info(env["server"].url).critic_step
        t0 = time.monotonic()
        with pytest.raises(CriticTimeoutError):
            short.infer(tokens, lengths, pl, after_step=held + 5).result()
        assert time.monotonic() - t0 < WAIT_S - 0.5
    _until(lambda: raw_info(env["server"].url).extra["infer_after_step"]["waiting"] == 0, "the wait to end")


def test_an_infer_whose_step_never_comes_or_is_past_fails_naming_both_steps(env, client):
    url = env["server"].url
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=9)
    if raw_info(url).critic_step < 1:
        _train(env, tokens, lengths, *train_arrays(lengths, pl, tokens.shape[1]), _next_step(env))
    held = raw_info(url).critic_step
    t0 = time.monotonic()
    with pytest.raises(CriticServerError) as e:
        client.infer(tokens, lengths, pl, after_step=held + 3).result()
    assert time.monotonic() - t0 >= WAIT_S
    assert (
        f"critic_infer needs critic step {held + 3} applied; the server holds critic step {held} after "
        f"waiting {WAIT_S:.0f}."
    ) in str(e.value)
    with pytest.raises(CriticRequestError) as e:
        client.infer(tokens, lengths, pl, after_step=held - 1).result()
    msg = str(e.value)
    assert msg.startswith(
        "[critic] critic_infer: field 'after_step': expected the critic step this server holds"
    )
    assert (
        f"after_step={held - 1}: the server has applied critic steps past it and holds critic step {held}"
        in msg
    )


def test_a_request_without_after_step_asks_for_no_critic_step(env, client):
    """What a bare tritonclient sends (the client always sends after_step): answered at once
    with the critic held, as after_step -1 is."""
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=7)
    bare = {"tokens": tokens, "lengths": lengths.reshape(-1, 1), "prompt_lengths": pl.reshape(-1, 1)}
    out = raw_infer(env["server"].url, P.INFER, bare)
    held, _ = client.infer(tokens, lengths, pl, after_step=raw_info(env["server"].url).critic_step).result()
    np.testing.assert_array_equal(out["values"], held)
