"""The pieces rollout workers are made of (:mod:`aligner.peer_group`,
:mod:`aligner.generation.remote`): what travels, checked against what was sent; a group of its own
between two threads of this process over a real TCP store; the ``rollout`` config's checks."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from aligner.actor.config import ActorConfig
from aligner.config_checks import Problems
from aligner.distributed import spare_port
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.remote import (
    JoinRequests,
    RolloutConfig,
    ask_to_join,
    decode_output,
    decode_prompts,
    encode_output,
    encode_prompts,
    mark_epoch,
    sampling_from,
    sampling_to,
)
from aligner.peer_group import PeerGroup, open_store, recv_message, send_message, split_address
from aligner.rollout.mailbox import Mailbox


def test_prompts_outputs_and_sampling_travel_unchanged():
    prompts = [[3, 4, 5], [6], [7, 8]]
    assert decode_prompts(encode_prompts(prompts)) == prompts
    bad = encode_prompts(prompts)
    bad["prompt_lengths"] = torch.tensor([3, 1, 3])
    with pytest.raises(ValueError, match="do not cut 6 prompt tokens"):
        decode_prompts(bad)
    gen = GenerationOutput(
        tokens=torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]]),
        lengths=torch.tensor([3, 4]),
        prompt_lengths=torch.tensor([1, 2]),
        logprobs=torch.randn(2, 3),
        ended=torch.tensor([True, False]),
    )
    back = decode_output(encode_output(gen, prefix="step7."), prefix="step7.")
    for f in ("tokens", "lengths", "prompt_lengths", "logprobs", "ended"):
        assert (
            torch.equal(getattr(back, f), getattr(gen, f)) and getattr(back, f).dtype == getattr(gen, f).dtype
        )
    with pytest.raises(ValueError, match="without"):
        decode_output(encode_output(gen), prefix="step7.")
    s = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3, stop_token_ids=(4, 5), seed=11)
    assert sampling_from(sampling_to(s)) == s


def test_a_group_of_its_own_carries_messages_broadcasts_and_sums_between_two_processes_ends():
    address = f"127.0.0.1:{spare_port()}"
    got: dict = {}

    def peer():
        store = open_store(address, 2, False, 30)
        g = PeerGroup(store, "t", 1, 2, 30)
        got["message"] = recv_message(g, 0)
        t = torch.zeros(4)
        g.broadcast(t, src=0)
        got["broadcast"] = t
        n = torch.tensor([5], dtype=torch.int64)
        g.all_reduce(n)
        send_message(g, 0, {"op": "done", "n": int(n.item())})

    th = threading.Thread(target=peer)
    th.start()
    store = open_store(address, 2, True, 30)
    g = PeerGroup(store, "t", 0, 2, 30)
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    send_message(g, 1, {"op": "hello", "nested": {"a": [1, 2]}}, {"x": x, "flag": torch.tensor([True])})
    g.broadcast(torch.arange(4.0), src=0)
    n = torch.tensor([2], dtype=torch.int64)
    g.all_reduce(n)
    meta, tensors = recv_message(g, 1)
    th.join(30)
    assert meta == {"op": "done", "n": 7} and tensors == {} and int(n.item()) == 7
    meta, tensors = got["message"]
    assert meta == {"op": "hello", "nested": {"a": [1, 2]}}
    assert torch.equal(tensors["x"], x) and tensors["x"].dtype == torch.bfloat16 and bool(tensors["flag"])
    assert torch.equal(got["broadcast"], torch.arange(4.0))


def test_addresses_and_rollout_settings_are_checked():
    assert split_address("10.0.0.5:29650") == ("10.0.0.5", 29650)
    assert split_address("[::1]:80") == ("::1", 80)
    for bad in ("29650", "host:", "host:0", "host:70000", ":5"):
        with pytest.raises(ValueError, match="expected host:port"):
            split_address(bad)
    p = RolloutConfig(
        workers=-1,
        max_staleness=-2,
        timeout_s=0,
        bucket_mb=0,
        weights_backend="mpi",
        address="x",
        overlap_push="yes",
        score_on_workers="no",
        tensor_parallel_size=0,
        schedule="greedy",
        partial="sometimes",
    ).problems()
    keys = (
        "workers",
        "max_staleness",
        "timeout_s",
        "bucket_mb",
        "weights_backend",
        "address",
        "overlap_push",
        "score_on_workers",
        "tensor_parallel_size",
        "schedule",
        "partial",
    )
    for key in keys:
        assert any(m.startswith(f"rollout.{key}=") for m in p), (key, p)
    # partial rollouts need the dynamic schedule (a swap mid-batch depends on timing)
    p = RolloutConfig(partial=True).problems()
    assert [m for m in p if m.startswith("rollout.partial=")] and "schedule=dynamic" in str(p)
    assert not RolloutConfig(partial=True, schedule="dynamic").problems()


def test_a_worker_s_mailbox_takes_commands_as_they_come_and_a_version_out_of_turn_only_past_asks():
    """The trainer's sends return while the worker is busy (the mailbox's thread takes them);
    ``take_weights`` skips ``generate`` asks but never a ``reset``; after a ``regroup`` the
    thread reads on only once the worker moved; the trainer gone is an error at its turn."""
    address = f"127.0.0.1:{spare_port()}"
    ready = threading.Event()
    groups: dict = {}

    def worker():
        store = open_store(address, 2, False, 30)
        groups["worker"] = PeerGroup(store, "commands", 1, 2, 30)
        groups["store"] = store
        ready.set()

    th = threading.Thread(target=worker)
    th.start()
    store = open_store(address, 2, True, 30)
    trainer = PeerGroup(store, "commands", 0, 2, 30)
    th.join(30)
    box = Mailbox(SimpleNamespace(commands=groups["worker"]))
    sent = [{"op": "generate", "step": 1}, {"op": "generate", "step": 2}, {"op": "weights", "version": 3}]
    sent += [{"op": "reset"}, {"op": "weights", "version": 4}, {"op": "regroup", "epoch": 1}]
    for meta in sent:  # nothing reads on the worker's main thread: the sends return all the same
        send_message(trainer, 1, meta, {"x": torch.ones(2)} if meta["op"] == "generate" else None)
    deadline = time.monotonic() + 30
    while len(box._queue) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box.take_weights() == {"op": "weights", "version": 3}
    assert box.take_weights() is None  # a reset comes before version 4
    meta, tensors = box.get()
    assert meta == {"op": "generate", "step": 1} and torch.equal(tensors["x"], torch.ones(2))
    assert [box.get()[0]["op"] for _ in range(4)] == ["generate", "reset", "weights", "regroup"]
    # the thread waits for the move: a command sent now is read on the new channels only
    moved = threading.Thread(target=lambda: groups.update(new=PeerGroup(groups["store"], "new", 1, 2, 30)))
    moved.start()
    new = PeerGroup(store, "new", 0, 2, 30)
    moved.join(30)
    box.moved(SimpleNamespace(commands=groups["new"]))
    send_message(new, 1, {"op": "generate", "step": 5})
    assert box.get()[0] == {"op": "generate", "step": 5}
    send_message(new, 1, {"op": "stop"})
    assert box.get()[0] == {"op": "stop"}
    box._thread.join(30)
    assert not box._thread.is_alive()  # it ends after a stop
    # nothing comes within the channel's timeout (the trainer gone): an error, at its turn
    quiet = threading.Thread(target=lambda: groups.update(quiet=PeerGroup(groups["store"], "quiet", 1, 2, 1)))
    quiet.start()
    keep = PeerGroup(store, "quiet", 0, 2, 1)
    quiet.join(30)
    box = Mailbox(SimpleNamespace(commands=groups["quiet"]))
    with pytest.raises(RuntimeError, match="the trainer went away"):
        box.get()
    del keep


def test_what_rollout_workers_need_of_the_rest_of_the_config():
    cfg = ActorConfig()
    cfg.rollout.max_staleness = 1
    assert any("rollout.max_staleness=1: expected 0 without rollout workers" in m for m in cfg.problems())
    cfg.rollout.workers = 2
    problems = cfg.problems(world_size=2)
    assert any(m.startswith("ppo.tis_cap=None: expected a cap") for m in problems), problems
    cfg.ppo.tis_cap = 2.0
    cfg.ppo.dynamic_sampling = True
    problems = cfg.problems(world_size=1)
    assert any(m.startswith("ppo.dynamic_sampling=True") for m in problems)
    cfg.ppo.dynamic_sampling = False
    cfg.generation.engine = "trtllm"  # TensorRT-LLM workers (tests/actor/test_rollout_trtllm.py)
    assert not [m for m in cfg.problems(world_size=2) if "rollout" in m]
    cfg.generation.engine = "native"
    assert not [m for m in cfg.problems(world_size=2) if "rollout" in m or "tis_cap" in m or "parallel" in m]
    # Workers score with any estimator (with GAE they ask for the critic's values too).
    cfg.rollout.score_on_workers = True
    assert not [m for m in cfg.problems(world_size=1) if "rollout" in m]
    cfg.ppo.advantage, cfg.ppo.samples_per_prompt = "grpo", 4
    assert not [m for m in cfg.problems(world_size=1) if "rollout" in m]


def test_a_worker_checks_only_what_it_uses_of_the_actors_config():
    """The trainer's files (prompts, run token) may not be on a worker's machine, and its layout
    is not the worker's: neither is checked there; what the worker serves is."""
    from aligner.rollout.worker import worker_problems

    cfg = ActorConfig()
    cfg.rollout.workers, cfg.rollout.worker_rank = 2, 2
    cfg.data.prompt_file, cfg.critic.run_token_file = "/nonexistent/prompts.jsonl", "/nonexistent/token"
    cfg.parallel.tensor_model_parallel_size = 2
    assert worker_problems(cfg, 14) == [] and isinstance(worker_problems(cfg, 14), Problems)
    cfg.generation.temperature, cfg.precision, cfg.rollout.max_staleness = -1.0, "fp8", 1
    problems = worker_problems(cfg, 20)
    for key in ("generation.temperature", "precision", "ppo.tis_cap", "model.vocab_size"):
        assert any(m.startswith(key) for m in problems), (key, problems)
    # A worker of several processes: the model must split that many ways, and torchrun start them.
    cfg = ActorConfig()
    cfg.rollout.workers, cfg.rollout.tensor_parallel_size = 1, 3
    problems = worker_problems(cfg, 14)
    assert any(
        m.startswith("rollout.tensor_parallel_size=3: expected the worker's number of processes (1")
        for m in problems
    )
    assert any(m.startswith("model:") and "3" in m for m in problems), problems


