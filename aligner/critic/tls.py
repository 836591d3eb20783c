"""TLS on the critic server's gRPC endpoint (``server.tls``; README.md, "What the server trusts").

With ``server.tls.cert_file`` and ``key_file`` set, Triton serves gRPC over TLS only (clients
connect with ``grpcs://host:port``, and the READY line names that URL); with
``server.tls.client_ca_file`` too, it also requires every client to present a certificate that
chains to that CA (mutual TLS). Checked at start (:meth:`ServerTLSConfig.problems`): the files
exist, are readable and hold PEM, the certificate comes with its key, and HTTP is off.

What it leaves plain:

- Triton's HTTP endpoint has no TLS, so ``server.http_port`` with TLS on is refused.
- PyTriton itself manages Triton (loads the models, waits for them) through a client that speaks
  no TLS. With TLS on, it does so through an HTTP endpoint bound to 127.0.0.1 on a free port
  (:func:`pytriton_http_port`), never reachable from another machine; the server then requires a
  run token as it does with HTTP on (:mod:`aligner.critic.security`), and checks its own
  readiness there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aligner.distributed import free_port
from aligner.wire.tls import TLS_SCHEME, file_problem

__all__ = ["ServerTLSConfig", "PYTRITON_HTTP_HOST", "pytriton_http_port", "http_options", "own_ready_url"]

PYTRITON_HTTP_HOST = "127.0.0.1"
"""Where PyTriton's own HTTP endpoint binds with TLS on: loopback only."""


@dataclass
class ServerTLSConfig:
    """TLS on the gRPC endpoint (``server.tls``): off while ``cert_file`` and ``key_file`` are null."""

    cert_file: str | None = None
    """PEM certificate (chain) the server presents; its names (subjectAltName) must include the
    host clients connect to. With key_file: TLS on."""
    key_file: str | None = None
    """PEM private key of cert_file."""
    client_ca_file: str | None = None
    """PEM certificates of the CA(s) client certificates must chain to: mutual TLS, a client
    without such a certificate is refused. Null: any client may connect (TLS without client
    certificates)."""

    @property
    def on(self) -> bool:
        return bool(self.cert_file or self.key_file)

    @property
    def mutual(self) -> bool:
        return self.on and bool(self.client_ca_file)

    @property
    def scheme(self) -> str:
        """The scheme of the gRPC endpoint's URL: ``grpcs`` with TLS, ``grpc`` without."""
        return TLS_SCHEME if self.on else "grpc"

    def problems(self, http_port: int | None, prefix: str = "server.tls") -> list[str]:
        """Every problem of these settings: a certificate without its key or the reverse, a
        client CA without TLS, a file that is missing, unreadable or no PEM, and HTTP on."""
        out = []
        if bool(self.cert_file) != bool(self.key_file):
            out.append(
                f"{prefix}.cert_file={self.cert_file!r}, {prefix}.key_file={self.key_file!r}: expected "
                "both (TLS on: the server's certificate and its private key) or neither (TLS off)"
            )
        if self.client_ca_file and not (self.cert_file and self.key_file):
            out.append(
                f"{prefix}.client_ca_file={self.client_ca_file!r}: mutual TLS needs TLS on; set "
                f"{prefix}.cert_file and {prefix}.key_file too"
            )
        for key, what in (
            ("cert_file", "certificates"),
            ("key_file", "a private key"),
            ("client_ca_file", "CA certificates"),
        ):
            problem = file_problem(f"{prefix}.{key}", getattr(self, key) or None, what)
            if problem:
                out.append(problem)
        if self.on and http_port is not None:
            out.append(
                f"server.http_port={http_port} with {prefix} on: Triton's HTTP endpoint has no TLS, so "
                "it would carry tokens and data in the clear; set server.http_port=null and use gRPC "
                f"({TLS_SCHEME}://), or put HTTP behind a TLS-terminating proxy"
            )
        return out

    def triton_options(self) -> dict[str, Any]:
        """``TritonConfig``'s gRPC TLS options; empty with TLS off."""
        if not self.on:
            return {}
        return {
            "grpc_use_ssl": True,
            "grpc_use_ssl_mutual": self.mutual,
            "grpc_server_cert": self.cert_file,
            "grpc_server_key": self.key_file,
            # Triton reads a root file whenever TLS is on; only mutual TLS verifies clients with it.
            "grpc_root_cert": self.client_ca_file if self.mutual else self.cert_file,
        }


def pytriton_http_port(tls: ServerTLSConfig, taken: tuple[int | None, ...]) -> int | None:
    """With TLS on, a free loopback port for PyTriton's own HTTP endpoint (its client speaks no
    TLS), none of ``taken``; None with TLS off."""
    if not tls.on:
        return None
    port = free_port(PYTRITON_HTTP_HOST)
    while port in taken:
        port = free_port(PYTRITON_HTTP_HOST)
    return port


def http_options(
    host: str, http_port: int | None, pytriton_port: int | None, tls: ServerTLSConfig
) -> dict[str, Any]:
    """``TritonConfig``'s HTTP options (on at ``host``:``http_port``; with TLS, PyTriton's own on
    loopback at ``pytriton_port``; else off) and its gRPC TLS options."""
    port = http_port if pytriton_port is None else pytriton_port
    address = host if pytriton_port is None else PYTRITON_HTTP_HOST
    on = port is not None
    return {
        "allow_http": on,
        "http_address": address if on else None,
        "http_port": port,
        **tls.triton_options(),
    }


def own_ready_url(grpc_url: str, pytriton_port: int | None) -> str:
    """Where the server checks its own readiness: its gRPC URL, or with TLS (whose CA and client
    certificate the server need not hold) PyTriton's loopback HTTP endpoint."""
    return grpc_url if pytriton_port is None else f"http://{PYTRITON_HTTP_HOST}:{pytriton_port}"
