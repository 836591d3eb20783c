"""The actor with ``optim.use_distributed_optimizer`` (ZeRO-1) through its entry point, at DP=2:
the run is the unsharded run's bit for bit (weights, optimizer state, every metric), it resumes
exactly after a kill in the middle of a save, and its checkpoint goes on at DP=1 without the
option. tests/actor/test_actor_resume.py's helpers run the actor.

The runs are critic-free (GRPO): with a critic, two identical unsharded DP=2 runs on one server
were seen to differ from step 2 on (the critic's values, not the policy's optimizer), which
would hide what is compared here."""

from __future__ import annotations

import pytest
import torch
from test_actor_resume import _env, _run, _same_run, server  # noqa: F401 (server: the module's critic)

from aligner.checkpoint import complete_steps, load_tensors
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.server, pytest.mark.subprocess, pytest.mark.slow, pytest.mark.multiprocess]
SHARDED = "optim.use_distributed_optimizer=true"
GRPO = ["ppo.advantage=grpo", "ppo.samples_per_prompt=8", "ppo.micro_batch_size=16"]


def test_a_sharded_run_is_the_unsharded_run_and_resumes_at_any_dp_size(server, tmp_path):  # noqa: F811
    args = [*GRPO, "ppo.num_steps=4", "checkpoint.save_interval=2"]
    _run(server, tmp_path / "unsharded", *args, nproc=2)
    _run(server, tmp_path / "sharded", *args, SHARDED, nproc=2)
    _same_run(tmp_path / "unsharded", tmp_path / "sharded", steps=4)
    # Bit for bit: the policy, the optimizer file (whole tensors, gathered from the slices) and
    # every training metric.
    step = "checkpoints/step_00000004/actor"
    for name in ("policy/model.safetensors", "optim_tp00_pp00.safetensors"):
        a, b = (
            load_tensors(tmp_path / "unsharded" / step / name),
            load_tensors(tmp_path / "sharded" / step / name),
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for x, y in zip(*(read_metrics(str(tmp_path / r / "metrics.jsonl")) for r in ("unsharded", "sharded"))):
        costs = ("timers/", "refit/", "time", "throughput/", "perf/")
        assert {k: v for k, v in x.items() if not k.startswith(costs)} == {
            k: v for k, v in y.items() if not k.startswith(costs)
        }
    # Killed while the ranks write step 4: resumes from step 2, sharded, and ends as the run.
    run_dir = tmp_path / "run"
    out = _run(
        server, run_dir, *args, SHARDED, env=_env(ALIGNER_FAULT_AT="mid_actor_write@4"), ok=False, nproc=2
    )
    assert out.returncode != 0 and complete_steps(run_dir / "checkpoints", role="actor")[-1] == 2
    out = _run(server, run_dir, *args, SHARDED, nproc=2)
    assert "resuming from step 2" in out.stdout, out.stdout[-2000:]
    _same_run(tmp_path / "sharded", run_dir, steps=4)
    # The sharded DP=2 checkpoint goes on at DP=1, unsharded.
    out = _run(server, run_dir, *GRPO, "ppo.num_steps=5")
    assert "resuming from step 4" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert read_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] == 5
