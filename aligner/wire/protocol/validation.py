"""The checks every request passes, on the client before sending and on the server before
anything runs: each names the model, the field, what was expected and what came
(:class:`~aligner.wire.protocol.errors.ProtocolError`). Shapes: ``b`` batch, ``s`` padded length.

What a request may not be however well formed: larger than :class:`InputLimits` allow (the
server's ``limits`` section). Those checks run on sizes alone, before anything is decoded or
parsed: the bytes of each row and of each input, then the JSON nesting depth of an ``extras``
row (by counting brackets outside strings, no recursion), then, parsed, its keys. A refusal
echoes what came only cut and neutralized (:func:`~aligner.wire.protocol.errors.quote`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aligner.wire.protocol.errors import ProtocolError, neutralize, quote
from aligner.wire.protocol.messages import InferRequest, TrainRequest
from aligner.wire.protocol.spec import ANY_CRITIC_STEP, INFER, TRAIN, Limits

__all__ = [
    "InputLimits",
    "json_depth",
    "as_numpy",
    "validate_infer",
    "validate_after_step",
    "validate_instance_id",
    "INSTANCE_ID_MOST",
    "validate_texts",
    "validate_train",
    "validate_step",
    "validate_expected_step",
]


@dataclass
class InputLimits:
    """How large critic_infer's text inputs may be (``prompt_text``, ``response_text``,
    ``extras``), checked by the server before it decodes or parses anything. Rows per request are
    bounded by ``server.max_batch_size`` and tokens per row by ``max_seq_len``
    (:class:`~aligner.wire.protocol.spec.Limits`)."""

    max_extras_bytes: int = 64 * 1024
    """Most bytes of one row of ``extras`` (one sample's JSON object)."""
    max_text_bytes: int = 256 * 1024
    """Most bytes of one row of ``prompt_text`` or ``response_text``."""
    max_input_bytes: int = 16 * 1024 * 1024
    """Most bytes of one text input, all its rows together."""
    max_json_depth: int = 32
    """Deepest nesting of arrays and objects in an ``extras`` row (the row's object is depth 1)."""
    max_extras_keys: int = 256
    """Most keys of one ``extras`` object, and most columns (distinct keys) over a request's rows:
    each column becomes a keyword argument of the reward function."""

    def per_row(self, name: str) -> tuple[int, str]:
        """The most bytes of one row of input ``name``, and the key that sets it."""
        if name == "extras":
            return self.max_extras_bytes, "max_extras_bytes"
        return self.max_text_bytes, "max_text_bytes"


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_depth(text: str) -> int:
    """How deeply ``text`` (JSON) nests arrays and objects (``{}`` is 1, ``{"a": [1]}`` 2),
    counted over the brackets outside strings, without recursion and without parsing it."""
    if text.count("[") + text.count("{") <= 1:
        return min(1, text.count("[") + text.count("{"))
    bare = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8"), dtype=np.uint8)
    step = np.isin(bare, _OPEN).astype(np.int32) - np.isin(bare, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def as_numpy(x: Any) -> np.ndarray:
    """A NumPy view of a NumPy array, torch tensor (any device) or nested list."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _describe(a: np.ndarray) -> str:
    return f"dtype {a.dtype} shape {list(a.shape)}"


def _first_bad(bad: np.ndarray, values: np.ndarray) -> str:
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    v = values[idx]
    return f"{v.item()!r} at index {list(idx)} ({int(bad.sum())} such element(s))"


def _check_array(model: str, name: str, a: Any, dtype: type, ndim: int) -> np.ndarray:
    a = as_numpy(a)
    if a.dtype != np.dtype(dtype):
        raise ProtocolError(model, name, f"dtype {np.dtype(dtype)}", _describe(a))
    if a.ndim != ndim:
        raise ProtocolError(model, name, f"rank {ndim}", _describe(a))
    return a


def _column(model: str, name: str, a: Any, b: int) -> np.ndarray:
    """Accept ``[b]`` or ``[b, 1]`` int64 and return ``[b]``."""
    a = as_numpy(a)
    if a.dtype != np.int64:
        raise ProtocolError(model, name, "dtype int64", _describe(a))
    if a.shape not in ((b,), (b, 1)):
        raise ProtocolError(model, name, f"shape [{b}, 1] (or [{b}]) to match tokens' batch", _describe(a))
    return a.reshape(b)


def _check_tokens(model: str, tokens: Any, limits: Limits, max_batch: int) -> np.ndarray:
    tokens = _check_array(model, "tokens", tokens, np.int64, 2)
    b, s = tokens.shape
    if b == 0:
        raise ProtocolError(
            model, "tokens", "at least one row (b >= 1)", "an empty batch, shape " + str([b, s])
        )
    if b > max_batch:
        raise ProtocolError(
            model, "tokens", f"at most {max_batch} rows (the server's batch limit)", f"{b} rows"
        )
    if s < 2:
        raise ProtocolError(
            model, "tokens", "padded length s >= 2 (a prompt token and a response token)", f"s={s}"
        )
    if s > limits.max_seq_len:
        raise ProtocolError(model, "tokens", f"padded length s <= max_seq_len={limits.max_seq_len}", f"s={s}")
    bad = (tokens < 0) | (tokens >= limits.vocab_size)
    if bad.any():
        raise ProtocolError(model, "tokens", f"ids in [0, {limits.vocab_size})", _first_bad(bad, tokens))
    return tokens


def _check_lengths(model: str, lengths: Any, b: int, s: int) -> np.ndarray:
    lengths = _column(model, "lengths", lengths, b)
    bad = (lengths < 2) | (lengths > s)
    if bad.any():
        raise ProtocolError(model, "lengths", f"2 <= length <= padded length {s}", _first_bad(bad, lengths))
    return lengths


def _rows(name: str, texts: Any, b: int) -> list[Any]:
    """The ``b`` rows of a text input as they came (a list of str, or BYTES ``[b, 1]``/``[b]``)."""
    if isinstance(texts, (list, tuple)):
        items, got = list(texts), f"{len(texts)} rows"
    else:
        a = as_numpy(texts)
        if a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        if a.ndim != 1:
            raise ProtocolError(
                INFER, name, f"shape [{b}, 1] (one string per sample)", f"shape {list(as_numpy(texts).shape)}"
            )
        items, got = list(a), f"{a.shape[0]} rows"  # the row objects themselves, nothing copied
    if len(items) != b:
        raise ProtocolError(
            INFER, name, f"{b} rows (one string per sample, shape [{b}, 1]) to match tokens' batch", got
        )
    return items


def _check_sizes(name: str, items: list[Any], limits: InputLimits) -> None:
    """Each row's bytes and the input's, before anything is decoded (a str counts its UTF-8)."""
    most, key = limits.per_row(name)
    total = 0
    for i, v in enumerate(items):
        if isinstance(v, (bytes, np.bytes_)):
            n = len(v)
        elif isinstance(v, str):
            n = len(v) if v.isascii() else len(v.encode("utf-8"))
        else:
            raise ProtocolError(
                INFER, name, "a string (UTF-8 bytes) in every row", f"row {i}: {type(v).__name__}"
            )
        if n > most:
            raise ProtocolError(
                INFER,
                name,
                f"at most {most} bytes per row (the server's limits.{key})",
                f"row {i}: {n} bytes",
            )
        total += n
    if total > limits.max_input_bytes:
        raise ProtocolError(
            INFER,
            name,
            f"at most {limits.max_input_bytes} bytes in all rows together (the server's limits.max_input_bytes)",
            f"{total} bytes in {len(items)} rows",
        )


def _parse_extras(i: int, v: str, limits: InputLimits | None) -> dict[str, Any]:
    """Row ``i`` of ``extras`` as a dict: depth bounded before parsing, keys after."""
    name = "extras"
    # Fewer brackets than the limit cannot nest deeper: most rows are never scanned.
    if limits is not None and v.count("[") + v.count("{") > limits.max_json_depth:
        depth = json_depth(v)
        if depth > limits.max_json_depth:
            raise ProtocolError(
                INFER,
                name,
                f"JSON nested at most {limits.max_json_depth} deep (the server's limits.max_json_depth)",
                f"row {i}: nested {depth} deep",
            )
    try:
        parsed = json.loads(v)
    except RecursionError:  # deeper than the parser goes (a caller without limits)
        raise ProtocolError(
            INFER, name, "JSON nested no deeper than the parser takes", f"row {i}: nested deeper"
        ) from None
    except ValueError as e:
        raise ProtocolError(
            INFER,
            name,
            "a JSON object in every row ('{}' for none)",
            f"row {i}: invalid JSON ({neutralize(str(e), 120)}): {quote(v)}",
        ) from None
    if not isinstance(parsed, dict):
        raise ProtocolError(
            INFER,
            name,
            "a JSON object in every row (the sample's extra data-set columns; '{}' for none)",
            f"row {i}: a JSON {type(parsed).__name__}: {quote(v)}",
        )
    if limits is not None and len(parsed) > limits.max_extras_keys:
        raise ProtocolError(
            INFER,
            name,
            f"at most {limits.max_extras_keys} keys per object (the server's limits.max_extras_keys)",
            f"row {i}: {len(parsed)} keys",
        )
    return parsed


def validate_texts(name: str, texts: Any, b: int, limits: InputLimits | None = None) -> list[str]:
    """One of critic_infer's optional inputs (``prompt_text``, ``response_text``, ``extras``) as
    ``b`` strings: a list of str, or (on the wire) a BYTES array ``[b, 1]`` or ``[b]`` of UTF-8;
    ``extras`` rows must each be a JSON object.

    Args:
        limits: the sizes allowed (:class:`InputLimits`), checked before anything is decoded;
            None checks none (a caller that trusts its input).

    Raises:
        ProtocolError: naming the input, the row and what was expected.
    """
    items = _rows(name, texts, b)
    if limits is not None:
        _check_sizes(name, items, limits)
    out: list[str] = []
    columns: set[str] = set()
    for i, v in enumerate(items):
        if isinstance(v, (bytes, np.bytes_)):
            try:
                v = bytes(v).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError(
                    INFER, name, "valid UTF-8 in every row", f"row {i}: {e.reason} at byte {e.start}"
                ) from None
        elif not isinstance(v, str):
            raise ProtocolError(
                INFER, name, "a string (UTF-8 bytes) in every row", f"row {i}: {type(v).__name__} {quote(v)}"
            )
        if name == "extras":
            columns.update(_parse_extras(i, v, limits))
        out.append(str(v))
    if limits is not None and len(columns) > limits.max_extras_keys:
        raise ProtocolError(
            INFER,
            name,
            f"at most {limits.max_extras_keys} columns (distinct keys) over the request's rows, each a "
            "keyword argument of the reward function (the server's limits.max_extras_keys)",
            f"{len(columns)} columns",
        )
    return out


def validate_after_step(after_step: Any, b: int) -> int:
    """critic_infer's ``after_step`` as one int: an int, or int64 ``[b, 1]`` (or ``[b]``) holding
    the same step in every row (one request, one critic step), >= -1; None (a request without it:
    a bare tritonclient, a tool written before it) asks for none, as
    :data:`~aligner.wire.protocol.spec.ANY_CRITIC_STEP` does.

    Raises:
        ProtocolError: naming ``after_step``, what was expected and what came.
    """
    name = "after_step"
    if after_step is None:
        return ANY_CRITIC_STEP
    if isinstance(after_step, (int, np.integer)) and not isinstance(after_step, bool):
        steps = np.full(b, int(after_step), dtype=np.int64)
    else:
        steps = _column(INFER, name, after_step, b)
    if (steps != steps[0]).any():
        i = int(np.flatnonzero(steps != steps[0])[0])
        raise ProtocolError(
            INFER,
            name,
            "the same step in every row (one request, one critic step)",
            f"{int(steps[0])} in row 0 and {int(steps[i])} in row {i}",
        )
    value = int(steps[0])
    if value < ANY_CRITIC_STEP:
        raise ProtocolError(
            INFER, name, f"a critic step >= 0, or {ANY_CRITIC_STEP} for any", f"after_step={value}"
        )
    return value


INSTANCE_ID_MOST = 64
"""The most bytes of critic_infer's ``instance_id`` (a server's is 32 hex digits)."""
_INSTANCE_ID = re.compile(r"[0-9A-Za-z_.-]+")


def validate_instance_id(instance_id: Any, b: int) -> str | None:
    """critic_infer's ``instance_id`` as one str: a str, or BYTES ``[b, 1]`` (or ``[b]``) holding
    the same id in every row, each at most :data:`INSTANCE_ID_MOST` bytes of letters, digits,
    ``_``, ``.`` and ``-`` (sizes checked before anything is decoded or compared). None, or an
    empty id (in every row): the request names no instance, and any server answers it.

    Raises:
        ProtocolError: naming ``instance_id``, what was expected and what came.
    """
    name, want = "instance_id", f"BYTES [{b}, 1]: one server instance id, the same in every row"
    if instance_id is None:
        return None
    if isinstance(instance_id, str):
        items: list[Any] = [instance_id]
    else:
        a = as_numpy(instance_id)
        if a.dtype.kind not in "SO" or a.shape not in ((b,), (b, 1)):
            raise ProtocolError(INFER, name, want, _describe(a))
        items = list(a.reshape(b))
    for i, v in enumerate(items):
        if not isinstance(v, (bytes, np.bytes_, str)):
            raise ProtocolError(INFER, name, want, f"row {i}: {type(v).__name__}")
        if len(v) > INSTANCE_ID_MOST:
            raise ProtocolError(INFER, name, f"at most {INSTANCE_ID_MOST} bytes", f"row {i}: {len(v)} bytes")
    first = items[0]
    if any(v != first for v in items[1:]):
        i = next(i for i, v in enumerate(items) if v != first)
        raise ProtocolError(
            INFER, name, "the same id in every row (one request, one server)", f"row {i} differs"
        )
    text = first if isinstance(first, str) else bytes(first).decode("ascii", "replace")
    if not text:
        return None
    if not _INSTANCE_ID.fullmatch(text):
        raise ProtocolError(
            INFER, name, "letters, digits, '_', '.' and '-' (a server's instance_id)", quote(text)
        )
    return text


def validate_infer(
    tokens: Any,
    lengths: Any,
    prompt_lengths: Any,
    limits: Limits,
    *,
    prompt_text: Any = None,
    response_text: Any = None,
    extras: Any = None,
    after_step: Any = None,
    instance_id: Any = None,
    require: Mapping[str, str] | None = None,
    input_limits: InputLimits | None = None,
) -> InferRequest:
    """Check a critic_infer request and return it typed (lengths as ``[b]``).

    Args:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` or ``[b, 1]`` int64.
        prompt_lengths: ``[b]`` or ``[b, 1]`` int64.
        prompt_text, response_text, extras: the optional inputs (:func:`validate_texts`), or None.
        after_step: the critic step the values must come from (:func:`validate_after_step`): an
            int, or int64 ``[b, 1]``; None: any.
        instance_id: the server instance the caller works with (:func:`validate_instance_id`);
            None: any.
        require: optional inputs the server needs -> why (a request without one is refused).
        input_limits: how large the text inputs may be (:class:`InputLimits`; the server passes
            its own); None checks no sizes.

    Raises:
        ProtocolError: naming the first field that breaks the contract.
    """
    tokens = _check_tokens(INFER, tokens, limits, limits.max_batch)
    b, s = tokens.shape
    lengths = _check_lengths(INFER, lengths, b, s)
    prompt_lengths = _column(INFER, "prompt_lengths", prompt_lengths, b)
    bad = (prompt_lengths < 1) | (prompt_lengths >= lengths)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        raise ProtocolError(
            INFER,
            "prompt_lengths",
            "1 <= prompt_length < length (at least one response token)",
            f"prompt_length {int(prompt_lengths[i])} with length {int(lengths[i])} at row {i} "
            f"({int(bad.sum())} such row(s))",
        )
    step = validate_after_step(after_step, b)
    instance = validate_instance_id(instance_id, b)
    given = {"prompt_text": prompt_text, "response_text": response_text, "extras": extras}
    for name, why in (require or {}).items():
        if given.get(name) is None:
            raise ProtocolError(
                INFER,
                name,
                f"the input {name!r} (BYTES [{b}, 1], one string per sample): {why}",
                "a request without it",
            )
    texts = [None if v is None else validate_texts(k, v, b, input_limits) for k, v in given.items()]
    return InferRequest(tokens, lengths, prompt_lengths, *texts, step, instance)


def _scalar(model: str, name: str, x: Any) -> int:
    """An int, or an int64 array of shape ``[1, 1]``, as an int."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    a = as_numpy(x)
    if a.dtype != np.int64:
        raise ProtocolError(model, name, "dtype int64", _describe(a))
    if a.shape != (1, 1):
        raise ProtocolError(model, name, "shape [1, 1]", _describe(a))
    return int(a[0, 0])


def validate_step(model: str, step: Any) -> int:
    """``step``: an int or an int64 array of shape ``[1, 1]``; must be >= 0."""
    value = _scalar(model, "step", step)
    if value < 0:
        raise ProtocolError(model, "step", "step >= 0", f"step={value}")
    return value


def validate_expected_step(model: str, expected_step: Any) -> int:
    """``expected_step``: an int or an int64 array of shape ``[1, 1]``; must be >= -1 (-1: a
    server that has applied no train step)."""
    value = _scalar(model, "expected_step", expected_step)
    if value < -1:
        raise ProtocolError(
            model, "expected_step", "expected_step >= -1 (-1: a server that applied nothing)", f"{value}"
        )
    return value


def validate_train(
    tokens: Any,
    lengths: Any,
    returns: Any,
    old_values: Any,
    mask: Any,
    step: Any,
    expected_step: Any,
    limits: Limits,
) -> TrainRequest:
    """Check a critic_train request and return it typed.

    Args:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` or ``[b, 1]`` int64.
        returns, old_values: ``[b, s-1]`` float32, finite everywhere.
        mask: ``[b, s-1]`` float32 in {0, 1}, zero at ``t >= length-1``, at least one 1 per row.
        step: int or int64 ``[1, 1]``, >= 0.
        expected_step: int or int64 ``[1, 1]``, >= -1; None only in-process (see
            :class:`~aligner.wire.protocol.messages.TrainRequest`).

    Raises:
        ProtocolError: naming the first field that breaks the contract.
    """
    tokens = _check_tokens(TRAIN, tokens, limits, limits.max_train_batch)
    b, s = tokens.shape
    lengths = _check_lengths(TRAIN, lengths, b, s)
    arrays = {}
    for name, a in (("returns", returns), ("old_values", old_values), ("mask", mask)):
        a = _check_array(TRAIN, name, a, np.float32, 2)
        if a.shape != (b, s - 1):
            raise ProtocolError(TRAIN, name, f"shape [{b}, {s - 1}] (tokens' [b, s-1])", _describe(a))
        bad = ~np.isfinite(a)
        if bad.any():
            raise ProtocolError(
                TRAIN, name, "finite values everywhere (use 0 where the mask is 0)", _first_bad(bad, a)
            )
        arrays[name] = a
    m = arrays["mask"]
    bad = (m != 0) & (m != 1)
    if bad.any():
        raise ProtocolError(TRAIN, "mask", "values in {0, 1}", _first_bad(bad, m))
    positions = np.arange(s - 1)[None, :]
    beyond = (m != 0) & (positions >= (lengths[:, None] - 1))
    if beyond.any():
        i, t = (int(v) for v in np.argwhere(beyond)[0])
        raise ProtocolError(
            TRAIN,
            "mask",
            "0 at positions t >= length-1 (padding)",
            f"1 at [{i}, {t}] with length {int(lengths[i])}",
        )
    empty = m.sum(axis=1) == 0
    if empty.any():
        rows = [int(i) for i in np.flatnonzero(empty)[:8]]
        raise ProtocolError(
            TRAIN, "mask", "at least one response token (a 1) in every row", f"no 1 in row(s) {rows}"
        )
    step = validate_step(TRAIN, step)
    expected = None if expected_step is None else validate_expected_step(TRAIN, expected_step)
    return TrainRequest(tokens, lengths, arrays["returns"], arrays["old_values"], m, step, expected)
