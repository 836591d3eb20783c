"""Launch a worker script of ``tests/workers/`` under ``torch.distributed.run`` on loopback and
read what it prints as ``RESULT <json>`` (the last such line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from aligner.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_worker(script: str, *args: str, nproc: int = 2, timeout: float = 300) -> Any:
    """Run ``tests/workers/<script>`` on ``nproc`` processes (one thread each); fail with the end
    of its output when it fails or prints no result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "workers" / script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT ") :])
