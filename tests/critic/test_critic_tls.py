"""TLS on the critic server's gRPC endpoint (server.tls) and its clients (grpcs:// URLs,
critic.tls; README.md, "What the server trusts").

One real server for the module, with mutual TLS (a throwaway CA made with the ``openssl`` CLI,
a server certificate for 127.0.0.1 and localhost, a client certificate): a TLS client with its
certificate scores and reads server_info, and so does the probe; a plain client, a client that
trusts another CA, one without a certificate and one with a certificate of another CA are each
refused at once with an error naming the URL and the cause (not retried until a deadline). A TLS
client at a plain gRPC endpoint is told so too. The configuration's refusals are unit tests
without a server.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from aligner.config_checks import ConfigError
from aligner.critic import probe
from aligner.critic.config import build_config
from aligner.critic.launch import start_server
from aligner.critic.testing import digit_batch, tiny_config, tiny_overrides
from aligner.tokenizers import build_tokenizer
from aligner.wire.client import RemoteCriticClient
from aligner.wire.readiness import parse_url, wait_ready
from aligner.wire.tls import ClientTLS, CriticTLSError, tls_problem

FAST_S = 20.0
"""A refusal comes within this, far inside the client's ready_timeout_s (120 s)."""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> Path:
    """Two throwaway CAs ('ca', 'other'), a server certificate for localhost and 127.0.0.1 and a
    client certificate from 'ca', and a client certificate from 'other', as PEM files in ``d``."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other"):
        _openssl(
            "req",
            "-x509",
            *key,
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.crt",
            "-days",
            "2",
            "-subj",
            f"/CN={ca}",
            cwd=d,
        )
    leaves = {
        "server": ("ca", "serverAuth", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"),
        "client": ("ca", "clientAuth", ""),
        "stranger": ("other", "clientAuth", ""),
    }
    for name, (ca, usage, san) in leaves.items():
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n{san}"
        )
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
            cwd=d,
        )  # fmt: skip
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool is not installed (it makes the test certificates)")
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Path, ca: str = "ca", client: str | None = "client") -> ClientTLS:
    if client is None:
        return ClientTLS(ca_file=str(pki / f"{ca}.crt"))
    return ClientTLS(str(pki / f"{ca}.crt"), str(pki / f"{client}.crt"), str(pki / f"{client}.key"))


@pytest.fixture(scope="module")
def server(pki, tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    tls = {
        "server.tls.cert_file": pki / "server.crt",
        "server.tls.key_file": pki / "server.key",
        "server.tls.client_ca_file": pki / "ca.crt",
    }
    s = start_server(tiny_overrides(root, **tls), log_path=root / "server.stderr", tls=_tls(pki))
    try:
        yield s
    finally:
        s.stop()


def _refused(url: str, tls: ClientTLS | None) -> str:
    """The CriticTLSError a client connecting to ``url`` gets, checked to come fast."""
    t0 = time.monotonic()
    with pytest.raises(CriticTLSError) as e:
        RemoteCriticClient(url, tls=tls, ready_timeout_s=120)
    assert time.monotonic() - t0 < FAST_S, "a TLS refusal must not wait for the deadline"
    assert url in str(e.value)
    return str(e.value)


@pytest.mark.server
def test_a_tls_client_scores_and_reads_server_info(server, pki):
    assert server.url.startswith("grpcs://127.0.0.1:")
    tok = build_tokenizer("char")
    tokens, lengths, pl, _, _ = digit_batch(tok, 3)
    with RemoteCriticClient(server.url, tls=_tls(pki), timeout_s=60) as c:
        info = c.server_info()
        assert info.protocol_version > 0
        assert info.run_token_required  # TLS gives PyTriton a loopback HTTP endpoint: token required
        values, rewards = c.infer(tokens, lengths, pl).result()
    assert values.shape == (3, tokens.shape[1] - 1) and rewards.shape == (3,)
    assert np.isfinite(values).all()
    assert server.ports["http"] == 0  # no HTTP for anyone else


@pytest.mark.server
def test_a_plain_client_is_told_to_use_grpcs(server):
    plain = server.url.replace("grpcs://", "grpc://")
    message = _refused(plain, None)
    assert "speaks TLS" in message and server.url in message


@pytest.mark.server
def test_clients_the_server_or_they_do_not_trust_are_refused(server, pki):
    assert "does not trust" in _refused(server.url, _tls(pki, ca="other"))
    assert "does not trust" in _refused(server.url, None)  # the system's roots know no test CA
    assert "requires a client certificate" in _refused(server.url, _tls(pki, client=None))
    assert "refused this client's certificate" in _refused(server.url, _tls(pki, client="stranger"))


def test_a_certificate_for_another_name_is_told_at_once_however_grpc_words_it():
    url, hostport = "grpcs://critic-0:8001", "critic-0:8001"
    for error in (
        "[StatusCode.UNAVAILABLE] failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.0.0.7:8001: Peer name critic-0 is not in peer certificate",
        "[StatusCode.UNAVAILABLE] failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.0.0.7:8001: Ssl handshake failed (TSI_INTERNAL_ERROR): Custom verification check "
        "failed with error: UNAUTHENTICATED: Hostname Verification Check failed.",
    ):
        problem = tls_problem(url, "grpcs", hostport, error, ClientTLS(ca_file=None))
        assert problem is not None and "does not name critic-0" in problem, error


@pytest.mark.server
def test_the_probe_works_over_grpcs(server, pki, capsys):
    files = ["--tls-ca-file", str(pki / "ca.crt"), "--tls-cert-file", str(pki / "client.crt")]
    files += ["--tls-key-file", str(pki / "client.key")]
    assert probe.main(["--url", server.url, "--timeout", "20", *files]) == 0
    assert probe.main(["--url", server.url, "--timeout", "20", "--ready", *files]) == 0
    assert probe.main(["--url", server.url, "--timeout", "20"]) == 1
    assert "does not trust" in capsys.readouterr().err
    assert probe.main(["--url", server.url.replace("grpcs", "grpc"), "--timeout", "20"]) == 1
    assert "speaks TLS" in capsys.readouterr().err
    assert probe.main(["--url", server.url, "--tls-cert-file", str(pki / "client.crt")]) == 2
    assert "--tls-key-file" in capsys.readouterr().err


def test_a_tls_client_at_a_plain_endpoint_is_told_so(pki):
    grpc = pytest.importorskip("grpc")
    plain = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        url = f"grpcs://127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(CriticTLSError, match="does not speak TLS") as e:
            wait_ready(url, timeout_s=60, tls=_tls(pki))
        assert time.monotonic() - t0 < FAST_S and f"grpc://127.0.0.1:{port}" in str(e.value)
    finally:
        plain.stop(0)


# --- configuration (no server) ---------------------------------------------------------------


def _config_error(tmp_path, **server) -> str:
    with pytest.raises(ConfigError) as e:
        build_config(tiny_config(tmp_path, server=server))
    return str(e.value)


def test_the_server_refuses_a_certificate_without_its_key(tmp_path, pki):
    message = _config_error(tmp_path, tls={"cert_file": str(pki / "server.crt")})
    assert "server.tls.key_file=None" in message and "expected both" in message


def test_the_server_refuses_a_missing_or_unreadable_file_naming_key_and_value(tmp_path, pki):
    missing = str(tmp_path / "nope.key")
    message = _config_error(tmp_path, tls={"cert_file": str(pki / "server.crt"), "key_file": missing})
    assert f"server.tls.key_file={missing!r}: expected a readable file of a private key" in message
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    message = _config_error(
        tmp_path, tls={"cert_file": str(tmp_path / "junk.crt"), "key_file": str(pki / "server.key")}
    )
    assert "server.tls.cert_file=" in message and "expected a PEM file" in message


def test_the_server_refuses_tls_with_http_saying_why(tmp_path, pki):
    tls = {"cert_file": str(pki / "server.crt"), "key_file": str(pki / "server.key")}
    message = _config_error(tmp_path, http_port=0, tls=tls)
    assert "server.http_port=0" in message and "HTTP endpoint has no TLS" in message
    message = _config_error(tmp_path, tls={"client_ca_file": str(pki / "ca.crt")})
    assert "mutual TLS needs TLS on" in message


def test_a_good_tls_config_builds_and_names_the_grpcs_scheme(tmp_path, pki):
    tls = {"cert_file": str(pki / "server.crt"), "key_file": str(pki / "server.key")}
    cfg = build_config(tiny_config(tmp_path, server={"tls": tls}))
    assert cfg.server.tls.on and not cfg.server.tls.mutual and cfg.server.tls.scheme == "grpcs"
    assert cfg.server.tls.triton_options()["grpc_use_ssl"] is True
    assert not build_config(tiny_config(tmp_path)).server.tls.on


def test_client_tls_settings_are_checked_against_the_url(pki):
    assert parse_url("grpcs://h:1") == ("grpcs", "h:1")
    with pytest.raises(ValueError, match="has no TLS"):
        parse_url("https://h:1")
    with pytest.raises(ValueError, match="not grpcs://host:port"):
        _tls(pki).check("grpc://h:1", "grpc")
    with pytest.raises(ValueError, match="expected both"):
        ClientTLS(cert_file=str(pki / "client.crt")).check("grpcs://h:1", "grpcs")
    with pytest.raises(ValueError, match="not grpcs://"):
        RemoteCriticClient("http://127.0.0.1:1", tls=_tls(pki))
    _tls(pki).check("grpcs://h:1", "grpcs")  # nothing to say
