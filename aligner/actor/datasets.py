"""Prompt data sets: the actor's prompts (and what travels with them to the reward function) read
from a file, a saved data set folder or a hub data set through Hugging Face ``datasets``.

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
(``train[:90%]``, ``train[-64:]``, ``train+test``). Each row gives one prompt: its prompt column
holds the text, or (with a chat template) a list of ``{"role", "content"}`` messages. With
``chat_template`` the tokenizer's template renders the prompt (a user turn after an optional
system message, or the row's own messages) up to the start of the assistant's reply. Every row's
other columns (``extra_columns``) travel with its prompt as one compact JSON object string
(sorted keys), for the reward function. Prompts longer than the context leaves for the response
(``max_prompt_tokens``, counted after the template) are dropped and counted; nothing is dropped
silently, and a bad row is an error naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aligner.models.config import ConfigError
from aligner.tokenizers import Tokenizer

if TYPE_CHECKING:
    from aligner.actor.config import DataConfig

__all__ = [
    "PromptSet",
    "load_prompt_set",
    "training_prompt_set",
    "validation_prompt_set",
    "DATA_FILE_FORMATS",
    "looks_like_local_path",
]

DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The data file suffixes a source may have, and the ``datasets`` builder that reads each."""

MAX_REPORTED = 20
"""Bad rows listed in one error before the rest are left out."""

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_CHUNK = 1024  # rows fetched from an Arrow data set at a time


@dataclass
class PromptSet:
    """The prompts read from a source, in its order, with what travels with each."""

    prompts: list[str]
    """Each row's prompt as the policy sees it (after the chat template, when one is applied)."""
    extras: list[str] | None
    """Each row's extra columns as a compact JSON object string with sorted keys (aligned with
    ``prompts``); None when no column travels with the prompts."""
    lengths: list[int]
    """Each prompt's token count."""
    stats: dict[str, Any] = field(default_factory=dict)
    """What was read: ``source``, ``split``, ``rows`` (in the split), ``read`` (rows looked at),
    ``too_long`` (dropped), ``kept``, ``max_prompt_tokens``, ``max_prompts``,
    ``chat_template``, ``prompt_tokens_mean``/``prompt_tokens_max`` (of those kept)."""
    texts: list[str] | None = None
    """With a chat template, each row's prompt as the data set writes it (the column's string, or
    the last user message of a chat-format row): what a reward model reading text gets in place of
    the templated prompt. None without a template."""

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, n: int) -> PromptSet:
        """The first ``n`` prompts (and their extras and lengths), the stats unchanged."""
        extras = None if self.extras is None else self.extras[:n]
        texts = None if self.texts is None else self.texts[:n]
        return PromptSet(self.prompts[:n], extras, self.lengths[:n], dict(self.stats), texts)

    def summary(self, label: str = "data") -> str:
        """One line: ``data: kept N of M prompts from <source> (K longer than L tokens dropped)``."""
        s = self.stats
        source = s["source"] if s["split"] == "train" else f"{s['source']} split {s['split']}"
        line = (
            f"{label}: kept {s['kept']} of {s['read']} prompts from {source} "
            f"({s['too_long']} longer than {s['max_prompt_tokens']} tokens dropped"
        )
        if s["read"] < s["rows"]:
            line += f"; stopped at max_prompts={s['max_prompts']}, {s['rows']} rows in all"
        return line + ")"


def looks_like_local_path(source: str) -> bool:
    """Whether ``source`` names a local file or folder (existing or not) rather than a hub data
    set: it exists, has a data file suffix, or starts like a path."""
    return (
        os.path.exists(source)
        or os.path.splitext(source)[1].lower() in DATA_FILE_FORMATS
        or source.startswith(("/", ".", "~"))
        or not _HUB_NAME.match(source)
    )


