"""The checks every request passes, on the client before sending and on the server before
anything runs: each names the model, the field, what was expected and what came
(:class:`~aligner.wire.protocol.errors.ProtocolError`). Shapes: ``b`` batch, ``s`` padded length.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from aligner.wire.protocol.errors import ProtocolError
from aligner.wire.protocol.messages import InferRequest, TrainRequest
from aligner.wire.protocol.spec import INFER, TRAIN, Limits

__all__ = [
    "as_numpy",
    "validate_infer",
    "validate_texts",
    "validate_train",
    "validate_step",
    "validate_expected_step",
]


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


def _short(text: str, most: int = 60) -> str:
    return repr(text if len(text) <= most else text[:most] + "...")


def validate_texts(name: str, texts: Any, b: int) -> list[str]:
    """One of critic_infer's optional inputs (``prompt_text``, ``response_text``, ``extras``) as
    ``b`` strings: a list of str, or (on the wire) a BYTES array ``[b, 1]`` or ``[b]`` of UTF-8;
    ``extras`` rows must each be a JSON object.

    Raises:
        ProtocolError: naming the input, the row and what was expected.
    """
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
        items, got = a.tolist(), f"{a.shape[0]} rows"
    if len(items) != b:
        raise ProtocolError(
            INFER, name, f"{b} rows (one string per sample, shape [{b}, 1]) to match tokens' batch", got
        )
    out: list[str] = []
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
                INFER, name, "a string (UTF-8 bytes) in every row", f"row {i}: {type(v).__name__} {v!r:.60}"
            )
        if name == "extras":
            try:
                parsed = json.loads(v)
            except ValueError as e:
                raise ProtocolError(
                    INFER,
                    name,
                    "a JSON object in every row ('{}' for none)",
                    f"row {i}: invalid JSON ({e}): {_short(v)}",
                ) from None
            if not isinstance(parsed, dict):
                raise ProtocolError(
                    INFER,
                    name,
                    "a JSON object in every row (the sample's extra data-set columns; '{}' for none)",
                    f"row {i}: a JSON {type(parsed).__name__}: {_short(v)}",
                )
        out.append(str(v))
    return out


def validate_infer(
    tokens: Any,
    lengths: Any,
    prompt_lengths: Any,
    limits: Limits,
    *,
    prompt_text: Any = None,
    response_text: Any = None,
    extras: Any = None,
    require: Mapping[str, str] | None = None,
) -> InferRequest:
    """Check a critic_infer request and return it typed (lengths as ``[b]``).

    Args:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` or ``[b, 1]`` int64.
        prompt_lengths: ``[b]`` or ``[b, 1]`` int64.
        prompt_text, response_text, extras: the optional inputs (:func:`validate_texts`), or None.
        require: optional inputs the server needs -> why (a request without one is refused).

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
    given = {"prompt_text": prompt_text, "response_text": response_text, "extras": extras}
    for name, why in (require or {}).items():
        if given.get(name) is None:
            raise ProtocolError(
                INFER,
                name,
                f"the input {name!r} (BYTES [{b}, 1], one string per sample): {why}",
                "a request without it",
            )
    texts = {k: None if v is None else validate_texts(k, v, b) for k, v in given.items()}
    return InferRequest(
        tokens, lengths, prompt_lengths, texts["prompt_text"], texts["response_text"], texts["extras"]
    )


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
