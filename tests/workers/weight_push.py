"""Run under ``torchrun --nproc_per_node 2``: rank 0 pushes versions of a tiny policy's weight
stream over a gloo group of its own, rank 1 receives them into an engine's owned weights and a
policy module; good pushes, faulty ones, stale versions and a sender that stops mid-push.

Prints ``RESULT <json>`` from rank 0: both ranks' records. Used by
tests/generation/test_weight_push.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from aligner import distributed
from aligner.generation.weight_push import (
    PushFault,
    WeightPusher,
    WeightPushError,
    WeightReceiver,
    apply_weights,
    receive_into,
)
from aligner.generation.weights import OwnedWeights
from aligner.models import gpt
from aligner.models.config import ModelConfig
from aligner.models.layout import ParallelLayout, iter_megatron_tensors, megatron_tensor_specs

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=40, max_seq_len=16)
SMALL = 2048  # below the largest tensor (the embedding: 40 x 32 x 4 bytes)
TIMEOUT_S = 3.0

# (version, bucket_bytes, fault, expect_after); rank 0 pushes them in order, rank 1 receives.
PLAN = [
    (1, SMALL, None, None),
    (2, 16 << 10, None, None),
    (3, 1 << 30, None, None),
    (4, SMALL, PushFault("corrupt", 1), None),
    (4, SMALL, None, None),
    (4, 1 << 30, None, None),  # equal: refused
    (2, SMALL, None, None),  # older: refused
    (5, SMALL, PushFault("version", 2), None),
    (5, SMALL, PushFault("manifest"), None),
    (5, SMALL, PushFault("skip", 1), None),
    (5, 16 << 10, None, None),
    (6, SMALL, None, 9),  # the receiver expects a version after 9: refused
    (7, SMALL, PushFault("stop", 1), None),  # no more buckets: the group's timeout
]
# Rank 1 then receives once more: its group is out of step, refused at once.


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()[:16]


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))


def owned_digests(owned: OwnedWeights) -> dict[str, str]:
    specs = {s.name: s.shape for s in megatron_tensor_specs(CFG, "lm")}
    return {n: digest(t[tuple(slice(0, s) for s in specs[n])]) for n, t in owned.tensors.items()}


def stream_digests(model: torch.nn.Module) -> dict[str, str]:
    return {n: digest(t) for n, t in iter_megatron_tensors(model)}


def main() -> None:
    state = distributed.initialize(distributed.ParallelConfig(1, 1), seed=7)
    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    model = gpt.build_policy(CFG)
    records = []
    if state.rank == 0:
        for i, (version, bucket_bytes, fault, _) in enumerate(PLAN):
            perturb(model, 100 + i)
            pusher = WeightPusher(group, src=0, bucket_bytes=bucket_bytes)
            sent = stream_digests(model)
            rep = pusher.push(version, iter_megatron_tensors(model), fault=fault)
            records.append(
                {"sent": sent, "buckets": rep.buckets, "tensors": rep.tensors, "bytes": rep.bytes}
                | {"refused": rep.refused, "gbps": rep.gbps}
            )
    else:
        perturb(model, 1)
        owned = OwnedWeights(model, ParallelLayout())
        receiver = WeightReceiver(group, src=0)
        for i, (_, _, _, expect_after) in enumerate([*PLAN, PLAN[-1]]):
            rec: dict = {}
            t0 = time.perf_counter()
            try:
                if i % 2:
                    rec["version"] = receive_into(receiver, owned, expect_after)
                    version, tensors = rec["version"], None
                else:
                    version, tensors = receiver.receive(expect_after)
                    rec["version"] = version
                    apply_weights(owned, tensors)
                    rec["received"] = {n: digest(t) for n, t in tensors}
                apply_weights(model, list(iter_megatron_tensors_of(owned)))
            except WeightPushError as e:
                rec["error"] = str(e)
            rec["seconds"] = time.perf_counter() - t0
            rec["owned"] = owned_digests(owned)
            rec["module"] = stream_digests(model)
            rec["last_version"] = receiver.last_version
            records.append(rec)
    both = distributed.all_gather_json(records)
    if state.rank == 0:
        print("RESULT " + json.dumps({"sender": both[0], "receiver": both[1]}), flush=True)
    distributed.destroy()


def iter_megatron_tensors_of(owned: OwnedWeights):
    """The canonical full tensors held by TP=1 owned weights (the vocabulary rows un-padded)."""
    for s in megatron_tensor_specs(CFG, "lm"):
        yield s.name, owned.tensors[s.name][tuple(slice(0, n) for n in s.shape)]


if __name__ == "__main__":
    main()
