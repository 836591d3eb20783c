"""How much work the critic server takes on: the queue Triton keeps per model, and the memory
budget checked before each execution's work (``server.max_queue_size``,
``server.memory_budget_gb``).

Queue. With the dynamic batcher (``server.dynamic_batching``, the default) critic_infer's queue
holds at most ``max_queue_size`` requests: Triton refuses the next one itself, before anything
is copied to the Python side, with the gRPC status UNAVAILABLE and the text "Exceeds maximum
queue size", which :func:`aligner.wire.transport.classify` reads as ``overloaded`` (retried with
backoff until the client's deadline, without using up its retries). Triton applies a queue
policy only to a model with a dynamic batcher: critic_infer with ``dynamic_batching=false``, and
critic_train, critic_save, critic_load and server_info (never batched: their inputs have no
batch dimension) have Triton's unbounded queue; they run one at a time, and the memory budget
bounds what their work may add.

Memory budget. Before an execution's work the server measures the memory of its process tree
(itself, Triton and Triton's backend stubs: the proportional set size of each, so shared memory
is counted once) and refuses the execution, changing nothing, when that plus an estimate of the
work would pass the budget: :class:`~aligner.critic.errors.OverloadedError`, marked
:data:`~aligner.wire.protocol.OVERLOADED_MARK`, naming the budget, the memory in use and the
estimate; the client backs off and resends, as for a full queue. A train refused so is not
applied, and its resend is applied once (exactly once by step id). server_info is never refused
(probes and readiness checks need it). Under torchrun only rank 0's tree is measured (the other
ranks hold their shards of the same model); leave them their headroom.

Memory returned. The CPU allocator is tuned to keep freed memory (:mod:`aligner.cpu_memory`);
after a refused execution, or one whose inputs were large, the server hands free heap memory
back to the operating system (glibc's ``malloc_trim``). What Triton keeps (its request buffers,
the Python backend's shared memory region, which grows to the largest request it copied and
never shrinks) is outside the server's reach: the budget counts it, and a queue bound keeps it
from growing with the number of requests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from aligner.critic.errors import OverloadedError

__all__ = [
    "ServerCapacity",
    "MemoryBudget",
    "memory_limit_bytes",
    "tree_memory_bytes",
    "request_bytes",
    "release_free_memory",
    "work_factors",
    "AUTO_BUDGET_FRACTION",
    "TRIM_AFTER_BYTES",
]

log = logging.getLogger("aligner.critic")

GIB = 1 << 30
AUTO_BUDGET_FRACTION = 0.9
"""The share of the container's memory limit the budget is by default (``memory_budget_gb`` null)."""
TRIM_AFTER_BYTES = 64 << 20
"""Free heap memory is handed back after an execution whose inputs were at least this large."""


@dataclass
class ServerCapacity:
    """The ``server`` settings that bound the work the server takes on (:mod:`aligner.critic.budget`)."""

    max_queue_size: int = 64
    """Most critic_infer requests Triton queues (with the dynamic batcher); the next one is
    refused at once, and the client backs off and resends it. 0: unbounded. Without the dynamic
    batcher (``dynamic_batching=false``), and for the other models, Triton's queue is unbounded
    (it has no queue policy for them); the memory budget still applies."""
    memory_budget_gb: float | None = None
    """Most memory (GiB) the server's process tree (the server, Triton and its backend stubs)
    may use with an execution's work: over it, the work is refused with a retryable error that
    names the budget, the memory in use and the request's estimate, and nothing changes. null:
    90% of the container's memory limit (cgroup) when it has one (Kubernetes: the pod's
    ``limits.memory``), so work is refused before the kernel kills the server; none when there
    is no limit. 0: no budget."""

    def capacity_problems(self) -> list[str]:
        """Every value out of range, named by its key."""
        e = []
        q = self.max_queue_size
        if not isinstance(q, int) or q < 0:
            e.append(f"server.max_queue_size={q!r}: expected an integer >= 0 (0: unbounded)")
        m = self.memory_budget_gb
        if m is not None and (not isinstance(m, (int, float)) or m < 0):
            e.append(
                f"server.memory_budget_gb={m!r}: expected GiB >= 0 (0: no budget), or null "
                f"({AUTO_BUDGET_FRACTION:.0%} of the container's memory limit, if it has one)"
            )
        return e


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


def memory_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None when there is none (or it cannot be read)."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # "max", or v1's huge "no limit"
            return int(text)
        return None
    return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return kids


