"""The wire contract's errors, the marks that tell them apart, and how a client reads them back
out of Triton's error text without trusting anything a request sent.

Every error a server raises reaches the client inside Triton's text (wrapped in a traceback);
the mark its message starts with says what it is: :data:`ERROR_MARK` a request that breaks the
contract, :data:`FENCED_MARK` a server that holds another critic step than the request expects,
:data:`UNAUTHORIZED_MARK` a mutating request without the run token. Three more marks are no
errors of the caller's: :data:`BATCH_PEER_MARK`, :data:`UNAVAILABLE_MARK` and
:data:`OVERLOADED_MARK` (retry).

Why a peer cannot forge a mark (docs/design.md, "Wire protocol", "Errors"). Two rules, each
enough on its own against text a request supplied:

1. *The server composes every message it raises*, and picks its mark by the exception's type,
   never by its text (:func:`wire_text`); whatever came from a request is echoed only through
   :func:`neutralize` (or :func:`quote`): control characters escaped (so it cannot start a line
   of the traceback), every ``[critic`` turned into ``(critic`` (so it holds no mark), and cut
   to a few hundred characters. A merged execution's neighbours get a :class:`BatchPeerError`
   that holds only counts and input names the server chose.
2. *The client reads a mark only where the server's message starts* (:func:`server_message`):
   at the start of Triton's text (after tritonclient's ``[StatusCode...]``/``[500]``) or at the
   start of a line, right after the exception's name (``ProtocolError: [critic] ...``); a mark
   anywhere else is text, not a mark. :func:`extract_error`, :func:`extract_fenced` and
   :func:`extract_unauthorized` read that message only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "ERROR_MARK",
    "BATCH_PEER_MARK",
    "UNAVAILABLE_MARK",
    "OVERLOADED_MARK",
    "FENCED_MARK",
    "UNAUTHORIZED_MARK",
    "MARK_KINDS",
    "RUN_TOKEN_ENV",
    "ProtocolError",
    "FencedError",
    "OtherInstanceError",
    "UnauthorizedError",
    "BatchPeerError",
    "neutralize",
    "quote",
    "mark_of",
    "wire_text",
    "server_message",
    "error_kind",
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

OVERLOADED_MARK = "[critic-overloaded] "
"""Prefix of the error a valid request gets from a server whose memory budget its work would pass
(``server.memory_budget_gb``): nothing was run; retry after a backoff."""

FENCED_MARK = "[critic-fenced] "
"""Prefix of :class:`FencedError`: the server holds another critic step than the request expects."""

UNAUTHORIZED_MARK = "[critic-unauthorized] "
"""Prefix of :class:`UnauthorizedError`: a mutating request without the server's run token."""

MARK_KINDS: dict[str, str] = {
    FENCED_MARK: "fenced",
    UNAUTHORIZED_MARK: "unauthorized",
    BATCH_PEER_MARK: "peer",
    UNAVAILABLE_MARK: "unavailable",
    OVERLOADED_MARK: "overloaded",
    ERROR_MARK: "request",
}
"""Each mark and the kind of failure a client reads in it (:func:`error_kind`)."""

RUN_TOKEN_ENV = "ALIGNER_RUN_TOKEN"
"""The environment variable that holds the run token (a file named by the configuration wins)."""

MESSAGE_MOST = 4000
"""The most characters of a message the server sends (the rest is cut, saying how much)."""

ECHO_MOST = 300
"""The most characters of a request's own value a message echoes."""

# ----------------------------------------------------------------------------------------------
# Echoing what a request sent
# ----------------------------------------------------------------------------------------------

_MARK_START = re.compile(r"\[(?=critic)", re.IGNORECASE)


def _escape(c: str) -> str:
    return c if c.isprintable() else c.encode("unicode_escape").decode("ascii")


def neutralize(text: str, most: int | None = ECHO_MOST) -> str:
    """``text`` made safe to put in a message the server sends: cut to ``most`` characters (None:
    uncut), control and other non-printable characters escaped (``\\n``, ``\\x00``, ``\\u2028``,
    so it never starts a line), and every ``[critic`` (any case) written ``(critic`` (so it holds
    no mark)."""
    text = str(text)
    cut = ""
    if most is not None and len(text) > most:
        cut = f"...({len(text) - most} more characters)"
        text = text[:most]
    if not text.isprintable():
        text = "".join(_escape(c) for c in text)
    return _MARK_START.sub("(", text) + cut


