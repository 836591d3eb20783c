"""Fixtures of the tests in tests/models: a tiny Llama saved as a HF folder (module-scoped)."""

from __future__ import annotations

import pytest
from _hf_convert import _hf_model, _save


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = _hf_model("llama")
    return model, _save(model, tmp_path_factory.mktemp("hf") / "llama")
