"""The critic at DP=2 with packed micro-batches against the same critic at DP=1 unpacked: two gloo
ranks in-process (no Triton). Each replica packs its own rows under the token budget and
accumulates their gradients, weighted within the replica, before the replicas' weighted sum:
the same values, scores, steps and weights, to float round-off."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_critic_packing import BUDGETS, CASES, _compare, _run

from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import TINY_MODEL, tiny_config
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_reward_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _config(root: Path, case: str, budget: int | None) -> dict:
    """The case's config; both runs share the checkpoint folder (the DP=2 run loads step 0)."""
    cfg = tiny_config(
        root / f"{case}_{budget}",
        optim={"lr": 1e-3, **CASES[case]},
        reward={"model_path": str(root / "rm")},
    )
    cfg["checkpoint"]["dir"] = str(root / case / "ckpt")
    cfg["precision"] = "fp32"
    cfg["max_tokens_per_micro_batch"] = budget
    return cfg


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    root = Path(root)
    try:
        state = initialize(ParallelConfig(), seed=1234)
        assert state.dp_size == 2
        for case in CASES:
            svc = CriticService(build_config(_config(root, case, BUDGETS["split"])), state)
            if rank != 0:
                svc.serve_peers()
                continue
            svc.load(0)  # the DP=1 run's initial critic
            want = json.loads((root / f"{case}.json").read_text())
            arrays = np.load(root / f"{case}.npz")
            want.update({k: arrays[k] for k in arrays.files if not k.startswith("weight_")})
            want["weights"] = [torch.from_numpy(arrays[f"weight_{i}"]) for i in range(want.pop("n_weights"))]
            got = _run(svc)
            _compare(got, want, f"{case} at DP=2, packed")
            svc.close()
    finally:
        destroy()


def test_dp2_packed_equals_dp1_unpacked(tmp_path):
    state = initialize(ParallelConfig(), seed=1234)
    try:
        cfg = ModelConfig(**TINY_MODEL)
        torch.manual_seed(0)
        save_model_checkpoint(build_reward_model(cfg), cfg, tmp_path / "rm", role="reward")
        for case in CASES:
            svc = CriticService(build_config(_config(tmp_path, case, None)), state)
            svc.save(0)
            got = _run(svc)
            weights = got.pop("weights")
            arrays = {k: v for k, v in got.items() if isinstance(v, np.ndarray)}
            arrays.update({f"weight_{i}": w.numpy() for i, w in enumerate(weights)})
            np.savez(tmp_path / f"{case}.npz", **arrays)
            rest = {k: v for k, v in got.items() if k not in arrays}
            (tmp_path / f"{case}.json").write_text(json.dumps({**rest, "n_weights": len(weights)}))
            svc.close()
    finally:
        destroy()
    # A rank that fails raises here with its traceback (torch.multiprocessing.spawn).
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
