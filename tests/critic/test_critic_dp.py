"""A critic server with data-parallel replicas, and batching that is shown.

- Two gloo ranks in-process (no Triton): the critic at DP=2 gives the values and takes the
  updates the same critic gives and takes at DP=1 (one and several minibatches, both loss
  aggregations, a replica left without rows), and resumes a DP=1 checkpoint.
- A real server under torchrun at DP=2, two clients: the values, the train step, exactly once
  and fencing as at DP=1, and checkpoints that move between DP=2 and DP=1 both ways.
- Four concurrent clients: the DP=2 server (with a queue delay) merges their requests into
  shared executions, as ``server_info``'s ``batching`` and the request metrics show, and each
  client gets exactly its own rows, in order; a server started with
  ``server.dynamic_batching=false`` answers the same load with one request per execution, so
  the merge assertion is one that batching can fail.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from aligner.actor.critic_link import sample_texts
from aligner.critic.config import build_config
from aligner.critic.launch import start_server
from aligner.critic.service import CriticService
from aligner.critic.testing import (
    TINY_MODEL,
    digit_batch,
    raw_info,
    raw_load,
    raw_save,
    raw_train,
    tiny_config,
    tiny_overrides,
    train_arrays,
)
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_reward_model
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.multiprocess]
TOK = build_tokenizer("char")

# ----------------------------------------------------------------------------------------------
# DP=2 against DP=1, in-process (two gloo ranks, no Triton)
# ----------------------------------------------------------------------------------------------

CASES = {
    # One minibatch, two epochs: the infer forward is the first pass (each replica its slice).
    # The reward model reads text with a tokenizer of its own (another alphabet than the
    # policy's): its second forward is split across the replicas too. Such a reward model cannot
    # seed the critic: it starts from the same checkpoint's trunk, as from a policy.
    "one_minibatch": {
        # The unclipped value loss here (the other case has the clipped one): from this start,
        # step 2's clip fraction turns on ties that DP=2 and DP=1 round differently.
        "optim": {"epochs": 2, "value_clip_eps": None},
        "reward": {"tokenizer": "char:9876543210:,"},
        "init": {"source": "policy", "policy_path": "<root>/rm"},
    },
    # Three minibatches of 5 rows (2, 2, 1): the last one leaves replica 1 without rows.
    "minibatches_seq_mean": {"optim": {"num_minibatches": 3, "epochs": 2, "loss_agg": "seq_mean_token_mean"}},
}


def _case_config(root: Path, case: str, tp: int = 1) -> dict:
    """The case's server config; at TP > 1 with checkpoints of its own (they hold TP shards)."""
    sections = {
        k: {n: v.replace("<root>", str(root)) if isinstance(v, str) else v for n, v in section.items()}
        for k, section in CASES[case].items()
    }
    reward = {
        "model_path": str(root / "rm"),
        "fn": "aligner.tasks.digits:sort_reward",
        **sections.pop("reward", {}),
    }
    cfg = tiny_config(root / case, reward=reward, parallel={"tensor_model_parallel_size": tp}, **sections)
    if tp > 1:
        cfg["checkpoint"]["dir"] = str(root / case / f"ckpt_tp{tp}")
    cfg["precision"] = "fp32"  # DP=2 is compared with DP=1 to float rounding
    return cfg


def _case_batches():
    """(tokens, lengths, prompt_lengths, returns, old_values, mask) of steps 1 and 2: 5 rows."""
    out = []
    for seed in (11, 12):
        tokens, lengths, pl, *_ = digit_batch(TOK, 5, seed=seed, pad_to=12)
        out.append((tokens, lengths, pl, *train_arrays(lengths, pl, tokens.shape[1], seed=seed)))
    return out


def _infer(svc: CriticService, tokens, lengths, prompt_lengths):
    """``svc.infer``, with the samples' texts when its reward model reads text."""
    texts = {}
    if svc.required_inputs:
        prompts, responses = sample_texts(TOK, tokens, lengths, prompt_lengths)
        texts = {"prompt_texts": prompts, "response_texts": responses}
    return svc.infer(tokens, lengths, prompt_lengths, **texts)


def _run_case(svc: CriticService) -> dict:
    """What the comparison covers: infer (1 row, then 5 rows), train steps 1 and 2 each right
    after the infer of its own rows (so that a case with one minibatch takes that forward as
    its first pass), infer after; and how many first passes were taken from an infer."""
    (t1, n1, p1, *rest1), (t2, n2, p2, *rest2) = _case_batches()
    before = svc.reused_forwards
    out = {"values_one_row": _infer(svc, t2[:1], n2[:1], p2[:1]).values}
    out["rewards_one_row"] = _infer(svc, t2[:1], n2[:1], p2[:1]).rewards
    out["rewards0"] = _infer(svc, t1, n1, p1).rewards
    out["values0"] = _infer(svc, t1, n1, p1).values
    out["step1"] = svc.train(t1, n1, *rest1, 1).to_dict()
    out["values1"] = _infer(svc, t2, n2, p2).values
    out["step2"] = svc.train(t2, n2, *rest2, 2).to_dict()
    out["values2"] = _infer(svc, t1, n1, p1).values
    out["reused"] = svc.reused_forwards - before
    return out


