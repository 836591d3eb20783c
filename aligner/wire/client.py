"""RemoteCriticClient: the actor's handle on the critic/reward server.

- ``infer`` and ``train`` return futures (:class:`~aligner.wire.transport.CriticFuture`) so the
  actor overlaps them with its own work (docs/design.md, "Roles and data flow", steps 3-4 and
  6-7): ``infer``'s of ``(values, rewards)``, ``train``'s of a
  :class:`~aligner.wire.protocol.TrainResult`; ``save``/``load``/``server_info`` block.
- Ordering: trains run one at a time in submission order, and an ``infer`` submitted after a
  ``train`` is sent only once that train has returned, so it sees the update. ``save`` waits
  for pending trains too. Across clients (the data-parallel ranks of an actor, of which one
  trains), ``infer``'s ``after_step`` names the critic step the values must come from, and the
  server answers only once it holds that step (docs/design.md, "Wire protocol").
- Requests are validated with :mod:`aligner.wire.protocol` (against the limits the server
  advertises in ``server_info``) before anything is sent. Of critic_infer's optional inputs
  (texts and extras) exactly those the server names in ``infer_inputs`` are sent; a batch
  larger than the server takes goes in several requests (:mod:`aligner.wire.requests`).
- Retries with exponential backoff on connection errors, timeouts, "unavailable" and models
  that are (re)loading (which failure is which: :func:`aligner.wire.transport.classify`);
  before retrying after a connection error the client waits (up to ``ready_timeout_s``) for the
  server to be ready again. Retrying ``train`` is safe because the server applies each step id
  exactly once. A batch-peer refusal (another client's bad request merged with ours) is resent
  until ``wait_timeout_s`` ends, without using up ``retries``; so is an overloaded server's (a
  full queue, a spent memory budget), after a backoff. Which kind a failure is comes only from
  the mark at the start of the server's own message, never from text a request supplied.
- Bounded waits: every wait on the server ends within ``wait_timeout_s`` (a future's
  ``result()``, ``save``, ``load``, one request's retries all together) or raises
  :class:`~aligner.wire.errors.CriticTimeoutError` naming the call, the step and the address.
- Fencing (docs/design.md, "Wire protocol"): the client keeps the critic step it believes the
  server holds (:attr:`RemoteCriticClient.expected_step`): the server's at connection, then the
  step the actor had it load, then each applied train's step; never taken from ``server_info``
  later. ``critic_train`` and ``critic_save`` carry it as ``expected_step``, with the run token.
  A server that no longer holds it refuses them (``FencedError``), and a reconnect that finds
  another server process (``instance_id``) is caught too. ``critic_infer`` carries the
  ``instance_id`` (when watching restarts): a server restarted between two requests (gRPC
  reconnects without a failed request) refuses it at once, fenced, instead of waiting for a
  critic step it will never hold. Each raises :class:`~aligner.wire.errors.CriticRestartedError`,
  and every later ``infer``, ``train`` and ``save`` raises it again until the actor has the
  server ``load`` a step.
- Thread-safe: every thread (pool workers and callers) gets its own tritonclient client.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import numpy as np

from aligner.wire.errors import (
    CriticError,
    CriticIncompatibleError,
    CriticRequestError,
    CriticRestartedError,
    CriticServerError,
    CriticTimeoutError,
    CriticUnavailableError,
)
from aligner.wire.protocol import (
    ANY_CRITIC_STEP,
    INFER,
    INFO,
    LOAD,
    MODEL_NAMES,
    MODELS,
    PROTOCOL_VERSION,
    SAVE,
    TRAIN,
    InferRequest,
    Limits,
    ServerInfo,
    TrainResult,
    UnauthorizedError,
    critic_step_after_load,
    extract_error,
    extract_fenced,
    extract_unauthorized,
    load_inputs,
    run_token_array,
    save_inputs,
    validate_step,
    validate_train,
)
from aligner.wire.readiness import (  # the URL helpers live there; named here as before
    DEFAULT_URL,
    ENV_URL,
    compatibility_problems,
    parse_url,
    protocol_mismatch,
    resolve_critic_url,
    wait_ready,
)
from aligner.wire.requests import (
    INFER_OUTPUTS,
    fenced_rows,
    float32s,
    infer_chunks,
    infer_request,
    infer_result,
    int64s,
)
from aligner.wire.tls import ClientTLS
from aligner.wire.transport import Connection, CriticFuture, classify, error_detail, run_into, timed_out

__all__ = [
    "RemoteCriticClient",
    "resolve_critic_url",
    "protocol_mismatch",
    "ENV_URL",
    "DEFAULT_URL",
]

log = logging.getLogger("aligner.wire.client")

T = TypeVar("T")

# ----------------------------------------------------------------------------------------------
# The client
# ----------------------------------------------------------------------------------------------


class RemoteCriticClient:
    """Client of the critic/reward server (``grpc://host:port``, ``grpcs://`` with TLS, ``http://``).

    Args:
        url: the server's URL (see :func:`resolve_critic_url`).
        timeout_s: per-request timeout (one attempt).
        ready_timeout_s: how long to wait for the server to be ready, at start and after a
            connection loss.
        wait_timeout_s: bounds every wait on a server result: a future's ``result()``,
            ``save``, ``load``, and one request's attempts and retries together.
        retries: retries of a request after a retryable failure.
        backoff_s: first backoff; doubles with each retry (capped at 8 s).
        max_workers: threads that send ``infer`` requests concurrently.
        run_token: the run's shared secret, sent with ``critic_train``, ``critic_save`` and
            ``critic_load`` (``aligner.wire.protocol.resolve_run_token``); None sends none.
        watch_restarts: after a reconnect, check that the same server process answers, and
            send its ``instance_id`` with every ``critic_infer`` (CriticRestartedError when
            another answers). Off for a client whose run depends on nothing the server holds
            (a critic-free run): a restarted server is then simply reconnected.
        tls: for a ``grpcs://`` URL, the CA to trust and a client certificate (None: the
            system's roots, none); ValueError when set for another URL.

    Raises (at construction): CriticTimeoutError when the server is not ready within
    ``ready_timeout_s``; CriticIncompatibleError when it speaks another protocol version;
    CriticTLSError when it and this client disagree on TLS or distrust a certificate.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        ready_timeout_s: float = 120.0,
        wait_timeout_s: float = 600.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_workers: int = 4,
        run_token: str | None = None,
        watch_restarts: bool = True,
        tls: ClientTLS | None = None,
    ) -> None:
        self.url = url
        self.scheme, self.hostport = parse_url(url)
        self.tls = tls if tls is None else tls.checked(url, self.scheme)
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._run_token = run_token
        self.watch_restarts = watch_restarts
        self._local = threading.local()
        self._conns: list[Connection] = []
        self._conns_lock = threading.Lock()
        self._order_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending_train: CriticFuture[TrainResult] | None = None
        self._closed = False
        self._restarted: CriticRestartedError | None = None
        self.instance_id: str | None = None
        """The server process this client trains with (``server_info``'s ``instance_id``)."""
        self._expected_step = -1
        self._wait_ready("connecting", time.monotonic() + ready_timeout_s, ready_timeout_s)
        self._info = self.server_info()
        if self._info.protocol_version != PROTOCOL_VERSION:
            raise CriticIncompatibleError(protocol_mismatch(url, self._info.protocol_version))
        self.instance_id = self._info.instance_id
        self._expected_step = self._info.critic_step
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="critic-infer")
        self._train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-train")

    # ------------------------------------------------------------------------------------------
    # Plumbing
    # ------------------------------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return self._info.limits

    @property
    def expected_step(self) -> int:
        """The critic step this client believes the server holds: the server's when the client
        connected, then the step the actor had it load, then each applied train's step."""
        with self._state_lock:
            return self._expected_step

    def _conn(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = Connection(self.scheme, self.hostport, self.timeout_s, self.tls)
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

    def _wait_ready(self, call: str, deadline: float, limit: float, step: int | None = None) -> None:
        """Wait for readiness until ``deadline`` (at most ``ready_timeout_s``); CriticTimeoutError
        naming ``call`` when the server does not get ready in time."""
        budget = min(self.ready_timeout_s, deadline - time.monotonic())
        try:
            if budget <= 0:
                raise TimeoutError("no time left")
            wait_ready(self.url, timeout_s=budget, models=MODEL_NAMES, tls=self.tls)
        except TimeoutError as e:
            raise CriticTimeoutError(
                call, self.url, limit, step=step, what=f"waiting for the server to be ready: {e}"
            ) from None

    def _info_inputs(self) -> dict[str, Any]:
        """server_info's inputs: the run token when this client has one (a server with a token
        gives its full info only to a caller that sends it; docs/design.md, "Wire protocol")."""
        return {"run_token": run_token_array(self._run_token)} if self._run_token else {}

    def _read_info(self, timeout_s: float) -> ServerInfo | None:
        """One ``server_info`` attempt, no retries (None when it fails)."""
        try:
            out = self._conn().infer(INFO, self._info_inputs(), ["info"], timeout_s=timeout_s)
            return ServerInfo.from_json(out["info"].reshape(-1)[0])
        except Exception:
            return None

    def _restart(self, call: str, reason: str, info: ServerInfo | None) -> CriticRestartedError:
        """Record that the server is not the one trained with: every later infer, train and save
        raises until :meth:`load`. Returns the error to raise."""
        with self._state_lock:
            err = CriticRestartedError(self.url, info, self._expected_step, call=call, reason=reason)
            self._restarted = err
            if info is not None:
                self.instance_id = info.instance_id
        log.warning("%s", err)
        return err

    def _check_restarted(self, call: str) -> None:
        with self._state_lock:
            err = self._restarted
        if err is not None:
            raise CriticRestartedError(
                self.url,
                err.info,
                err.expected_step,
                call=call,
                reason=f"{err.call} found it restarted earlier, and the actor has not had it load a step since",
            )

    def _call(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        *,
        step: int | None = None,
        attempt_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """One request with retries, all within ``wait_timeout_s``, each attempt within
        ``attempt_s`` (default ``timeout_s``); raises a :class:`~aligner.wire.errors.CriticError`
        subclass (or ``UnauthorizedError``)."""
        deadline = time.monotonic() + self.wait_timeout_s
        attempt = 0
        refused: dict[str, int] = {}  # batch-peer and overloaded refusals: no sign of trouble here
        while True:
            if self._closed:
                raise CriticError(f"client for {self.url} is closed")
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError(f"{model}: no time left")
                return self._conn().infer(model, inputs, outputs, timeout_s=left, attempt_s=attempt_s)
            except Exception as e:
                kind = classify(e)
                detail = error_detail(e)
                if kind == "fenced":
                    info = self._read_info(min(self.timeout_s, max(deadline - time.monotonic(), 1.0)))
                    fenced = extract_fenced(str(e))
                    raise self._restart(model, str(fenced) if fenced else detail, info) from None
                if kind == "unauthorized":  # not retried: the same token would be refused again
                    raise (extract_unauthorized(str(e)) or UnauthorizedError(model)) from None
                if kind == "request":
                    raise CriticRequestError(extract_error(str(e)) or str(e)) from None
                if kind == "server":
                    raise CriticServerError(
                        f"{model} failed on the critic server at {self.url}: {detail}"
                    ) from e
                ran_out = time.monotonic() >= deadline
                if kind in ("peer", "overloaded") and not ran_out:
                    # Resent until the deadline, not against `retries` (nothing was run): a batch
                    # peer's at once, then after a pause; an overloaded one's after a backoff.
                    refused[kind] = n = refused.get(kind, 0) + 1
                    pause = 0.01 * (n - 1) if kind == "peer" else self.backoff_s * 2 ** min(n - 1, 5)
                    if n % 10 == 0 or (kind == "overloaded" and n == 1):
                        log.warning(
                            "%s to %s: %d %s refusal(s) (%s); resending", model, self.url, n, kind, detail
                        )
                    cap = 0.5 if kind == "peer" else 8.0
                    time.sleep(min(pause, cap, max(deadline - time.monotonic(), 0.0)))
                    continue
                if ran_out or (attempt >= self.retries and timed_out(e)):  # a hung server, not a lost one
                    limit = self.wait_timeout_s if ran_out else (attempt_s or self.timeout_s)
                    what = f"{attempt + 1} attempt(s), the last: {detail}"
                    raise CriticTimeoutError(model, self.url, limit, step=step, what=what) from None
                if attempt >= self.retries:
                    raise CriticUnavailableError(
                        f"{model} to the critic server at {self.url} failed after "
                        f"{attempt + 1} attempt(s): {detail}"
                    ) from e
                delay = min(self.backoff_s * 2**attempt, 8.0)
                attempt += 1
                last = str(e).strip().splitlines()[-1][:200] if str(e) else ""
                log.warning(
                    "%s to %s failed (%s: %s); retry %d/%d in %.1f s",
                    model,
                    self.url,
                    type(e).__name__,
                    last,
                    attempt,
                    self.retries,
                    delay,
                )
                if kind != "unavailable":
                    time.sleep(delay)
                    continue
                self._drop_conn()
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                self._wait_ready(model, deadline, self.wait_timeout_s, step)
                self._check_instance(model, deadline)

    def _check_instance(self, call: str, deadline: float) -> None:
        """After a reconnect: CriticRestartedError when another server process answers (a
        failed read is left to the next attempt)."""
        if not self.watch_restarts or self.instance_id is None:
            return
        info = self._read_info(min(self.timeout_s, max(deadline - time.monotonic(), 0.001)))
        if info is not None and info.instance_id != self.instance_id:
            raise self._restart(
                call, f"reconnected to server instance {info.instance_id}, not {self.instance_id}", info
            )

    def _wait_pending_train(self, call: str, step: int, *, reraise: bool) -> None:
        """Wait (at most ``wait_timeout_s``) for the train in flight; ``reraise``: its error, if it failed."""
        with self._order_lock:
            pending = self._pending_train
        if pending is None:
            return
        done, _ = wait_futures([pending], timeout=self.wait_timeout_s)
        if not done:
            raise CriticTimeoutError(
                call,
                self.url,
                self.wait_timeout_s,
                step=step,
                what=f"waiting for the critic_train of step {pending.step} submitted before it",
            )
        if reraise and pending.exception() is not None:
            raise pending.exception()

    def _submit(
        self, pool: ThreadPoolExecutor, call: str, step: int | None, fn: Callable[..., T], *args: Any
    ) -> CriticFuture[T]:
        future: CriticFuture[T] = CriticFuture(call, self.url, self.wait_timeout_s, step)
        pool.submit(run_into, future, fn, *args)
        return future

    # ------------------------------------------------------------------------------------------
    # API
    # ------------------------------------------------------------------------------------------

    def server_info(self) -> ServerInfo:
        """The server's :class:`~aligner.wire.protocol.ServerInfo` (fresh, not cached)."""
        out = self._call(INFO, self._info_inputs(), ["info"])
        blob = out["info"].reshape(-1)[0]
        return ServerInfo.from_json(blob)

    def info(self) -> dict[str, Any]:
        """``server_info``'s JSON as it came, a dict: every field the server sent, those this
        client's :class:`~aligner.wire.protocol.ServerInfo` does not know included (for reports
        and benchmarks; :meth:`server_info` is the typed view)."""
        out = self._call(INFO, self._info_inputs(), ["info"])
        return json.loads(out["info"].reshape(-1)[0])

    def check_compatible(self, vocab_size: int, max_seq_len: int, tokenizer_fingerprint: str) -> None:
        """Raise :class:`CriticIncompatibleError` naming every field where the actor and server differ.

        The actor's ``vocab_size`` (its tokenizer's) and ``tokenizer_fingerprint`` must equal the
        server's, and its ``max_seq_len`` (prompt + response) must not exceed the server's.
        """
        info = self.server_info()
        self._info = info
        problems = compatibility_problems(info, vocab_size, max_seq_len, tokenizer_fingerprint)
        if problems:
            raise CriticIncompatibleError(
                f"critic server at {self.url} is incompatible with this actor: " + "; ".join(problems)
            )

    def _check_not_closed(self) -> None:
        if self._closed:
            raise CriticError(f"client for {self.url} is closed")

    def infer(
        self,
        tokens: Any,
        lengths: Any,
        prompt_lengths: Any,
        step: int | None = None,
        *,
        prompt_texts: list[str] | None = None,
        response_texts: list[str] | None = None,
        extras: list[str] | None = None,
        after_step: int | None = None,
    ) -> CriticFuture[tuple[np.ndarray, np.ndarray]]:
        """Values and rewards of a batch, as a future of ``(values [b, s-1] float32, rewards [b] float32)``.

        Args:
            tokens: ``[b, s]`` integer ids (NumPy or torch); lengths, prompt_lengths: ``[b]``.
            step: the caller's step these samples belong to (named in errors and timeouts).
            prompt_texts, response_texts: each sample's prompt and response as text (the response
                up to its end-of-sequence, special tokens skipped); sent when the server needs
                them (``server_info``'s ``infer_inputs``: its reward model reads text).
            extras: each sample's extra data-set columns as one compact JSON object ('{}' for
                none); sent when the server has a reward function ('{}' per row when None).
            after_step: the critic step the values must come from (the step of the last
                critic_train the run sent, or of the load it had the server do): the server
                answers once it holds it (waiting up to its ``server.infer_wait_s``, then a
                CriticServerError naming both steps), and refuses it when it holds a later one
                (CriticRequestError). None or -1: any step (this client's own trains are waited
                for all the same).

        Only the optional inputs the server names in ``infer_inputs`` are sent.

        Raises (immediately): ProtocolError if the batch breaks the contract; ValueError when the
        server needs the texts and they are not given; CriticRestartedError while a restart the
        actor has not handled is known. Batches larger than the server's ``max_batch_size`` are
        split into several requests (each with its rows of every input).
        """
        self._check_not_closed()
        self._check_restarted(INFER)
        texts = {"prompt_texts": prompt_texts, "response_texts": response_texts, "extras": extras}
        after = ANY_CRITIC_STEP if after_step is None else int(after_step)
        req = infer_request(self._info, self.url, tokens, lengths, prompt_lengths, **texts, after_step=after)
        with self._order_lock:
            after = self._pending_train
        return self._submit(self._pool, INFER, step, self._infer_task, req, after, step)

    def _infer_task(
        self, req: InferRequest, after: CriticFuture[TrainResult] | None, step: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        if after is not None:
            done, _ = wait_futures([after], timeout=self.wait_timeout_s)
            if not done:
                raise CriticTimeoutError(
                    INFER,
                    self.url,
                    self.wait_timeout_s,
                    step=step,
                    what=f"waiting for the critic_train of step {after.step} submitted before it",
                )
        self._check_restarted(INFER)
        instance = self.instance_id if self.watch_restarts else None  # another process refuses it
        req = dataclasses.replace(req, instance_id=instance or None)
        # A request naming its critic step may wait on the server (up to its infer_wait_s) for
        # that step's train: each attempt gets that long on top of timeout_s, so the server's
        # answer (the values, or an error naming the step) comes before the client would resend.
        attempt_s = self.timeout_s + self._info.infer_wait_s if req.after_step >= 0 else None
        values, rewards = [], []
        for chunk in infer_chunks(req, self.limits.max_batch):
            out = self._call(INFER, chunk.to_wire(), INFER_OUTPUTS, step=step, attempt_s=attempt_s)
            fenced = fenced_rows(out)  # refused alone in a merged execution: another server process
            if fenced is not None:
                raise self._restart(INFER, fenced, self._read_info(self.timeout_s))
            v, r = infer_result(out, self.url)
            values.append(v)
            rewards.append(r)
        return np.concatenate(values), np.concatenate(rewards)

    def train(
        self, tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: int
    ) -> CriticFuture[TrainResult]:
        """One critic update for ``step``; a future of its
        :class:`~aligner.wire.protocol.TrainResult` (``loss``, ``grad_norm``, ``applied_step``,
        ``explained_variance``, ``value_clipfrac``, ``train_ms``).

        Shapes: tokens ``[b, s]``; lengths ``[b]``; returns, old_values, mask ``[b, s-1]`` (float32;
        other float dtypes are cast). Trains run one at a time in the order they were submitted;
        each carries the critic step the previous one left (``expected_step``).
        """

        self._check_not_closed()
        self._check_restarted(TRAIN)
        arrays = (int64s(tokens), int64s(lengths), float32s(returns), float32s(old_values), float32s(mask))
        # Checked here with the belief of now; sent with the belief the previous train leaves.
        validate_train(*arrays, int(step), self.expected_step, self.limits)
        with self._order_lock:
            fut = self._submit(self._train_pool, TRAIN, int(step), self._train_task, arrays, int(step))
            self._pending_train = fut
        return fut

    def _train_task(self, arrays: tuple[np.ndarray, ...], step: int) -> TrainResult:
        self._check_restarted(TRAIN)
        req = validate_train(*arrays, step, self.expected_step, self.limits)
        names = [t.name for t in MODELS[TRAIN].outputs]
        result = TrainResult.from_wire(self._call(TRAIN, req.to_wire(self._run_token), names, step=step))
        with self._state_lock:
            self._expected_step = result.applied_step
        return result

    def save(self, step: int) -> None:
        """Ask the server to save the critic at ``step`` (under its own checkpoint dir); blocks until
        written, after every train submitted before it. The server must hold critic step
        ``step`` (fenced otherwise: CriticRestartedError)."""
        step = validate_step(SAVE, int(step))
        self._check_not_closed()
        self._check_restarted(SAVE)
        self._wait_pending_train(SAVE, step, reraise=True)
        # The server must hold critic step `step` to save it as step `step`.
        out = self._call(SAVE, save_inputs(step, step, self._run_token), ["ok"], step=step)
        if int(out["ok"].reshape(-1)[0]) != 1:
            raise CriticServerError(f"critic_save of step {step} at {self.url} did not report ok")

    def load(self, step: int) -> None:
        """Restore the critic and its optimiser saved at ``step`` (blocks). The client then
        expects the server at that step, and a restart it had found counts as handled."""
        step = validate_step(LOAD, int(step))
        self._check_not_closed()
        self._wait_pending_train(LOAD, step, reraise=False)
        out = self._call(LOAD, load_inputs(step, self._run_token), ["ok"], step=step)
        if int(out["ok"].reshape(-1)[0]) != 1:
            raise CriticServerError(f"critic_load of step {step} at {self.url} did not report ok")
        info = self._read_info(self.timeout_s) if self.watch_restarts else None
        with self._state_lock:
            self._expected_step = critic_step_after_load(step)
            self._restarted = None
            if info is not None:  # the process that loaded it: its id is the one infers name
                self.instance_id = info.instance_id

    def follow(self, instance_id: str) -> None:
        """The server process ``instance_id`` (after a restart the run rolled back from, on every
        rank, whichever rank's client loaded the step) is this client's from now on: a restart it
        had found counts as handled, and only another process after it is a restart."""
        with self._state_lock:
            self.instance_id = instance_id
            self._restarted = None

    def close(self) -> None:
        """Wait for submitted requests (each ends within ``wait_timeout_s``), then release
        threads and connections."""
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
