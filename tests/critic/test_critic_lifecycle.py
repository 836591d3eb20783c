"""The critic server process: its entry points (also from an installed package), start-up errors,
a crash at a fault point and a restart that resumes its checkpoint and fences stale steps, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from aligner.checkpoint import complete_steps, read_json
from aligner.critic.launch import SERVER_MODULE, start_server
from aligner.critic.testing import (
    digit_batch,
    raw_error,
    raw_info,
    raw_save,
    raw_train,
    tiny_overrides,
    train_arrays,
)
from aligner.distributed import free_port
from aligner.faults import SERVER
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.readiness import ServerStartError

pytestmark = pytest.mark.server
TOK = build_tokenizer("char")
ROOT = Path(__file__).resolve().parents[2]


def _run_failing(overrides: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", SERVER_MODULE, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=cwd,
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
    procs = {
        name: _run_failing(tiny_overrides(tmp_path / name) + o, tmp_path) for name, (o, _) in cases.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode not in (0, None), (name, out, err)
        assert "READY" not in out
        for needle in cases[name][1]:
            assert needle in err, (name, needle, err[-2000:])
    # Nothing was written into the working directory by Hydra.
    assert not (tmp_path / "outputs").exists()


ENTRY_POINTS = {
    "module": [sys.executable, "-m", SERVER_MODULE],
    "script": [sys.executable, str(ROOT / "servers" / "serve_critic.py")],
    # What pip's console script aligner-serve-critic runs.
    "console": [sys.executable, "-c", "import sys; from aligner.critic.server import main; sys.exit(main())"],
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_reads_the_packaged_config_from_anywhere(tmp_path, entry):
    """The module, the script and the console script compose critic.yaml from the package (in a
    working directory that has no configs), print it for --help, and reject an unknown key."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    helped = subprocess.run(
        [*ENTRY_POINTS[entry], "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.startswith("the critic server is powered by Hydra")
    assert "grpc_port: 8001" in helped.stdout and "keep_last:" in helped.stdout
    bad = subprocess.run(
        [*ENTRY_POINTS[entry], "checkpoint.kep_last=1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert bad.returncode not in (0, None) and "READY" not in bad.stdout
    assert "kep_last" in bad.stderr, bad.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # Hydra wrote nothing into the working directory
    if entry == "console":
        scripts = (ROOT / "pyproject.toml").read_text()
        assert 'aligner-serve-critic = "aligner.critic.server:main"' in scripts


def test_the_server_child_imports_the_package_its_launcher_came_from(monkeypatch):
    """A checkout goes first on the child's PYTHONPATH; site-packages never does (it would come
    before the standard library)."""
    import sysconfig

    from aligner.critic import launch

    assert launch._child_pythonpath(f"/x{os.pathsep}") == os.pathsep.join([str(ROOT), "/x"])
    installed = Path(sysconfig.get_paths()["purelib"]) / "aligner" / "critic" / "launch.py"
    monkeypatch.setattr(launch, "__file__", str(installed))
    assert launch._child_pythonpath("/x") == "/x"


@pytest.mark.slow
def test_an_installed_package_serves_without_the_repository(tmp_path):
    """Built as a wheel and installed elsewhere (not editable), the package carries its configs
    and its launcher starts the server from that installation."""
    src = tmp_path / "project"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "aligner", src / "aligner", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src], check=True
    )
    wheel = next((tmp_path / "dist").glob("aligner_rlhf-*.whl"))  # the distribution aligner-rlhf
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    work = tmp_path / "work"
    work.mkdir()
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    helped = subprocess.run(
        [site / "bin" / "aligner-serve-critic", "--help"], capture_output=True, text=True, env=env, cwd=work
    )
    assert helped.returncode == 0 and "grpc_port: 8001" in helped.stdout, helped.stderr[-2000:]
    helped = subprocess.run(  # the actor's script, from the same installation
        [site / "bin" / "aligner-train", "--help"], capture_output=True, text=True, env=env, cwd=work
    )
    assert helped.returncode == 0 and "mini_batch_size" in helped.stdout, helped.stderr[-2000:]
    run = """
import sys, aligner
from aligner.critic.launch import start_server
from aligner.critic.testing import tiny_overrides
print("PACKAGE", aligner.__file__)
server = start_server(tiny_overrides(sys.argv[1]), log_path=sys.argv[1] + "/server.log")
print("STOPPED", server.stop(timeout=60))
"""
    out = subprocess.run(
        [sys.executable, "-c", run, str(tmp_path / "server")],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"PACKAGE {site / 'aligner' / '__init__.py'}" in out.stdout
    assert "STOPPED 0" in out.stdout
    assert complete_steps(tmp_path / "server" / "ckpt", role="critic") == [0]


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


def test_a_crashed_server_resumes_its_last_checkpoint_fences_stale_steps_and_stops_cleanly(tmp_path):
    """A server that dies mid-step (the ``train@3`` fault point: SIGKILL after the backward)
    restarts on the same ports with ``checkpoint.resume=auto`` at its newest checkpoint (step 1),
    as another process; a caller that still expects step 2 is refused, naming both steps; the
    steps redone from there give the results they gave before; SIGTERM saves and exits 0."""
    ws = Path(tempfile.mkdtemp(prefix="critic-ws-"))  # short: PyTriton's Unix sockets live there
    ports = {"server.grpc_port": free_port(), "server.workspace_root": ws}
    # Beyond loopback, as in a pod; the first server has no run token (waived: allow_no_token),
    # the second has one.
    overrides = tiny_overrides(tmp_path, **ports, **{"server.host": "0.0.0.0", "checkpoint.resume": "auto"})
    tokens, lengths, pl, *_ = digit_batch(TOK, 4, seed=1)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=1)
    token = "lifecycle-run-token"

    def train(url, step, expected, run_token=None):
        req = P.TrainRequest(tokens, lengths, returns, old_values, mask, step, expected)
        return P.TrainResult.from_wire(raw_train(url, req, run_token))

    first = start_server(
        overrides + ["server.allow_no_token=true"],
        log_path=tmp_path / "first.log",
        env={SERVER.env: "train@3"},
    )
    try:
        info1 = raw_info(first.url)
        assert (info1.critic_step, info1.checkpoint_steps, info1.run_token_required) == (-1, [0], False)
        r1 = train(first.url, 1, -1)
        raw_save(first.url, 1, 1)
        r2 = train(first.url, 2, 1)
        with pytest.raises(InferenceServerException):  # the server dies under the request
            train(first.url, 3, 2)
        first.proc.wait(30)
        assert first.returncode == -9
        first_pid = first.pid
    except BaseException:
        first.kill()
        raise
    assert "WITHOUT A RUN TOKEN" in (tmp_path / "first.log").read_text()
    second = start_server(overrides, log_path=tmp_path / "second.log", env={P.RUN_TOKEN_ENV: token})
    try:
        assert second.url == first.url  # same ports: nothing of the killed server holds them
        assert not any(p.name.startswith(f"critic-{first_pid}-") for p in ws.iterdir())
        info = raw_info(second.url, token)
        assert info.instance_id != info1.instance_id and info.run_token_required
        assert (info.critic_step, info.checkpoint_steps) == (1, [0, 1])
        # The caller that saw step 2 applied retries step 3: refused, nothing applied.
        text = raw_error(
            second.url,
            P.TRAIN,
            P.TrainRequest(tokens, lengths, returns, old_values, mask, 3, 2).to_wire(token),
        )
        assert (
            "[critic-fenced] critic_train step 3: the request expects the server at critic step 2, but it "
            "holds critic step 1 (restarted or rolled back?); nothing applied"
        ) in text
        assert raw_info(second.url).critic_step == 1
        # Redone from the checkpoint, step 2 gives what it gave (weights, optimizer and RNG came
        # back), and the run goes on.
        assert train(second.url, 2, 1, token) == r2 and train(second.url, 1, 0, token) == r1
        assert train(second.url, 3, 2, token).applied_step == 3
        code = second.stop(timeout=60)
    finally:
        second.kill()
    assert code == 0, second.output_tail()
    assert "WITHOUT A RUN TOKEN" not in (tmp_path / "second.log").read_text()
    # Step 0 is the initial critic (checkpoint.save_initial); step 3 was saved on SIGTERM.
    assert complete_steps(tmp_path / "ckpt", role="critic") == [0, 1, 3]
    assert read_json(tmp_path / "ckpt" / "step_00000003" / "critic" / "meta.json")["critic_step"] == 3
    assert not list(ws.iterdir())  # the clean stop removed its workspace
    shutil.rmtree(ws, ignore_errors=True)
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "critic/vf_loss" in r]
    # The restarted server rewound its metrics to the step it loaded: step 2's abandoned row went,
    # the redone one replaced it.
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert {"critic/grad_norm", "critic/vf_explained_var", "critic/vf_clipfrac"} <= set(trained[-1])
    assert trained[-1]["timers/critic_train_ms"] > 0 and "loss/value" not in trained[-1]
    assert any("server/critic_infer/requests" in r or "server/server_info/requests" in r for r in records)
