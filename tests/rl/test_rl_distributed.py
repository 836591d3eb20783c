"""Two-process CPU (gloo) tests of the collective paths of aligner.rl.

Each test spawns two workers that check their results in-process; an assertion error in a
worker makes ``torch.multiprocessing.spawn`` raise in the parent, which fails the test
(``test_worker_failure_fails_the_test`` checks exactly that).
"""

from __future__ import annotations

import os
import random
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aligner.rl import (
    RunningMoments,
    aggregate,
    entropy_from_logits,
    explained_variance,
    gather_logprobs,
    global_masked_mean,
    global_masked_var,
    global_whiten,
    loss_normaliser,
    masked_mean,
    masked_var,
    reinforce_pp_advantages,
    response_mask,
    sequence_logprobs,
    whiten,
)

pytestmark = pytest.mark.multiprocess
WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, port: int, errors, fn, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        fn(rank, *args)
    except BaseException:
        # Report before dying: once this rank exits, the peer's pending collective fails
        # with "connection closed", and spawn may surface that secondary error instead.
        # Truncated so that the put never blocks on a full pipe.
        errors.put((rank, traceback.format_exc()[-4000:]))
        raise
    finally:
        dist.destroy_process_group()


def _run(fn, *args) -> None:
    """Run ``fn(rank, *args)`` on two gloo ranks; a failure on any rank fails the caller."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_entry, args=(_free_port(), errors, fn, args), nprocs=WORLD, join=True)
    except Exception as exc:
        reports = []
        while not errors.empty():
            rank, trace = errors.get()
            reports.append(f"--- rank {rank} ---\n{trace}")
        raise AssertionError("worker failed:\n" + "\n".join(sorted(reports))) from exc


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------
# Workers (module level so that spawn can pickle them by reference)
# ---------------------------------------------------------------------------------------


def _vocab_parallel_worker(rank: int) -> None:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1234)  # same data on both ranks
    b, s, vocab = 3, 6, 11
    bounds = [0, 6, vocab]  # uneven shards: 6 + 5
    start, end = bounds[rank], bounds[rank + 1]
    for scale in (3.0, 1e4):
        logits = torch.randn(b, s, vocab, generator=g) * scale
        tokens = torch.randint(0, vocab, (b, s), generator=g)
        weights = torch.randn(b, s, generator=g)
        for temperature in (1.0, 0.7):
            full = logits.clone().requires_grad_()
            shard = logits[..., start:end].clone().requires_grad_()

            ref = gather_logprobs(full, tokens, temperature)
            out = gather_logprobs(shard, tokens, temperature, group=group, vocab_start=start)
            assert torch.isfinite(out).all()
            _close(out, ref, tol=1e-5 if scale < 10 else 1e-3)

            ref_seq = sequence_logprobs(full, tokens, temperature)
            out_seq = sequence_logprobs(shard, tokens, temperature, group=group, vocab_start=start)
            _close(out_seq, ref_seq, tol=1e-5 if scale < 10 else 1e-3)

            ref_ent = entropy_from_logits(full, temperature)
            out_ent = entropy_from_logits(shard, temperature, group=group)
            assert torch.isfinite(out_ent).all()
            _close(out_ent, ref_ent)

            # Gradients w.r.t. the local shard are the shard's slice of the full gradient
            # (the loss is replicated on both TP ranks, as in Megatron).
            ((ref + ref_ent) * weights).sum().backward()
            ((out + out_ent) * weights).sum().backward()
            assert torch.isfinite(shard.grad).all()
            _close(shard.grad, full.grad[..., start:end])


def _dp_batch(seed: int, b: int, s: int):
    rng = random.Random(seed)
    prompts = [rng.randint(1, s - 1) for _ in range(b)]
    lengths = [rng.randint(p, s) for p in prompts]
    mask = response_mask(torch.tensor(lengths), torch.tensor(prompts), s)
    x = torch.randn(b, s - 1, generator=torch.Generator().manual_seed(seed)) * 2.0 + 0.7
    # garbage in the padding must not matter
    return torch.where(mask.bool(), x, torch.full_like(x, 1e6)), mask


def _data_parallel_worker(rank: int) -> None:
    group = dist.group.WORLD
    s = 9
    cases = [
        [(10, 2), (20, 5)],  # different batch sizes and ragged masks per rank
        [(30, 4), (43, 1)],
    ]
    for case in cases:
        batches = [_dp_batch(seed, b, s) for seed, b in case]
        # one row with no response at all, on rank 0
        batches[0][1][0] = 0.0
        x_all = torch.cat([x for x, _ in batches])
        m_all = torch.cat([m for _, m in batches])
        x, m = batches[rank]
        offset = sum(bx.shape[0] for bx, _ in batches[:rank])
        rows = slice(offset, offset + x.shape[0])

        _close(global_masked_mean(x, m, group=group), masked_mean(x_all, m_all))
        for unbiased in (True, False):
            _close(
                global_masked_var(x, m, unbiased=unbiased, group=group), masked_var(x_all, m_all, unbiased)
            )
        for shift in (True, False):
            _close(global_whiten(x, m, shift_mean=shift, group=group), whiten(x_all, m_all, shift)[rows])
        # the local statistics differ from the global ones, so the checks above can fail
        assert not torch.allclose(masked_mean(x, m), masked_mean(x_all, m_all))
        # explained variance over both ranks' rows (values: x, returns: x plus noise)
        noise = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(3))
        r_all = x_all + noise
        _close(explained_variance(x, r_all[rows], m, group=group), explained_variance(x_all, r_all, m_all))
        assert not torch.allclose(
            explained_variance(x, r_all[rows], m), explained_variance(x_all, r_all, m_all)
        )
        # a loss over the global normaliser (summed over the ranks): the ranks' losses add up to
        # the whole batch's
        for agg in ("token_mean", "seq_mean_token_mean"):
            n = loss_normaliser(m, agg)
            dist.all_reduce(n, group=group)
            part = aggregate(x, m, agg, n)
            dist.all_reduce(part, group=group)
            _close(part, aggregate(x_all, m_all, agg))

    # a rank whose whole batch is masked still participates and gets the global result
    x0, m0 = _dp_batch(5, 3, s)
    x1, m1 = _dp_batch(6, 2, s)
    m0 = torch.zeros_like(m0)
    x, m = (x0, m0) if rank == 0 else (x1, m1)
    x_all, m_all = torch.cat([x0, x1]), torch.cat([m0, m1])
    _close(global_masked_mean(x, m, group=group), masked_mean(x_all, m_all))
    rows = slice(0, 3) if rank == 0 else slice(3, 5)
    _close(global_whiten(x, m, group=group), whiten(x_all, m_all)[rows])

    # REINFORCE++: one baseline and one scale over both ranks' response tokens
    x0, m0 = _dp_batch(7, 4, s)
    x1, m1 = _dp_batch(8, 3, s)
    x, m = (x0, m0) if rank == 0 else (x1, m1)
    rows = slice(0, 4) if rank == 0 else slice(4, 7)
    whole, _ = reinforce_pp_advantages(torch.cat([x0, x1]), torch.cat([m0, m1]), 0.9)
    mine, _ = reinforce_pp_advantages(x, m, 0.9, group=group)
    _close(mine, whole[rows])
    assert not torch.allclose(reinforce_pp_advantages(x, m, 0.9)[0], whole[rows])


def _running_moments_worker(rank: int) -> None:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(99)
    steps = [(torch.randn(3, generator=g) * 2 + 1, torch.randn(5, generator=g) - 4) for _ in range(3)]
    steps.append((torch.randn(1, generator=g), torch.randn(0)))  # one rank contributes nothing
    dist_rm, ref_rm = RunningMoments(), RunningMoments()
    for a, b in steps:
        local = a if rank == 0 else b
        got = dist_rm.update(local, group=group)
        want = ref_rm.update(torch.cat([a, b]))
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (got, want)
        assert dist_rm.count == ref_rm.count
        assert dist_rm.mean == pytest.approx(ref_rm.mean, rel=1e-9)
        assert dist_rm.std == pytest.approx(ref_rm.std, rel=1e-9)
    # and a group-less update only sees the local batch, which differs
    solo = RunningMoments()
    solo.update(steps[0][rank])
    assert solo.count != ref_rm.count


def _failing_worker(rank: int) -> None:
    if rank == 1:
        raise AssertionError("deliberate failure on rank 1")
    time.sleep(60)  # rank 0 would outlive the test; the parent terminates it on rank 1's failure


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_vocab_parallel_logprobs_and_entropy_tp2():
    _run(_vocab_parallel_worker)


def test_global_whiten_mean_var_dp2():
    _run(_data_parallel_worker)


def test_running_moments_group_update_dp2():
    _run(_running_moments_worker)


def test_worker_failure_fails_the_test():
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        _run(_failing_worker)
