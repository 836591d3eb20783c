"""The critic server's distributed optimizer (``optim.use_distributed_optimizer``): the replicas
shard the bf16 critic's fp32 masters and Adam moments, and nothing else changes.

Two gloo ranks in-process (no Triton), TP=1 x DP=2, then TP=2 x DP=2 on four: from the same
DP=1 checkpoint (with Adam moments), the sharded server's train results and values equal the
unsharded server's bit for bit over steps of several clipped minibatches, it resumes its own
checkpoint exactly, and its checkpoint files are the unsharded server's, tensor for tensor, so
they load at DP=1 (and the DP=1 checkpoint loaded at DP=2 above).
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from aligner.checkpoint import load_tensors, read_json, shard_file
from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.precision import MixedPrecisionAdamW, ShardedAdamW, master_state_dict
from aligner.tokenizers import build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOK = build_tokenizer("char")
MODES = ("unsharded", "sharded")


def _config(root: Path, mode: str, tp: int = 1) -> dict:
    cfg = tiny_config(
        root / f"{mode}_tp{tp}",
        optim={
            "num_minibatches": 2,
            "epochs": 2,
            "grad_clip": 0.05,  # every step clips
            "weight_decay": 0.01,
            "use_distributed_optimizer": mode == "sharded",
        },
        parallel={"tensor_model_parallel_size": tp},
    )
    cfg["precision"] = "bf16"  # the masters are separate fp32 tensors: what is sharded
    return cfg


def _batch(step: int):
    """(tokens, lengths, prompt_lengths, returns, old_values, mask) of ``step``: 6 rows."""
    tokens, lengths, pl, *_ = digit_batch(TOK, 6, seed=step, pad_to=12)
    return (tokens, lengths, pl, *train_arrays(lengths, pl, tokens.shape[1], seed=step))


def _train(svc: CriticService, step: int) -> dict:
    tokens, lengths, _, returns, old_values, mask = _batch(step)
    out = svc.train(tokens, lengths, returns, old_values, mask, step).to_dict()
    del out["train_ms"]  # a timing: the rest is compared bit for bit
    return out


def _values(svc: CriticService) -> np.ndarray:
    tokens, lengths, pl, *_ = _batch(99)
    return svc.infer(tokens, lengths, pl).values


def _step_files(root: Path, mode: str, tp: int, step: int) -> dict[str, torch.Tensor]:
    d = root / f"{mode}_tp{tp}" / "ckpt" / f"step_{step:08d}" / "critic"
    out = {}
    for kind in ("model", "optim"):
        for r in range(tp):
            out.update({f"{kind}{r}.{k}": v for k, v in load_tensors(d / shard_file(kind, tp=r)).items()})
    return out


def _worker(rank: int, world: int, tp: int, port: int, root: str, errors) -> None:
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
        state = initialize(ParallelConfig(tensor_model_parallel_size=tp), seed=1234)
        assert (state.tp_size, state.dp_size) == (tp, 2)
        got = {}
        for mode in MODES:
            svc = CriticService(build_config(_config(root, mode, tp)), state)
            assert isinstance(svc.optimizer, ShardedAdamW if mode == "sharded" else MixedPrecisionAdamW)
            if rank != 0:
                svc.serve_peers()
                continue
            svc.load(1)  # the DP=1 run's step 1, moments included
            run = {"step2": _train(svc, 2)}
            svc.save(2)
            run["step3"] = _train(svc, 3)
            run["values3"] = _values(svc).tolist()
            svc.save(3)
            if mode == "sharded":  # its own checkpoint, at the same DP size
                svc.load(2)
                assert _train(svc, 3) == run["step3"]
                assert _values(svc).tolist() == run["values3"]
            svc.close()
            got[mode] = run
        if rank == 0:
            assert got["sharded"] == got["unsharded"]  # bit for bit: train results and values
            (root / f"dp2_tp{tp}.json").write_text(json.dumps(got["sharded"]))
    except BaseException:
        errors.put((rank, traceback.format_exc()[-4000:]))
        raise
    finally:
        destroy()


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_critic_equals_unsharded_and_its_checkpoints_are_the_same(tmp_path, tp):
    if tp == 1:
        state = initialize(ParallelConfig(), seed=1234)
        try:
            svc = CriticService(build_config(_config(tmp_path, "unsharded")), state)
            svc.save(0)
            _train(svc, 1)
            svc.save(1)
            svc.close()
        finally:
            destroy()
        shutil.copytree(tmp_path / "unsharded_tp1" / "ckpt", tmp_path / "sharded_tp1" / "ckpt")
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        if tp == 2:
            mp.spawn(_tp2_step1, args=(free_port(), str(tmp_path), errors), nprocs=2, join=True)
        mp.spawn(_worker, args=(2 * tp, tp, free_port(), str(tmp_path), errors), nprocs=2 * tp, join=True)
    except Exception as exc:
        reports = []
        while not errors.empty():
            rank, trace = errors.get()
            reports.append(f"--- rank {rank} ---\n{trace}")
        raise AssertionError("a rank failed:\n" + "\n".join(sorted(reports))) from exc
    for step in (2, 3):
        want = _step_files(tmp_path, "unsharded", tp, step)
        got = _step_files(tmp_path, "sharded", tp, step)
        assert sorted(got) == sorted(want)
        assert [k for k in want if not torch.equal(got[k], want[k])] == []
        meta = [
            read_json(tmp_path / f"{m}_tp{tp}" / "ckpt" / f"step_{step:08d}" / "critic" / "meta.json")
            for m in MODES
        ]
        for m in meta:  # in the order torch's state happens to hold them (after a load: by name)
            m["optimizer"]["adam"]["param_ids"].sort(key=int)
        assert meta[0]["optimizer"] == meta[1]["optimizer"]
    if tp == 1:
        # The sharded DP=2 checkpoint at DP=1: it loads (its fp32 weights become the masters,
        # its moments the moments) and trains on.
        state = initialize(ParallelConfig(), seed=1234)
        try:
            svc = CriticService(build_config(_config(tmp_path, "sharded")), state)
            svc.load(3)
            saved = _step_files(tmp_path, "sharded", 1, 3)
            held, _ = svc.optimizer.state_tensors()
            assert all(torch.equal(v, saved[f"optim0.{k}"]) for k, v in held.items())
            model = master_state_dict(svc.critic, svc.optimizer)
            assert all(torch.equal(v, saved[f"model0.{k}"]) for k, v in model.items())
            assert _train(svc, 4)["applied_step"] == 4
            svc.close()
        finally:
            destroy()


def _tp2_step1(rank: int, port: int, root: str, errors) -> None:
    """TP=2 at DP=1: step 0 and step 1 saved, copied for both modes' servers."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    root = Path(root)
    try:
        state = initialize(ParallelConfig(tensor_model_parallel_size=2), seed=1234)
        svc = CriticService(build_config(_config(root, "unsharded", 2)), state)
        if rank != 0:
            svc.serve_peers()
            return
        svc.save(0)
        _train(svc, 1)
        svc.save(1)
        svc.close()
        shutil.copytree(root / "unsharded_tp2" / "ckpt", root / "sharded_tp2" / "ckpt")
    except BaseException:
        errors.put((rank, traceback.format_exc()[-4000:]))
        raise
    finally:
        destroy()
