"""What the critic client sends and reads back: the caller's arrays and texts as checked, typed
requests (against what the server advertises in ``server_info``), cut into chunks the server
takes, and the responses as the caller's values and rewards.

:class:`~aligner.wire.client.RemoteCriticClient` is built on these; nothing here sends anything.
Shapes: ``b`` batch, ``s`` padded length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from aligner.wire.errors import CriticServerError
from aligner.wire.protocol import (
    ANY_CRITIC_STEP,
    INFER,
    OPTIONAL_INFER_INPUTS,
    TEXT_INPUTS,
    InferRequest,
    Limits,
    ServerInfo,
    as_numpy,
    error_kind,
    server_message,
    validate_infer,
)

__all__ = [
    "int64s",
    "float32s",
    "infer_request",
    "infer_chunks",
    "infer_result",
    "fenced_rows",
    "INFER_OUTPUTS",
]

INFER_OUTPUTS = ["values", "rewards", "error"]
"""What the client asks ``critic_infer`` for (``error`` too: see :func:`infer_result`)."""


def int64s(x: Any) -> np.ndarray:
    """``x`` (NumPy or torch) as a NumPy array, integers as int64 (anything else as it is, for
    the checks to name)."""
    a = as_numpy(x)
    if a.dtype.kind in "iu" and a.dtype != np.int64:
        a = a.astype(np.int64)
    return a


def float32s(x: Any) -> np.ndarray:
    """``x`` (NumPy or torch) as a NumPy array, floats as float32 (anything else as it is)."""
    a = as_numpy(x)
    return a.astype(np.float32) if a.dtype.kind == "f" and a.dtype != np.float32 else a


def infer_request(
    info: ServerInfo,
    url: str,
    tokens: Any,
    lengths: Any,
    prompt_lengths: Any,
    *,
    prompt_texts: list[str] | None = None,
    response_texts: list[str] | None = None,
    extras: list[str] | None = None,
    after_step: int = ANY_CRITIC_STEP,
) -> InferRequest:
    """The checked ``critic_infer`` request of a batch, with exactly the optional inputs the
    server at ``url`` needs (``info.infer_inputs``; ``extras`` as ``"{}"`` per row when it needs
    them and none are given), and ``after_step``, the critic step its values must come from.
    Any batch size passes: :func:`infer_chunks` cuts it to the server's ``max_batch_size``.

    Raises: ProtocolError if the batch breaks the contract; ValueError when the server needs the
    texts and they are not given."""
    tokens, lengths, prompt_lengths = int64s(tokens), int64s(lengths), int64s(prompt_lengths)
    limits = info.limits
    b = tokens.shape[0] if tokens.ndim == 2 else 0
    whole = Limits(limits.vocab_size, limits.max_seq_len, max(limits.max_batch, b), limits.max_train_batch)
    needs = set(info.infer_inputs or ())
    given = {"prompt_text": prompt_texts, "response_text": response_texts, "extras": extras}
    missing = [n for n in TEXT_INPUTS if n in needs and given[n] is None]
    if missing:
        text = (info.reward or {}).get("text") or {}
        raise ValueError(
            f"critic_infer to {url}: the server needs {missing} (server_info's infer_inputs): its "
            f"reward model reads text with a tokenizer of its own ({text.get('tokenizer')!r}, not the "
            "policy's), so each sample's prompt and response go as text: pass prompt_texts= and "
            "response_texts="
        )
    if "extras" in needs and extras is None:
        given["extras"] = ["{}"] * b
    send = {n: given[n] if n in needs else None for n in OPTIONAL_INFER_INPUTS}
    return validate_infer(tokens, lengths, prompt_lengths, whole, **send, after_step=after_step)


def infer_chunks(req: InferRequest, max_batch: int) -> Iterator[InferRequest]:
    """``req`` in requests of at most ``max_batch`` rows, in row order (each with its rows of
    every input)."""
    for start in range(0, req.tokens.shape[0], max_batch):
        yield req.rows(start, start + max_batch)


def _first_error(out: dict[str, np.ndarray]) -> str | None:
    """The first non-empty ``error`` row of one ``critic_infer`` response, as text, or None."""
    failed = [m for m in np.asarray(out.get("error", [])).reshape(-1) if m]
    if not failed:
        return None
    return failed[0].decode("utf-8", "replace") if isinstance(failed[0], bytes) else str(failed[0])


def fenced_rows(out: dict[str, np.ndarray]) -> str | None:
    """The server's fenced refusal of this request alone, in an execution Triton merged with
    others (its ``error`` rows start with the fenced mark: the request named another server
    instance than the one answering), or None. Only the mark at the start of the server's own
    message counts (:func:`~aligner.wire.protocol.server_message`)."""
    text = _first_error(out)
    return server_message(text) if text is not None and error_kind(text) == "fenced" else None


def infer_result(out: dict[str, np.ndarray], url: str) -> tuple[np.ndarray, np.ndarray]:
    """Values ``[b, s-1]`` and rewards ``[b]`` (float32) of one ``critic_infer`` response;
    CriticServerError when its ``error`` rows say this request's samples failed on their own
    (in an execution Triton merged with others)."""
    text = _first_error(out)
    if text is not None:
        raise CriticServerError(f"{INFER} failed on the critic server at {url}: {text}")
    missing = [name for name in ("values", "rewards") if out.get(name) is None]
    if missing:  # an error row with no message, or a server that is not ours
        raise CriticServerError(
            f"{INFER} answer from the critic server at {url} has no {' or '.join(missing)} output "
            "and names no error"
        )
    values = out["values"].astype(np.float32, copy=False)
    return values, out["rewards"].reshape(-1).astype(np.float32, copy=False)
