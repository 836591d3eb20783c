"""The distributed optimizer (``optim.use_distributed_optimizer``, ZeRO-1: aligner.sharded_optim).

- Its layout: every element of every parameter in exactly one rank's slice, aligned, padded.
- One rank: the same numbers as MixedPrecisionAdamW, bit for bit (bf16 and fp32), and the same
  checkpoint tensors and JSON; each loads the other's state.
- Two gloo ranks (DP=2): a sharded update equals the unsharded DP=2 update and the DP=1 update
  of the same gradients (the two ranks' micro-batches summed, halved), bit for bit, over steps
  that clip; the optimizer state per rank is half; a checkpoint saved sharded at DP=2 resumes
  exactly at DP=2 sharded and at DP=1 unsharded, and a DP=1 checkpoint resumes exactly at DP=2
  sharded. Three ranks (DP=3, padding that does not divide evenly): a DP=2 checkpoint resumes
  there, sharded equal to unsharded.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from aligner.actor.config import ActorConfig
from aligner.actor.optimizer import make_policy_optimizer
from aligner.checkpoint import load_tensors, read_json, save_tensors, write_json
from aligner.critic.config import CriticOptimConfig
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.models.config import ModelConfig
from aligner.models.forward import policy_logits
from aligner.models.gpt import build_policy, tensor_state_dict
from aligner.optim import OptimConfig
from aligner.precision import MixedPrecisionAdamW, ShardedAdamW, make_optimizer, master_state_dict
from aligner.sharded_optim import ALIGN, ShardLayout

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)
STEPS, SAVED_AT = 4, 2
MAX_NORM = 0.05  # below every step's norm here: each step clips
PRECISIONS = ("bf16", "fp32")


# -- the layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_every_element_is_in_exactly_one_slice(dp):
    numels = [1, 63, 64, 65, 1000, 7, 4096, 3]
    lay = ShardLayout.of(numels, dp)
    assert all(o % ALIGN == 0 for o in lay.offsets) and lay.shard_size % ALIGN == 0
    assert lay.offsets[-1] + numels[-1] <= lay.total == dp * lay.shard_size
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for r in range(dp):
        for i, lo, hi in lay.pieces(r):
            start = lay.offsets[i] + lo
            assert r * lay.shard_size <= start and lay.offsets[i] + hi <= (r + 1) * lay.shard_size
            seen[i][lo:hi] += 1
    assert all(bool((s == 1).all()) for s in seen)


def test_config_key_and_its_check():
    assert OptimConfig().use_distributed_optimizer is False
    assert CriticOptimConfig(use_distributed_optimizer=True).problems() == []
    problems = OptimConfig(use_distributed_optimizer="yes").problems("optim")  # type: ignore[arg-type]
    assert problems == ["optim.use_distributed_optimizer='yes': expected true or false"]


# -- shared by the runs --------------------------------------------------------------------------


def _model_and_optimizer(precision: str, dp_group=None, sharded: bool = False, device: str = "cpu"):
    torch.manual_seed(0)
    model = build_policy(TINY).to(device)  # fp32: make_optimizer keeps these values as the masters
    opt = make_optimizer(
        model, lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, precision=precision,
        dp_group=dp_group if sharded else None,
    )  # fmt: skip
    if sharded:
        assert isinstance(opt, ShardedAdamW)
        opt.bucket_numel = 1000  # several all-gathers per step
    return model, opt


def _backward(model, step: int, rank: int) -> None:
    """One rank's micro-batch of ``step``: its gradient accumulates (fp32) in the optimizer."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=gen)  # [b, s]
    tokens = tokens.to(next(model.parameters()).device)
    logits = policy_logits(model, tokens)  # [b, s, v] fp32
    logits.logsumexp(-1).mean().backward()


