"""Where a prompt data set's rows come from: a file, a saved data set folder or a hub data set,
read through Hugging Face ``datasets``, and the split (or slice) of it that is read.

A source is one of

- a JSON Lines file (``.jsonl``, and every ``prompt_file``): read here line by line, so that an
  error names the line (``prompts.jsonl:12: not valid JSON``);
- a ``.json``, ``.parquet`` or ``.csv`` file, or a folder of such files (its file names make the
  splits, e.g. ``train.jsonl`` and ``test.jsonl``): read with ``datasets.load_dataset``;
- a folder written by ``Dataset.save_to_disk`` (one split, named ``train``) or
  ``DatasetDict.save_to_disk`` (its splits): read with ``datasets.load_from_disk``;
- any other name: a data set on the hub (``org/name``, with ``dataset_config``), where the network
  allows.

A single file is one split named ``train``. A split may be sliced as ``datasets`` understands it
(``train[:90%]``, ``train[-64:]``, ``train+test``). What the rows hold (the prompts, their extras)
is read by :mod:`aligner.actor.datasets`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from aligner.models.config import ConfigError

__all__ = [
    "DATA_FILE_FORMATS",
    "MAX_REPORTED",
    "JsonlRows",
    "looks_like_local_path",
    "open_splits",
    "select_split",
    "iter_rows",
    "quote_names",
]

DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The data file suffixes a source may have, and the ``datasets`` builder that reads each."""

MAX_REPORTED = 20
"""Bad rows listed in one error before the rest are left out."""

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_CHUNK = 1024  # rows fetched from an Arrow data set at a time


def looks_like_local_path(source: str) -> bool:
    """Whether ``source`` names a local file or folder (existing or not) rather than a hub data
    set: it exists, has a data file suffix, or starts like a path."""
    return (
        os.path.exists(source)
        or os.path.splitext(source)[1].lower() in DATA_FILE_FORMATS
        or source.startswith(("/", ".", "~"))
        or not _HUB_NAME.match(source)
    )


