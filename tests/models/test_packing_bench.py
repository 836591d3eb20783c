"""benchmarks/bench_packing.py runs end to end at a miniature shape and reports what it says it
does (its numbers are not checked: a shared machine's timings are not a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_the_packing_benchmark_runs():
    args = ["--rows", "6", "--min-len", "4", "--max-len", "40", "--budget", "64", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_packing.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    assert out["rows"] == 6 and out["budget_tokens"] == 64 and out["micro_batches"] >= 2
    assert out["real_tokens"] < out["padded_positions"]
    for key in ("infer_padded_tokens_per_s", "train_packed_tokens_per_s", "packed_micro_batch_max_mib"):
        assert out[key] > 0, key
    assert out["padded_rows_per_micro_batch"] == 2  # ceil(64 / 40)
