"""The critic server process: start-up errors, SIGKILL + restart with a recovering client, SIGTERM."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from aligner.checkpoint import complete_steps, read_json
from aligner.critic.client import RemoteCriticClient
from aligner.critic.launch import SERVE_SCRIPT, ServerStartError, start_server
from aligner.critic.testing import digit_batch, tiny_overrides, train_arrays
from aligner.distributed import free_port
from aligner.tokenizers import build_tokenizer

TOK = build_tokenizer("char")


def _run_failing(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SERVE_SCRIPT), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def test_config_errors_fail_at_start_up_naming_the_key(tmp_path):
    cases = {
        "unknown": (["server.grpc_prot=1"], ["grpc_prot"]),
        "reward_fn": (
            ["reward.fn=nope:missing"],
            ["reward.fn='nope:missing'", "cannot import module 'nope'"],
        ),
        "values": (
            ["optim.lr=-1", "server.max_batch_size=0", "model.num_attention_heads=3"],
            ["optim.lr=-1.0", "server.max_batch_size=0", "num_attention_heads"],
        ),
        "type": (["model.hidden_size=wide"], ["model.hidden_size", "wide"]),
    }
    procs = {name: _run_failing(tiny_overrides(tmp_path / name) + o) for name, (o, _) in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode not in (0, None), (name, out, err)
        assert "READY" not in out
        for needle in cases[name][1]:
            assert needle in err, (name, needle, err[-2000:])
    # Nothing was written into the working directory by Hydra.
    assert not (SERVE_SCRIPT.parent.parent / "outputs").exists()


def test_a_taken_port_fails_fast_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            ServerStartError, match=f"exited with code 2 before READY(.|\n)*server.grpc_port={port}"
        ):
            start_server(
                tiny_overrides(tmp_path, **{"server.grpc_port": port}),
                ready_timeout_s=60,
                log_path=tmp_path / "server.log",
            )


def test_kill_restart_recovery_and_clean_sigterm(tmp_path):
    ws = Path(tempfile.mkdtemp(prefix="critic-ws-"))  # short: PyTriton's Unix sockets live there
    ports = {"server.http_port": free_port(), "server.grpc_port": free_port(), "server.workspace_root": ws}
    overrides = tiny_overrides(tmp_path, **ports)
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=1)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=1)

    first = start_server(overrides, log_path=tmp_path / "first.log")
    try:
        client = RemoteCriticClient(first.url, timeout_s=20, ready_timeout_s=120, retries=6, backoff_s=0.2)
        fresh, _ = client.infer(tokens, lengths, pl).result()
        client.train(tokens, lengths, returns, old_values, mask, 0).result()
        first_pid = first.pid
        first.kill()  # SIGKILL: no clean-up at all
        assert first.returncode == -9
        pending = client.infer(tokens, lengths, pl)  # sent into the void: retried until the server is back
        second = start_server(overrides, log_path=tmp_path / "second.log")
    except BaseException:
        first.kill()
        raise
    try:
        assert second.url == first.url  # same ports
        values, _ = pending.result(timeout=180)
        # A fresh server with the same seed starts from the same weights (no checkpoint to resume).
        np.testing.assert_allclose(values, fresh, rtol=0, atol=1e-6)
        assert not any(p.name.startswith(f"critic-{first_pid}-") for p in ws.iterdir())
        # Training continues on the restarted server, then SIGTERM saves it and exits 0.
        result = client.train(tokens, lengths, returns, old_values, mask, 1).result(timeout=60)
        assert result["applied_step"] == 1
        client.close()
        code = second.stop(timeout=60)
    finally:
        second.kill()
    assert code == 0, second.output_tail()
    # Step 0 is the initial critic (checkpoint.save_initial); step 1 was saved on SIGTERM.
    assert complete_steps(tmp_path / "ckpt", role="critic") == [0, 1]
    meta = read_json(tmp_path / "ckpt" / "step_00000001" / "critic" / "meta.json")
    assert meta["critic_step"] == 1
    assert not list(ws.iterdir())  # the clean stop removed its workspace
    shutil.rmtree(ws, ignore_errors=True)
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss/value" in r]
    assert [r["step"] for r in trained] == [0, 1]
    assert {"critic/grad_norm", "critic/explained_variance", "critic/value_clipfrac"} <= set(trained[-1])
    assert any("server/critic_infer/requests" in r for r in records)
