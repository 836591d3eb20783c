"""A rollout worker (``aligner.rollout.worker``'s entry point, the same arguments) made slow, or
lost, on purpose, for the dynamic schedule's and partial rollouts' tests
(tests/actor/test_rollout_dynamic.py):

- ``SLOW_BATCH_S``: seconds it sleeps before each batch it generates;
- ``SLOW_STEP_S``: seconds it sleeps before each decode step (a push then lands mid-batch);
- ``DIE_AT_BATCH=N``: it kills itself (SIGKILL) when it is asked for its N-th batch.
"""

from __future__ import annotations

import os
import signal
import time

from aligner.generation.steppers import LeanStepper
from aligner.rollout import worker

batch_s = float(os.environ.get("SLOW_BATCH_S", "0"))
step_s = float(os.environ.get("SLOW_STEP_S", "0"))
die_at = int(os.environ.get("DIE_AT_BATCH", "0"))
generate, decode_step = worker.RolloutWorker._generate, LeanStepper.__call__
batches = 0


def _generate(self, meta, tensors):
    global batches
    batches += 1
    if batches == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(batch_s)
    return generate(self, meta, tensors)


def _decode_step(self, tokens):
    time.sleep(step_s)
    return decode_step(self, tokens)


worker.RolloutWorker._generate = _generate
LeanStepper.__call__ = _decode_step

if __name__ == "__main__":
    worker.main()
