"""A rollout worker whose engine is TensorRT-LLM (``generation.engine=trtllm`` on the workers),
through the TensorRT-LLM test double (tests/_trtllm_fakes.py: TensorRT-LLM needs a GPU and does
not install here; its documented API, written down, with a seeded stream per request for a
model), in the worker process (tests/workers/trtllm_rollout.py) and the trainer's own engine.

At k = 0 the worker's run is the run that generates with the same engine in process, every
number and weight: the same requests (each rank's rows seeded by the trainer rank's, as in
process), the same outputs through the rollout channels; the double took one refit per version
pushed, of every tensor. Partial rollouts need the native engine, and say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _trtllm_fakes import API, UUID
from _worker_runs import policy_weights, run_actor, same_rows, same_weights

from aligner.actor.config import ActorConfig
from aligner.distributed import destroy
from aligner.generation.trtllm import engine as trtllm_engine

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

TRTLLM = ["generation.engine=trtllm"]


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


@pytest.fixture(autouse=True)
def _double(monkeypatch):
    """The trainer's own engine (validation) is the double too."""
    monkeypatch.setattr(trtllm_engine, "local_device_uuid", lambda: UUID)
    monkeypatch.setattr(trtllm_engine, "load_llm_api", lambda: API)


def test_k0_on_a_tensorrt_llm_worker_is_the_in_process_tensorrt_llm_run(tmp_path: Path):
    ours, _ = run_actor(tmp_path / "in-process", 3, extra=TRTLLM)
    entry = (str(Path(__file__).resolve().parents[1] / "workers" / "trtllm_rollout.py"),)
    theirs, codes = run_actor(tmp_path / "worker", 3, workers=1, k=0, extra=TRTLLM, worker_entry=entry)
    assert codes == [0]
    same_rows(ours, theirs)
    same_weights(policy_weights(tmp_path / "in-process", 2), policy_weights(tmp_path / "worker", 2))
    log = (tmp_path / "worker" / "workers" / "worker1.log").read_text()
    refits = [line for line in log.splitlines() if line.startswith("TRTLLM ")]
    assert len(refits) == 1 and "refits=3 " in refits[0], log[-2000:]  # versions 0, 1, 2
    assert int(refits[0].split("weights=")[1]) > 0


def test_partial_rollouts_need_the_native_engine():
    cfg = ActorConfig()
    cfg.rollout.workers, cfg.rollout.schedule, cfg.rollout.partial = 1, "dynamic", True
    cfg.generation.engine = "trtllm"
    problems = cfg.rollout_problems()
    assert any(
        m.startswith("rollout.partial=True: expected false with generation.engine='trtllm'") for m in problems
    )
    cfg.generation.engine = "native"
    assert not cfg.rollout_problems()
