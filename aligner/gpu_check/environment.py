"""Section a of the check: the machine and the software it runs (Python, torch and CUDA, the GPU,
the versions of the project's dependencies), and the device's measured bandwidth and matrix
throughput (:mod:`aligner.gpu_check.measure`)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch

from aligner.gpu_check.measure import GIB, copy_bandwidth, datasheet, matmul_throughput

__all__ = ["PACKAGES", "package_versions", "describe", "yardsticks"]

PACKAGES = (
    "torch",
    "megatron-core",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "datasets",
    "pyyaml",
    "tqdm",
    # Not needed by the check (it serves no critic): recorded to show which machine this is.
    "tritonclient",
    "nvidia-pytriton",
)
"""The distributions whose versions the report records (None: not installed)."""


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe(device: torch.device) -> dict[str, object]:
    """Python, torch, CUDA, the device and the package versions."""
    env: dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "packages": package_versions(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / GIB, 2),
            "multiprocessors": props.multi_processor_count,
            "count": torch.cuda.device_count(),
            "datasheet": datasheet(props.name),
        }
    return env


def yardsticks(device: torch.device, dtype: torch.dtype, reduced: bool) -> dict[str, object]:
    """The device's memory bandwidth and dense matrix-product throughput in ``dtype``: 2 GiB
    copies and 8192^3 products on a GPU (small ones in the reduced check)."""
    big = device.type == "cuda" and not reduced
    copy = copy_bandwidth(device, (2 << 30) if big else (32 << 20))
    mm = matmul_throughput(device, 8192 if big else 512, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 4 GiB of copies go back before the PPO run
    return {
        "copy_bandwidth_gb_s": round(copy["gb_s"], 1),
        "copy_bytes": copy["bytes"],
        "matmul_tflops": round(mm["tflops"], 3),
        "matmul_n": int(mm["n"]),
        "matmul_dtype": str(dtype).replace("torch.", ""),
    }