def test_a_worker_joins_a_run_under_way_through_the_store_and_bad_requests_are_refused():
    """Before the trainer marks an epoch a worker joins with the others (None); after it, its
    request reaches the trainer, who answers it. A request that is not a JSON object is refused
    naming why; a ticket taken and never filed (its worker died) holds up no other."""
    import torch.distributed as dist

    store = dist.HashStore()
    me = {"model": {"num_layers": 2}, "tokenizer": "f", "dtype": "fp32"}
    assert ask_to_join(store, 2, me, timeout_s=1.0) is None  # the run has not started: epoch 0
    joins = JoinRequests(store)
    mark_epoch(store, 0)
    assert joins.new() == []

    store.add("aligner/rollout/joins", 1)  # ticket 1: taken, never filed
    store.add("aligner/rollout/joins", 1)  # ticket 2: not JSON
    store.set("aligner/rollout/joins/2", b"\xff{not json")
    store.add("aligner/rollout/joins", 1)  # ticket 3: JSON, not an object
    store.set("aligner/rollout/joins/3", "[2]")
    said, answer = [], {}

    def worker():
        answer["got"] = ask_to_join(store, 2, me, timeout_s=30.0, say=said.append)

    t = threading.Thread(target=worker)
    t.start()
    while not said:  # its request is filed: ticket 4
        time.sleep(0.01)
    got = joins.new()
    assert [(tk, r["rank"], r["identity"]) for tk, r in got] == [(4, 2, me)]
    assert json.loads(store.get("aligner/rollout/joins/2/answer"))["refused"].startswith(
        "an unreadable request"
    )
    assert "not an object" in json.loads(store.get("aligner/rollout/joins/3/answer"))["refused"]
    assert joins.unfiled == {1}
    joins.answer(4, {"epoch": 1, "rank": 2, "workers": 2})
    t.join(10)
    assert answer["got"] == {"epoch": 1, "rank": 2, "workers": 2}
    assert said == ["the run is under way: asked the trainer to join as worker 2"]

    store.set("aligner/rollout/joins/1", json.dumps({"rank": 1, "identity": me}))  # filed at last
    assert [tk for tk, _ in joins.new()] == [1] and joins.unfiled == set()
    with pytest.raises(RuntimeError, match="the trainer refused this worker: worker 2 is in the run"):
        threading.Timer(0.5, lambda: joins.answer(5, {"refused": "worker 2 is in the run"})).start()
        ask_to_join(store, 2, me, timeout_s=30.0)
    with pytest.raises(RuntimeError, match="did not admit it within rollout.timeout_s=0.3 s"):
        ask_to_join(store, 2, me, timeout_s=0.3)
