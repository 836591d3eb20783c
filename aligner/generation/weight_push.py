"""The versioned weight push: one sender streams a policy's full tensors to every receiver of a
collective group, bucket by bucket; a receiver verifies a whole version before it hands out any
tensor (docs/design.md, "The weight push").

Format. Each bucket is two broadcasts from ``src``: a fixed-size header (uint8: JSON length,
its CRC-32, the JSON: version, bucket index, last flag, each tensor's name, dtype, shape and
offset, the payload's size and checksum; in the last one the manifest) and the payload (one flat
uint8 tensor, each tensor at an :data:`ALIGN`-byte offset). With ``ack``, a version ends with an
all-reduce of the receivers' refusals. Nothing is pickled.

Checksum (:func:`checksum`), computed where the payload lives (on a GPU, no host copy of the
payload: two int64 scalars come back): the payload viewed as int64 words ``w_i``, ``i = 0..n-1``;
``s1 = sum(w_i)`` and ``s2 = sum((i + 1) * w_i)``, both modulo 2**64 (torch's int64 arithmetic
wraps, the same on every device and in any order of summation). It catches every change within
one 64-bit word (``s1`` moves by the change: one flipped bit or byte, a word zeroed) and every
exchange of two different words ``i`` and ``j`` unless ``(i - j) * (w_j - w_i)`` is a multiple of
2**64 (possible only when the words are ``2**t`` apart and differ in their top ``t`` bits alone).
It does not catch every change of several words (``+d, -2d, +d`` in three consecutive words
leaves both sums), and it is no defence against a sender that lies: the header's own CRC-32 and
the manifest guard the framing.

A receiver that finds a bad bucket receives the rest of the version unread (so all stay in
step), then raises :class:`WeightPushError`. A bucket that never comes ends the wait with the
group's timeout (``dist.new_group(..., timeout=...)``). :class:`PushFault` injects faults.

The group is a group of the default world (``src`` a global rank) or a
:class:`~aligner.peer_group.PeerGroup` joining separately launched processes (``src`` its rank
there: the trainer and its rollout workers).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aligner.distributed import comm_device
from aligner.generation.weights import OwnedWeights
from aligner.models.gpt import config_of, head_of, unwrap
from aligner.models.layout import load_megatron_tensors, megatron_tensor_specs
from aligner.peer_group import PeerGroup

__all__ = ["ALIGN", "PushFault", "PushReport", "WeightPushError", "WeightPusher", "WeightReceiver"]
__all__ += ["PUSHED_DTYPES", "apply_weights", "check_fits", "checksum", "plan_buckets", "receive_into"]

ALIGN = 16
"""Every tensor's offset in a payload, and every payload's size, is a multiple of this."""
HEADER_BYTES = 1 << 16
FORMAT = 1
_CHUNK, _CPU_CHUNK = 1 << 22, 1 << 16  # int64 words per step of the checksum (GPU, CPU)
PUSHED_DTYPES = {
    n: getattr(torch, n)
    for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
"""The dtypes a version may carry, by the name its headers give (``torch.`` left out)."""


class WeightPushError(RuntimeError):
    """A pushed version refused by a receiver (nothing of it was handed out), or a push that
    could not be sent."""


@dataclass(frozen=True)
class PushFault:
    """A failure the sender makes on purpose at bucket ``bucket`` (for tests):

    - ``corrupt``: one payload byte flipped after the checksum was taken;
    - ``skip``: the bucket is not sent, the ones after it are (the last one skipped: nothing
      more is sent, as with ``stop``);
    - ``stop``: nothing more of the version is sent, no ack (a sender that died);
    - ``version``: the bucket's header names the next version (a consistent, lying header);
    - ``manifest``: the last header counts one tensor more than were sent (``bucket`` unused).
    """

    kind: str
    bucket: int = 0

    KINDS = ("corrupt", "skip", "stop", "version", "manifest")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS or self.bucket < 0:
            raise ValueError(f"PushFault({self.kind!r}, {self.bucket}): expected a kind in {self.KINDS}")


@dataclass(frozen=True)
class PushReport:
    version: int
    seconds: float
    bytes: int
    """Bytes of the tensors pushed."""
    wire_bytes: int
    """Bytes broadcast: payloads (with alignment padding) and headers."""
    buckets: int
    tensors: int
    refused: int | None
    """Receivers that refused the version (None: no ack was taken, or the push stopped)."""

    @property
    def gbps(self) -> float:
        """Tensor bytes per second, in GB/s (1e9)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def checksum(payload: torch.Tensor) -> tuple[int, int]:
    """``(s1, s2)`` of a flat uint8 payload whose size is a multiple of 8 (see the module)."""
    return tuple(_checksum(payload).tolist())


