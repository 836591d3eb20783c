"""benchmarks/bench_shapes.py --quick: one PPO run padded and one packed, each against a fresh
critic server; its JSON holds both sides, every phase, and the same first step on both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "logprobs", "critic_wait", "train", "refit", "step")


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.subprocess
def test_quick_run_reports_both_sides_and_every_phase(tmp_path):
    out = tmp_path / "shapes.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_shapes.py"), "--quick", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    shutil.rmtree(r["run_dir"], ignore_errors=True)  # the bench keeps its run dir (servers' and actors' logs)
    assert r["actor_budget_tokens"] > 0 and r["server_budget_tokens"] > 0
    for side in ("padded", "packed"):
        s = r[side]
        for phase in PHASES:
            assert s[f"{phase}_s"] >= 0, (side, phase)
        assert s["step_s"] > 0 and s["train_s"] > 0 and s["generate_s"] > 0
        assert s["train_tokens_per_s"] > 0 and s["critic_train_s"] > 0 and s["critic_infer_s"] > 0
        assert 8 * r["batch"] <= s["prompt_tokens"] <= 64 * r["batch"]
        assert 0 < s["response_tokens"] <= r["max_new_tokens"] * r["batch"]
    # The same seeds and the same initial policy: step 1 generates the same responses on both sides.
    assert r["step1_scores_equal"]
    assert r["padded"]["step1_response_length"] == r["packed"]["step1_response_length"]