def _train(model, opt, steps, rank: int, dp_group=None, dp: int = 1, ranks_per_step: int = 1) -> list[float]:
    """Steps ``steps``: this rank's micro-batch (at DP=1, ``ranks_per_step`` ranks' micro-batches
    summed and averaged: what a DP all-reduce of that many ranks gives), clipped."""
    norms = []
    for step in steps:
        opt.zero_grad()
        for r in range(ranks_per_step):
            _backward(model, step, rank + r)
        if ranks_per_step > 1:
            opt.copy_grads_to_master()
            for g in opt.grad_params:
                g.grad /= ranks_per_step
        opt.allreduce_grads(dp_group, dp)
        norms.append(opt.clip_grad_norm(MAX_NORM))
        assert opt.step()
    return norms


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """The model's weights and the optimizer's whole state (collective when sharded)."""
    tensors, _ = opt.state_tensors()
    out = {f"optim.{k}": v.detach().cpu() for k, v in tensors.items()}
    out.update({f"model.{k}": v.detach().cpu() for k, v in tensor_state_dict(model).items()})
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: not bit-identical: {bad[:6]}"


def _save(opt, path: Path, write: bool = True) -> None:
    """``write``: this rank writes; else it only takes part in gathering a sharded state."""
    if not write:
        assert opt.state_tensors(keep=False)[0] == {}
        return
    tensors, meta = opt.state_tensors()
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(path / "optim.safetensors", tensors)
    write_json(path / "optim.json", meta)


def _load(opt, path: Path) -> None:
    opt.load_state_tensors(load_tensors(path / "optim.safetensors"), read_json(path / "optim.json"))


# -- one rank ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world1():
    state = initialize(ParallelConfig(), seed=1234)
    yield state
    destroy()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_rank_equals_the_unsharded_optimizer(world1, precision, tmp_path, device):
    runs = {}
    for sharded in (False, True):
        model, opt = _model_and_optimizer(precision, device=device)
        if sharded:
            torch.manual_seed(0)
            model = build_policy(TINY).to(device)
            masters = [p.detach().clone() for p in model.parameters()]
            if precision == "bf16":
                model.to(torch.bfloat16)
            opt = ShardedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
            opt.bucket_numel = 1000
            opt.load_masters(masters, to_model=False)
        norms = _train(model, opt, range(STEPS), 0)
        runs[sharded] = (norms, _snapshot(model, opt), opt.state_tensors()[1], model, opt)
    (n0, s0, meta0, m0, o0), (n1, s1, meta1, m1, o1) = runs[False], runs[True]
    assert n0 == n1
    _assert_equal(s1, s0, precision)
    assert meta1 == meta0  # the same JSON: param groups, which parameters have state, dtypes
    assert o1.precision == o0.precision == precision
    got, want = master_state_dict(m1, o1), master_state_dict(m0, o0)
    assert all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)
    # Each takes the other's state and continues the same.
    _save(o0, tmp_path / "unsharded")
    _save(o1, tmp_path / "sharded")
    _load(o0, tmp_path / "sharded")
    _load(o1, tmp_path / "unsharded")
    assert _train(m0, o0, range(STEPS, STEPS + 2), 0) == _train(m1, o1, range(STEPS, STEPS + 2), 0)
    _assert_equal(_snapshot(m1, o1), _snapshot(m0, o0), f"{precision} after swapping states")
    with pytest.raises(TypeError, match="state_tensors"):
        o1.state_dict()


# -- several ranks -------------------------------------------------------------------------------


def _reference_dp1(root: Path, precision: str) -> dict[str, torch.Tensor]:
    """DP=1, unsharded, each step the two ranks' micro-batches averaged; saves step SAVED_AT."""
    model, opt = _model_and_optimizer(precision)
    _train(model, opt, range(SAVED_AT), 0, ranks_per_step=2)
    _save(opt, root / f"{precision}_dp1")
    _train(model, opt, range(SAVED_AT, STEPS), 0, ranks_per_step=2)
    return _snapshot(model, opt)


