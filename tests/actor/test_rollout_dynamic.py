"""The dynamic schedule (``rollout.schedule=dynamic``) and partial rollouts (``rollout.partial``)
with real worker processes, made slow or lost on purpose (tests/workers/slow_rollout.py):

- two workers, one slow (half a second a decode step), at k = 1, with partial rollouts (without
  them each push would wait for the slow worker's batch): a step takes the first whole batch
  back (out of the order they were drawn in), never one more than k versions old; the batch that
  came back past the bound after a resume is dropped and asked again, as is what a worker lost
  mid-run owed (``rollout/regenerated``); across the resume and the loss no batch is used twice;
- a worker of two tensor-parallel processes, each decode step slowed, takes the versions pushed
  while it generates at token boundaries: batches of two versions, their tokens after the swap
  less stale than the batch (``rollout/token_staleness``); both processes end cleanly.

(tests/actor/test_rollout_workers.py: on one worker the dynamic schedule is the fixed one.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _toy_critic import ToyCritic
from _worker_runs import run_actor

from aligner.distributed import destroy

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

SLOW = ("tests/workers/slow_rollout.py",)
DYNAMIC = ["rollout.schedule=dynamic", "rollout.partial=true", "rollout.on_worker_loss=continue"]


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


def test_steps_take_the_first_batch_back_within_the_bound_and_none_twice_across_a_resume_and_a_loss(
    tmp_path: Path,
):
    root, critic = tmp_path / "run", ToyCritic()
    slow = {2: {"SLOW_STEP_S": "0.5"}}
    entry = (str(Path(__file__).resolve().parents[1] / "workers" / "slow_rollout.py"),)
    first, codes = run_actor(
        root, 2, workers=2, k=1, extra=DYNAMIC, critic=critic, worker_env=slow, worker_entry=entry
    )
    assert codes == [0, 0]
    # step 1: ask 1 (worker 1); step 2: ask 3 (worker 1) is back before ask 2 (worker 2, slow,
    # which took version 1 mid-batch: the push did not wait for its batch)
    assert [r["rollout/ask"] for r in first] == [1, 3]
    # the checkpoint of step 2 keeps ask 2 (version 0): past the bound at step 3, dropped and
    # asked again; worker 2, asked for ask 4 first (the fixed order breaks the tie), is lost there
    lost = {2: {"DIE_AT_BATCH": "1"}}
    rows, codes = run_actor(
        root,
        4,
        workers=2,
        k=1,
        extra=DYNAMIC,
        critic=critic,
        worker_env=lost,
        worker_entry=entry,
        resume=True,
    )
    assert codes[0] == 0 and codes[1] != 0
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    asks = [int(r["rollout/ask"]) for r in rows]
    assert len(set(asks)) == 4 and set(asks) <= set(range(1, 6)), asks  # asks 1..5 drawn, none twice
    assert all(r["rollout/staleness"] <= 1 for r in rows)
    assert sum(r["rollout/regenerated"] for r in rows[2:]) >= 2  # ask 2 past the bound, ask 4 lost
    assert rows[-1]["rollout/workers"] == 1.0


def test_a_tensor_parallel_worker_takes_versions_pushed_mid_batch_at_token_boundaries(tmp_path: Path):
    entry = (str(Path(__file__).resolve().parents[1] / "workers" / "slow_rollout.py"),)
    extra = ["rollout.schedule=dynamic", "rollout.partial=true"]
    rows, codes = run_actor(
        tmp_path,
        4,
        workers=1,
        k=1,
        extra=extra,
        worker_tp=2,
        worker_env={1: {"SLOW_STEP_S": "0.4"}},
        worker_entry=entry,
    )
    assert codes == [0]
    assert all(r["rollout/staleness"] <= 1 for r in rows)
    swapped = [r for r in rows if r["rollout/swaps"] > 0]
    assert swapped, [(r["step"], r["rollout/swaps"]) for r in rows]
    for r in swapped:  # the tokens after a swap are from a newer version
        assert r["rollout/token_staleness"] < r["rollout/staleness"]
        assert 0 < r["rollout/swapped_token_frac"] < 1
    log = (tmp_path / "workers" / "worker1.log").read_text()
    assert "stopped by the trainer" in log
