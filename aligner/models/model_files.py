"""The files of a model folder, ours or Hugging Face's, written safely.

- :class:`StreamingSafetensorsWriter` writes a safetensors file tensor by tensor, so a model
  streamed out of a TP/PP-sharded model (:func:`aligner.models.layout.iter_megatron_tensors`)
  never has to be held whole in memory; :func:`write_tensor_stream` drains such a stream on
  every rank and writes it where a path is given.
- :func:`atomic_output_dir` is the output folder: written as a temporary folder next to the
  target and renamed into place, so a crash leaves no half-written folder.
- :func:`write_sharded_tensor_stream` writes the same stream as Hugging Face's sharded
  checkpoints: ``model-00001-of-0000N.safetensors`` files of at most a given size and
  ``model.safetensors.index.json`` (one ``model.safetensors`` when everything fits one);
  :func:`parse_size` reads such a size (``"5GB"``, as ``save_pretrained``'s ``max_shard_size``).
- :func:`read_json_object` reads a JSON object (``config.json``, ``meta.json``, a safetensors
  index) with errors naming the file; :func:`as_dtype` reads a dtype given by name.

Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aligner.checkpoint import atomic_directory, writing
from aligner.models.config import ConversionError

__all__ = [
    "StreamingSafetensorsWriter",
    "write_tensor_stream",
    "write_sharded_tensor_stream",
    "parse_size",
    "SAFETENSORS_INDEX",
    "check_output_dir",
    "atomic_output_dir",
    "read_json_object",
    "as_dtype",
]


_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, knowing every name/shape/dtype in advance
    (the header comes first in the format). Tensors must arrive in the declared order."""

    def __init__(
        self,
        path: str | os.PathLike,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._entries = list(entries)
        self._next = 0
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, shape, dtype in self._entries:
            if dtype not in _ST_DTYPES:
                raise ConversionError(f"safetensors cannot hold dtype {dtype} ({name})")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with writing(self.path):
            self._fh = open(self.path, "wb")
            self._fh.write(struct.pack("<Q", len(raw)))
            self._fh.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._entries):
            raise ConversionError(f"{self.path}: unexpected extra tensor {name}")
        exp_name, shape, dtype = self._entries[self._next]
        if name != exp_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ConversionError(
                f"{self.path}: expected tensor {exp_name} {tuple(shape)} {dtype} next, got "
                f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            with writing(self.path):
                self._fh.write(t.view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> None:
        if self._fh.closed:
            return
        with writing(self.path):
            self._fh.flush()
            os.fsync(self._fh.fileno())
        self._fh.close()
        if self._next != len(self._entries):
            missing = [e[0] for e in self._entries[self._next :]]
            raise ConversionError(f"{self.path}: {len(missing)} tensors were never written: {missing[:5]}")

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, or a non-empty folder unless ``overwrite``: checked
    before any work (and on every rank, so all of them raise alike)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"output folder {out_dir} exists and is not empty (pass overwrite=True to replace it)"
        )


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder next to ``out_dir``; on success it replaces ``out_dir``, on
    failure it is removed (:func:`aligner.checkpoint.atomic_directory`, with no completion
    marker). Call on the writing rank only."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    with atomic_directory(out_dir, mark_complete=False) as tmp:
        yield tmp


def write_tensor_stream(
    stream: Iterator[tuple[str, torch.Tensor]],
    path: Path | None,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Drain ``stream`` (on every rank: it is collective) and write it to ``path`` where given."""
    writer = StreamingSafetensorsWriter(path, entries, metadata) if path is not None else None
    try:
        for name, t in stream:
            if writer is not None:
                writer.write(name, t)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


SAFETENSORS_INDEX = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint: ``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: shard file}}``."""

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str | None, what: str = "max_shard_size") -> int | None:
    """Bytes of a size given as an int or as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (decimal and binary
    units, as transformers reads ``max_shard_size``); None stays None (no limit)."""
    if size is None:
        return None
    if isinstance(size, bool):
        raise ConversionError(f"{what}={size!r}: expected a size such as '5GB' or a number of bytes")
    if isinstance(size, int):
        n = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        unit = text[len(digits) :]
        try:
            n = int(float(digits) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            raise ConversionError(
                f"{what}={size!r}: expected a size such as '5GB', '500MB', '2GiB' or a number of bytes"
            ) from None
    if n < 1:
        raise ConversionError(f"{what}={size!r}: expected a positive size")
    return n


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def shard_plan(
    entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int | None
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """``entries`` cut, in order, into shards of at most ``max_bytes`` each (a tensor larger than
    that alone in its shard, as transformers does); one shard without a limit."""
    if not max_bytes:
        return [list(entries)]
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for e in entries:
        n = _nbytes(e[1], e[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards


def write_sharded_tensor_stream(
    stream: Iterator[tuple[str, torch.Tensor]],
    folder: Path | None,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    max_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Drain ``stream`` (every rank) into Hugging Face's file layout in ``folder`` (where given):
    ``model.safetensors`` when the tensors fit one shard of ``max_bytes`` (None: no limit), else
    ``model-0000i-of-0000N.safetensors`` and :data:`SAFETENSORS_INDEX`. Returns the file names."""
    shards = shard_plan(entries, max_bytes)
    n = len(shards)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    it = iter(stream)
    for name, shard in zip(names, shards):
        # Each shard takes its own tensors off the one stream, in order.
        part = (next(it) for _ in range(len(shard)))
        write_tensor_stream(part, folder / name if folder is not None else None, shard, metadata)
    for extra, _ in it:  # pragma: no cover - a stream longer than its entries is a bug
        raise ConversionError(f"unexpected extra tensor {extra} in the stream")
    if folder is not None and n > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(s, d) for _, s, d in entries)},
            "weight_map": {e[0]: name for name, shard in zip(names, shards) for e in shard},
        }
        with writing(folder / SAFETENSORS_INDEX):
            with open(folder / SAFETENSORS_INDEX, "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2, sort_keys=True)
                fh.write("\n")
    return names


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype: a torch dtype or None as is, a name (``"bf16"``,
    ``"float32"``, ...) looked up; any other name is a :class:`ConversionError`."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ConversionError(f"dtype={dtype!r}: expected one of {sorted(names)}")
    return names[dtype]


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; a missing file, invalid JSON or a non-object is a
    :class:`ConversionError` naming ``what`` (e.g. "HF config") and the file."""
    if not path.is_file():
        raise ConversionError(f"{what}: {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{what}: {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{what}: {path} holds a {type(data).__name__}, expected a JSON object")
    return data
