"""How the critic client's requests travel: one tritonclient connection per thread, the future a
request's caller waits on, bounded in time, and what a failed attempt means (:func:`classify`:
retried, or raised as which of the client's errors).

:class:`~aligner.wire.client.RemoteCriticClient` is built on these; nothing else uses them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from aligner.wire.errors import CriticTimeoutError
from aligner.wire.protocol import error_kind, server_message
from aligner.wire.tls import ClientTLS, grpc_client_options

__all__ = ["Connection", "CriticFuture", "run_into", "WIRE_DTYPES", "classify", "timed_out", "error_detail"]

T = TypeVar("T")


WIRE_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.object_): "BYTES"}


class Connection:
    """One tritonclient client (gRPC, gRPC with TLS, or HTTP) owned by one thread; ``tls``: what
    a ``grpcs`` client trusts and presents (:class:`~aligner.wire.tls.ClientTLS`)."""

    def __init__(self, scheme: str, hostport: str, timeout_s: float, tls: ClientTLS | None = None) -> None:
        self.scheme = scheme
        self.hostport = hostport
        self.timeout_s = timeout_s
        self.grpc = scheme != "http"
        if self.grpc:
            import tritonclient.grpc as mod

            self.client = mod.InferenceServerClient(hostport, **grpc_client_options(scheme, tls))
        else:
            import tritonclient.http as mod

            self.client = mod.InferenceServerClient(
                hostport, connection_timeout=timeout_s, network_timeout=timeout_s
            )
        self.mod = mod

    def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        timeout_s: float | None = None,
        attempt_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """One request, bounded by ``timeout_s`` (what is left of the caller's deadline) and by
        ``attempt_s`` (by default the connection's per-request timeout), over gRPC and HTTP alike."""
        mod = self.mod
        binary = {} if self.grpc else {"binary_data": True}
        ins = []
        for name, a in inputs.items():
            i = mod.InferInput(name, list(a.shape), WIRE_DTYPES[a.dtype])
            i.set_data_from_numpy(np.ascontiguousarray(a) if a.dtype != np.object_ else a, **binary)
            ins.append(i)
        outs = [mod.InferRequestedOutput(n, **binary) for n in outputs]
        limit = self.timeout_s if attempt_s is None else attempt_s
        limit = max(limit if timeout_s is None else min(limit, timeout_s), 0.001)
        if self.grpc:
            r = self.client.infer(model, ins, outputs=outs, client_timeout=limit)
        elif abs(limit - self.timeout_s) < 1e-3:
            r = self.client.infer(model, ins, outputs=outs)
        else:
            # HTTP's timeout is the client's (its socket's), not the call's: an attempt bounded
            # otherwise (the run's deadline is nearer, or the server may hold it longer) gets a
            # client of its own with that timeout.
            client = self.mod.InferenceServerClient(
                self.hostport, connection_timeout=min(limit, self.timeout_s), network_timeout=limit
            )
            try:
                r = client.infer(model, ins, outputs=outs)
            finally:
                client.close()
        return {n: r.as_numpy(n) for n in outputs}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


class CriticFuture(Future[T]):
    """A request's future whose :meth:`result` waits at most ``timeout_s`` unless told otherwise,
    and then raises :class:`~aligner.wire.errors.CriticTimeoutError` naming the call, the step
    and the address (instead of a bare ``TimeoutError``)."""

    def __init__(self, call: str, url: str, timeout_s: float, step: int | None = None) -> None:
        super().__init__()
        self.call, self.url, self.timeout_s, self.step = call, url, timeout_s, step

    def result(self, timeout: float | None = None) -> T:
        limit = self.timeout_s if timeout is None else timeout
        try:
            return super().result(limit)
        except TimeoutError:
            if self.done():  # the request itself raised a timeout: that one, as it is
                raise
            raise CriticTimeoutError(
                self.call, self.url, limit, step=self.step, what="waiting for its result"
            ) from None


def run_into(future: CriticFuture[T], fn: Callable[..., T], *args: Any) -> None:
    """Run ``fn(*args)`` (on a pool thread) and settle ``future`` with its result or error."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to whoever waits on the future
        future.set_exception(e)


# ----------------------------------------------------------------------------------------------
# Errors on the wire
# ----------------------------------------------------------------------------------------------


_QUEUE_FULL = re.compile(
    r"\A(?:\[(?:StatusCode\.UNAVAILABLE|503)\] )?(?:\[request id: [^\]\n]*\] )?Exceeds maximum queue size"
)
"""Triton's own refusal of a request its model's queue has no room for (``server.max_queue_size``),
at the start of the text tritonclient raises (gRPC status UNAVAILABLE, HTTP 503)."""


def classify(exc: BaseException) -> str:
    """'fenced' (the server no longer holds the expected critic step), 'unauthorized' (run
    token), 'request' (contract error), 'peer' (batch-peer error: retry), 'overloaded' (a full
    queue or a spent memory budget: back off and retry), 'unavailable' (retry after readiness),
    or 'server' (a real server-side failure).

    A mark counts only where the server's own message starts
    (:func:`~aligner.wire.protocol.server_message`), never anywhere in the text: what another
    request sent (merged into the same execution by Triton) cannot pass for one."""
    text = str(exc)
    kind = error_kind(text)
    if kind is not None:
        return kind
    if _QUEUE_FULL.match(text.strip()):  # Triton's text alone, never one a request could echo
        return "overloaded"
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return "unavailable"
    if "Traceback (most recent call last)" in text:
        return "server"  # raised inside the server's callable: a real failure, not a lost connection
    status = ""
    try:
        status = str(exc.status() or "")  # type: ignore[attr-defined]
    except Exception:
        pass
    lowered = text.lower()
    for needle in (
        "unavailable",
        "deadline",
        "failed to connect",
        "connection refused",
        "connection reset",
        "socket closed",
        "broken pipe",
        "timed out",
        "timeout",
        "unknown model",
        "is not ready",
        "is not healthy",  # a Python-backend stub Triton restarts (seen under heavy CPU load)
        "not found",
        "cancelled",
        "eof",
        "503",
        "502",
        "connect",
    ):
        if needle in lowered or needle in status.lower():
            return "unavailable"
    try:
        import gevent

        if isinstance(exc, gevent.Timeout):
            return "unavailable"
    except ImportError:
        pass
    return "server"


def timed_out(exc: BaseException) -> bool:
    """Whether a failed attempt ran out of time (rather than finding no server)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "deadline" in text or "timed out" in text


_EXC_LINE = re.compile(r"([A-Za-z_.]*(?:Error|Exception)): (.+?)(?:\\n|\n|$)")


def error_detail(exc: BaseException) -> str:
    """The informative line of a (traceback-laden) Triton error."""
    text = str(exc)
    found = server_message(text)
    if found:
        return found
    lines = [
        f"{name}: {msg}"
        for name, msg in _EXC_LINE.findall(text)
        if not name.endswith(("TritonModelException", "InferenceServerException"))
    ]
    if lines:
        return lines[-1][:500]
    return (text.strip().splitlines() or [repr(exc)])[-1][:500]
