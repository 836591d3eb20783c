"""The wire contract's errors and the marks that tell them apart in Triton's error text.

Every error a server raises reaches the client inside Triton's text (often wrapped in a
traceback); the mark its message starts with says what it is: :data:`ERROR_MARK` a request that
breaks the contract, :data:`FENCED_MARK` a server that holds another critic step than the request
expects, :data:`UNAUTHORIZED_MARK` a mutating request without the run token. Two more marks are
no errors of the caller's: :data:`BATCH_PEER_MARK` and :data:`UNAVAILABLE_MARK` (retry).
:func:`extract_error`, :func:`extract_fenced` and :func:`extract_unauthorized` cut them out.
"""

from __future__ import annotations

import re

__all__ = [
    "ERROR_MARK",
    "BATCH_PEER_MARK",
    "UNAVAILABLE_MARK",
    "FENCED_MARK",
    "UNAUTHORIZED_MARK",
    "RUN_TOKEN_ENV",
    "ProtocolError",
    "FencedError",
    "UnauthorizedError",
    "extract_error",
    "extract_fenced",
    "extract_unauthorized",
]

ERROR_MARK = "[critic] "
"""Every contract error's message starts with this, so clients can cut it out of Triton's text."""

BATCH_PEER_MARK = "[critic-batch-peer] "
"""Prefix of the error a *valid* infer request gets when another request merged into the same
dynamic batch was invalid (PyTriton 0.7 can only fail a whole execution); safe to retry."""

UNAVAILABLE_MARK = "[critic-unavailable] "
"""Prefix of the error a valid request gets from a server that is shutting down and ran nothing:
retry once a server is ready again."""

FENCED_MARK = "[critic-fenced] "
"""Prefix of :class:`FencedError`: the server holds another critic step than the request expects."""

UNAUTHORIZED_MARK = "[critic-unauthorized] "
"""Prefix of :class:`UnauthorizedError`: a mutating request without the server's run token."""

RUN_TOKEN_ENV = "ALIGNER_RUN_TOKEN"
"""The environment variable that holds the run token (a file named by the configuration wins)."""


class ProtocolError(ValueError):
    """A request broke the contract; the message names the model, field, expectation and value."""

    def __init__(self, model: str, field: str, expected: str, got: str) -> None:
        self.model, self.field, self.expected, self.got = model, field, expected, got
        super().__init__(f"{ERROR_MARK}{model}: field {field!r}: expected {expected}, got {got}")


class FencedError(ProtocolError):
    """The server holds another critic step than the request expects (it restarted, or was
    rolled back): nothing was applied. The message starts with :data:`FENCED_MARK`.

    Attributes:
        step: the request's step (the train step id, or the step to save).
        expected_step: the critic step the request expected the server to hold.
        critic_step: the critic step the server holds.
    """

    def __init__(self, model: str, step: int, expected_step: int, critic_step: int) -> None:
        self.model, self.field = model, "expected_step"
        self.expected, self.got = f"critic step {critic_step}", f"expected_step={expected_step}"
        self.step, self.expected_step, self.critic_step = step, expected_step, critic_step
        ValueError.__init__(
            self,
            f"{FENCED_MARK}{model} step {step}: the request expects the server at critic step "
            f"{expected_step}, but it holds critic step {critic_step} (restarted or rolled back?); "
            "nothing applied",
        )


class UnauthorizedError(ProtocolError):
    """A mutating request came without the server's run token, or with another one: nothing was
    applied. The message starts with :data:`UNAUTHORIZED_MARK` and never holds a token.

    ``missing``: True when no token came, False when another one did, None when not known (a
    client rebuilding the error from the server's text)."""

    def __init__(self, model: str, missing: bool | None = None) -> None:
        how = {True: "missing", False: "wrong", None: "missing or wrong"}[missing]
        self.model, self.field, self.expected = model, "run_token", "the run token of this server"
        self.got, self.missing = how, missing
        ValueError.__init__(
            self,
            f"{UNAUTHORIZED_MARK}{model}: the run token is {how}; this server applies critic_train, "
            f"critic_save and critic_load only with its run's token (${RUN_TOKEN_ENV}, or the file "
            "run_token_file names); nothing applied",
        )


# One pattern for every mark of a caller's error: Triton quotes the message (\" or \n ends it).
_MARKED = re.compile(r"\[critic(?:-fenced|-unauthorized)?\] ?(?:.*?)(?=\\n|\n|\"|$)")
_FENCED = re.compile(
    re.escape(FENCED_MARK) + r"(\w+) step (-?\d+): the request expects the server at critic step "
    r"(-?\d+), but it holds critic step (-?\d+)"
)
_UNAUTHORIZED = re.compile(re.escape(UNAUTHORIZED_MARK) + r"(\w+): the run token is (missing or wrong|\w+)")


def extract_error(text: str) -> str | None:
    """The first marked error (contract, fenced or unauthorized) inside Triton's error text (which
    wraps it in tracebacks), or None."""
    m = _MARKED.search(text or "")
    return m.group(0).rstrip("\\ ") if m else None


def extract_fenced(text: str) -> FencedError | None:
    """The :class:`FencedError` a server raised, rebuilt from Triton's error text, or None."""
    m = _FENCED.search(text or "")
    if m is None:
        return None
    return FencedError(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def extract_unauthorized(text: str) -> UnauthorizedError | None:
    """The :class:`UnauthorizedError` a server raised, rebuilt from Triton's error text, or None."""
    m = _UNAUTHORIZED.search(text or "")
    if m is None:
        return None
    return UnauthorizedError(m.group(1), {"missing": True, "wrong": False}.get(m.group(2)))
