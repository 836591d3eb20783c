"""The actor under pipeline parallelism: Megatron's pipeline schedule computes the same log-probs,
entropies, loss statistics and gradients as the unpipelined forward on the same weights
(``tests/workers/pp_schedule.py``, two processes over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_pipeline_schedule_equals_the_unpipelined_forward_and_backward():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "workers" / "pp_schedule.py"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, result in enumerate(json.loads(line[-1][len("RESULT ") :])):
        for case, d in result.items():
            where = f"rank {rank}, {case} embedding"
            # Every stage's log-probs and entropies are the last stage's, equal to PP=1's.
            assert d["logprobs"] < 1e-6 and d["entropy"] < 1e-6, where
            assert d["stat_keys_equal"] == 1.0 and d["stats"] < 1e-6, where
            # Each stage's gradients are PP=1's for its tensors (the tied embedding's copy on the
            # last stage included), and every one of them received some.
            assert d["grads"] < 1e-6 * max(1.0, d["grad_scale"]), where
            assert d["all_grads_nonzero"] == 1.0, where
            assert d["grad_tensors"] >= 7, where
