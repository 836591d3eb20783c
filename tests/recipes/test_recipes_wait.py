"""The readiness CLI the recipes wait with (``python -m aligner.critic.wait``): it times out
naming the URL, gives up when the server's process exits, and is the check the local launcher
uses too. One test starts a real server for the CLI and the manifests' probe paths.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _recipes import ROOT, container, one, rendered

from aligner.critic import launch
from aligner.critic import wait as wait_cli
from aligner.wire import client as critic_client
from aligner.wire import readiness

# --- the readiness CLI ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_cli_times_out_naming_the_url(capsys, monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv(critic_client.ENV_URL, url)  # no --url: the actor's variable
    t0 = time.monotonic()
    assert wait_cli.main(["--timeout", "0.5"]) == 1
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert url in err and "not ready" in err
    assert wait_cli.main(["--url", "ftp://x:1", "--timeout", "1"]) == 2


def test_wait_cli_gives_up_when_the_server_process_exits(capsys):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    t0 = time.monotonic()
    code = wait_cli.main(
        ["--url", f"http://127.0.0.1:{_free_port()}", "--timeout", "60", "--pid", str(proc.pid)]
    )
    assert code == 1 and time.monotonic() - t0 < 10
    assert "has exited" in capsys.readouterr().err


def test_the_recipes_and_the_local_launcher_share_one_readiness_check():
    # The CLI the recipes run and the launcher of `make demo` (start_server) both wait through
    # readiness.wait_ready; the CLI also requires every model of the wire protocol.
    from aligner.wire import protocol

    assert wait_cli.wait_ready is readiness.wait_ready
    assert set(wait_cli.SERVED_MODELS) == set(protocol.MODELS)
    assert "wait_ready(" in Path(launch.__file__).read_text().split("class ServerProcess")[1]
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'aligner-wait-critic = "aligner.critic.wait:main"' in scripts


@pytest.mark.slow
@pytest.mark.server
def test_wait_cli_and_probe_paths_against_a_real_server(tmp_path):
    from aligner.critic.testing import tiny_overrides

    server = launch.start_server(tiny_overrides(tmp_path), log_path=tmp_path / "server.log")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "aligner.critic.wait", "--url", server.url, "--timeout", "30"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        assert f"critic server at {server.url} is ready" in out.stdout
        c = container(one(rendered(), "Deployment")["spec"]["template"]["spec"], "critic")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            # The manifest's own command, pointed at this server's port instead of the pod's.
            command = list(c[probe]["exec"]["command"])
            command[command.index("--url") + 1] = server.url
            t0 = time.monotonic()
            done = subprocess.run(
                [sys.executable, *command[1:]], capture_output=True, text=True, timeout=60, cwd=ROOT
            )
            assert done.returncode == 0, (probe, done.stderr)
            assert time.monotonic() - t0 < c[probe]["timeoutSeconds"], probe
    finally:
        server.kill()
