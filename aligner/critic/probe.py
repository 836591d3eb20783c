"""Is a running critic/reward server alive? One bounded check for a container's health probes.

    python -m aligner.critic.probe                     # liveness: server_info answered in 10 s
    python -m aligner.critic.probe --ready             # readiness: Triton ready, every model loaded
    python -m aligner.critic.probe --url grpc://127.0.0.1:8001 --timeout 5
    python -m aligner.critic.probe --url grpcs://localhost:8001 --tls-ca-file /etc/critic-tls/ca.crt

Triton's own ``/v2/health/live`` answers as long as the Triton process runs, also when the Python
service behind every model is stuck (a deadlock, a hung collective between the server's
replicas): a probe that asks Triton only never restarts such a server. Liveness here is a
``server_info`` request, which Triton hands to the Python service and the service answers from
its own thread (not behind a train step in progress), so it fails exactly when the Python side
stops answering. Readiness adds Triton's readiness of every model of the wire protocol
(:func:`aligner.wire.readiness.wait_ready`, the check the actor's client makes).

The check is one attempt, never retried: the probe's ``failureThreshold`` decides how many misses
a restart takes. It needs no run token (``server_info`` answers every client, with its public
view) and sends nothing that changes the server. gRPC by default, on loopback: the pod's own
server, whatever the NetworkPolicy lets in.

A server with ``server.tls`` on is probed at ``grpcs://`` (``--tls-ca-file`` for a private CA,
``--tls-cert-file``/``--tls-key-file`` where it requires client certificates); the host must be a
name its certificate holds (localhost, 127.0.0.1 where the certificate names them).

Exit status: 0 alive (or ready); 1 not; 2 a malformed URL or TLS settings.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from aligner.wire.protocol import INFO, MODEL_NAMES, ServerInfo
from aligner.wire.readiness import parse_url, wait_ready
from aligner.wire.tls import ClientTLS, CriticTLSError, tls_problem
from aligner.wire.transport import Connection

__all__ = ["main", "check_alive"]

DEFAULT_PROBE_URL = "grpc://127.0.0.1:8001"


def check_alive(url: str, timeout_s: float, tls: ClientTLS | None = None) -> str | None:
    """One ``server_info`` round trip through the Python service within ``timeout_s``: None when
    it answered with a server's description, else what went wrong (one line); ``tls``: what a
    ``grpcs://`` probe trusts and presents."""
    scheme, hostport = parse_url(url)
    conn = Connection(scheme, hostport, timeout_s, tls)
    try:
        out = conn.infer(INFO, {}, ["info"], timeout_s=timeout_s)
        info = ServerInfo.from_json(out["info"].reshape(-1)[0])
    except Exception as e:  # unreachable, timed out, or an answer that is no server_info
        problem = tls_problem(url, scheme, hostport, str(e), tls) if scheme != "http" else None
        if problem:
            return problem
        return f"server_info did not answer within {timeout_s:g} s: {type(e).__name__}: {str(e)[:300]}"
    finally:
        conn.close()
    return None if info.protocol_version else "server_info answered without a protocol version"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aligner.critic.probe",
        description="One health check of a running critic server (for liveness and readiness probes).",
    )
    p.add_argument(
        "--url",
        default=DEFAULT_PROBE_URL,
        help=f"grpc://HOST:PORT, grpcs://HOST:PORT (TLS) or http://HOST:PORT (default: {DEFAULT_PROBE_URL})",
    )
    p.add_argument("--tls-ca-file", default=None, help="grpcs: PEM CA the server's certificate chains to")
    p.add_argument("--tls-cert-file", default=None, help="grpcs: PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default=None, help="grpcs: PEM key of --tls-cert-file")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds the check may take (default: 10)")
    p.add_argument("--ready", action="store_true", help="also require Triton's readiness of every model")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tls = ClientTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    try:
        tls.check(args.url, parse_url(args.url)[0], prefix="--tls")
    except ValueError as e:
        print(f"aligner.critic.probe: {e}", file=sys.stderr, flush=True)
        return 2
    t0 = time.monotonic()
    if args.ready:
        try:
            wait_ready(args.url, timeout_s=args.timeout, models=MODEL_NAMES, poll_s=args.timeout, tls=tls)
        except (TimeoutError, CriticTLSError) as e:
            print(f"aligner.critic.probe: not ready: {e}", file=sys.stderr, flush=True)
            return 1
    left = max(args.timeout - (time.monotonic() - t0), 0.1)
    problem = check_alive(args.url, left, tls)
    if problem is not None:
        print(f"aligner.critic.probe: {problem}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
