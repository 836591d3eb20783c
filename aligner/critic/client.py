"""RemoteCriticClient: the actor's handle on the critic/reward server.

- ``infer`` and ``train`` return ``concurrent.futures.Future`` so the actor overlaps them with
  its own work (docs/design.md, "Roles and data flow", steps 3-4 and 6-7); ``save``/``load``/``info``
  block.
- Ordering: trains run one at a time in submission order, and an ``infer`` submitted after a
  ``train`` is sent only once that train has returned, so it sees the update (the server's
  lock then guarantees the rest). ``save`` waits for pending trains too.
- Requests are validated with :mod:`aligner.critic.protocol` (against the limits the server
  advertises in ``server_info``) before anything is sent.
- Retries with exponential backoff on connection errors, timeouts, "unavailable" and models
  that are (re)loading; before retrying after a connection error the client waits (up to
  ``ready_timeout_s``) for the server to be ready again, so a restarted server is picked up.
  Retrying ``train`` is safe because the server applies each step id exactly once.
- Thread-safe: every thread (pool workers and callers) gets its own tritonclient client.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from aligner.critic import protocol as P
from aligner.critic.launch import parse_url, wait_ready

__all__ = [
    "RemoteCriticClient",
    "resolve_critic_url",
    "CriticError",
    "CriticRequestError",
    "CriticServerError",
    "CriticUnavailableError",
    "CriticIncompatibleError",
    "ENV_URL",
    "DEFAULT_URL",
]

log = logging.getLogger("aligner.critic.client")

ENV_URL = "ALIGNER_CRITIC_URL"
DEFAULT_URL = "grpc://127.0.0.1:8001"


class CriticError(RuntimeError):
    """Base of the client's errors."""


class CriticRequestError(CriticError, ValueError):
    """The server rejected the request as breaking the contract (not retried); names the field."""


class CriticServerError(CriticError):
    """The server failed to run a valid request (e.g. the reward function raised); not retried."""


class CriticUnavailableError(CriticError, ConnectionError):
    """The server could not be reached (or stayed unavailable) through every retry."""


class CriticIncompatibleError(CriticError):
    """The server's vocabulary, sequence length, tokenizer or protocol differ from the actor's."""


def resolve_critic_url(configured: str | None) -> str:
    """The critic server's URL: ``configured`` if set, else ``$ALIGNER_CRITIC_URL``, else
    ``grpc://127.0.0.1:8001``. Checked to be ``grpc://host:port`` or ``http://host:port``."""
    url = (configured or "").strip() or os.environ.get(ENV_URL, "").strip() or DEFAULT_URL
    parse_url(url)
    return url


def _classify(exc: BaseException) -> str:
    """'request' (contract error), 'peer' (batch-peer error: retry), 'unavailable' (retry after
    readiness), or 'server' (a real server-side failure)."""
    text = str(exc)
    if P.BATCH_PEER_MARK.strip() in text:
        return "peer"
    if P.ERROR_MARK.strip() in text:
        return "request"
    if P.UNAVAILABLE_MARK.strip() in text:
        return "unavailable"
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


_EXC_LINE = re.compile(r"([A-Za-z_.]*(?:Error|Exception)): (.+?)(?:\\n|\n|$)")


def _detail(exc: BaseException) -> str:
    """The informative line of a (traceback-laden) Triton error."""
    text = str(exc)
    found = P.extract_error(text)
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


class _Conn:
    """One tritonclient client (gRPC or HTTP) owned by one thread."""

    def __init__(self, scheme: str, hostport: str, timeout_s: float) -> None:
        self.scheme = scheme
        self.timeout_s = timeout_s
        if scheme == "grpc":
            import tritonclient.grpc as mod

            self.client = mod.InferenceServerClient(hostport)
        else:
            import tritonclient.http as mod

            self.client = mod.InferenceServerClient(
                hostport, connection_timeout=timeout_s, network_timeout=timeout_s
            )
        self.mod = mod

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        mod = self.mod
        binary = {} if self.scheme == "grpc" else {"binary_data": True}
        ins = []
        for name, a in inputs.items():
            dtype = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}[a.dtype]
            i = mod.InferInput(name, list(a.shape), dtype)
            i.set_data_from_numpy(np.ascontiguousarray(a), **binary)
            ins.append(i)
        outs = [mod.InferRequestedOutput(n, **binary) for n in outputs]
        if self.scheme == "grpc":
            r = self.client.infer(model, ins, outputs=outs, client_timeout=self.timeout_s)
        else:
            r = self.client.infer(model, ins, outputs=outs)
        return {n: r.as_numpy(n) for n in outputs}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


