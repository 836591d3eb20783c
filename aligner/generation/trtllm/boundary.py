"""The boundary with the ``tensorrt_llm`` package: the release this engine targets, the import of its
LLM API (only when an engine is built, never when a module of this package is imported) and the
error that says where to get it.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = [
    "TRTLLM_VERSION",
    "TRTLLM_IMAGE",
    "TrtllmUnavailableError",
    "LlmApi",
    "load_llm_api",
    "missing_package_message",
]

TRTLLM_VERSION = "1.2.1"
"""The TensorRT-LLM release this package is written against (see the package docstring)."""
TRTLLM_IMAGE = f"nvcr.io/nvidia/tensorrt-llm/release:{TRTLLM_VERSION}"
"""NVIDIA's container with that release; ``Dockerfile.trtllm`` builds on it."""


class TrtllmUnavailableError(ImportError):
    """TensorRT-LLM cannot be used here: not installed, or another release line."""


class LlmApi(NamedTuple):
    """The three classes of TensorRT-LLM's LLM API the engine uses."""

    LLM: Any
    """``tensorrt_llm.LLM`` (the PyTorch backend)."""
    SamplingParams: Any
    """``tensorrt_llm.llmapi.SamplingParams``."""
    KvCacheConfig: Any
    """``tensorrt_llm.llmapi.KvCacheConfig``."""


def missing_package_message(cause: BaseException | str) -> str:
    """What to tell a user whose ``import tensorrt_llm`` failed with ``cause``."""
    return (
        f"generation.engine=trtllm needs TensorRT-LLM {TRTLLM_VERSION} (the tensorrt_llm package), which "
        f"cannot be imported here ({cause}). TensorRT-LLM installs only on Linux with CUDA and Python "
        "3.10 or 3.12 (its PyPI entry is a stub that fetches the real wheel from NVIDIA's own index); "
        f"run the actor in NVIDIA's TensorRT-LLM container instead: `docker build -f Dockerfile.trtllm "
        f"-t aligner:trtllm .` builds this project on {TRTLLM_IMAGE} (docs/trtllm.md). Or set "
        "generation.engine=native."
    )


def _release_line(version: str) -> tuple[int, int] | None:
    """``"1.2.1"`` / ``"1.2.0rc6"`` -> ``(1, 2)``; None when it does not start with two numbers."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = ""
    for ch in parts[1]:
        if not ch.isdigit():
            break
        minor += ch
    return (int(parts[0]), int(minor)) if minor else None


def load_llm_api() -> LlmApi:
    """Import TensorRT-LLM's LLM API (the default ``llm_factory``), or raise
    :class:`TrtllmUnavailableError` saying what is missing and where to get it."""
    # The Ray orchestrator runs without MPI; TensorRT-LLM's own Ray tests set this before
    # importing the package (tests/unittest/_torch/ray_orchestrator/conftest.py).
    os.environ.setdefault("TLLM_DISABLE_MPI", "1")
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import KvCacheConfig
        from tensorrt_llm.llmapi import SamplingParams as TrtSamplingParams
    except (ImportError, OSError) as e:
        raise TrtllmUnavailableError(missing_package_message(e)) from e
    version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    if _release_line(version) != _release_line(TRTLLM_VERSION):
        raise TrtllmUnavailableError(
            f"tensorrt_llm {version} is installed, but this engine is written against the "
            f"{TRTLLM_VERSION} release line (1.2.x: enable_sleep, its memory tags, the Ray worker "
            f"extension); use {TRTLLM_IMAGE} (Dockerfile.trtllm) or set generation.engine=native"
        )
    return LlmApi(LLM, TrtSamplingParams, KvCacheConfig)
