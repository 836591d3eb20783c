"""Is a critic server ready? Triton's readiness over gRPC or HTTP, polled until a deadline: the
local launcher (:mod:`aligner.critic.launch`), the actor's client and ``python -m
aligner.critic.wait`` (what the cluster recipes run) all wait through :func:`wait_ready`. A
``grpcs://`` URL waits over TLS (:mod:`aligner.wire.tls`); a TLS mismatch or an untrusted
certificate ends the wait at once (:class:`~aligner.wire.tls.CriticTLSError`)."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from aligner.wire.protocol import PROTOCOL_VERSION, ServerInfo
from aligner.wire.tls import TLS_SCHEME, ClientTLS, CriticTLSError, grpc_client_options, tls_problem

__all__ = [
    "wait_ready",
    "ServerStartError",
    "parse_url",
    "resolve_critic_url",
    "protocol_mismatch",
    "compatibility_problems",
    "ENV_URL",
    "DEFAULT_URL",
]


class ServerStartError(RuntimeError):
    """The server process exited or did not become ready; the message carries its last output."""


def parse_url(url: str) -> tuple[str, str]:
    """``grpc://host:port``, ``grpcs://host:port`` (TLS) or ``http://host:port`` -> (scheme,
    'host:port'). A bare 'host:port' is gRPC."""
    if "://" not in url:
        return "grpc", url
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "https":
        raise ValueError(
            f"critic url {url!r}: Triton's HTTP endpoint has no TLS; use {TLS_SCHEME}://host:port "
            "(gRPC with TLS, server.tls) or http:// behind a TLS-terminating proxy"
        )
    if scheme not in ("grpc", TLS_SCHEME, "http"):
        raise ValueError(
            f"critic url {url!r}: expected grpc://host:port, {TLS_SCHEME}://host:port or http://host:port"
        )
    rest = rest.rstrip("/")
    if ":" not in rest:
        raise ValueError(f"critic url {url!r}: expected an explicit port (grpc://host:port)")
    return scheme, rest


ENV_URL = "ALIGNER_CRITIC_URL"
DEFAULT_URL = "grpc://127.0.0.1:8001"


def resolve_critic_url(configured: str | None) -> str:
    """The critic server's URL: ``configured`` if set, else ``$ALIGNER_CRITIC_URL``, else
    ``grpc://127.0.0.1:8001``. Checked to be ``grpc://``, ``grpcs://`` (TLS) or ``http://host:port``."""
    url = (configured or "").strip() or os.environ.get(ENV_URL, "").strip() or DEFAULT_URL
    parse_url(url)
    return url


def protocol_mismatch(url: str, server_version: int) -> str:
    """Why this client refuses the server at ``url`` that speaks ``server_version``, naming both
    versions (a client of protocol 5 tells a server of protocol 6 the same, in its own words)."""
    return (
        f"critic server at {url} speaks protocol version {server_version}, this client "
        f"{PROTOCOL_VERSION}: run one release of aligner on both sides (protocol 6: critic_infer "
        "carries instance_id, the server process it is for; 5: critic_train answers train_ms, the "
        "server's time for the update; 4: critic_infer carries after_step)"
    )


def compatibility_problems(
    info: ServerInfo, vocab_size: int, max_seq_len: int, tokenizer_fingerprint: str
) -> list[str]:
    """Every field where an actor (its tokenizer's ``vocab_size`` and ``tokenizer_fingerprint``,
    which must equal the server's, and its ``max_seq_len``, which must not exceed the server's)
    and the server of ``info`` differ, each naming both sides; empty when none does."""
    problems = []
    if info.protocol_version != PROTOCOL_VERSION:
        problems.append(
            f"protocol_version: server {info.protocol_version}, client {PROTOCOL_VERSION} (run one "
            "release of aligner on both sides)"
        )
    if vocab_size != info.vocab_size:
        problems.append(f"vocab_size: actor {vocab_size}, server {info.vocab_size}")
    if max_seq_len > info.max_seq_len:
        problems.append(f"max_seq_len: actor {max_seq_len} exceeds the server's {info.max_seq_len}")
    if tokenizer_fingerprint != info.tokenizer_fingerprint:
        problems.append(
            f"tokenizer_fingerprint: actor {tokenizer_fingerprint!r}, server "
            f"{info.tokenizer_fingerprint!r} (tokenizer {info.tokenizer!r})"
        )
    return problems


def _ready_once(
    scheme: str, hostport: str, models: Sequence[str], timeout_s: float, tls: ClientTLS | None = None
) -> str | None:
    """None when the server and every model are ready, else what was not."""
    if scheme == "http":
        paths = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in models]
        for path in paths:
            try:
                with urllib.request.urlopen(f"http://{hostport}{path}", timeout=timeout_s) as r:
                    if r.status != 200:
                        return f"GET {path} answered {r.status}"
            except urllib.error.HTTPError as e:
                return f"GET {path} answered {e.code}"
            except OSError as e:
                return f"GET {path} failed: {e}"
        return None
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(hostport, **grpc_client_options(scheme, tls))
    try:
        if not client.is_server_ready(client_timeout=timeout_s):
            return "server is not ready"
        for m in models:
            if not client.is_model_ready(m, client_timeout=timeout_s):
                return f"model {m} is not ready"
        return None
    except Exception as e:  # InferenceServerException, grpc errors: not up yet
        return f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        client.close()


def wait_ready(
    url: str,
    timeout_s: float = 120.0,
    models: Sequence[str] = (),
    *,
    poll_s: float = 0.2,
    abort: Callable[[], str | None] | None = None,
    tls: ClientTLS | None = None,
) -> None:
    """Block until ``url`` answers Triton's readiness (``/v2/health/ready``, and each of
    ``models`` ready); TimeoutError naming the url and the last thing that was not ready.

    ``abort``, polled between attempts, returns why waiting is pointless (e.g. the server
    process exited) or None; a reason raises :class:`ServerStartError` at once. ``tls``: what a
    ``grpcs://`` wait trusts (None: the system's roots, no client certificate); a failure no
    retry can fix (a TLS mismatch, an untrusted certificate) raises
    :class:`~aligner.wire.tls.CriticTLSError` at once.
    The local launcher, the actor's client and ``python -m aligner.critic.wait`` (what the
    cluster recipes run) all wait through this function."""
    scheme, hostport = parse_url(url)
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        # Each probe within what is left of the wait (a hung server answers no probe at all).
        probe_s = min(5.0, max(0.2, deadline - time.monotonic()))
        last = _ready_once(scheme, hostport, models, timeout_s=probe_s, tls=tls) or ""
        if not last:
            return
        problem = tls_problem(url, scheme, hostport, last, tls) if scheme != "http" else None
        if problem:
            raise CriticTLSError(problem)
        reason = abort() if abort is not None else None
        if reason:
            raise ServerStartError(f"critic server at {url} will not become ready: {reason}")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"critic server at {url} not ready after {timeout_s:.0f} s: tried "
                f"{scheme} readiness of the server and models {list(models)}; last answer: {last}"
            )
        time.sleep(poll_s)
