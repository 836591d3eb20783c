"""A rollout worker (``aligner.rollout.worker``'s entry point, the same arguments) whose
TensorRT-LLM is the test double of tests/_trtllm_fakes.py (TensorRT-LLM needs a GPU and does not
install here), for tests/actor/test_rollout_trtllm.py. At exit it prints what the double took:
``TRTLLM refits=<n> weights=<n tensors>``.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _trtllm_fakes import API, UUID, FakeLLM  # noqa: E402

from aligner.generation.trtllm import engine as trtllm_engine  # noqa: E402
from aligner.rollout import worker  # noqa: E402

trtllm_engine.local_device_uuid = lambda: UUID
trtllm_engine.load_llm_api = lambda: API


@atexit.register
def _report() -> None:
    for llm in FakeLLM.instances:
        refits = sum(1 for event, _ in llm.events if event == "update_weights")
        print(f"TRTLLM refits={refits} weights={len(llm.weights)}", flush=True)


if __name__ == "__main__":
    worker.main()