class JsonlRows:
    """A JSON Lines file's rows, parsed here (errors name the line); columns: every key seen, in
    the order first seen; a row without a key has None there (as ``datasets`` reads it)."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.lines: list[int] = []
        self.errors: list[str] = []
        seen: dict[str, None] = {}
        name = os.path.basename(path)
        try:
            f = open(path, encoding="utf-8")
        except OSError as ex:
            raise ConfigError(f"{what}: cannot read the file ({ex.strerror})") from None
        with f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as ex:
                    self.errors.append(f"{name}:{i}: not valid JSON ({ex.msg})")
                    obj = None
                except RecursionError:
                    self.errors.append(f"{name}:{i}: JSON nested deeper than this reader can follow")
                    obj = None
                else:
                    if not isinstance(obj, dict):
                        self.errors.append(
                            f"{name}:{i}: expected a JSON object (one row per line), got {line.strip()[:80]}"
                        )
                        obj = None
                if obj is None:
                    if len(self.errors) >= MAX_REPORTED:
                        break
                    continue
                seen.update(dict.fromkeys(obj))
                self.rows.append(obj)
                self.lines.append(i)
        if self.errors:
            raise ConfigError(f"bad prompt file {what}:\n  " + "\n  ".join(self.errors))
        self.columns = list(seen)
        self.name = name

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        return f"{self.name}:{self.lines[i]}"

    def batch(self, start: int, stop: int, columns: list[str]) -> list[dict[str, Any]]:
        return [{c: r.get(c) for c in columns} for r in self.rows[start:stop]]


class _ArrowRows:
    """One split of a ``datasets.Dataset``."""

    def __init__(self, ds: Any, split: str) -> None:
        self.ds, self.split = ds.with_format(None), split  # plain Python values, whatever was saved
        self.columns = list(ds.column_names)
        self._selected: tuple[list[str], Any] | None = None

    def __len__(self) -> int:
        return len(self.ds)

    def where(self, i: int) -> str:
        return f"split {self.split!r} row {i}"

    def batch(self, start: int, stop: int, columns: list[str]) -> list[dict[str, Any]]:
        if self._selected is None or self._selected[0] != columns:
            self._selected = (columns, self.ds.select_columns(columns))
        cols = self._selected[1][start:stop]
        return [dict(zip(columns, values)) for values in zip(*(cols[c] for c in columns))]


def open_splits(
    source: str, what: str, *, jsonl: bool, dataset_config: str | None, cache_dir: str | None
) -> dict[str, Any]:
    """The splits of ``source``, by name: each a :class:`JsonlRows` or an Arrow split, with
    ``columns``, ``len()``, ``where(i)`` (a row's place, for errors) and ``batch(start, stop,
    columns)``. ``what`` (``key=value``) names the source in every error."""
    path = os.path.expanduser(source)
    suffix = os.path.splitext(path)[1].lower()
    if jsonl or (suffix == ".jsonl" and os.path.isfile(path)):
        if not os.path.isfile(path):
            raise ConfigError(f"{what}: no such file")
        return {"train": JsonlRows(path, what)}
    if looks_like_local_path(source) and not os.path.exists(path):
        raise ConfigError(
            f"{what}: no such file or folder (expected a {', '.join(DATA_FILE_FORMATS)} file, a folder of "
            "them or one written by save_to_disk, or a hub data set name)"
        )
    if os.path.isfile(path) and suffix not in DATA_FILE_FORMATS:
        raise ConfigError(
            f"{what}: unknown data file type {suffix or '(none)'!r}: expected one of "
            f"{', '.join(DATA_FILE_FORMATS)}, a folder, or a hub data set name"
        )
    if dataset_config is not None and os.path.exists(path):
        raise ConfigError(
            f"data.dataset_config={dataset_config!r} names a configuration of a hub data set, but {what} "
            "is a local file or folder: leave data.dataset_config null"
        )
    import datasets

    quiet = not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        if os.path.isdir(path) and _saved_to_disk(path):
            loaded = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            loaded = datasets.load_dataset(
                DATA_FILE_FORMATS[suffix], data_files={"train": path}, cache_dir=cache_dir
            )
        else:  # a folder of data files, or a hub data set
            loaded = datasets.load_dataset(path, dataset_config, cache_dir=cache_dir)
    except ConfigError:
        raise
    except Exception as ex:  # datasets and pyarrow raise many types here
        where = "" if os.path.exists(path) else " (not a local file or folder: looked up as a hub data set)"
        raise ConfigError(f"{what}: cannot read it with the datasets library{where}: {ex}") from ex
    finally:
        if quiet:
            datasets.enable_progress_bars()
    if isinstance(loaded, datasets.Dataset):
        return {"train": _ArrowRows(loaded, "train")}
    if isinstance(loaded, datasets.DatasetDict):
        return {name: _ArrowRows(ds, name) for name, ds in loaded.items()}
    raise ConfigError(f"{what}: expected a Dataset or DatasetDict, got {type(loaded).__name__}")


def _saved_to_disk(path: str) -> bool:
    """Whether folder ``path`` was written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))


def select_split(splits: dict[str, Any], spec: str, what: str) -> list[tuple[Any, int, int]]:
    """``(rows, start, stop)`` of each part of split spec ``spec`` (``train``, ``train[-64:]``,
    ``train[:10%]+test``), in order."""
    from datasets import ReadInstruction

    named = [s.strip().split("[")[0].strip() for s in spec.split("+")]
    unknown = [s for s in named if s not in splits]
    if unknown:
        raise ConfigError(
            f"split {spec!r}: {what} has no split {quote_names(unknown)} "
            f"(its splits: {quote_names(list(splits))})"
        )
    try:
        instructions = ReadInstruction.from_spec(spec).to_absolute({n: len(r) for n, r in splits.items()})
    except (ValueError, AssertionError) as ex:
        raise ConfigError(
            f"split {spec!r} of {what}: not a split the datasets library understands (e.g. 'train', "
            f"'test', 'train[:90%]', 'train[-64:]', 'train+test'): {ex}"
        ) from None
    parts = [(splits[i.splitname], i.from_, max(i.from_, i.to)) for i in instructions]
    columns = parts[0][0].columns
    for rows, _, _ in parts[1:]:
        if rows.columns != columns:
            raise ConfigError(
                f"split {spec!r} of {what} joins splits whose columns differ ({quote_names(columns)} and "
                f"{quote_names(rows.columns)})"
            )
    return parts


def iter_rows(parts: list[tuple[Any, int, int]], columns: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of every selected row, in order, holding ``columns`` only."""
    for rows, start, stop in parts:
        for a in range(start, stop, _CHUNK):
            b = min(a + _CHUNK, stop)
            for i, row in enumerate(rows.batch(a, b, columns), a):
                yield rows.where(i), row


def quote_names(names: list[str]) -> str:
    """``'a', 'b'`` (``none`` for no names), for errors that list columns or splits."""
    return ", ".join(repr(n) for n in names) if names else "none"
