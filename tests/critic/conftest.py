"""Fixtures of the tests in tests/critic: the one-process parallel state (module-scoped)."""

from __future__ import annotations

import pytest

from aligner.distributed import ParallelConfig, destroy, initialize


@pytest.fixture(scope="module")
def pstate():
    state = initialize(ParallelConfig(), seed=1234)
    yield state
    destroy()
