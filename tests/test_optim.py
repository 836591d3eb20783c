"""Gradient sums and means over data parallelism, and TP-aware clipping, against plain PyTorch on
one process, and at TP=2 against the TP=1 norm of the same full gradient."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aligner.distributed import free_port
from aligner.optim import allreduce_gradients, clip_grad_norm


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def test_single_process_matches_torch():
    ours, ref = _params(0), _params(0)
    norm = clip_grad_norm(ours, 0.5, None, 1, 0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert math.isclose(norm, float(ref_norm), rel_tol=1e-6)
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_measure_only_when_max_norm_is_none():
    ps = _params(1)
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm(ps, None, None, 1, 0)
    assert norm > 0 and all(torch.equal(a, p.grad) for a, p in zip(before, ps))


def _tp_worker(rank: int, port: int, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        full_w = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10  # split by rows over TP
        shared = torch.tensor([3.0, -4.0])  # replicated: same on both ranks
        w = torch.nn.Parameter(torch.zeros(3, 4))
        w.grad = full_w[rank * 3 : (rank + 1) * 3].clone()
        w.tensor_model_parallel = True
        r = torch.nn.Parameter(torch.zeros(2))
        r.grad = shared.clone()
        norm = clip_grad_norm([w, r], None, dist.group.WORLD, 2, rank)
        q.put((rank, norm, float(torch.cat([full_w.reshape(-1), shared]).norm())))
        dist.destroy_process_group()
    except BaseException as e:  # report, do not hang the peer
        q.put((rank, repr(e), None))


@pytest.mark.multiprocess
def test_tp2_norm_counts_shards_once_and_replicated_once():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for _rank, norm, expected in results:
        assert expected is not None, norm
        assert norm == pytest.approx(expected, rel=1e-6)  # reference summed in float32


def test_grad_reduction_is_named_and_one_rank_is_left_alone():
    ps = _params(2)
    before = [p.grad.clone() for p in ps]
    for op in ("mean", "sum"):
        allreduce_gradients(ps, None, 1, op=op)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ps))
    with pytest.raises(ValueError, match="'average'"):
        allreduce_gradients(ps, None, 1, op="average")


def _dp_worker(rank: int, port: int, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        out = {}
        for op in ("sum", "mean"):
            p = torch.nn.Parameter(torch.zeros(3))
            p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # rank 0: g, rank 1: 2g
            allreduce_gradients([p], dist.group.WORLD, 2, op=op)
            out[op] = p.grad.tolist()
        q.put((rank, out))
        dist.destroy_process_group()
    except BaseException as e:  # report, do not hang the peer
        q.put((rank, repr(e)))


@pytest.mark.multiprocess
def test_dp2_gradients_summed_or_averaged():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dp_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for _rank, out in results:
        assert isinstance(out, dict), out
        assert out == {"sum": [3.0, 6.0, 9.0], "mean": [1.5, 3.0, 4.5]}