def load_prompt_set(
    source: str,
    tokenizer: Tokenizer,
    max_prompt_tokens: int,
    *,
    key: str = "data.dataset",
    split: str = "train",
    dataset_config: str | None = None,
    prompt_column: str = "prompt",
    extra_columns: list[str] | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    max_prompts: int | None = None,
    jsonl: bool = False,
    cache_dir: str | None = None,
) -> PromptSet:
    """Read the prompts of ``source`` (the value of config key ``key``, named in every error).

    ``split``: the split (or slice, ``datasets`` syntax) to read; ``prompt_column``: the column
    that holds each prompt; ``extra_columns``: the columns whose values travel with each prompt
    (None: every column but the prompt column; []: none); ``chat_template``: render each prompt
    with the tokenizer's chat template, after ``system_prompt`` when set; ``max_prompts``: keep
    the first this many prompts that fit (None: all). Prompts of more than ``max_prompt_tokens``
    tokens are dropped and counted (an error when every prompt is). ``jsonl``: read ``source``
    as JSON Lines whatever its suffix (a ``prompt_file``); ``cache_dir``: the ``datasets`` cache
    (None: its default). Raises :class:`ConfigError` naming the key, the value and what was
    expected, with the rows at fault.
    """
    if max_prompt_tokens < 1:
        raise ConfigError(
            f"no room for a prompt: model.max_seq_len - generation.max_new_tokens = {max_prompt_tokens}"
        )
    what = f"{key}={source!r}"
    if chat_template:
        has = getattr(tokenizer, "has_chat_template", None)
        if has is None or not has():
            raise ConfigError(
                f"data.chat_template=true, but the tokenizer {tokenizer!r} has no chat template: use a "
                "HF tokenizer folder whose tokenizer_config.json (or chat_template.jinja) holds one, as "
                "chat and instruct models' do, or set data.chat_template=false to use the prompts as "
                "they are"
            )
    if system_prompt is not None and not chat_template:
        raise ConfigError(f"data.system_prompt={system_prompt!r} needs data.chat_template=true")
    splits = _open(source, what, jsonl=jsonl, dataset_config=dataset_config, cache_dir=cache_dir)
    parts = _select(splits, split, what)
    columns = parts[0][0].columns
    total = sum(to - start for _, start, to in parts)
    if total == 0:
        expected = (
            ' (expected JSONL lines like {"prompt": "..."})' if isinstance(parts[0][0], _JsonlRows) else ""
        )
        raise ConfigError(f"{what} holds no prompts: split {split!r} has no rows{expected}")
    if prompt_column not in columns:
        raise ConfigError(
            f"{what} has no column {prompt_column!r} (its columns: {_names(columns)}): expected an object "
            f'with a non-empty string "{prompt_column}" in each row, or data.prompt_column naming the '
            "column that holds the prompts"
        )
    if extra_columns is None:
        extra = [c for c in columns if c != prompt_column]
    else:
        missing = [c for c in extra_columns if c not in columns]
        if missing:
            raise ConfigError(
                f"data.extra_columns={list(extra_columns)!r}: {what} has no column(s) {_names(missing)} "
                f"(its columns: {_names(columns)})"
            )
        extra = list(dict.fromkeys(extra_columns))
    needed = list(dict.fromkeys([prompt_column, *extra]))

    prompts: list[str] = []
    extras: list[str] = []
    lengths: list[int] = []
    texts: list[str] = []
    errors: list[str] = []
    read = too_long = 0
    first_dropped: tuple[str, int] | None = None
    for where, row in _rows(parts, needed):
        read += 1
        text = _prompt_text(row, where, prompt_column, tokenizer, chat_template, system_prompt, errors)
        if text is None:
            if len(errors) >= MAX_REPORTED:
                break
            continue
        try:
            n = len(tokenizer.encode(text))
        except ValueError as ex:
            errors.append(f"{where}: {ex}")
            if len(errors) >= MAX_REPORTED:
                break
            continue
        if n > max_prompt_tokens:
            too_long += 1
            if first_dropped is None:
                first_dropped = (where, n)
            continue
        if extra:
            blob = _extras_json(row, extra, where, errors)
            if blob is None:
                if len(errors) >= MAX_REPORTED:
                    break
                continue
            extras.append(blob)
        prompts.append(text)
        lengths.append(n)
        if chat_template:
            texts.append(_raw_prompt(row[prompt_column]))
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    if errors:
        more = " (the first ones; there may be more)" if len(errors) >= MAX_REPORTED else ""
        raise ConfigError(f"bad prompts in {what}{more}:\n  " + "\n  ".join(errors))
    if not prompts:
        where, n = first_dropped or ("?", 0)
        raise ConfigError(
            f"{what}: all {read} prompts are longer than the {max_prompt_tokens} tokens that fit "
            f"(model.max_seq_len - generation.max_new_tokens), e.g. {where}: prompt has {n} tokens, more "
            f"than the {max_prompt_tokens} that fit: raise model.max_seq_len or lower "
            "generation.max_new_tokens"
        )
    stats = {
        "source": source,
        "split": split,
        "rows": total,
        "read": read,
        "too_long": too_long,
        "kept": len(prompts),
        "max_prompt_tokens": max_prompt_tokens,
        "max_prompts": max_prompts,
        "chat_template": chat_template,
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "prompt_tokens_max": max(lengths),
    }
    return PromptSet(prompts, extras if extra else None, lengths, stats, texts if chat_template else None)


