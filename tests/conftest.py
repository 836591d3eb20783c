"""Shared test set-up: one thread per process (two-thread runs on two cores show 10-80x
outliers), and a project-local cache so PyTriton does not write into the home directory."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Each device a test can run on: the CPU everywhere, and CUDA as a test marked ``gpu``
    (skipped without one; ``pytest -m gpu`` runs only those)."""
    return torch.device(request.param)
