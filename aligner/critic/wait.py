"""Wait until a critic/reward server can serve: the step every launch recipe runs before the actor.

    python -m aligner.critic.wait --url grpc://critic:8001 --timeout 600
    aligner-wait-critic                          # the URL from $ALIGNER_CRITIC_URL, as the actor

The Kubernetes actor runs it as an init container and the SLURM script before starting the
actor, so a run that cannot reach its server fails with one clear line instead of a stack of
retries. It waits through :func:`aligner.critic.launch.wait_ready`, the check the local launcher
(``make demo``) and the actor's client use: Triton's ``/v2/health/ready`` (or its gRPC
equivalent) and every model of the wire protocol ready.

A server with ``server.tls`` on is waited for at ``grpcs://`` (``--tls-ca-file`` for a private CA,
``--tls-cert-file``/``--tls-key-file`` where it requires client certificates); a TLS mismatch or
an untrusted certificate ends the wait at once (exit status 1, naming the cause).

Exit status: 0 ready; 1 not ready within ``--timeout``, or the process named by ``--pid`` exited;
2 a malformed URL or TLS settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from aligner.wire.client import DEFAULT_URL, ENV_URL, resolve_critic_url
from aligner.wire.protocol import MODELS
from aligner.wire.readiness import ServerStartError, parse_url, wait_ready
from aligner.wire.tls import ClientTLS, CriticTLSError

__all__ = ["main", "SERVED_MODELS"]

SERVED_MODELS: tuple[str, ...] = tuple(MODELS)
"""The models a server must have loaded before an actor can use it."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aligner.critic.wait",
        description="Wait until the critic/reward server answers Triton's readiness for every model.",
    )
    p.add_argument(
        "--url",
        default=None,
        help=f"grpc://HOST:PORT, grpcs://HOST:PORT (TLS) or http://HOST:PORT (default: ${ENV_URL}, else {DEFAULT_URL})",
    )
    p.add_argument("--tls-ca-file", default=None, help="grpcs: PEM CA the server's certificate chains to")
    p.add_argument("--tls-cert-file", default=None, help="grpcs: PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default=None, help="grpcs: PEM key of --tls-cert-file")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default: 600)")
    p.add_argument(
        "--pid",
        type=int,
        default=None,
        help="give up as soon as this process (the server started in the background) has exited",
    )
    p.add_argument("--quiet", action="store_true", help="print nothing when the server is ready")
    return p


def _process_gone(pid: int):
    def reason() -> str | None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"process {pid} (the server) has exited"
        except PermissionError:  # alive, owned by someone else
            return None
        return None

    return reason


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        url = resolve_critic_url(args.url)
        tls = ClientTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
        tls.check(url, parse_url(url)[0], prefix="--tls")
    except ValueError as e:
        print(f"aligner.critic.wait: {e}", file=sys.stderr, flush=True)
        return 2
    if not args.quiet:
        print(f"waiting up to {args.timeout:.0f} s for the critic server at {url} ...", flush=True)
    t0 = time.monotonic()
    try:
        wait_ready(
            url,
            timeout_s=args.timeout,
            models=SERVED_MODELS,
            poll_s=1.0,
            abort=_process_gone(args.pid) if args.pid else None,
            tls=tls,
        )
    except (TimeoutError, ServerStartError, CriticTLSError) as e:
        print(f"aligner.critic.wait: {e}", file=sys.stderr, flush=True)
        return 1
    if not args.quiet:
        print(f"critic server at {url} is ready ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
