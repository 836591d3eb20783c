"""The fault suite's restart roll-back at TP=2 and DP=2: a real two-process actor (torchrun) against
a critic server killed mid-step (SIGKILL at a fault point) and started again on its folder must
roll both roles back to their newest common step and end with every tensor of both roles equal
to an uninterrupted run of the same layout, and its metrics equal row for row
(``tests/test_faults.py`` does the same for one process, at every fault point).

Each layout has its own uninterrupted reference (a run's numbers depend on its layout), both on
servers of the suite's settings (``_faults.SERVER_SETTINGS``). Four steps, both roles saving every
two: the kill falls in step 3, so steps 3 and 4 are redone from step 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _faults import (
    SAVE_INTERVAL,
    Critic,
    assert_same_weights,
    final_weights,
    kill_server_mid_run,
    rollbacks,
    run_actor,
    same_metrics,
)

from aligner.checkpoint import complete_steps, step_dir_name
from aligner.metrics import read_metrics

pytestmark = [pytest.mark.faults, pytest.mark.server, pytest.mark.subprocess, pytest.mark.multiprocess]

STEPS = 4
LAYOUTS = {
    # 16 rows a rank: each rank's minibatch is one micro-batch.
    "dp2": ("ppo.micro_batch_size=16",),
    "tp2": ("parallel.tensor_model_parallel_size=2",),
}
"""The actor's overrides per layout (besides the suite's ``ACTOR_RUN``), two processes each."""
FAULTS = {"dp2": "train@3", "tp2": "infer@3"}
"""Where each layout's server kills itself: after step 3's critic backward, before its optimizer
step (DP=2: both ranks' rows merged into one train); and while step 3's rollout is scored with
critic step 2 held (TP=2: rank 0 asks, the model-parallel group waits on its answer)."""


def _extra(layout: str) -> tuple[str, ...]:
    return (f"ppo.num_steps={STEPS}", "critic.on_restart=resume", *LAYOUTS[layout])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_server_killed_mid_step_rolls_a_two_process_actor_back_to_the_uninterrupted_run(
    layout, tmp_path: Path, capsys
):
    # The uninterrupted run of this layout.
    ref = Critic(tmp_path / "reference-server")
    ref.start()
    try:
        run_actor(ref.url, tmp_path / "reference", ref.ckpt, *_extra(layout), nproc=2, timeout_s=600)
    finally:
        ref.kill()
    kept = tmp_path / "reference-kept"
    shutil.copytree(ref.ckpt / step_dir_name(STEPS), kept / step_dir_name(STEPS))
    want = final_weights(kept, step=STEPS)
    want_metrics = read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))
    assert [r["step"] for r in want_metrics] == list(range(1, STEPS + 1))

    killed = tmp_path / "killed"
    critic, run, newest = kill_server_mid_run(killed, FAULTS[layout], *_extra(layout), nproc=2)
    assert run.returncode == 0, run.tail()
    assert newest == SAVE_INTERVAL
    (r,) = rollbacks(run.stdout)  # the logging rank prints it once (its log has the same line)
    assert r["to"] == r["server_step"] == SAVE_INTERVAL and r["first"] == SAVE_INTERVAL + 1, r
    assert complete_steps(critic.ckpt, role="actor") == list(range(SAVE_INTERVAL, STEPS + 1, SAVE_INTERVAL))
    assert_same_weights(final_weights(critic.ckpt, step=STEPS), want)
    same_metrics(read_metrics(str(killed / "actor" / "metrics.jsonl")), want_metrics)
    with capsys.disabled():
        print(
            f"\n[faults] {layout}: server killed at {FAULTS[layout]}, back with critic step "
            f"{r['server_step']}; rolled back to step {r['to']}, steps {r['first']}..{r['last']} redone; "
            f"final weights of both roles equal the uninterrupted {layout} run's; actor {run.wall_s:.0f} s"
        )
