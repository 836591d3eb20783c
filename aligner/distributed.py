"""The one place that sets up and tears down torch.distributed and Megatron's parallel state.

Backend: NCCL when CUDA is available, gloo otherwise. Works under ``torchrun`` (reads
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``) and as a plain single
process (a world of one on a free loopback port), so the same code serves tests, the demo and
clusters.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aligner import cpu_compat

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "barrier",
    "broadcast_json",
    "comm_device",
    "destroy",
    "free_port",
    "initialize",
    "is_writer",
    "recv_json",
    "seed_everything",
    "send_json",
]


@dataclass
class ParallelConfig:
    """How the model is split across processes. Data parallel is what remains of the world."""

    tensor_model_parallel_size: int = 1
    """Ranks that share each layer's weights (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Consecutive stages the layers are cut into (Megatron PP)."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'."""
    timeout_s: float = 600.0
    """Collective timeout before a hung peer becomes an error."""

    def __post_init__(self) -> None:
        errors = []
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                errors.append(f"{name}={v!r}: expected an integer >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            errors.append(f"backend={self.backend!r}: expected one of 'auto', 'gloo', 'nccl'")
        if errors:
            raise ValueError("invalid parallel config:\n  " + "\n  ".join(errors))


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the TP x PP x DP grid, with the groups to pass to maths wrappers."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    tp_group: object
    pp_group: object
    dp_group: object

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that logs and writes run-level files (global rank 0)."""
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and, where present, CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def initialize(parallel: ParallelConfig | None = None, seed: int = 1234) -> ParallelState:
    """Initialise torch.distributed and Megatron's model-parallel state, and seed this rank.

    Every rank gets the same base ``seed`` for Python/NumPy/torch (so weights initialise
    identically everywhere) and Megatron's tracker derives the per-TP-rank stream from it.
    Idempotent within a process when called with the same sizes.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    parallel = parallel or ParallelConfig()
    cpu_compat.apply()

    use_cuda = torch.cuda.is_available()
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise RuntimeError("backend='nccl' needs CUDA, which this torch build does not see; use 'gloo'")

    if not dist.is_initialized():
        from datetime import timedelta

        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=parallel.timeout_s)
        if "RANK" not in os.environ:
            # A plain single process: a world of one, over an in-process store. No port is
            # opened and nothing is written to os.environ, so child processes (and later
            # process groups in this one) inherit no stale rendezvous address.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend=backend, timeout=timeout)

    world = dist.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}); launch a multiple of {tp * pp} processes"
        )
    if mpu.model_parallel_is_initialized():
        if (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()) != (
            tp,
            pp,
        ):
            raise RuntimeError(
                "model parallel state is already initialised with other sizes; call destroy() first"
            )
    else:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)

    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return ParallelState(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        device=device,
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
    )


def destroy() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Small collectives every role uses: all of them are no-ops in a world of one
# ----------------------------------------------------------------------------------------------


def is_writer() -> bool:
    """Whether this process writes run-level files: global rank 0, or a process with no group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier(group: object | None = None) -> None:
    """``dist.barrier`` when there is more than one rank, else nothing."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def comm_device() -> torch.device:
    """Where collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def broadcast_json(obj: Any, src: int = 0, group: object | None = None) -> Any:
    """Rank ``src``'s JSON-able ``obj`` on every rank of ``group`` (as bytes in a tensor: nothing
    is pickled). ``src`` is a global rank; other ranks' ``obj`` is ignored."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return obj
    dev = comm_device()
    blob = _json_tensor(obj) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    n = torch.tensor([blob.numel()], dtype=torch.int64, device=dev)
    dist.broadcast(n, src, group=group)
    buf = blob.to(dev) if dist.get_rank() == src else torch.empty(int(n), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src, group=group)
    return json.loads(bytes(buf.cpu().numpy()))


def send_json(obj: Any, dst: int, group: object | None = None) -> None:
    """Send a JSON-able ``obj`` to global rank ``dst`` (its length, then its bytes)."""
    blob = _json_tensor(obj).to(comm_device())
    dist.send(torch.tensor([blob.numel()], dtype=torch.int64, device=blob.device), dst, group=group)
    dist.send(blob, dst, group=group)


def recv_json(src: int, group: object | None = None) -> Any:
    """Receive what :func:`send_json` on global rank ``src`` sent."""
    dev = comm_device()
    n = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(n, src, group=group)
    buf = torch.empty(int(n), dtype=torch.uint8, device=dev)
    dist.recv(buf, src, group=group)
    return json.loads(bytes(buf.cpu().numpy()))