def _compare(got: dict, want: dict, what: str) -> None:
    # The infer forward is the first pass of both steps with one minibatch, at DP=1 as at DP=2.
    assert got["reused"] == want["reused"] == (2 if "one_minibatch" in what else 0), (what, got["reused"])
    for key in ("values0", "rewards0", "values_one_row", "rewards_one_row", "values1"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5, err_msg=f"{what}: {key}")
    for step in ("step1", "step2"):
        g, w = got[step], want[step]
        assert g["applied_step"] == w["applied_step"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-5), (what, step, g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (what, step, g, w)
        assert g["explained_variance"] == pytest.approx(w["explained_variance"], abs=1e-5), (what, step)
        assert g["value_clipfrac"] == pytest.approx(w["value_clipfrac"], abs=1e-6), (what, step, g, w)
    np.testing.assert_allclose(got["values2"], want["values2"], rtol=0, atol=1e-4, err_msg=f"{what}: values2")


def _dp2_worker(rank: int, port: int, root: str, tp: int, errors) -> None:
    """One of the TP x 2 ranks of a DP=2 critic; rank 0 runs each case and compares it with
    what the DP=1 run in the parent got."""
    world = 2 * tp
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    root = Path(root)
    try:
        state = initialize(ParallelConfig(tensor_model_parallel_size=tp), seed=1234)
        assert (state.dp_size, state.tp_size) == (2, tp)
        for case in CASES:
            svc = CriticService(build_config(_case_config(root, case, tp)), state)
            if rank != 0:
                svc.serve_peers()
                continue
            want = json.loads((root / f"{case}.json").read_text())
            arrays = np.load(root / f"{case}.npz")
            want.update({k: arrays[k] for k in arrays.files})
            if tp > 1:
                # Both start from the reward model (the DP=1 run from its step 0, which holds it).
                got = _run_case(svc)
                _compare(got, want, f"{case} at TP={tp}")
                # Saved from replica 0's TP shards, loaded into every replica.
                svc.save(2)
                (t1, n1, p1, *rest1) = _case_batches()[0]
                svc.train(t1, n1, *rest1, 3)
                svc.load(2)
                np.testing.assert_array_equal(_infer(svc, t1, n1, p1).values, got["values2"])
                svc.close()
                continue
            # The DP=1 run's step-1 checkpoint (with its Adam moments): step 2 as at DP=1.
            svc.load(1)
            (t2, n2, p2, *rest2) = _case_batches()[1]
            step2 = svc.train(t2, n2, *rest2, 2).to_dict()
            assert step2["loss"] == pytest.approx(want["step2"]["loss"], rel=1e-5), (case, step2)
            assert step2["grad_norm"] == pytest.approx(want["step2"]["grad_norm"], rel=1e-4), (case, step2)
            # From the DP=1 run's initial critic, the whole run again.
            svc.load(0)
            _compare(_run_case(svc), want, case)
            svc.close()
    except BaseException:
        errors.put((rank, traceback.format_exc()[-4000:]))
        raise
    finally:
        destroy()


def test_dp2_updates_equal_dp1_updates(tmp_path):
    """At TP=1 x DP=2 (two ranks), and at TP=2 x DP=2 (four)."""
    state = initialize(ParallelConfig(), seed=1234)
    try:
        cfg = ModelConfig(**TINY_MODEL)
        save_model_checkpoint(build_reward_model(cfg), cfg, tmp_path / "rm", role="reward")
        for case in CASES:
            svc = CriticService(build_config(_case_config(tmp_path, case)), state)
            svc.save(0)
            (t1, n1, p1, *rest1) = _case_batches()[0]
            _infer(svc, t1, n1, p1)
            svc.train(t1, n1, *rest1, 1)
            svc.save(1)
            svc.load(0)
            got = _run_case(svc)
            arrays = {k: v for k, v in got.items() if isinstance(v, np.ndarray)}
            np.savez(tmp_path / f"{case}.npz", **arrays)
            (tmp_path / f"{case}.json").write_text(
                json.dumps({k: v for k, v in got.items() if k not in arrays})
            )
    finally:
        destroy()
    for tp in (1, 2):
        errors = mp.get_context("spawn").SimpleQueue()
        try:
            mp.spawn(_dp2_worker, args=(free_port(), str(tmp_path), tp, errors), nprocs=2 * tp, join=True)
        except Exception as exc:
            reports = []
            while not errors.empty():
                rank, trace = errors.get()
                reports.append(f"--- rank {rank} ---\n{trace}")
            raise AssertionError(f"a rank of TP={tp} x DP=2 failed:\n" + "\n".join(sorted(reports))) from exc


# ----------------------------------------------------------------------------------------------
# A real DP=2 server
# ----------------------------------------------------------------------------------------------

QUEUE_DELAY_US = 20_000  # long enough that requests released together meet in the queue


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """(server at DP=2, the same critic at DP=1 in this process, root)."""
    root = tmp_path_factory.mktemp("critic_dp2")
    state = initialize(ParallelConfig(), seed=1234)
    cfg = ModelConfig(**TINY_MODEL)
    save_model_checkpoint(build_reward_model(cfg), cfg, root / "rm", role="reward")
    server = start_server(
        tiny_overrides(
            root / "server",
            **{
                "parallel.data_parallel_size": 2,
                "reward.model_path": root / "rm",
                "precision": "fp32",
                "server.max_batch_size": 32,
                "server.max_queue_delay_us": QUEUE_DELAY_US,
                "log.stats_interval_s": 1.0,
            },
        ),
        nproc=2,
        log_path=root / "server.stderr",
        ready_timeout_s=180,
    )
    # The reference writes into the server's checkpoint folder, so each loads what the other saved.
    ref_cfg = tiny_config(root / "ref", reward={"model_path": str(root / "rm")}, checkpoint={})
    ref_cfg["checkpoint"]["dir"] = str(root / "server" / "ckpt")
    ref_cfg["precision"] = "fp32"
    reference = CriticService(build_config(ref_cfg), state)
    try:
        yield {"server": server, "reference": reference, "root": root}
        assert server.stop(timeout=60) == 0, server.output_tail()
    finally:
        server.kill()
        destroy()


def _train(url, reference, batch, step, expected):
    tokens, lengths, _, returns, old_values, mask = batch
    req = P.TrainRequest(tokens, lengths, returns, old_values, mask, step, expected)
    got = P.TrainResult.from_wire(raw_train(url, req)).to_dict()
    want = None if reference is None else reference.train(tokens, lengths, returns, old_values, mask, step)
    return got, want


def _assert_same_step(got, want):
    assert got["applied_step"] == want.applied_step
    assert got["loss"] == pytest.approx(want.loss, rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4)
    assert got["explained_variance"] == pytest.approx(want.explained_variance, abs=1e-5)


def _batch(seed, b):
    tokens, lengths, pl, *_ = digit_batch(TOK, b, seed=seed, pad_to=12)
    return (tokens, lengths, pl, *train_arrays(lengths, pl, tokens.shape[1], seed=seed))


def test_two_clients_train_and_checkpoints_at_dp2_equal_dp1(dp2):
    server, reference = dp2["server"], dp2["reference"]
    url = server.url
    info = raw_info(url)
    assert info.parallel == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 2,
    }
    assert info.batching["dynamic_batching"] is True and info.batching["max_queue_delay_us"] == QUEUE_DELAY_US
    assert info.critic_step == -1  # both start from the reward model's trunk and head
    batches = [_batch(30, 5), _batch(31, 3)]
    # Two clients at once; each batch is split across the two replicas (and maybe merged).
    with RemoteCriticClient(url, timeout_s=60) as a, RemoteCriticClient(url, timeout_s=60) as b:
        futures = [c.infer(*batch[:3]) for c, batch in zip((a, b), batches)]
        for fut, batch in zip(futures, batches):
            values, rewards = fut.result()
            want = reference.infer(*batch[:3])
            np.testing.assert_allclose(values, want.values, rtol=0, atol=1e-5)
            np.testing.assert_allclose(rewards, want.rewards, rtol=0, atol=1e-5)

    # One step on each: the same loss, norm and new values.
    got, want = _train(url, reference, batches[0], 1, -1)
    _assert_same_step(got, want)
    after = reference.infer(*batches[0][:3]).values
    with RemoteCriticClient(url, timeout_s=60) as c:
        np.testing.assert_allclose(c.infer(*batches[0][:3]).result()[0], after, rtol=0, atol=1e-4)
        # Exactly once across the replicas: a repeat gets the first result and changes nothing.
        tokens, lengths, pl, returns, old_values, mask = batches[0]
        again, _ = _train(url, None, (tokens, lengths, pl, returns * 5, old_values, mask), 1, 0)
        assert again == got
        np.testing.assert_allclose(c.infer(tokens, lengths, pl).result()[0], after, rtol=0, atol=1e-4)
        with pytest.raises(Exception, match=r"\[critic-fenced\] critic_train step 3"):
            _train(url, None, batches[1], 3, 2)
        assert raw_info(url).critic_step == 1

        # Saved at DP=2, loaded at DP=1 (over a reference that has moved on): the same values,
        # and the same next step (the Adam moments came along).
        raw_save(url, 1, 1)
        reference.train(tokens, lengths, returns * 3, old_values, mask, 2)
        reference.load(1)
        np.testing.assert_allclose(
            reference.infer(*batches[1][:3]).values, c.infer(*batches[1][:3]).result()[0], rtol=0, atol=1e-5
        )
        got, want = _train(url, reference, batches[1], 2, 1)
        _assert_same_step(got, want)

        # Saved at DP=1, loaded at DP=2: the server takes the reference's step 3, which it never
        # trained, and the next step is the same on both.
        reference.train(tokens, lengths, returns, old_values, mask, 3)
        reference.save(3)
        raw_load(url, 3)
        np.testing.assert_allclose(
            c.infer(tokens, lengths, pl).result()[0],
            reference.infer(tokens, lengths, pl).values,
            rtol=0,
            atol=1e-5,
        )
        got, want = _train(url, reference, batches[1], 4, 3)
        _assert_same_step(got, want)


