"""Process groups of their own between separately launched processes: the trainer and its
rollout workers (docs/design.md, "Rollout workers").

Each process of the actor role and each rollout worker already has a default torch.distributed
world (its own torchrun job, or a world of one). The groups that join them cannot be part of
those worlds, so they are made as verl and NeMo-RL make theirs: from a ``torch.distributed``
TCP store that the trainer hosts at ``address`` and the workers connect to, one process group
per channel under a prefix of that store (gloo on CPU; NCCL where the torch build has it and
the caller asks for it). They are used through their own methods, never through the
``torch.distributed`` functions (which accept only the default world's groups).

Messages (:func:`send_message`, :func:`recv_message`) are a length and one safetensors buffer:
JSON metadata and named tensors, nothing pickled.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PeerGroup", "decode_message", "encode_message", "open_store", "recv_message", "send_message"]
__all__ += ["check_message_size", "split_address"]

MAX_MESSAGE_BYTES = 1 << 34
"""A message longer than this (16 GiB) is refused before anything is allocated for it."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> ``(host, port)``, with a clear error for anything else."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rollout.address={address!r}: expected host:port (a port in 1..65535)")
    return host.strip("[]"), int(port)


def open_store(address: str, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The TCP store every group of the run meets through: hosted by the trainer (``is_master``),
    joined by each worker (which retries until the trainer is up or ``timeout_s`` passes)."""
    host, port = split_address(address)
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        role = "host" if is_master else "reach"
        raise RuntimeError(
            f"rollout.address={address}: could not {role} the rollout store within {timeout_s:g} s: {e}"
        ) from e


class PeerGroup:
    """One channel among ``size`` processes (rank 0: the trainer): a process group over
    ``store`` under the prefix ``name``."""

    def __init__(
        self, store: dist.Store, name: str, rank: int, size: int, timeout_s: float, backend: str = "gloo"
    ) -> None:
        self.name, self.rank, self.size, self.backend = name, rank, size, backend
        prefixed = dist.PrefixStore(f"aligner/{name}/", store)
        timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            if not (torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL")):
                raise RuntimeError(f"{name}: backend 'nccl' needs a CUDA build of torch and a GPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"{name}: backend {backend!r}: expected 'gloo' or 'nccl'")

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([t], opts).wait()

    def all_reduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.pg.send([t], dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> None:
        self.pg.recv([t], src, tag).wait()

    def __repr__(self) -> str:
        return f"PeerGroup({self.name!r}, rank {self.rank} of {self.size}, {self.backend})"


def encode_message(meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``meta`` (JSON) and ``tensors`` (any device and dtype) as one uint8 tensor on the CPU: a
    safetensors buffer with ``meta`` in its metadata."""
    from safetensors.torch import save

    body = {k: v.detach().contiguous().cpu() for k, v in (tensors or {}).items()}
    data = save(body, metadata={"aligner": json.dumps(meta)})
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_message(payload: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What :func:`encode_message` made: the metadata and the tensors (on the CPU)."""
    from safetensors.torch import load

    data = payload.cpu().numpy().tobytes()
    tensors = load(data)
    # The metadata: the JSON header safetensors' format starts with (its length, 8 bytes LE).
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["aligner"])
    return meta, tensors


def check_message_size(size: int, where: str) -> None:
    """Refuse a message length that no message has, before anything is allocated for it."""
    if not 0 < size <= MAX_MESSAGE_BYTES:
        raise RuntimeError(f"{where}: a message of {size} bytes (out of step?)")


def send_message(
    group: PeerGroup, dst: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
) -> None:
    """Send ``meta`` (JSON) and ``tensors`` (any dtype) to ``dst``: the buffer's length, then the
    buffer (:func:`encode_message`)."""
    payload = encode_message(meta, tensors)
    group.send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
    group.send(payload, dst)


def recv_message(group: PeerGroup, src: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The next message from ``src``: its metadata and tensors (on the CPU)."""
    n = torch.empty(1, dtype=torch.int64)
    group.recv(n, src)
    size = int(n.item())
    check_message_size(size, f"{group.name}, from rank {src}")
    payload = torch.empty(size, dtype=torch.uint8)
    group.recv(payload, src)
    return decode_message(payload)
