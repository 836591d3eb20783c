"""Two-process launches with torchrun on CPU (gloo): TP=2, PP=2 and DP=2 each build a policy
and run forward + backward through Megatron's pipeline schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tp: int, pp: int) -> list[dict]:
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
        str(ROOT / "tests" / "workers" / "dist_check.py"),
        str(tp),
        str(pp),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT ") :])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tp,pp,expect",
    [
        (2, 1, {"tp": [[0, 2], [1, 2]], "pp": [[0, 1], [0, 1]], "dp": [[0, 1], [0, 1]]}),
        (1, 2, {"tp": [[0, 1], [0, 1]], "pp": [[0, 2], [1, 2]], "dp": [[0, 1], [0, 1]]}),
        (1, 1, {"tp": [[0, 1], [0, 1]], "pp": [[0, 1], [0, 1]], "dp": [[0, 2], [1, 2]]}),
    ],
    ids=["tp2", "pp2", "dp2"],
)
def test_two_process_layouts(tp, pp, expect):
    results = sorted(_torchrun(tp, pp), key=lambda r: r["rank"])
    assert [r["world"] for r in results] == [2, 2]
    for key in ("tp", "pp", "dp"):
        assert [r[key] for r in results] == expect[key]
    assert all(r["device"] == "cpu" for r in results)
    # Every rank holds parameters that received gradients through the schedule.
    assert all(r["has_grads"] for r in results)
    if pp == 2:
        assert results[0]["loss"] is None and results[1]["loss"] is not None  # loss on the last stage
    if tp == 1 and pp == 1:
        assert results[0]["loss"] == results[1]["loss"]  # same data, same weights on both DP ranks


def test_invalid_parallel_config_names_field():
    from aligner.distributed import ParallelConfig

    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        ParallelConfig(backend="mpi")
