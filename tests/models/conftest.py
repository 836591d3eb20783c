"""Fixtures of the tests in tests/models: a world of one process (for the modules that ask for it)
and a tiny Llama saved as a HF folder (module-scoped)."""

from __future__ import annotations

import os

import pytest
import transformers
from _hf_convert import _hf_model, _save

from aligner import distributed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = _hf_model("llama")
    return model, _save(model, tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def one_process_world():
    """A single-process group with Megatron's parallel state, for one test module."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    transformers.logging.set_verbosity_error()
    distributed.initialize(distributed.ParallelConfig())
    yield
    distributed.destroy()
