"""The device's own yardsticks, measured in the same run as the PPO figures they divide: memory
bandwidth (a large device-to-device copy) and dense matrix-product throughput (a large square
product in the compute dtype); the datasheet peaks of the GPUs we are lent, for a second opinion;
and the peak memory of each role's work (:class:`PeakMemory`).

On a CPU (the reduced check) the same measurements run at small sizes: the numbers then only
show that the code path works.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "sync",
    "copy_bandwidth",
    "matmul_throughput",
    "datasheet",
    "DATASHEETS",
    "PeakMemory",
    "GIB",
]

GIB = float(1 << 30)

DATASHEETS = {
    # name: (dense bf16 tensor TFLOP/s without sparsity, memory bandwidth TB/s), NVIDIA's datasheets
    "H100 SXM": (989.4, 3.35),
    "H100 PCIe": (756.0, 2.0),
    "H100 NVL": (835.0, 3.9),
    "H200": (989.4, 4.8),
}
"""Datasheet peaks of the GPUs a check may run on."""


def datasheet(device_name: str) -> dict[str, object] | None:
    """The datasheet entry for a ``torch.cuda.get_device_name()`` (None for other devices)."""
    name = device_name.upper()
    if "H200" in name:
        key = "H200"
    elif "H100" in name and "PCIE" in name:
        key = "H100 PCIe"
    elif "H100" in name and "NVL" in name:
        key = "H100 NVL"
    elif "H100" in name:
        key = "H100 SXM"
    else:
        return None
    tflops, tbs = DATASHEETS[key]
    return {"name": key, "bf16_dense_tflops": tflops, "memory_tb_s": tbs}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_seconds(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """The mean seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """Memory bandwidth from ``dst.copy_(src)`` of ``nbytes``, counting the bytes read and the
    bytes written (2 x ``nbytes`` per copy): the traffic a kernel that streams the weights once can
    reach."""
    n = nbytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _mean_seconds(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    return {"bytes": float(2 * n * 2), "seconds": seconds, "gb_s": 2 * n * 2 / seconds / 1e9}


def matmul_throughput(device: torch.device, n: int, dtype: torch.dtype) -> dict[str, float]:
    """Dense ``[n, n] @ [n, n]`` throughput in ``dtype`` on random data (2 n^3 FLOP a product)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    seconds = _mean_seconds(lambda: a @ b, device, warmup=3, repeats=10)
    return {"n": float(n), "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12}


class PeakMemory:
    """Peak allocated device memory, by role: ``with peaks.role("generation"): ...`` around each
    piece of a role's work; ``with peaks.step(): ...`` around a whole step (its peak counts every
    role inside it). Nothing is measured on a CPU (:attr:`available` is False)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda"
        self.peaks: dict[str, int] = {}
        """Role -> the highest ``torch.cuda.max_memory_allocated`` seen in it, in bytes."""
        self._running = 0  # the step's peak so far, before the last reset

    def _fold(self) -> int:
        """The peak since the last reset, folded into the running step peak."""
        peak = torch.cuda.max_memory_allocated(self.device)
        self._running = max(self._running, peak)
        return peak

    def allocated(self) -> int | None:
        """Bytes allocated now (None on a CPU)."""
        return torch.cuda.memory_allocated(self.device) if self.available else None

    @contextmanager
    def role(self, name: str) -> Iterator[None]:
        if not self.available:
            yield
            return
        self._fold()
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.peaks[name] = max(self.peaks.get(name, 0), self._fold())

    @contextmanager
    def step(self) -> Iterator[None]:
        if not self.available:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        self._running = 0
        try:
            yield
        finally:
            self._fold()
            self.peaks["step"] = max(self.peaks.get("step", 0), self._running)

    def gib(self) -> dict[str, float] | None:
        """The peaks in GiB, by role (None on a CPU)."""
        if not self.available:
            return None
        return {k: round(v / GIB, 3) for k, v in sorted(self.peaks.items())}
