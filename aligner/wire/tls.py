"""TLS for a client of the critic server's gRPC endpoint: a ``grpcs://host:port`` URL turns it on,
:class:`ClientTLS` names what the client trusts and, for mutual TLS, who it is; and a failed
connection that no retry can fix (a plain client at a TLS server, a TLS client at a plain one,
a certificate the client does not trust) is told as such (:func:`tls_problem`), at once, instead
of being retried until a deadline.

Triton's HTTP endpoint has no TLS: ``http://`` URLs stay plain, and ``https://`` is refused
(:func:`aligner.wire.readiness.parse_url`).
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any

from aligner.wire.errors import CriticError

__all__ = [
    "ClientTLS",
    "CriticTLSError",
    "TLS_SCHEME",
    "tls_problem",
    "speaks_tls",
    "file_problem",
    "grpc_client_options",
]

TLS_SCHEME = "grpcs"
"""The URL scheme of a gRPC endpoint with TLS (``grpc`` is the plain one)."""


class CriticTLSError(CriticError, ConnectionError):
    """The client and the server at its URL do not agree on TLS, or the client does not trust
    the server's certificate (or the server the client's): retrying cannot help. The message
    names the URL and the likely cause (a CriticError, as the actor's other critic failures)."""


def file_problem(key: str, value: str | None, what: str) -> str | None:
    """Why ``value`` (the setting ``key``) is no readable file of PEM ``what``, or None."""
    if value is None:
        return None
    try:
        with open(value, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        return f"{key}={value!r}: expected a readable file of {what} ({e.strerror or e})"
    if b"-----BEGIN " not in head:
        return f"{key}={value!r}: expected a PEM file of {what} (no '-----BEGIN' line)"
    return None


@dataclass
class ClientTLS:
    """What a ``grpcs://`` client trusts and presents (the actor's ``critic.tls``). Ignored for
    a plain URL, where setting any of it is an error (:meth:`check`)."""

    ca_file: str | None = None
    """PEM certificates of the CA(s) the server's certificate must chain to (a private CA, or the
    server's self-signed certificate); None: the system's roots."""
    cert_file: str | None = None
    """PEM client certificate (chain), for a server that requires one (mutual TLS); with key_file."""
    key_file: str | None = None
    """PEM private key of cert_file."""

    @property
    def any_set(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file))

    def problems(self, prefix: str = "critic.tls") -> list[str]:
        """Every problem of these settings alone: a file that is missing, unreadable or no PEM,
        a client certificate without its key or the reverse. ``prefix`` names the settings
        (``critic.tls`` gives ``critic.tls.ca_file``; ``--tls`` gives ``--tls-ca-file``)."""

        def name(key: str) -> str:
            return f"{prefix}-{key.replace('_', '-')}" if prefix.startswith("--") else f"{prefix}.{key}"

        out = []
        if bool(self.cert_file) != bool(self.key_file):
            out.append(
                f"{name('cert_file')}={self.cert_file!r}, {name('key_file')}={self.key_file!r}: "
                "expected both (mutual TLS: the client's certificate and its key) or neither"
            )
        for key, what in (
            ("ca_file", "CA certificates"),
            ("cert_file", "certificates"),
            ("key_file", "a private key"),
        ):
            problem = file_problem(name(key), getattr(self, key) or None, what)
            if problem:
                out.append(problem)
        return out

    def check(self, url: str, scheme: str, prefix: str = "critic.tls") -> None:
        """ValueError naming every problem, and TLS settings given for a URL that is not grpcs://."""
        out = self.problems(prefix)
        if self.any_set and scheme != TLS_SCHEME:
            out.append(
                f"{prefix} is set but the critic url {url!r} is not {TLS_SCHEME}://host:port: TLS "
                f"needs a {TLS_SCHEME}:// URL (and a server with server.tls on)"
            )
        if out:
            raise ValueError("; ".join(out))

    def checked(self, url: str, scheme: str) -> ClientTLS:
        """Itself, once :meth:`check` found nothing to say."""
        self.check(url, scheme)
        return self

    def grpc_options(self) -> dict[str, Any]:
        """Keyword arguments of ``tritonclient.grpc.InferenceServerClient`` for TLS (it reads
        the files)."""
        return {
            "ssl": True,
            "root_certificates": self.ca_file or None,
            "private_key": self.key_file or None,
            "certificate_chain": self.cert_file or None,
        }

    def describe_roots(self) -> str:
        return f"critic.tls.ca_file={self.ca_file}" if self.ca_file else "the system's CA roots"


def grpc_client_options(scheme: str, tls: ClientTLS | None) -> dict[str, Any]:
    """``InferenceServerClient`` keyword arguments for ``scheme`` (grpc or grpcs)."""
    if scheme != TLS_SCHEME:
        return {}
    return (tls or ClientTLS()).grpc_options()


def speaks_tls(hostport: str, tls: ClientTLS | None = None, timeout_s: float = 2.0) -> str | None:
    """What the endpoint at ``hostport`` answers a TLS handshake (with ``tls``'s client
    certificate, if any; the server's is not checked: this only tells TLS from plain gRPC and
    whether the server takes this client): ``"plain"`` (it answered, not with TLS), ``"tls"``,
    ``"tls-refused"`` (TLS, and it refused this client's certificate or the lack of one: a
    server that requires client certificates closes the connection right after the handshake,
    where it would otherwise send its HTTP/2 settings), or None when nothing answered at all."""
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if tls is not None and tls.cert_file and tls.key_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError):
            return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            with ctx.wrap_socket(sock, server_hostname=host or None) as tls_sock:
                try:  # a gRPC server sends its SETTINGS at once; one that refused this client closes
                    first = tls_sock.recv(1)
                except ssl.SSLError as e:
                    return "tls-refused" if "certificate" in str(e).lower() else "tls"
                except OSError:
                    return "tls"
                return "tls" if first else "tls-refused"
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return "plain"
    except OSError:
        return None


