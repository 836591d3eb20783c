"""The critic server end to end: a real PyTriton server (one for the module), real clients.

The server scores the sort task with a reward function *and* a reward model the test wrote, and
its critic starts from that reward model, so every number it returns can be recomputed here.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from aligner.checkpoint import load_tensors
from aligner.critic import protocol as P
from aligner.critic.client import CriticIncompatibleError, RemoteCriticClient
from aligner.critic.launch import start_server
from aligner.critic.testing import TINY_MODEL, digit_batch, raw_error, raw_infer, tiny_overrides, train_arrays
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import (
    build_critic,
    build_reward_model,
    sequence_scores,
    token_values,
)
from aligner.tasks.digits import sort_reward
from aligner.tokenizers import build_tokenizer

pytestmark = pytest.mark.server
MAX_BATCH = 16
TOK = build_tokenizer("char")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(server, reward model, in-process critic builder, root) for the whole module."""
    root = tmp_path_factory.mktemp("critic_server")
    state = initialize(ParallelConfig(), seed=77)
    cfg = ModelConfig(**TINY_MODEL)
    rm = build_reward_model(cfg)
    save_model_checkpoint(rm, cfg, root / "rm", role="reward")
    server = start_server(
        tiny_overrides(
            root,
            **{
                "reward.model_path": root / "rm",
                "reward.fn": "aligner.tasks.digits:sort_reward",
                "server.max_batch_size": MAX_BATCH,
                "server.max_request_batch": MAX_BATCH,
                "server.max_queue_delay_us": 3000,
                # fp32: values are compared with an fp32 in-process forward, and merged batches
                # with unmerged ones, to 1e-5.
                "precision": "fp32",
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
    with RemoteCriticClient(env["server"].url, timeout_s=30, max_workers=8) as c:
        yield c


def _in_process_values(env, client, tokens, step_label):
    """Save the server's critic, load it here, and run the same forward."""
    client.save(step_label)
    state = load_tensors(
        env["root"] / "ckpt" / f"step_{step_label:08d}" / "critic" / "model_tp00_pp00.safetensors"
    )
    critic = build_critic(env["cfg"], init_from=state)
    with torch.no_grad():
        return token_values(critic, torch.from_numpy(tokens)).numpy()


def _next_step(client) -> int:
    return client.info()["critic_step"] + 1


def test_server_info_and_compatibility(env, client):
    info = client.info()
    assert info["protocol_version"] == P.PROTOCOL_VERSION
    assert (info["vocab_size"], info["max_seq_len"]) == (TOK.vocab_size, TINY_MODEL["max_seq_len"])
    assert info["tokenizer_fingerprint"] == TOK.fingerprint() and info["tokenizer"] == "char"
    assert info["reward"]["fn"] == "aligner.tasks.digits:sort_reward"
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
    np.testing.assert_allclose(values, _in_process_values(env, client, tokens, 900), rtol=0, atol=1e-5)
    with torch.no_grad():
        scores = sequence_scores(env["rm"], torch.from_numpy(tokens), torch.from_numpy(lengths)).numpy()
    np.testing.assert_allclose(
        rewards, np.asarray(sort_reward(prompts, responses)) + scores, rtol=0, atol=1e-5
    )


def test_train_then_infer_sees_the_update_and_steps_apply_once(env, client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=2)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=2)
    step = _next_step(client)
    v0, _ = client.infer(tokens, lengths, pl).result()
    train = client.train(tokens, lengths, returns, old_values, mask, step)
    v1, _ = client.infer(tokens, lengths, pl).result()  # sent only after the train returned
    result = train.result()
    assert result["applied_step"] == step and np.isfinite(result["loss"]) and result["grad_norm"] > 0
    assert set(result) >= {"loss", "grad_norm", "applied_step", "explained_variance", "value_clipfrac"}
    assert not np.allclose(v0, v1)
    # Repeating the step (a client retry) returns the first result and changes nothing.
    again = client.train(tokens, lengths, returns * 5, old_values, mask, step).result()
    assert again == result
    v2, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(v1, v2)
    assert client.info()["critic_step"] == step


def _bad_requests(tokens, lengths, pl, returns, old_values, mask):
    """(model, inputs, field or message) for every way a request can break the contract."""

    def col(a):
        return np.asarray(a, np.int64).reshape(-1, 1)

    step = np.array([[10_000]], np.int64)

    def infer(**kw):
        return {"tokens": tokens, "lengths": col(lengths), "prompt_lengths": col(pl), **kw}

    def train(**kw):
        return {
            "tokens": tokens,
            "lengths": col(lengths),
            "returns": returns,
            "old_values": old_values,
            "mask": mask,
            "step": step,
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
            infer(tokens=big, lengths=col(np.tile(lengths, 6)), prompt_lengths=col(np.tile(pl, 6))),
            f"batch-size must be <= {MAX_BATCH}",
        ),
        (P.INFER, infer(lengths=col(np.ones_like(lengths))), "lengths"),
        (P.INFER, infer(lengths=col(lengths + tokens.shape[1])), "lengths"),
        (P.INFER, infer(prompt_lengths=col(np.zeros_like(pl))), "prompt_lengths"),
        (P.INFER, infer(prompt_lengths=col(lengths)), "prompt_lengths"),
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
        (P.SAVE, {"step": np.array([[-3]], np.int64)}, "step"),
        (P.LOAD, {"step": np.array([[-3]], np.int64)}, "step"),
        (P.LOAD, {"step": np.array([[123456]], np.int64)}, "step"),
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
    good = raw_infer(
        url,
        P.INFER,
        {"tokens": tokens, "lengths": lengths.reshape(-1, 1), "prompt_lengths": pl.reshape(-1, 1)},
    )
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
                {
                    "tokens": bad_tokens + 50,
                    "lengths": bad_lengths.reshape(-1, 1),
                    "prompt_lengths": bad_pl.reshape(-1, 1),
                },
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


def test_save_train_load_restores_the_saved_values(env, client):
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=5)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=5)
    k = _next_step(client)
    client.train(tokens, lengths, returns, old_values, mask, k)
    client.save(k)
    at_k, _ = client.infer(tokens, lengths, pl).result()
    for step in (k + 1, k + 2):
        client.train(tokens, lengths, returns, old_values, mask, step)
    later, _ = client.infer(tokens, lengths, pl).result()
    assert not np.allclose(later, at_k)
    client.load(k)
    restored, _ = client.infer(tokens, lengths, pl).result()
    np.testing.assert_array_equal(restored, at_k)
    assert client.info()["critic_step"] == k
    assert (env["root"] / "ckpt" / f"step_{k:08d}" / "critic" / "complete.json").is_file()