class RemoteCriticClient:
    """Client of the critic/reward server (gRPC ``grpc://host:port`` or HTTP ``http://host:port``).

    Args:
        url: the server's URL (see :func:`resolve_critic_url`).
        timeout_s: per-request timeout.
        ready_timeout_s: how long to wait for the server to be ready, at start and after a
            connection loss.
        retries: retries of a request after a retryable failure.
        backoff_s: first backoff; doubles with each retry (capped at 8 s).
        max_workers: threads that send ``infer`` requests concurrently.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        ready_timeout_s: float = 120.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_workers: int = 4,
    ) -> None:
        self.url = url
        self.scheme, self.hostport = parse_url(url)
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._local = threading.local()
        self._conns: list[_Conn] = []
        self._conns_lock = threading.Lock()
        self._order_lock = threading.Lock()
        self._pending_train: Future | None = None
        self._closed = False
        wait_ready(url, timeout_s=ready_timeout_s, models=P.MODEL_NAMES)
        self._info = self.server_info()
        if self._info.protocol_version != P.PROTOCOL_VERSION:
            raise CriticIncompatibleError(
                f"critic server at {url} speaks protocol version "
                f"{self._info.protocol_version}, this client {P.PROTOCOL_VERSION}"
            )
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="critic-infer")
        self._train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-train")

    # ------------------------------------------------------------------------------------------
    # Plumbing
    # ------------------------------------------------------------------------------------------

    @property
    def limits(self) -> P.Limits:
        return self._info.limits

    def _conn(self) -> _Conn:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Conn(self.scheme, self.hostport, self.timeout_s)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._conns_lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _call(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """One request with retries; raises a :class:`CriticError` subclass."""
        attempt = 0
        while True:
            if self._closed:
                raise CriticError(f"client for {self.url} is closed")
            try:
                return self._conn().infer(model, inputs, outputs)
            except Exception as e:
                kind = _classify(e)
                if kind == "request":
                    raise CriticRequestError(P.extract_error(str(e)) or str(e)) from None
                if kind == "server" or attempt >= self.retries:
                    detail = _detail(e)
                    if kind == "server":
                        raise CriticServerError(
                            f"{model} failed on the critic server at {self.url}: {detail}"
                        ) from e
                    raise CriticUnavailableError(
                        f"{model} to the critic server at {self.url} failed after "
                        f"{attempt + 1} attempt(s): {detail}"
                    ) from e
                # A batch-peer error is no sign of trouble: resend at once.
                delay = 0.0 if kind == "peer" else min(self.backoff_s * 2**attempt, 8.0)
                attempt += 1
                log.warning(
                    "%s to %s failed (%s: %s); retry %d/%d in %.1f s",
                    model,
                    self.url,
                    type(e).__name__,
                    str(e).strip().splitlines()[-1][:200] if str(e) else "",
                    attempt,
                    self.retries,
                    delay,
                )
                if kind == "unavailable":
                    self._drop_conn()
                time.sleep(delay)
                if kind == "unavailable":
                    try:
                        wait_ready(self.url, timeout_s=self.ready_timeout_s, models=P.MODEL_NAMES)
                    except TimeoutError as te:
                        raise CriticUnavailableError(str(te)) from e

    def _check_not_closed(self) -> None:
        if self._closed:
            raise CriticError(f"client for {self.url} is closed")

    def _wait_pending_train(self) -> None:
        with self._order_lock:
            pending = self._pending_train
        if pending is not None:
            wait_futures([pending])

    # ------------------------------------------------------------------------------------------
    # API
    # ------------------------------------------------------------------------------------------

    def server_info(self) -> P.ServerInfo:
        """The server's :class:`~aligner.critic.protocol.ServerInfo` (fresh, not cached)."""
        out = self._call(P.INFO, {}, ["info"])
        blob = out["info"].reshape(-1)[0]
        return P.ServerInfo.from_json(blob)

    def info(self) -> dict[str, Any]:
        """``server_info`` as a dict: protocol version, vocab size, max sequence length, tokenizer
        fingerprint, critic step, reward source, model config, parallel sizes, ..."""
        out = self._call(P.INFO, {}, ["info"])
        return json.loads(out["info"].reshape(-1)[0])

    def check_compatible(self, vocab_size: int, max_seq_len: int, tokenizer_fingerprint: str) -> None:
        """Raise :class:`CriticIncompatibleError` naming every field where the actor and server differ.

        The actor's ``vocab_size`` (its tokenizer's) and ``tokenizer_fingerprint`` must equal the
        server's, and its ``max_seq_len`` (prompt + response) must not exceed the server's.
        """
        info = self.server_info()
        self._info = info
        problems = []
        if info.protocol_version != P.PROTOCOL_VERSION:
            problems.append(f"protocol_version: server {info.protocol_version}, client {P.PROTOCOL_VERSION}")
        if vocab_size != info.vocab_size:
            problems.append(f"vocab_size: actor {vocab_size}, server {info.vocab_size}")
        if max_seq_len > info.max_seq_len:
            problems.append(f"max_seq_len: actor {max_seq_len} exceeds the server's {info.max_seq_len}")
        if tokenizer_fingerprint != info.tokenizer_fingerprint:
            problems.append(
                f"tokenizer_fingerprint: actor {tokenizer_fingerprint!r}, server "
                f"{info.tokenizer_fingerprint!r} (tokenizer {info.tokenizer!r})"
            )
        if problems:
            raise CriticIncompatibleError(
                f"critic server at {self.url} is incompatible with this actor: " + "; ".join(problems)
            )

    @staticmethod
    def _ints(x: Any) -> np.ndarray:
        a = P.as_numpy(x)
        if a.dtype.kind in "iu" and a.dtype != np.int64:
            a = a.astype(np.int64)
        return a

    def infer(self, tokens: Any, lengths: Any, prompt_lengths: Any) -> Future:
        """Values and rewards of a batch, as a Future of ``(values [b, s-1] float32, rewards [b] float32)``.

        Args:
            tokens: ``[b, s]`` integer ids (NumPy or torch); lengths, prompt_lengths: ``[b]``.

        Raises (immediately): ProtocolError if the batch breaks the contract. Batches larger than
        the server's ``max_batch_size`` are split into several requests.
        """
        self._check_not_closed()
        tokens = self._ints(tokens)
        lengths = self._ints(lengths)
        prompt_lengths = self._ints(prompt_lengths)
        limits = self.limits
        b = tokens.shape[0] if tokens.ndim == 2 else 0
        whole = P.Limits(
            limits.vocab_size, limits.max_seq_len, max(limits.max_batch, b), limits.max_train_batch
        )
        req = P.validate_infer(tokens, lengths, prompt_lengths, whole)
        with self._order_lock:
            after = self._pending_train
        return self._pool.submit(self._infer_task, req, after)

    def _infer_task(self, req: P.InferRequest, after: Future | None) -> tuple[np.ndarray, np.ndarray]:
        if after is not None:
            wait_futures([after])
        n = self.limits.max_batch
        values, rewards = [], []
        for start in range(0, req.tokens.shape[0], n):
            chunk = P.InferRequest(
                req.tokens[start : start + n],
                req.lengths[start : start + n],
                req.prompt_lengths[start : start + n],
            )
            out = self._call(P.INFER, chunk.to_wire(), ["values", "rewards"])
            values.append(out["values"].astype(np.float32, copy=False))
            rewards.append(out["rewards"].reshape(-1).astype(np.float32, copy=False))
        return np.concatenate(values), np.concatenate(rewards)

    def train(self, tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: int) -> Future:
        """One critic update for ``step``; a Future of ``{"loss", "grad_norm", "applied_step",
        "explained_variance", "value_clipfrac"}``.

        Shapes: tokens ``[b, s]``; lengths ``[b]``; returns, old_values, mask ``[b, s-1]`` (float32;
        other float dtypes are cast). Trains run one at a time in the order they were submitted.
        """

        self._check_not_closed()

        def f32(x: Any) -> np.ndarray:
            a = P.as_numpy(x)
            return a.astype(np.float32) if a.dtype.kind == "f" and a.dtype != np.float32 else a

        req = P.validate_train(
            self._ints(tokens),
            self._ints(lengths),
            f32(returns),
            f32(old_values),
            f32(mask),
            int(step),
            self.limits,
        )
        with self._order_lock:
            fut = self._train_pool.submit(self._train_task, req)
            self._pending_train = fut
        return fut

    def _train_task(self, req: P.TrainRequest) -> dict[str, float | int]:
        names = [t.name for t in P.MODELS[P.TRAIN].outputs]
        out = self._call(P.TRAIN, req.to_wire(), names)
        return P.TrainResult.from_wire(out).to_dict()

    def save(self, step: int) -> None:
        """Ask the server to save the critic at ``step`` (under its own checkpoint dir); blocks until
        written, after every train submitted before it."""
        step = P.validate_step(P.SAVE, int(step))
        self._wait_pending_train()
        out = self._call(P.SAVE, {"step": np.array([[step]], dtype=np.int64)}, ["ok"])
        if int(out["ok"].reshape(-1)[0]) != 1:
            raise CriticServerError(f"critic_save of step {step} at {self.url} did not report ok")

    def load(self, step: int) -> None:
        """Restore the critic and its optimiser saved at ``step`` (blocks)."""
        step = P.validate_step(P.LOAD, int(step))
        self._wait_pending_train()
        out = self._call(P.LOAD, {"step": np.array([[step]], dtype=np.int64)}, ["ok"])
        if int(out["ok"].reshape(-1)[0]) != 1:
            raise CriticServerError(f"critic_load of step {step} at {self.url} did not report ok")

    def close(self) -> None:
        """Wait for submitted requests, then release threads and connections."""
        if self._closed:
            return
        self._train_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()

    def __enter__(self) -> RemoteCriticClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