def _refuses(hostport: str, tls: ClientTLS) -> bool:
    """Whether the server refuses this client, twice in a row (not a connection that a server
    going down happened to close)."""
    if speaks_tls(hostport, tls) != "tls-refused":
        return False
    time.sleep(0.2)
    return speaks_tls(hostport, tls) == "tls-refused"


_PLAIN_AT_TLS = ("wrong_version_number", "wrong version number", "packet_length_too_long", "http_request")
_UNTRUSTED = ("certificate_verify_failed", "certificate verify failed")
_CLOSED = ("socket closed", "connection reset", "end of tcp stream", "broken pipe")


def tls_problem(url: str, scheme: str, hostport: str, error: str, tls: ClientTLS | None) -> str | None:
    """Why an attempt at ``url`` failed with ``error`` for a reason of TLS that retrying will not
    fix, naming the URL and the likely cause; None when it is no such reason (or not known to be:
    a connection closed is checked with a handshake of its own, :func:`speaks_tls`)."""
    text = error.lower()
    closed = any(s in text for s in _CLOSED) and "refused" not in text
    if scheme == TLS_SCHEME:
        tls = tls or ClientTLS()
        if any(s in text for s in _PLAIN_AT_TLS):
            return (
                f"critic server at {url} does not speak TLS (its answer to the TLS handshake was plain): "
                f"use grpc://{hostport}, or turn TLS on at the server (server.tls.cert_file and key_file)"
            )
        if any(s in text for s in _UNTRUSTED):
            return (
                f"critic server at {url} presented a certificate that {tls.describe_roots()} does not "
                "trust: set critic.tls.ca_file to the CA that signed the server's certificate"
            )
        if "peer name" in text or "hostname verification" in text:  # gRPC says it either way
            return (
                f"critic server at {url} presented a certificate that does not name "
                f"{hostport.rpartition(':')[0]}: connect by a name its certificate holds (its subjectAltName)"
            )
        if closed and _refuses(hostport, tls):
            if tls.cert_file:
                return (
                    f"critic server at {url} refused this client's certificate (critic.tls.cert_file="
                    f"{tls.cert_file}): it must chain to the server's server.tls.client_ca_file"
                )
            return (
                f"critic server at {url} requires a client certificate (mutual TLS, its "
                "server.tls.client_ca_file): set critic.tls.cert_file and critic.tls.key_file"
            )
        return None
    if scheme == "grpc" and closed and speaks_tls(hostport) in ("tls", "tls-refused"):
        return (
            f"critic server at {url} speaks TLS (server.tls is on) and closed this plain connection: "
            f"connect with {TLS_SCHEME}://{hostport}, and critic.tls.ca_file when its certificate comes "
            "from a private CA"
        )
    return None
