"""The examples' modules (examples/<example>/<name>.py), loaded by path for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(example: str, name: str):
    """``examples/<example>/<name>.py`` as a module of its own name (two examples share file names)."""
    key = f"_{example}_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / example / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
