"""Shared test set-up: one thread per process (two-thread runs on two cores show 10-80x
outliers), a project-local cache so PyTriton does not write into the home directory, and a
check that no process a test module started outlives it (tests/_leftovers.py)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import _leftovers  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# multiprocessing's resource tracker lives as long as this process, by design: started here, before
# any module's mark is set, it carries none and is never taken for a module's leftover.
if os.name == "posix":
    import multiprocessing.resource_tracker  # noqa: E402

    multiprocessing.resource_tracker.ensure_running()


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


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module(request):
    """Every process this module starts carries its mark; once the module's own fixtures are torn
    down (this one, set up first, is torn down last) none may be left: they are killed, and the
    module's last test errors naming them."""
    mark = _leftovers.new_mark(request.module.__name__)
    before = os.environ.get(_leftovers.MARK)
    os.environ[_leftovers.MARK] = mark
    yield
    if before is None:
        os.environ.pop(_leftovers.MARK, None)
    else:
        os.environ[_leftovers.MARK] = before
    if "wandb" in sys.modules:
        # W&B keeps one service process (wandb-core) per client process until that exits: a module
        # that ran W&B stops it here, so the next module's runs start a fresh one.
        sys.modules["wandb"].teardown()
    left = _leftovers.reap(mark)
    if left:
        pytest.fail(
            f"{len(left)} process(es) started by {request.module.__name__} outlived it (killed now): "
            + "; ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items())),
            pytrace=False,
        )
