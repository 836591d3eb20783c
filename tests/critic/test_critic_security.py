"""The critic server's secure defaults (aligner.critic.security, README "What the server trusts"):
a token required beyond loopback or with HTTP on (made 0600 in log.dir when none is set, reused
on restart), HTTP off by default, the token kept out of Triton's environment, server_info's public
view, and throttled logging of refused requests. One real server for the module, bound to 0.0.0.0
without a token."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from aligner.critic import probe, security
from aligner.critic.config import build_config
from aligner.critic.host import descendants
from aligner.critic.launch import start_server
from aligner.critic.testing import digit_batch, raw_error, raw_info, tiny_config, tiny_overrides, train_arrays
from aligner.critic.tls import ServerTLSConfig
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P

TOK = build_tokenizer("char")


# ------------------------------------------------------------------------------------------------
# Without a server
# ------------------------------------------------------------------------------------------------


def test_loopback_and_when_a_token_is_required():
    assert all(security.is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "LOCALHOST"))
    assert not any(security.is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "critic.ns.svc", ""))
    assert security.token_required_reason("127.0.0.1", http_on=False) is None
    assert "beyond loopback" in security.token_required_reason("0.0.0.0", http_on=False)
    assert "HTTP" in security.token_required_reason("127.0.0.1", http_on=True)


def test_http_is_off_by_default(tmp_path):
    cfg = build_config({"log": {"dir": str(tmp_path)}, "reward": {"fn": "aligner.tasks.digits:sort_reward"}})
    assert cfg.server.http_port is None and cfg.server.allow_no_token is False
    assert build_config(tiny_config(tmp_path, server={"http_port": 0})).server.http_port == 0


def _cfg(tmp_path, host="0.0.0.0", http_port=None, allow_no_token=False):
    server = SimpleNamespace(
        host=host, http_port=http_port, allow_no_token=allow_no_token, tls=ServerTLSConfig()
    )
    return SimpleNamespace(server=server, log=SimpleNamespace(dir=str(tmp_path / "log")))


def test_a_token_file_is_made_0600_reused_on_restart_and_refused_when_others_may_read_it(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "aligner.critic")
    path = tmp_path / "log" / security.TOKEN_FILE_NAME
    assert security.server_run_token(_cfg(tmp_path, host="127.0.0.1"), None) is None  # loopback, no HTTP
    assert not path.exists()
    token = security.server_run_token(_cfg(tmp_path), None)
    assert len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == token
    assert str(path) in caplog.text and token not in caplog.text
    # A restart on the same log.dir requires the same token (the actor keeps working).
    assert security.server_run_token(_cfg(tmp_path, host="127.0.0.1", http_port=0), None) == token
    # A configured token wins; nothing is made.
    assert security.server_run_token(_cfg(tmp_path), "configured") == "configured"
    path.chmod(0o644)
    with pytest.raises(security.TokenFileError, match="mode 0600"):
        security.server_run_token(_cfg(tmp_path), None)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(security.TokenFileError):
        security.server_run_token(_cfg(tmp_path), None)
    path.unlink()
    caplog.clear()
    assert security.server_run_token(_cfg(tmp_path, allow_no_token=True), None) is None
    assert "WITHOUT A RUN TOKEN" in caplog.text and not path.exists()


def test_the_token_variable_is_dropped(monkeypatch):
    monkeypatch.setenv(P.RUN_TOKEN_ENV, "secret")
    security.drop_token_env()
    assert P.RUN_TOKEN_ENV not in os.environ


def test_refusals_are_logged_once_per_kind_and_interval_with_a_count(caplog):
    caplog.set_level(logging.WARNING, "t")
    now = [0.0]
    r = security.RefusalLog(logging.getLogger("t"), interval_s=60, clock=lambda: now[0])
    for _ in range(5):
        r.refused(P.TRAIN, P.UnauthorizedError(P.TRAIN, missing=True))
    r.refused(P.TRAIN, P.ProtocolError(P.TRAIN, "mask", "0/1", "2"))
    assert len(caplog.records) == 2
    now[0] = 61.0
    r.refused(P.TRAIN, P.UnauthorizedError(P.TRAIN, missing=False))
    assert len(caplog.records) == 3 and "4 more UnauthorizedError" in caplog.records[-1].getMessage()
    assert not any(rec.exc_info for rec in caplog.records)


# ------------------------------------------------------------------------------------------------
# A real server on 0.0.0.0, no token configured, HTTP left at its default
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    overrides = {"server.host": "0.0.0.0", "reward.fn": "aligner.tasks.digits:sort_reward"}
    # An empty $ALIGNER_RUN_TOKEN is no token (one is made), and the variable must still go.
    server = start_server(
        tiny_overrides(root, **overrides), log_path=root / "server.stderr", env={P.RUN_TOKEN_ENV: ""}
    )
    try:
        token_file = root / "log" / security.TOKEN_FILE_NAME
        yield {"server": server, "root": root, "token": token_file.read_text().strip(), "file": token_file}
    finally:
        server.stop()


def _tritonserver(pid: int) -> int:
    found = [
        p for p in descendants(pid) if "tritonserver" in Path(f"/proc/{p}/cmdline").read_bytes().decode()
    ]
    assert found, "no tritonserver child"
    return found[0]


def _listening_ports(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.server
def test_the_server_makes_a_0600_token_file_and_logs_its_path_not_the_token(env):
    assert stat.S_IMODE(env["file"].stat().st_mode) == 0o600 and len(env["token"]) >= 40
    log = (env["root"] / "log" / "server.log").read_text()
    assert str(env["file"].resolve()) in log and env["token"] not in log
    assert env["token"] not in (env["root"] / "server.stderr").read_text()


@pytest.mark.server
def test_http_is_off_only_grpc_listens(env):
    server = env["server"]
    assert server.ports["http"] == 0 and server.http_url == ""
    assert _listening_ports(_tritonserver(server.pid)) == {server.ports["grpc"]}


@pytest.mark.server
def test_tritons_admin_token_is_off_its_command_line_and_still_guards_the_admin_calls(env):
    args = Path(f"/proc/{_tritonserver(env['server'].pid)}/cmdline").read_bytes().split(b"\0")
    values = [args[i + 1] for i, a in enumerate(args) if a in security._RESTRICTED]
    assert len(values) == 2, args  # gRPC and HTTP (off here, but configured alike)
    for v in values:
        header, _, token = v.partition(b":")[2].partition(b"=")
        assert header and token and set(token) == {ord("x")}, v
    # Triton kept its own copy: the model-repository API still wants the real token.
    client = grpcclient.InferenceServerClient(env["server"].url.split("://", 1)[1])
    try:
        with pytest.raises(InferenceServerException, match="(?i)restricted|unauthenticated|permission"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="(?i)restricted|unauthenticated|permission"):
            client.get_model_repository_index(headers={header.decode(): token.decode()})
    finally:
        client.close()


@pytest.mark.server
def test_the_token_variable_is_not_in_the_environment_of_the_servers_children(env):
    kids = list(descendants(env["server"].pid))
    assert kids
    for pid in kids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        assert f"{P.RUN_TOKEN_ENV}=".encode() not in environ and env["token"].encode() not in environ


@pytest.mark.server
def test_an_untokened_critic_train_is_refused_with_one_log_line_and_no_traceback(env):
    url = env["server"].url
    tokens, lengths, pl, *_ = digit_batch(TOK, 2, seed=3)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=3)
    held = raw_info(url).critic_step
    req = P.TrainRequest(tokens, lengths, returns, old_values, mask, held + 1, held)
    for tok, missing in ((None, True), ("wrong", False), (None, True), ("wrong", False), (None, True)):
        refused = P.extract_unauthorized(raw_error(url, P.TRAIN, req.to_wire(tok)))
        assert refused is not None and refused.missing is missing
    assert raw_info(url).critic_step == held
    log = (env["root"] / "log" / "server.log").read_text()
    assert log.count("critic_train refused") == 1 and "Traceback" not in log
    assert "Traceback" not in (env["root"] / "server.stderr").read_text()


@pytest.mark.server
def test_server_info_is_public_without_the_token_and_full_with_it(env):
    url = env["server"].url
    public = raw_info(url)
    assert public.full is False and public.run_token_required is True
    assert (
        public.extra == {}
        and public.reward == {}
        and public.tokenizer == ""
        and public.checkpoint_steps == []
    )
    assert public.vocab_size == TOK.vocab_size and public.tokenizer_fingerprint == TOK.fingerprint()
    full = raw_info(url, env["token"])
    assert full.full is True and full.extra["pid"] == env["server"].pid and full.checkpoint_steps == [0]
    assert full.reward["fn"] == "aligner.tasks.digits:sort_reward" and full.instance_id == public.instance_id
    refused = P.extract_unauthorized(raw_error(url, P.INFO, {"run_token": P.run_token_array("wrong")}))
    assert refused is not None and refused.model == P.INFO
    assert probe.check_alive(url, 10) is None  # the probe sends no token