def quote(value: object, most: int = 60) -> str:
    """A value a request sent, as a message echoes it: the ``repr`` of a string's first ``most``
    characters (``...`` when cut), or the first ``most`` characters of another value's ``repr``,
    neutralized (:func:`neutralize`)."""
    if isinstance(value, str):
        shown = repr(value if len(value) <= most else value[:most] + "...")
    else:
        shown = repr(value)
        shown = shown if len(shown) <= most else shown[:most] + "..."
    return neutralize(shown, None)


# ----------------------------------------------------------------------------------------------
# The errors
# ----------------------------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A request broke the contract; the message names the model, field, expectation and value
    (every part neutralized: :func:`neutralize`)."""

    def __init__(self, model: str, field: str, expected: str, got: str) -> None:
        model, field = neutralize(model, 100), neutralize(field, 100)
        expected, got = neutralize(expected, 1000), neutralize(got, ECHO_MOST)
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
        self.model, self.field = neutralize(model, 100), "expected_step"
        self.expected, self.got = f"critic step {critic_step}", f"expected_step={expected_step}"
        self.step, self.expected_step, self.critic_step = int(step), int(expected_step), int(critic_step)
        ValueError.__init__(
            self,
            f"{FENCED_MARK}{self.model} step {self.step}: the request expects the server at critic step "
            f"{self.expected_step}, but it holds critic step {self.critic_step} (restarted or rolled "
            "back?); nothing applied",
        )


class OtherInstanceError(ProtocolError):
    """A critic_infer names the server instance its caller works with (``instance_id``), and this
    server is another process (it was restarted since): nothing was run. The message starts with
    :data:`FENCED_MARK`, as :class:`FencedError`'s does: the caller's server is gone.

    Attributes:
        asked: the instance the request named (neutralized).
        held: this server's instance.
    """

    def __init__(self, model: str, asked: str, held: str) -> None:
        self.model, self.field = neutralize(model, 100), "instance_id"
        self.asked, self.held = neutralize(asked, 64), neutralize(held, 64)
        self.expected, self.got = f"server instance {self.held}", f"instance_id={self.asked}"
        ValueError.__init__(
            self,
            f"{FENCED_MARK}{self.model}: the request is for server instance {self.asked}, but this is "
            f"server instance {self.held} (restarted since?); nothing run",
        )


class UnauthorizedError(ProtocolError):
    """A mutating request came without the server's run token, or with another one: nothing was
    applied. The message starts with :data:`UNAUTHORIZED_MARK` and never holds a token.

    ``missing``: True when no token came, False when another one did, None when not known (a
    client rebuilding the error from the server's text)."""

    def __init__(self, model: str, missing: bool | None = None) -> None:
        how = {True: "missing", False: "wrong", None: "missing or wrong"}[missing]
        self.model, self.field = neutralize(model, 100), "run_token"
        self.expected = "the run token of this server"
        self.got, self.missing = how, missing
        ValueError.__init__(
            self,
            f"{UNAUTHORIZED_MARK}{self.model}: the run token is {how}; this server applies critic_train, "
            f"critic_save and critic_load only with its run's token (${RUN_TOKEN_ENV}, or the file "
            "run_token_file names); nothing applied",
        )


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class BatchPeerError(ProtocolError):
    """What every request of a merged critic_infer execution gets when some of them broke the
    contract (PyTriton 0.7 fails an execution only as a whole): nothing was run, and a valid
    request may be retried. The message starts with :data:`BATCH_PEER_MARK` and holds only what
    the server chose: how many requests, which of them (by position) and the names of the fields
    they broke; nothing a request sent. A request that breaks the contract gets its own error,
    naming its value, when it runs alone.

    Args:
        model: the model (critic_infer).
        bad: ``(position in the execution, field name)`` of each request that broke the contract.
        merged: how many requests Triton merged into the execution.
    """

    def __init__(self, model: str, bad: Sequence[tuple[int, str]], merged: int) -> None:
        names = [(int(i), f if _NAME.fullmatch(f) else "?") for i, f in bad]
        shown = ", ".join(f"request {i}: field {f!r}" for i, f in names[:8])
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        self.model, self.field = neutralize(model, 100), names[0][1] if names else "?"
        self.expected = "requests that keep the contract in one execution"
        self.got = f"{len(names)} of {int(merged)} requests broke it"
        self.bad, self.merged = names, int(merged)
        ValueError.__init__(
            self,
            f"{BATCH_PEER_MARK}{self.model}: {len(names)} of {int(merged)} requests Triton merged into "
            f"this execution broke the contract ({shown}{more}); nothing was run: a valid request may "
            "be retried, and one that breaks the contract gets its own error when it runs alone",
        )


# ----------------------------------------------------------------------------------------------
# On the wire: the server's message, and where the client finds it
# ----------------------------------------------------------------------------------------------


def mark_of(exc: BaseException) -> str:
    """The mark the wire contract's own errors carry, chosen by type: ``""`` for any other."""
    for cls, mark in (
        (FencedError, FENCED_MARK),
        (OtherInstanceError, FENCED_MARK),
        (UnauthorizedError, UNAUTHORIZED_MARK),
        (BatchPeerError, BATCH_PEER_MARK),
        (ProtocolError, ERROR_MARK),
    ):
        if isinstance(exc, cls):
            return mark
    return ""


def wire_text(message: str, mark: str) -> str:
    """The message a server sends: ``mark`` (chosen by the error's type, ``""`` for none) and
    ``message`` without it, neutralized (:func:`neutralize`: no other mark, no line breaks,
    at most :data:`MESSAGE_MOST` characters)."""
    body = message[len(mark) :] if mark and message.startswith(mark) else message
    return mark + neutralize(body, MESSAGE_MOST)


_MARK_ALTERNATIVES = "|".join(re.escape(m) for m in MARK_KINDS)
_SERVER_MESSAGE = re.compile(
    r"(?:\A|\n|\\n)"  # a line start: Triton's text has real (or, escaped, literal) newlines
    r"(?:\[(?:StatusCode\.[A-Z_]+|\d{3})\] )?"  # tritonclient's status, at the text's start
    r"(?:[A-Za-z_][\w.]*: )?"  # the exception's qualified name, in a traceback's last line
    rf"((?:{_MARK_ALTERNATIVES})[^\n]*?)(?=\\n|\n|\Z)"
)


def server_message(text: str) -> str | None:
    """The message the server composed, cut out of Triton's error text (which wraps it in a
    traceback), when it starts with a mark: found only at the start of the text or of a line,
    right after the exception's name; None when there is none. Text a request sent never starts
    a line (the server escapes line breaks in what it echoes), so it cannot pass for one."""
    found = None
    for m in _SERVER_MESSAGE.finditer(text or ""):
        found = m.group(1)  # the last: the exception raised (the server chains none)
    return found.rstrip("\\ ") if found is not None else None


def error_kind(text: str) -> str | None:
    """'request', 'fenced', 'unauthorized', 'peer', 'unavailable' or 'overloaded': the kind the mark of the
    server's own message says (:func:`server_message`); None when it has no mark."""
    message = server_message(text)
    if message is None:
        return None
    return next(kind for mark, kind in MARK_KINDS.items() if message.startswith(mark))


def extract_error(text: str) -> str | None:
    """The server's marked message (contract, fenced, unauthorized, batch peer, unavailable)
    inside Triton's error text, or None (:func:`server_message`)."""
    return server_message(text)


_FENCED = re.compile(
    re.escape(FENCED_MARK) + r"(\w+) step (-?\d+): the request expects the server at critic step "
    r"(-?\d+), but it holds critic step (-?\d+)"
)
_UNAUTHORIZED = re.compile(re.escape(UNAUTHORIZED_MARK) + r"(\w+): the run token is (missing or wrong|\w+)")


def extract_fenced(text: str) -> FencedError | None:
    """The :class:`FencedError` a server raised, rebuilt from the server's message in Triton's
    error text, or None."""
    m = _FENCED.match(server_message(text) or "")
    if m is None:
        return None
    return FencedError(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def extract_unauthorized(text: str) -> UnauthorizedError | None:
    """The :class:`UnauthorizedError` a server raised, rebuilt from the server's message in
    Triton's error text, or None."""
    m = _UNAUTHORIZED.match(server_message(text) or "")
    if m is None:
        return None
    return UnauthorizedError(m.group(1), {"missing": True, "wrong": False}.get(m.group(2)))