def _process_bytes(pid: int) -> int:
    """One process's proportional set size (``smaps_rollup``), else its resident set size."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tree_memory_bytes(root: int | None = None) -> int:
    """The memory of ``root`` (default: this process) and all its descendants (Linux ``/proc``;
    0 where it cannot be read): each one's proportional set size, so pages they share (Triton's
    shared memory with its stubs) count once."""
    root = os.getpid() if root is None else root
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _process_bytes(pid)
        todo += _children(pid)
    return total


def request_bytes(requests: Any) -> int:
    """The bytes of the inputs of one execution's requests (PyTriton's requests or dicts)."""
    total = 0
    for r in requests:
        for name in r.keys():
            a = r[name]
            if isinstance(a, np.ndarray) and a.dtype == np.object_:
                total += 8 * a.size + sum(len(x) for x in a.ravel() if isinstance(x, (bytes, str)))
            else:
                total += int(getattr(a, "nbytes", 0))
    return total


_trim_lock = threading.Lock()
_malloc_trim: Any = None


def release_free_memory() -> bool:
    """Hand the heap's free memory back to the operating system (glibc ``malloc_trim(0)``; torch's
    CPU tensors come from malloc); False where there is no such call."""
    global _malloc_trim
    with _trim_lock:
        if _malloc_trim is None:
            try:
                fn = ctypes.CDLL("libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _malloc_trim = fn
            except (OSError, AttributeError):
                _malloc_trim = False
        if not _malloc_trim:
            return False
        _malloc_trim(0)
        return True


# ----------------------------------------------------------------------------------------------
# The budget
# ----------------------------------------------------------------------------------------------


class MemoryBudget:
    """Refuses an execution's work when the server's process tree and the work would pass the
    budget (:meth:`admit`), and hands free memory back after refused or large ones (:meth:`done`).

    Args:
        budget_gb: ``server.memory_budget_gb`` (null: :data:`AUTO_BUDGET_FRACTION` of the
            container's limit, if any; 0: none).
        work_factor: the work's estimated memory per byte of a request's inputs, by model (the
            inputs themselves, the copies decoding makes, the activations of the forward and, for
            a train, the backward); models not named: 1.
        measure: the memory in use (default: :func:`tree_memory_bytes` of this process).
    """

    def __init__(
        self,
        budget_gb: float | None,
        work_factor: dict[str, float] | None = None,
        measure: Any = None,
    ) -> None:
        if budget_gb is None:
            limit = memory_limit_bytes()
            self.budget = None if limit is None else int(AUTO_BUDGET_FRACTION * limit)
        else:
            self.budget = int(budget_gb * GIB) if budget_gb > 0 else None
        self.work_factor = dict(work_factor or {})
        self.measure = measure or tree_memory_bytes
        self.refused = 0
        """Executions refused for memory since start-up."""

    def describe(self) -> str:
        return "off" if self.budget is None else f"{self.budget / GIB:.2f} GiB"

    def stats(self) -> dict[str, int | None]:
        """The budget (None: off), the memory the server's processes use now, and the executions
        refused for memory since start-up (``server_info``'s ``extra.capacity``)."""
        return {
            "memory_budget_bytes": self.budget,
            "memory_used_bytes": self.measure(),
            "refused_for_memory": self.refused,
        }

    def estimate(self, model: str, nbytes: int) -> int:
        """The memory an execution's work is estimated to add: its inputs' ``nbytes``
        (:func:`request_bytes`) x the model's factor."""
        return int(nbytes * self.work_factor.get(model, 1.0))

    def admit(self, model: str, nbytes: int) -> None:
        """Raise :class:`~aligner.critic.errors.OverloadedError` (nothing run) when the memory in
        use and the estimate of an execution whose inputs are ``nbytes`` pass the budget; free
        heap memory is handed back and measured again before refusing."""
        if self.budget is None:
            return
        need = self.estimate(model, nbytes)
        used = self.measure()
        if used + need > self.budget:
            release_free_memory()
            used = self.measure()
        if used + need > self.budget:
            self.refused += 1
            raise OverloadedError(model, self.budget, used, need)

    def done(self, nbytes: int, failed: bool) -> None:
        """After an execution whose inputs were ``nbytes``: hand free heap memory back when they
        were large, or over a MiB and it failed (a refused request leaves nothing behind)."""
        if nbytes >= (1 << 20 if failed else TRIM_AFTER_BYTES):
            release_free_memory()


def work_factors(model_cfg: Any) -> dict[str, float]:
    """Rough memory of an execution's work per byte of its inputs, for a critic of ``model_cfg``
    (None: reward only): critic_infer's ids (8 bytes a token) and one layer's activations at a
    time (about 16 floats of the hidden size a token); critic_train's ids and float inputs (20
    bytes a token) and every layer's activations, kept for the backward, and their gradients."""
    hidden = int(getattr(model_cfg, "hidden_size", 0) or 0)
    layers = int(getattr(model_cfg, "num_layers", 0) or 0)
    return {
        "critic_infer": 2 + 4 * 16 * hidden / 8,
        "critic_train": 2 + 2 * 4 * 16 * hidden * layers / 20,
    }