def _checksum(payload: torch.Tensor) -> torch.Tensor:
    """The two sums as an int64 tensor on the payload's device (no synchronisation), a chunk of
    words at a time (on a CPU, chunks that stay in cache)."""
    words = payload.view(torch.int64)
    n, dev = words.numel(), payload.device
    chunk = min(n, _CHUNK if dev.type == "cuda" else _CPU_CHUNK)
    s = torch.zeros(2, dtype=torch.int64, device=dev)
    ramp = torch.arange(1, chunk + 1, dtype=torch.int64, device=dev)
    buf = torch.empty(chunk, dtype=torch.int64, device=dev)
    for start in range(0, n, max(chunk, 1)):
        w = words[start : start + chunk]
        m, ws = w.numel(), w.sum()
        s[0] += ws
        s[1] += torch.mul(w, ramp[:m], out=buf[:m]).sum() + ws * start  # sum((start + j + 1) * w_j)
    return s


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(
    stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, header_bytes: int = HEADER_BYTES
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(bucket, is_last)`` of consecutive tensors of ``stream``, each bucket's aligned payload
    at most ``bucket_bytes`` (a larger tensor alone) and its header's tensor list within
    ``header_bytes``. Pulls one tensor ahead to know which bucket is the last."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected an integer >= 1")
    room = header_bytes - 1024  # the fields besides the tensor list
    bucket: list[tuple[str, torch.Tensor]] = []
    size = text = 0
    for name, t in stream:
        n, entry = _aligned(_nbytes(t)), len(name) + 16 * t.dim() + 48
        if entry > room:
            raise ValueError(f"tensor {name}: its header entry does not fit header_bytes={header_bytes}")
        if bucket and (size + n > bucket_bytes or text + entry > room):
            yield bucket, False
            bucket, size, text = [], 0, 0
        bucket.append((name, t))
        size, text = size + n, text + entry
    if bucket:
        yield bucket, True


def _device(group: object) -> torch.device:
    return group.device if isinstance(group, PeerGroup) else comm_device(group)


def _broadcast(t: torch.Tensor, src: int, group: object) -> None:
    if isinstance(group, PeerGroup):
        group.broadcast(t, src)
    else:
        dist.broadcast(t, src=src, group=group)


def _all_reduce(t: torch.Tensor, group: object) -> None:
    if isinstance(group, PeerGroup):
        group.all_reduce(t)
    else:
        dist.all_reduce(t, group=group)


def _encode_header(obj: dict, header_bytes: int, device: torch.device) -> torch.Tensor:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) + 8 > header_bytes:
        raise WeightPushError(
            f"a bucket header of {len(body)} bytes does not fit header_bytes={header_bytes}"
        )
    raw = bytearray(header_bytes)
    raw[0:4] = len(body).to_bytes(4, "little")
    raw[4:8] = zlib.crc32(body).to_bytes(4, "little")
    raw[8 : 8 + len(body)] = body
    return torch.frombuffer(raw, dtype=torch.uint8).to(device)


def _decode_header(buf: torch.Tensor) -> dict:
    raw = bytes(buf.cpu().numpy())
    n, crc = int.from_bytes(raw[0:4], "little"), int.from_bytes(raw[4:8], "little")
    body = raw[8 : 8 + n]
    if n + 8 > len(raw) or zlib.crc32(body) != crc:
        raise ValueError("its CRC-32 or length does not match")
    obj = json.loads(body)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"not a header of format {FORMAT}")
    return obj


