"""Run under ``torchrun --nproc_per_node 2`` (two data-parallel ranks, TP=PP=1): our checkpoint
and an HF export of a policy, with rank 1 late to each, and the output folder checked on every
rank. The weight stream has no collective at TP=PP=1, so without a barrier the writer could
create the folder before rank 1 checks that it is free.

Prints ``RESULT <json>`` from global rank 0. Used by tests/test_distributed.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from aligner import distributed
from aligner.models import checkpoint_io, gpt, hf
from aligner.models.config import ModelConfig


def main(out: str) -> None:
    state = distributed.initialize(distributed.ParallelConfig(), seed=1)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, max_seq_len=16)
    model = gpt.build_policy(cfg)
    root = Path(out)
    errors = []
    for name, save in (
        (
            "checkpoint",
            lambda: checkpoint_io.save_model_checkpoint(model, cfg, root / "policy", role="policy"),
        ),
        ("hf", lambda: hf.export_hf(model, cfg, root / "hf", "llama")),
    ):
        if state.rank == 1:
            time.sleep(1.5)  # the writer is done with the stream long before
        try:
            save()
        except Exception as e:  # reported, not raised: the test names the rank and the error
            errors.append(f"{name}: {type(e).__name__}: {e}")
    gathered = [None] * state.world_size
    dist.all_gather_object(gathered, errors)
    if state.rank == 0:
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*.safetensors"))
        print("RESULT " + json.dumps({"errors": gathered, "files": files}), flush=True)
    distributed.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