def training_prompt_set(
    data: DataConfig, tokenizer: Tokenizer, max_prompt_tokens: int, cache_dir: str | None = None
) -> PromptSet:
    """The training prompts of ``data`` (``data.dataset`` or ``data.prompt_file``, its
    ``data.split``); see :func:`load_prompt_set`."""
    source = _training_source(data)
    if source is None:
        raise ConfigError("data.dataset and data.prompt_file are both null: the prompts come from data.task")
    return load_prompt_set(
        source,
        tokenizer,
        max_prompt_tokens,
        split=data.split,
        max_prompts=data.max_prompts,
        cache_dir=cache_dir,
        **_source_options(data),
    )


def validation_prompt_set(
    data: DataConfig,
    prompt_file: str | None,
    num_prompts: int,
    tokenizer: Tokenizer,
    max_prompt_tokens: int,
    cache_dir: str | None = None,
) -> PromptSet | None:
    """The first ``num_prompts`` validation prompts that fit: from ``data.val_split`` of the
    training data set, else from ``prompt_file`` (``validation.prompt_file``, read with the
    training data's columns and template); None when neither is set. Both set is an error."""
    if data.val_split is not None and prompt_file is not None:
        raise ConfigError(
            f"data.val_split={data.val_split!r} and validation.prompt_file={prompt_file!r}: expected one "
            "source of validation prompts"
        )
    if data.val_split is not None:
        source = _training_source(data)
        if source is None:
            raise ConfigError(f"data.val_split={data.val_split!r} needs data.dataset or data.prompt_file")
        split = data.val_split
    elif prompt_file is not None:
        source, split = prompt_file, "train"
    else:
        return None
    options = _source_options(data)
    if prompt_file is not None:
        options.update(key="validation.prompt_file", jsonl=True, dataset_config=None)
    return load_prompt_set(
        source,
        tokenizer,
        max_prompt_tokens,
        split=split,
        max_prompts=num_prompts,
        cache_dir=cache_dir,
        **options,
    )


def _training_source(data: DataConfig) -> str | None:
    """``data.dataset``, else ``data.prompt_file`` (None: the built-in task)."""
    return data.dataset if data.dataset is not None else data.prompt_file