class WeightPusher:
    """Broadcasts versions of a weight stream from global rank ``src`` to the rest of ``group``
    (every rank of which runs a :class:`WeightReceiver` with the same ``header_bytes`` and
    ``ack``)."""

    def __init__(
        self,
        group: object,
        src: int,
        bucket_bytes: int = 256 << 20,
        header_bytes: int = HEADER_BYTES,
        ack: bool = True,
    ) -> None:
        self.group, self.src, self.bucket_bytes = group, src, bucket_bytes
        self.header_bytes, self.ack = header_bytes, ack
        self.device = _device(group)
        self._buf: torch.Tensor | None = None

    def push(
        self, version: int, stream: Iterable[tuple[str, torch.Tensor]], fault: PushFault | None = None
    ) -> PushReport:
        """Send every tensor of ``stream`` as version ``version`` (consumed to its end: it may be
        collective, like :func:`~aligner.models.layout.iter_megatron_tensors`)."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version={version!r}: expected an integer >= 0")
        t0 = time.perf_counter()
        total = wire = count = k = 0
        stopped = False
        for k, (items, last) in enumerate(plan_buckets(stream, self.bucket_bytes, self.header_bytes)):
            if stopped:
                continue  # a stopped push still drains a collective stream
            hit = fault is not None and fault.bucket == k and fault.kind != "manifest"
            if hit and (fault.kind == "stop" or (fault.kind == "skip" and last)):
                stopped = True
                continue
            payload, entries = _pack(items, self.device, self._buf)
            if self._buf is None or payload.numel() > self._buf.numel():
                self._buf = payload  # reused: later copies are ordered after the broadcast
            total += sum(_nbytes(t) for _, t in items)
            count += len(items)
            header = {
                "format": FORMAT,
                "version": version + 1 if hit and fault.kind == "version" else version,
                "bucket": k,
                "final": last,
                "nbytes": payload.numel(),
                "checksum": _checksum(payload).tolist(),
                "tensors": entries,
            }
            if last:
                extra = fault is not None and fault.kind == "manifest"
                header["manifest"] = {"tensors": count + extra, "bytes": total, "buckets": k + 1}
            if hit and fault.kind == "corrupt":
                payload[payload.numel() // 2] ^= 0x5A
            if hit and fault.kind == "skip":
                continue
            h = _encode_header(header, self.header_bytes, self.device)
            _broadcast(h, self.src, self.group)
            _broadcast(payload, self.src, self.group)
            wire += h.numel() + payload.numel()
        refused = None
        if self.ack and not stopped:
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            _all_reduce(n, self.group)
            refused = int(n.item())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return PushReport(version, time.perf_counter() - t0, total, wire, k + 1, count, refused)


def _pack(
    items: list[tuple[str, torch.Tensor]], device: torch.device, buf: torch.Tensor | None = None
) -> tuple[torch.Tensor, list]:
    """The bucket's payload (in ``buf`` when it is large enough) and its tensor entries."""
    offsets, end = [], 0
    for _, t in items:
        offsets.append(end)
        end = _aligned(end + _nbytes(t))
    fits = buf is not None and buf.numel() >= end
    payload = buf[:end] if fits else torch.empty(end, dtype=torch.uint8, device=device)
    entries = []
    for (name, t), off in zip(items, offsets, strict=True):
        n, dtype = _nbytes(t), str(t.dtype).removeprefix("torch.")
        if dtype not in PUSHED_DTYPES:
            raise WeightPushError(
                f"tensor {name}: dtype {t.dtype} cannot be pushed (one of {list(PUSHED_DTYPES)})"
            )
        if n:
            payload[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        payload[off + n : _aligned(off + n)].zero_()
        entries.append([name, dtype, list(t.shape), off])
    return payload, entries


def _unpack(payload: torch.Tensor, entries: object) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a payload, as views of it; ValueError on an entry that does not fit."""
    if not isinstance(entries, list):
        raise ValueError("its tensor list is not a list")
    out = []
    for e in entries:
        ok = isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and e[1] in PUSHED_DTYPES
        ok = ok and isinstance(e[2], list) and all(isinstance(s, int) and s >= 0 for s in e[2])
        if not ok or not isinstance(e[3], int) or e[3] < 0 or e[3] % ALIGN:
            raise ValueError(f"tensor entry {str(e)[:200]} is malformed")
        name, dtype, shape, off = e
        n = PUSHED_DTYPES[dtype].itemsize * int(torch.Size(shape).numel())
        if off + n > payload.numel():
            raise ValueError(
                f"tensor {name} [{off}, {off + n}) runs past the payload of {payload.numel()} bytes"
            )
        out.append((name, payload[off : off + n].view(PUSHED_DTYPES[dtype]).view(shape)))
    return out


class WeightReceiver:
    """Receives versions pushed by a :class:`WeightPusher` at global rank ``src`` over ``group``."""

    def __init__(self, group: object, src: int, header_bytes: int = HEADER_BYTES, ack: bool = True) -> None:
        self.group, self.src, self.header_bytes, self.ack = group, src, header_bytes, ack
        self.device = _device(group)
        self.last_version: int | None = None
        """The last version accepted."""
        self._broken: str | None = None

    def receive(self, expect_after: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """The next version and its tensors, in stream order (views of staging buffers of their
        own), once every bucket of it is verified: the header CRCs, one version in every bucket,
        newer than :attr:`last_version` and than ``expect_after``, the buckets' order, each
        payload's checksum and tensor layout, the names unique and the manifest.

        Raises:
            WeightPushError: naming the version, the bucket and what failed; nothing is handed
                out. After a header that cannot be read or a bucket that never came, the group
                is out of step and every later call raises too.
        """
        if self._broken:
            raise WeightPushError(f"the push group is out of step since {self._broken}: make it again")
        floors = [v for v in (self.last_version, expect_after) if v is not None]
        floor = max(floors) if floors else None
        version, error, got, names, k = None, None, [], set(), 0
        while True:
            h = torch.empty(self.header_bytes, dtype=torch.uint8, device=self.device)
            where = f"version {'?' if version is None else version}, bucket {k}"
            try:
                _broadcast(h, self.src, self.group)
            except RuntimeError as e:  # the group's timeout, or a dead peer
                self._broken = f"{where} never came"
                raise WeightPushError(
                    f"{where}: no bucket came before the group's timeout or error: {e}"
                ) from e
            try:
                head = _decode_header(h)
                nbytes, final = head["nbytes"], head["final"]
                if not isinstance(nbytes, int) or nbytes < 0 or nbytes % ALIGN or not isinstance(final, bool):
                    raise ValueError("its payload size or final flag is malformed")
            except (ValueError, KeyError) as e:
                self._broken = f"an unreadable header at {where}"
                raise WeightPushError(
                    f"{where}: the bucket header is unreadable ({e}); the stream is out of step"
                ) from e
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            _broadcast(payload, self.src, self.group)
            if version is None:
                version = head.get("version")
                where = f"version {version}, bucket {k}"
            if error is None:
                error = self._check(head, payload, version, floor, k, names, got, where)
                if error is not None:
                    got.clear()  # the rest of the version is received unread
            k += 1
            if final:
                break
        if error is None:
            m, total = head.get("manifest"), sum(_nbytes(t) for _, t in got)
            came = {"tensors": len(got), "bytes": total, "buckets": k}
            if not isinstance(m, dict) or {key: m.get(key) for key in came} != came:
                error = f"version {version}: the manifest {m} does not match what came, {came}"
        if self.ack:
            n = torch.tensor([int(error is not None)], dtype=torch.int64, device=self.device)
            _all_reduce(n, self.group)
        if error is not None:
            raise WeightPushError(f"refused: {error}; nothing was swapped")
        self.last_version = version
        return version, got

    @staticmethod
    def _check(head, payload, version, floor, k, names, got, where) -> str | None:
        """What is wrong with bucket ``k`` (its tensors added to ``got``), or None."""
        if not isinstance(version, int) or isinstance(version, bool):
            return f"{where}: version {version!r} is not an integer"
        if k == 0 and floor is not None and version <= floor:
            return f"{where}: version {version} is not newer than version {floor}"
        if head.get("version") != version:
            return f"{where}: the header names version {head.get('version')}, bucket 0 version {version}"
        if head.get("bucket") != k:
            return f"{where}: bucket {head.get('bucket')} came where bucket {k} was expected (bucket {k} is missing)"
        sums = _checksum(payload).tolist()
        if sums != head.get("checksum"):
            return f"{where}: checksum {sums} of the payload, the header says {head.get('checksum')}"
        try:
            tensors = _unpack(payload, head.get("tensors"))
        except ValueError as e:
            return f"{where}: {e}"
        for name, t in tensors:
            if name in names:
                return f"{where}: tensor {name} came twice"
            names.add(name)
            got.append((name, t))
        return None


def apply_weights(target: OwnedWeights | nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy a verified version's full canonical tensors into ``target``: an engine's
    :class:`~aligner.generation.weights.OwnedWeights` (its shard of each) or a GPT module built by
    :mod:`aligner.models.gpt` (this rank's shards, via ``load_megatron_tensors``). The names and
    shapes are checked against the target's architecture before anything is copied."""
    check_fits(target, tensors)
    if isinstance(target, OwnedWeights):
        target.load(iter(tensors))
    else:
        load_megatron_tensors(target, None, dict(tensors).__getitem__)


def check_fits(target: OwnedWeights | nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`WeightPushError` unless ``tensors`` are the full canonical tensors of
    ``target``'s architecture, by name and shape."""
    if isinstance(target, OwnedWeights):
        cfg, head = target.cfg, "lm"
    else:
        m = unwrap(target)
        cfg, head = config_of(m), head_of(m)
    want = {s.name: s.shape for s in megatron_tensor_specs(cfg, head)}
    have = {name: tuple(t.shape) for name, t in tensors}
    if have != want:
        odd = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        raise WeightPushError(
            f"the version's tensors do not fit the target: {odd[:8]} differ in name or shape"
        )


def receive_into(
    receiver: WeightReceiver,
    target: OwnedWeights | nn.Module,
    expect_after: int | None = None,
    apply: Callable[[Any, list[tuple[str, torch.Tensor]]], None] = apply_weights,
) -> int:
    """Receive the next version, verify all of it, then ``apply`` it to ``target``
    (:func:`apply_weights`, which checks the names and shapes first); return its version. A
    version refused (by the receiver, or by ``apply`` raising ``WeightPushError``) leaves
    ``target`` as it was, and a later push of it may be taken."""
    before = receiver.last_version
    version, tensors = receiver.receive(expect_after)
    try:
        apply(target, tensors)
    except WeightPushError:
        receiver.last_version = before  # not applied: a later push of it may be taken
        raise
    return version