def _dp_worker(rank: int, world: int, port: int, root: str, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    root = Path(root)
    try:
        state = initialize(ParallelConfig(), seed=1234)
        g, dp = state.dp_group, state.dp_size
        assert dp == world
        # The actor's builder shards with the option, over the state given or Megatron's.
        cfg = ActorConfig()
        for flag, given, kind in (
            (True, state, ShardedAdamW),
            (True, None, ShardedAdamW),
            (False, state, MixedPrecisionAdamW),
        ):
            cfg.optim.use_distributed_optimizer = flag
            torch.manual_seed(0)
            opt, _ = make_policy_optimizer(build_policy(TINY), cfg, "bf16", given)
            assert type(opt) is kind and (not flag or opt.dp_size == dp)
        for precision in PRECISIONS:
            out = root / f"{precision}_dp{dp}"

            def run(sharded: bool, load: Path | None = None, save: Path | None = None, precision=precision):
                model, opt = _model_and_optimizer(precision, g, sharded)
                steps = range(STEPS)
                if load is not None:
                    _load(opt, load)
                    steps = range(SAVED_AT, STEPS)
                for step in steps:
                    _train(model, opt, [step], rank, g, dp)
                    if save is not None and step + 1 == SAVED_AT:
                        _save(opt, save, write=rank == 0)  # every rank gathers, rank 0 writes
                return _snapshot(model, opt), opt

            unsharded, u_opt = run(False)
            sharded, s_opt = run(True, save=out / "sharded" if dp == 2 else None)
            _assert_equal(sharded, unsharded, f"{precision}: DP={dp} sharded vs unsharded")
            # Optimizer state per rank: masters and moments of 1/DP of the (aligned) parameters.
            n, k = sum(p.numel() for p in u_opt.model_params), len(u_opt.model_params)
            whole = 4 * n * (3 if precision == "bf16" else 2)  # fp32 weights are their own masters
            assert (
                s_opt.memory_bytes() == 12 * s_opt.layout.shard_size <= 12 * ((n + k * ALIGN) // dp + ALIGN)
            )
            if dp == 2:
                # Resumed from its own checkpoint, and from the DP=1 run's.
                _assert_equal(run(True, load=out / "sharded")[0], sharded, f"{precision}: DP=2 resume")
                _assert_equal(
                    run(True, load=root / f"{precision}_dp1")[0], sharded, f"{precision}: DP=1 -> 2"
                )
            else:
                # The DP=2 run's sharded checkpoint, at another DP size: sharded as unsharded.
                dp2 = root / f"{precision}_dp2" / "sharded"
                _assert_equal(run(True, load=dp2)[0], run(False, load=dp2)[0], f"{precision}: DP=2 -> {dp}")
            if rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                save_tensors(out / "result.safetensors", sharded)
                write_json(out / "memory.json", {"sharded": s_opt.memory_bytes(), "unsharded": whole})
    except BaseException:
        errors.put((rank, traceback.format_exc()[-4000:]))
        raise
    finally:
        destroy()


def _spawn(world: int, root: Path) -> None:
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_dp_worker, args=(world, free_port(), str(root), errors), nprocs=world, join=True)
    except Exception as exc:
        reports = []
        while not errors.empty():
            rank, trace = errors.get()
            reports.append(f"--- rank {rank} ---\n{trace}")
        raise AssertionError(f"a rank of DP={world} failed:\n" + "\n".join(sorted(reports))) from exc


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_sharded_updates_and_checkpoints_are_bit_identical(world1, tmp_path):
    want = {p: _reference_dp1(tmp_path, p) for p in PRECISIONS}
    _spawn(2, tmp_path)
    _spawn(3, tmp_path)
    for precision in PRECISIONS:
        dp2 = tmp_path / f"{precision}_dp2"
        # DP=2 sharded == DP=1 on the same gradients (their mean), bit for bit.
        _assert_equal(load_tensors(dp2 / "result.safetensors"), want[precision], f"{precision}: DP=2 vs DP=1")
        # Masters and moments per rank: half of 12 bytes a weight, against 12 (bf16: separate
        # fp32 masters) or 8 (fp32: the weights are their own masters); up to alignment padding.
        memory = read_json(dp2 / "memory.json")
        expected = (12 / 2) / (12 if precision == "bf16" else 8)
        assert expected <= memory["sharded"] / memory["unsharded"] <= 1.1 * expected, memory
        # The sharded DP=2 checkpoint resumes exactly at DP=1, unsharded.
        model, opt = _model_and_optimizer(precision)
        assert isinstance(opt, MixedPrecisionAdamW)
        _load(opt, dp2 / "sharded")
        _train(model, opt, range(SAVED_AT, STEPS), 0, ranks_per_step=2)
        _assert_equal(_snapshot(model, opt), want[precision], f"{precision}: DP=2 -> DP=1 resume")
