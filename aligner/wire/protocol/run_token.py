"""The run token: the shared secret that lets a caller change the server's state.

``critic_train``, ``critic_save`` and ``critic_load`` carry it as ``run_token`` (BYTES ``[1]``,
UTF-8, empty for none); a server configured with a token refuses them without it
(:class:`~aligner.wire.protocol.errors.UnauthorizedError`), while ``critic_infer`` and
``server_info`` need none. Both roles read it the same way (:func:`resolve_run_token`): the file
their configuration names, else ``$ALIGNER_RUN_TOKEN``, else no token. No message ever holds it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from aligner.wire.protocol.errors import RUN_TOKEN_ENV, ProtocolError, UnauthorizedError

__all__ = ["resolve_run_token", "run_token_array", "validate_run_token", "check_run_token"]


def resolve_run_token(
    token_file: str | os.PathLike | None, key: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """The run token: the contents of ``token_file`` (surrounding whitespace stripped, so a
    trailing newline does not count) when set, else ``$ALIGNER_RUN_TOKEN``, else None (no token).

    Args:
        token_file: the file the configuration names (the file wins over the variable).
        key: the configuration key that names it, for messages (``server.run_token_file``).
        environ: where to read the variable (default ``os.environ``).

    Raises:
        ValueError: naming ``key`` and the file (never the token) when it cannot be read or holds
            nothing.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ValueError(f"{key}={str(token_file)!r} cannot be read: {why}") from None
        if not token:
            raise ValueError(f"{key}={str(token_file)!r} is empty: expected the run token")
        return token
    token = (os.environ if environ is None else environ).get(RUN_TOKEN_ENV, "").strip()
    return token or None


def run_token_array(token: str | None) -> np.ndarray:
    """The ``run_token`` input: BYTES ``[1]`` holding ``token`` as UTF-8 (empty for None)."""
    return np.array([(token or "").encode("utf-8")], dtype=np.object_)


def validate_run_token(model: str, a: Any) -> str:
    """The token a request carries (``""`` for none): a str, or a bytes array of one element
    (``[1]``; ``[1, 1]`` is accepted too) holding UTF-8.

    Raises:
        ProtocolError: on ``run_token`` when it is not that (the message shows no content).
    """
    if isinstance(a, str):
        return a
    a = np.asarray(a)
    if a.dtype.kind not in "SO" or a.size != 1 or a.ndim not in (1, 2):
        got = f"dtype {a.dtype} shape {list(a.shape)}"
        raise ProtocolError(model, "run_token", "BYTES of shape [1] (UTF-8, empty for none)", got)
    value = a.reshape(-1)[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        raise ProtocolError(model, "run_token", "UTF-8 bytes", "bytes that are not UTF-8") from None


def check_run_token(model: str, required: str | None, given: str) -> None:
    """Refuse a mutating request whose token is not ``required`` (None: any request passes).

    Raises:
        UnauthorizedError: naming ``model`` and whether the token was missing or wrong.
    """
    if required is None:
        return
    if not given:
        raise UnauthorizedError(model, missing=True)
    # Constant time: how long the comparison takes says nothing about the token.
    if not hmac.compare_digest(given.encode("utf-8"), required.encode("utf-8")):
        raise UnauthorizedError(model, missing=False)
