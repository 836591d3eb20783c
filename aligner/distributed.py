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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from aligner import cpu_compat

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "barrier",
    "RankZeroError",
    "all_gather_json",
    "broadcast_json",
    "comm_device",
    "destroy",
    "free_port",
    "initialize",
    "is_writer",
    "on_rank0",
    "recv_json",
    "seed_everything",
    "send_json",
    "spare_port",
]


@dataclass
class ParallelConfig:
    """How the model is split across processes. Data parallel is what remains of the world."""

    tensor_model_parallel_size: int = 1
    """Ranks that share each layer's weights (Megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Consecutive stages the layers are cut into (Megatron PP)."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'. It also decides the device: under
    nccl each rank runs on ``cuda:LOCAL_RANK``, under gloo on the CPU (also where CUDA is
    present)."""
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
    """This rank's place in the TP x PP x DP grid, with the groups to pass to maths wrappers.

    Made once, by :func:`initialize` (from Megatron's parallel state, which nothing else reads):
    the roles are handed it and never look up Megatron's globals themselves."""

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
    mp_group: object = None
    """The model-parallel group: this data-parallel replica's TP x PP ranks."""
    embedding_group: object = None
    """The first and the last pipeline stage (each holds a copy of a tied embedding); None on a
    rank outside it, and at PP=1."""

    GROUPS: ClassVar[tuple[str, ...]] = ("tp", "pp", "dp", "mp", "embedding")

    def group(self, kind: str) -> object:
        """The process group of ``kind``: 'tp', 'pp', 'dp', 'mp' (model parallel) or 'embedding'."""
        if kind not in self.GROUPS:
            raise ValueError(f"group kind {kind!r}: expected one of {list(self.GROUPS)}")
        return getattr(self, f"{kind}_group")

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

    @classmethod
    def from_megatron(cls, device: torch.device) -> ParallelState | None:
        """This rank's state as Megatron's parallel state holds it; None when that is not set up."""
        from megatron.core import parallel_state as mpu

        if not (dist.is_initialized() and mpu.model_parallel_is_initialized()):
            return None
        pp = mpu.get_pipeline_model_parallel_world_size()
        in_embedding = pp > 1 and mpu.is_rank_in_embedding_group(ignore_virtual=True)
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_size=pp,
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            device=device,
            tp_group=mpu.get_tensor_model_parallel_group(),
            pp_group=mpu.get_pipeline_model_parallel_group(),
            dp_group=mpu.get_data_parallel_group(),
            mp_group=mpu.get_model_parallel_group(),
            embedding_group=mpu.get_embedding_group() if in_embedding else None,
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spare_port(host: str = "127.0.0.1") -> int:
    """A free TCP port for another process to bind later, picked at random below the range the OS
    hands out to ``bind(0)`` and outgoing connections (Linux: ``net.ipv4.ip_local_port_range``,
    usually from 32768): no other process's ephemeral port can take it in between, as one took a
    :func:`free_port` once between its choice and the trainer's bind. Random from the system's
    source (seeded streams would make parallel processes pick alike); checked free."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 11000:  # no room below the ephemeral range: take one of them
        return free_port(host)
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


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

    has_cuda = torch.cuda.is_available()
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if has_cuda else "gloo")
    if backend == "nccl" and not has_cuda:
        raise RuntimeError("backend='nccl' needs CUDA, which this torch build does not see; use 'gloo'")
    # One device per rank, decided here: cuda:LOCAL_RANK under NCCL, else the CPU. Every model,
    # optimizer state, buffer and collective of both roles then lives on it.
    use_cuda = backend == "nccl"

    if not dist.is_initialized():
        from datetime import timedelta

        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise RuntimeError(
                    f"LOCAL_RANK={local}, but this process sees {torch.cuda.device_count()} CUDA device(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): launch at most one "
                    "process per GPU on each node"
                )
            torch.cuda.set_device(local)
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
    state = ParallelState.from_megatron(device)
    assert state is not None
    return state


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


def comm_device(group: object | None = None) -> torch.device:
    """Where collectives over ``group`` (default: the world) take their tensors: the current CUDA
    device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
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


def all_gather_json(obj: Any, group: object | None = None) -> list[Any]:
    """Every member's JSON-able ``obj``, in group-rank order (as bytes in tensors: nothing is
    pickled)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    dev = comm_device(group)
    data = _json_tensor(obj).to(dev)
    n = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    padded = torch.zeros(max(int(x) for x in sizes), dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(bytes(p[: int(x)].cpu().numpy())) for p, x in zip(parts, sizes)]


T = TypeVar("T")


class RankZeroError(RuntimeError):
    """What the other ranks raise when :func:`on_rank0`'s function failed on the first rank with an
    error they do not rebuild; the message names it."""


def on_rank0(
    fn: Callable[[], T],
    *,
    group: object | None = None,
    carried: Sequence[type[BaseException]] = (),
    wrap: Callable[[str], BaseException] = RankZeroError,
) -> T:
    """``fn()`` on the first rank of ``group`` (default: global rank 0), and its outcome on every
    rank: its JSON-able result, or its error (a result that is not JSON-able is a TypeError on
    every rank, never a rank left waiting). Call it on every rank of the group.

    The first rank raises its own exception. The others raise the same type when it is one of
    ``carried`` (rebuilt with ``from_json(e.to_json())`` where the type has both, else from its
    message), and ``wrap("<Type>: <message>")`` otherwise. One broadcast; none in a world of one.
    """
    src = dist.get_global_rank(group, 0) if group is not None else 0
    mine = not dist.is_initialized() or dist.get_rank() == src
    raised: BaseException | None = None
    outcome: dict[str, Any] | None = None
    if mine:
        try:
            outcome = {"value": fn()}
            json.dumps(outcome)  # a result that cannot travel fails here, not in the broadcast
        except Exception as e:  # every rank raises, not only this one
            raised = e
            outcome = {"type": type(e).__name__, "message": str(e)}
            if hasattr(e, "to_json"):
                outcome["json"] = e.to_json()
    outcome = broadcast_json(outcome, src, group)
    if raised is not None:
        raise raised
    if "value" in outcome:
        return outcome["value"]
    for cls in carried:
        if cls.__name__ == outcome["type"]:
            if "json" in outcome and hasattr(cls, "from_json"):
                raise cls.from_json(outcome["json"])
            raise cls(outcome["message"])
    raise wrap(f"{outcome['type']}: {outcome['message']}")


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
