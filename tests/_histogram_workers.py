"""Worker of tests/test_step_metrics.py's two-rank check (spawned, so it lives in an importable
module): each rank holds its own values of different sizes; the distributions and histograms over
the gloo world must equal those of one process holding all of them."""

from __future__ import annotations

import json
import os

RANK_VALUES = ([0.5, -1.0, 2.0, 7.0], [3.0, 3.0])
"""Rank r's values (the second rank has fewer, and none of them masked out)."""
RANK_MASKS = ([1.0, 1.0, 0.0, 1.0], [1.0, 1.0])


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from aligner.histograms import distributions

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.tensor(RANK_VALUES[rank])
        named = {"v": (x, torch.tensor(RANK_MASKS[rank])), "all": (x, None), "none": (x[:0], None)}
        scalars, hists = distributions(named, dist.group.WORLD, bins=4)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"scalars": scalars, "hists": {k: vars(h) for k, h in hists.items()}}, f)
    finally:
        dist.destroy_process_group()