# ----------------------------------------------------------------------------------------------
# Batching that is shown: four concurrent clients
# ----------------------------------------------------------------------------------------------

CLIENTS = 4
REQUESTS_PER_CLIENT = 6


def _four_clients(url: str) -> tuple[dict[str, int], list[list[tuple]], list[list[tuple]]]:
    """Each of four clients (threads, each its own RemoteCriticClient) sends its requests one
    after another, all four released together. Returns the histogram of requests per execution
    over that load (from ``server_info``), what each client got, and what each request gets
    alone."""
    batches = [
        [
            digit_batch(TOK, 1 + (c + k) % 3, seed=1000 * c + k, pad_to=12)[:3]
            for k in range(REQUESTS_PER_CLIENT)
        ]
        for c in range(CLIENTS)
    ]
    with RemoteCriticClient(url, timeout_s=60) as c:
        alone = [[c.infer(*req).result() for req in reqs] for reqs in batches]
    before = raw_info(url).batching["requests_per_execution"]
    got: list[list[tuple]] = [[] for _ in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        with RemoteCriticClient(url, timeout_s=60) as c:
            barrier.wait()
            for req in batches[i]:
                got[i].append(c.infer(*req).result())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    after = raw_info(url).batching["requests_per_execution"]
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert sum(int(k) * v for k, v in delta.items()) == CLIENTS * REQUESTS_PER_CLIENT, delta
    return delta, got, alone


def _assert_own_rows_in_order(got, alone):
    for c in range(CLIENTS):
        assert len(got[c]) == REQUESTS_PER_CLIENT
        for k, ((values, rewards), (want_values, want_rewards)) in enumerate(zip(got[c], alone[c])):
            assert values.shape == want_values.shape, (c, k)
            np.testing.assert_allclose(
                values, want_values, rtol=0, atol=1e-5, err_msg=f"client {c} request {k}"
            )
            np.testing.assert_allclose(
                rewards, want_rewards, rtol=0, atol=1e-5, err_msg=f"client {c} request {k}"
            )


def test_four_clients_are_merged_and_each_gets_its_own_rows_in_order(dp2):
    url = dp2["server"].url
    delta, got, alone = _four_clients(url)
    print(f"\nrequests per execution under {CLIENTS} clients at DP=2 (merged -> executions): {delta}")
    assert max(int(k) for k in delta) > 1, f"no execution merged two requests: {delta}"
    _assert_own_rows_in_order(got, alone)
    # The same numbers as metrics: requests.jsonl gets a row every log.stats_interval_s.
    path = dp2["root"] / "server" / "log" / "requests.jsonl"
    deadline = time.monotonic() + 10
    seen = 0
    while time.monotonic() < deadline and seen <= 1:
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        seen = max((r.get("server/critic_infer/requests_per_execution_max", 0) for r in rows), default=0)
        time.sleep(0.5)
    assert seen > 1, "requests.jsonl never showed a merged critic_infer execution"
    batching = raw_info(url).batching
    assert batching["requests_per_execution_mean"] > 1 or batching["executions"] < batching["requests"]


@pytest.fixture(scope="module")
def unbatched(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic_unbatched")
    server = start_server(
        tiny_overrides(
            root, **{"server.dynamic_batching": "false", "server.max_queue_delay_us": QUEUE_DELAY_US}
        ),
        log_path=root / "server.stderr",
    )
    try:
        yield server
    finally:
        server.stop()


def test_without_dynamic_batching_the_same_load_is_never_merged(unbatched):
    delta, got, alone = _four_clients(unbatched.url)
    assert raw_info(unbatched.url).batching["dynamic_batching"] is False
    assert set(delta) == {"1"}, f"an execution merged requests with batching off: {delta}"
    _assert_own_rows_in_order(got, alone)