def _source_options(data: DataConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`load_prompt_set` that ``data`` decides, but for the split."""
    is_file = data.dataset is None
    return {
        "key": "data.prompt_file" if is_file else "data.dataset",
        "jsonl": is_file,
        "dataset_config": data.dataset_config,
        "prompt_column": data.prompt_column,
        "extra_columns": None if data.extra_columns is None else list(data.extra_columns),
        "chat_template": data.chat_template,
        "system_prompt": data.system_prompt,
    }


# -- reading sources --------------------------------------------------------------------------


class _JsonlRows:
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


def _open(
    source: str, what: str, *, jsonl: bool, dataset_config: str | None, cache_dir: str | None
) -> dict[str, Any]:
    """The splits of ``source``, by name."""
    path = os.path.expanduser(source)
    suffix = os.path.splitext(path)[1].lower()
    if jsonl or (suffix == ".jsonl" and os.path.isfile(path)):
        if not os.path.isfile(path):
            raise ConfigError(f"{what}: no such file")
        return {"train": _JsonlRows(path, what)}
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


def _select(splits: dict[str, Any], spec: str, what: str) -> list[tuple[Any, int, int]]:
    """``(rows, start, stop)`` of each part of split spec ``spec`` (``train``, ``train[-64:]``,
    ``train[:10%]+test``), in order."""
    from datasets import ReadInstruction

    named = [s.strip().split("[")[0].strip() for s in spec.split("+")]
    unknown = [s for s in named if s not in splits]
    if unknown:
        raise ConfigError(
            f"split {spec!r}: {what} has no split {_names(unknown)} (its splits: {_names(list(splits))})"
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
                f"split {spec!r} of {what} joins splits whose columns differ ({_names(columns)} and "
                f"{_names(rows.columns)})"
            )
    return parts


def _rows(parts: list[tuple[Any, int, int]], columns: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of every selected row, in order, holding ``columns`` only."""
    for rows, start, stop in parts:
        for a in range(start, stop, _CHUNK):
            b = min(a + _CHUNK, stop)
            for i, row in enumerate(rows.batch(a, b, columns), a):
                yield rows.where(i), row


# -- one row ----------------------------------------------------------------------------------


def _prompt_text(
    row: dict[str, Any],
    where: str,
    column: str,
    tokenizer: Tokenizer,
    chat_template: bool,
    system_prompt: str | None,
    errors: list[str],
) -> str | None:
    """The prompt of ``row`` as the policy sees it, or None after recording what is wrong."""
    value = row[column]
    if isinstance(value, str):
        if not value:
            errors.append(f'{where}: "{column}" is empty: expected a non-empty string')
            return None
        if not chat_template:
            return value
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and chat_template:
        checked = _messages(value, where, column, errors)
        if checked is None:
            return None
        messages = checked
    else:
        if isinstance(value, list):
            expected = "a string, or a list of messages with data.chat_template=true"
        elif chat_template:
            expected = 'a non-empty string or a list of {"role": ..., "content": ...} messages'
        else:
            expected = "a non-empty string"
        errors.append(
            f'{where}: "{column}" holds {_short(value)} ({type(value).__name__}): expected {expected}'
        )
        return None
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    try:
        return tokenizer.apply_chat_template(messages)  # type: ignore[attr-defined]
    except Exception as ex:  # a template raises what its Jinja code raises
        errors.append(f"{where}: the chat template failed on this row's messages: {ex}")
        return None


def _raw_prompt(value: Any) -> str:
    """A row's prompt as written: the string, or a chat-format row's last user message."""
    if isinstance(value, str):
        return value
    users = [m["content"] for m in value if m.get("role") == "user"]
    return users[-1] if users else value[-1]["content"]


def _messages(value: list, where: str, column: str, errors: list[str]) -> list[dict[str, str]] | None:
    """A chat-format row's messages (keys a data set filled with None dropped), or None after
    recording what is wrong."""
    out = []
    for k, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            errors.append(
                f'{where}: "{column}" message {k} is {_short(m)}: expected {{"role": <string>, "content": '
                "<string>}"
            )
            return None
        out.append({n: v for n, v in m.items() if v is not None})
    if not out:
        errors.append(f'{where}: "{column}" is an empty list of messages')
        return None
    if out[-1]["role"] == "assistant":
        # The generation prompt would follow the answer: the policy would be shown it.
        errors.append(
            f'{where}: "{column}" ends with an assistant message: expected the conversation up to the turn '
            "the policy answers (drop the final assistant message, or keep it in another column)"
        )
        return None
    return out


def _extras_json(row: dict[str, Any], columns: list[str], where: str, errors: list[str]) -> str | None:
    """``row``'s ``columns`` as a compact JSON object with sorted keys, or None after recording
    the column whose value JSON cannot hold."""
    obj = {c: row[c] for c in columns}
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        pass
    for c in columns:
        try:
            json.dumps(row[c], allow_nan=False)
        except (TypeError, ValueError) as ex:
            value = row[c]
            reason = "JSON has no NaN or infinity" if _non_finite(value) else str(ex)
            errors.append(
                f"{where}: extra column {c!r} holds {_short(value)} ({type(value).__name__}), which is not "
                f"JSON-serialisable ({reason}): leave it out of data.extra_columns"
            )
            return None
    return None  # pragma: no cover - some column failed above


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names) if names else "none"
