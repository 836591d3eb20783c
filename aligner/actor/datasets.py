"""Prompt data sets: the ``data`` section of the actor's config (:class:`DataConfig`), and the
actor's prompts (and what travels with them to the reward function) read from one of the sources
of :mod:`aligner.actor.sources` (a file, a saved data set folder or a hub data set).

Each row gives one prompt: its prompt column
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
from dataclasses import dataclass, field
from typing import Any

from aligner.actor.sources import (
    MAX_REPORTED,
    JsonlRows,
    iter_rows,
    looks_like_local_path,
    open_splits,
    quote_names,
    select_split,
)
from aligner.config_checks import ConfigError, Problems
from aligner.tokenizers import Tokenizer

__all__ = [
    "DataConfig",
    "PromptSet",
    "load_prompt_set",
    "training_prompt_set",
    "validation_prompt_set",
]


@dataclass
class DataConfig:
    """Where prompts come from: a built-in task, a JSONL prompt file, or a data set read with
    Hugging Face ``datasets`` (:func:`training_prompt_set`, :mod:`aligner.actor.sources`)."""

    task: str | None = "sort"
    """Built-in task ('copy', 'reverse', 'sort'); ignored when dataset or prompt_file is set."""
    num_digits: int = 6
    """Digits per prompt for the built-in tasks."""
    prompt_file: str | None = None
    """A JSONL file of {"prompt": ...} lines (a data set read line by line), used instead of a
    built-in task."""
    dataset: str | None = None
    """A data set used instead of a built-in task: a .json/.jsonl/.parquet/.csv file, a folder
    of them or one written by save_to_disk, or a hub data set name."""
    dataset_config: str | None = None
    """The hub data set's configuration name (null: its default)."""
    split: str = "train"
    """The split of the training prompts, or a slice of it as datasets writes one
    ('train[:90%]'); a single file is one split named 'train'."""
    val_split: str | None = None
    """Validation prompts from this split (or slice, e.g. 'test', 'train[-64:]') of the same
    data set; null: validation.prompt_file, else the first training prompts."""
    prompt_column: str = "prompt"
    """The column holding each row's prompt: a string, or (with chat_template) a list of
    {"role": ..., "content": ...} messages."""
    extra_columns: list[str] | None = None
    """Columns that travel with each prompt to the reward function (a JSON object per prompt);
    null: every column but the prompt column; []: none."""
    chat_template: bool = False
    """Render each prompt with the tokenizer's chat template (a user turn after the optional
    system_prompt, or the row's own messages) up to where the assistant's reply begins."""
    system_prompt: str | None = None
    """A system message put before each prompt (chat_template only; a row's own system message wins)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template reads, passed to ``apply_chat_template`` (chat_template only),
    e.g. ``{enable_thinking: false}`` for Qwen3's prompts without a thinking block."""
    max_prompts: int | None = None
    """Keep the first N prompts that fit the context (null: all)."""
    num_prompts: int = 100_000
    """Prompts drawn from a built-in task (an epoch of data)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (with the run's seed)."""
    balance_dp: bool = True
    """Under data parallelism, deal each step's prompts to the ranks by token count (longest
    first, snake order) so that every rank gets the same mix of lengths; false: contiguous
    slices of the drawn order."""

    def problems(self, max_new_tokens: int, max_seq_len: int, prefix: str = "data") -> Problems:
        """Where prompts come from, and whether a built-in task's prompt and answer fit in
        ``max_new_tokens`` and ``max_seq_len`` (a data set's too-long prompts are dropped and
        counted when it is read)."""
        e = Problems()
        if self.dataset is not None or self.prompt_file is not None:
            e += self._data_set_problems(prefix)
            return e
        for name in ("val_split", "dataset_config", "system_prompt", "max_prompts", "extra_columns"):
            e.expect(
                getattr(self, name) is None,
                f"{prefix}.{name}",
                getattr(self, name),
                f"null with the built-in task (it applies to {prefix}.dataset or {prefix}.prompt_file)",
            )
        for name in ("chat_template", "chat_template_kwargs"):
            e.expect(
                not getattr(self, name),
                f"{prefix}.{name}",
                getattr(self, name),
                f"{'false' if name == 'chat_template' else '{}'} with the built-in task (its prompts are "
                f"digits; set {prefix}.dataset for chat prompts)",
            )
        if self.task not in ("copy", "reverse", "sort"):
            e.append(
                f"{prefix}.task={self.task!r}: expected 'copy', 'reverse' or 'sort' (or set {prefix}.dataset "
                f"or {prefix}.prompt_file)"
            )
            return e
        prompt = self.num_digits + 1
        if prompt + max_new_tokens > max_seq_len:
            e.append(
                f"prompt ({prompt} tokens) + generation.max_new_tokens ({max_new_tokens}) = "
                f"{prompt + max_new_tokens} exceeds model.max_seq_len ({max_seq_len}) (the packaged "
                "defaults are sized for a model given by init_from and a data set; the digit tasks' "
                "CPU demo is +recipe=demo)"
            )
        if max_new_tokens < prompt:
            e.append(
                f"generation.max_new_tokens={max_new_tokens} cannot hold the answer to a "
                f"{self.num_digits}-digit {self.task} task plus end-of-sequence ({prompt})"
            )
        return e

    def _data_set_problems(self, prefix: str) -> Problems:
        """The data set keys on their own (what the data set holds is checked when it is read)."""
        e = Problems()
        if self.dataset is not None and self.prompt_file is not None:
            e.append(
                f"{prefix}.dataset={self.dataset!r} and {prefix}.prompt_file={self.prompt_file!r}: expected one "
                "of them (a JSONL prompt file can be given as data.dataset)"
            )
        if self.prompt_file is not None:
            e.existing_file(f"{prefix}.prompt_file", self.prompt_file)
        d = self.dataset
        if d is not None:
            local = looks_like_local_path(d)
            e.expect(
                isinstance(d, str) and d != "" and (not local or os.path.exists(os.path.expanduser(d))),
                f"{prefix}.dataset",
                d,
                "an existing .json/.jsonl/.parquet/.csv file, a data set folder, or a hub data set name",
            )
            e.expect(
                self.dataset_config is None or not local,
                f"{prefix}.dataset_config",
                self.dataset_config,
                f"null for a local {prefix}.dataset (it names a hub data set's configuration)",
            )
        elif self.dataset_config is not None:
            e.append(
                f"{prefix}.dataset_config={self.dataset_config!r}: expected null without {prefix}.dataset"
            )
        for name in ("split", "prompt_column"):
            v = getattr(self, name)
            e.expect(isinstance(v, str) and v.strip() != "", f"{prefix}.{name}", v, "a non-empty string")
        v = self.val_split
        e.expect(v is None or v.strip() != "", f"{prefix}.val_split", v, "a split name or slice, or null")
        cols = self.extra_columns
        e.expect(
            cols is None or (all(isinstance(c, str) and c for c in cols) and len(set(cols)) == len(cols)),
            f"{prefix}.extra_columns",
            cols,
            "a list of distinct column names, [] or null",
        )
        e.expect(
            self.system_prompt is None or self.chat_template,
            f"{prefix}.system_prompt",
            self.system_prompt,
            f"null without {prefix}.chat_template=true (a system message is part of a chat template)",
        )
        kw = self.chat_template_kwargs
        e.expect(
            isinstance(kw, dict) and all(isinstance(k, str) and k.isidentifier() for k in kw),
            f"{prefix}.chat_template_kwargs",
            kw,
            "a mapping of template variable names to values, e.g. {enable_thinking: false}",
        )
        e.expect(
            not kw or self.chat_template,
            f"{prefix}.chat_template_kwargs",
            kw,
            f"{{}} without {prefix}.chat_template=true (they are the chat template's variables)",
        )
        n = self.max_prompts
        e.expect(
            n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
            f"{prefix}.max_prompts",
            n,
            "a positive integer or null",
        )
        return e


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
    chat_template_kwargs: dict[str, Any] | None = None,
    max_prompts: int | None = None,
    jsonl: bool = False,
    cache_dir: str | None = None,
) -> PromptSet:
    """Read the prompts of ``source`` (the value of config key ``key``, named in every error).

    ``split``: the split (or slice, ``datasets`` syntax) to read; ``prompt_column``: the column
    that holds each prompt; ``extra_columns``: the columns whose values travel with each prompt
    (None: every column but the prompt column; []: none); ``chat_template``: render each prompt
    with the tokenizer's chat template, after ``system_prompt`` when set, with
    ``chat_template_kwargs`` as the template's variables; ``max_prompts``: keep
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
    if chat_template_kwargs and not chat_template:
        raise ConfigError(f"data.chat_template_kwargs={chat_template_kwargs!r} needs data.chat_template=true")
    template = (system_prompt, dict(chat_template_kwargs or {}))
    splits = open_splits(source, what, jsonl=jsonl, dataset_config=dataset_config, cache_dir=cache_dir)
    parts = select_split(splits, split, what)
    columns = parts[0][0].columns
    total = sum(to - start for _, start, to in parts)
    if total == 0:
        expected = (
            ' (expected JSONL lines like {"prompt": "..."})' if isinstance(parts[0][0], JsonlRows) else ""
        )
        raise ConfigError(f"{what} holds no prompts: split {split!r} has no rows{expected}")
    if prompt_column not in columns:
        raise ConfigError(
            f"{what} has no column {prompt_column!r} (its columns: {quote_names(columns)}): expected an "
            f'object with a non-empty string "{prompt_column}" in each row, or data.prompt_column naming the '
            "column that holds the prompts"
        )
    if extra_columns is None:
        extra = [c for c in columns if c != prompt_column]
    else:
        missing = [c for c in extra_columns if c not in columns]
        if missing:
            raise ConfigError(
                f"data.extra_columns={list(extra_columns)!r}: {what} has no column(s) {quote_names(missing)} "
                f"(its columns: {quote_names(columns)})"
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
    for where, row in iter_rows(parts, needed):
        read += 1
        text = _prompt_text(row, where, prompt_column, tokenizer, chat_template, template, errors)
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
        "chat_template_kwargs": dict(data.chat_template_kwargs or {}),
    }


# -- one row ----------------------------------------------------------------------------------


def _prompt_text(
    row: dict[str, Any],
    where: str,
    column: str,
    tokenizer: Tokenizer,
    chat_template: bool,
    template: tuple[str | None, dict[str, Any]],
    errors: list[str],
) -> str | None:
    """The prompt of ``row`` as the policy sees it, or None after recording what is wrong.
    ``template``: the system prompt (or None) and the chat template's variables."""
    system_prompt, template_kwargs = template
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
        return tokenizer.apply_chat_template(messages, **template_kwargs)  # type: ignore[attr-defined]
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
    except (TypeError, ValueError, RecursionError):
        pass
    for c in columns:
        try:
            json.dumps(row[c], allow_nan=False)
        except (TypeError, ValueError, RecursionError) as ex:
            value = row[c]
            if isinstance(ex, RecursionError):
                reason = "nested deeper than JSON can be written here"
            else:
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
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deep to show"
    return text if len(text) <= 80 else text[:77] + "..."
