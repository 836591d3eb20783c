"""The health probe (python -m aligner.critic.probe) against a real server: alive while the Python
service answers, not alive once that service stops answering although Triton itself still says
"live" (the case a probe that asks Triton only never restarts)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from aligner.critic import probe
from aligner.critic.launch import start_server
from aligner.critic.testing import HTTP_ON, tiny_overrides


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    s = start_server(tiny_overrides(root, **HTTP_ON), log_path=root / "server.stderr")
    try:
        yield s
    finally:
        try:
            os.kill(s.pid, signal.SIGCONT)  # never leave it stopped for stop() to wait on
        except ProcessLookupError:
            pass
        s.stop()


@pytest.mark.server
def test_probe_answers_for_a_serving_server(server, capsys):
    assert probe.main(["--url", server.url, "--timeout", "10"]) == 0
    assert probe.main(["--url", server.url, "--timeout", "10", "--ready"]) == 0
    assert probe.check_alive(server.http_url, 10) is None


@pytest.mark.server
def test_probe_fails_when_the_python_service_hangs_though_triton_is_live(server, capsys):
    os.kill(server.pid, signal.SIGSTOP)  # the Python service stops; its Triton child runs on
    try:
        with urllib.request.urlopen(f"{server.http_url}/v2/health/live", timeout=10) as r:
            assert r.status == 200  # what a Triton-only probe sees
        t0 = time.monotonic()
        assert probe.main(["--url", server.url, "--timeout", "2"]) == 1
        assert time.monotonic() - t0 < 15  # bounded by --timeout, not by the client's defaults
        assert "server_info did not answer within" in capsys.readouterr().err
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert probe.main(["--url", server.url, "--timeout", "30"]) == 0


def test_probe_refuses_a_malformed_url(capsys):
    assert probe.main(["--url", "ftp://x:1"]) == 2
    assert "expected grpc://host:port" in capsys.readouterr().err


def test_probe_reports_an_unreachable_server(capsys):
    assert probe.main(["--url", "grpc://127.0.0.1:9", "--timeout", "2"]) == 1
