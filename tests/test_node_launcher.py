"""aligner-launch (aligner/node.py): the arguments it refuses, and both roles on this machine's
CPU: the demo's task for a few steps, an actor that fails, a server that does not start. Every
case ends with both roles stopped (the module's leftover check fails otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.node import actor_command, parse_devices, role_env, rollout_command

ROOT = Path(__file__).resolve().parents[1]
# The demo's critic (examples/demo.py) and a tiny, short actor run of the copy task.
CRITIC = [
    "server.metrics_port=null",
    "model.max_seq_len=16",
    "optim.lr=1e-3",
    "reward.fn=aligner.tasks.digits:copy_reward",
    "checkpoint.save_on_sigterm=false",
    "log.tensorboard=false",
]
ACTOR = [
    "+recipe=digits",
    "data.task=copy",
    "data.num_digits=3",
    "generation.max_new_tokens=4",
    "ppo.num_steps=3",
    "ppo.global_batch_size=64",
    "ppo.mini_batch_size=64",
    "ppo.micro_batch_size=64",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "validation.interval=0",
    "validation.before_train=false",
]


def test_devices_and_commands():
    assert parse_devices("0,1", "--actor-gpus") == ["0", "1"] and parse_devices(" CPU ", "x") is None
    for bad in ("", "0,,1", "a", "0,0", "-1"):
        with pytest.raises(ValueError, match="--actor-gpus="):
            parse_devices(bad, "--actor-gpus")
    assert (
        role_env(None) == {"CUDA_VISIBLE_DEVICES": ""}
        and role_env(["2", "3"])["CUDA_VISIBLE_DEVICES"] == "2,3"
    )
    assert actor_command(1, "grpc://h:1", ["a=1"], python="py") == [
        "py",
        "-m",
        "aligner.actor.run",
        "critic.url=grpc://h:1",
        "a=1",
    ]
    cmd = actor_command(4, "grpc://h:1", [], python="py")
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    where = ["rollout.workers=3", "rollout.worker_rank=2", "rollout.address=h:2"]
    assert rollout_command(2, 3, "h:2", ["a=1"], python="py") == [
        "py",
        "-m",
        "aligner.rollout.worker",
        "a=1",
        *where,
    ]
    cmd = rollout_command(2, 3, "h:2", ["a=1"], python="py", tp=2)
    assert cmd[:7] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "aligner.rollout.worker",
    ]
    assert cmd[7:] == ["a=1", *where, "rollout.tensor_parallel_size=2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--critic-gpus", "0", "--actor-gpus", "0,1"], "share device(s) 0"),
        (
            ["--critic-gpus", "0", "--actor-gpus", "1", "--rollout-gpus", "1,2"],
            "--actor-gpus and --rollout-gpus share",
        ),
        (
            ["--critic-gpus", "cpu", "--actor-gpus", "cpu", "--rollout-procs", "2"],
            "name the workers' devices",
        ),
        (
            [
                "--critic-gpus",
                "cpu",
                "--actor-gpus",
                "cpu",
                "--rollout-gpus",
                "cpu",
                "--",
                "rollout.workers=3",
            ],
            "the launcher places the rollout workers",
        ),
        (
            ["--critic-gpus", "0", "--actor-gpus", "1", "--rollout-gpus", "2,3,4", "--rollout-tp", "2"],
            "--rollout-tp=2 does not divide the 3 device(s)",
        ),
        (
            ["--critic-gpus", "0", "--actor-gpus", "1", "--rollout-tp", "2"],
            "name the workers' devices",
        ),
        (
            [
                "--critic-gpus",
                "0",
                "--actor-gpus",
                "1",
                "--rollout-gpus",
                "2,3",
                "--rollout-tp",
                "2",
                "--rollout-procs",
                "2",
            ],
            "--rollout-procs=2: 1 worker(s) of 2 device(s) each",
        ),
        (
            ["--critic-gpus", "0", "--actor-gpus", "1", "--actor-procs", "2"],
            "--actor-procs=2: one process per device",
        ),
        (
            ["--critic-gpus", "cpu", "--actor-gpus", "cpu", "--critic-procs", "0"],
            "--critic-procs=0: expected at least 1",
        ),
        (["--critic-gpus", "x", "--actor-gpus", "cpu"], "--critic-gpus='x'"),
        (
            ["--critic-gpus", "cpu", "--actor-gpus", "cpu", "--", "critic.url=grpc://elsewhere:1"],
            "points the actor",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args, message, capsys):
    from aligner.node import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def _launch(
    tmp_path: Path, critic: list[str], actor: list[str], *flags: str, **env: str
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "aligner.node", "--critic-gpus", "cpu", "--actor-gpus", "cpu", *flags]
    cmd += [x for o in critic for x in ("--critic", o)]
    cmd += ["--log-dir", str(tmp_path / "log"), "--grace-s", "30", "--", *actor]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.subprocess
def test_both_roles_run_and_stop_and_a_failing_actor_stops_the_server(tmp_path):
    def roles(d: Path) -> tuple[list[str], list[str]]:
        ckpt = f"checkpoint.dir={d / 'ckpt'}"
        return [*CRITIC, f"log.dir={d / 'critic'}", ckpt], [*ACTOR, f"logging.run_dir={d / 'actor'}", ckpt]

    # All three roles: the actor trains on batches a rollout worker generates one version behind.
    critic, actor = roles(tmp_path / "ok")
    actor += ["rollout.max_staleness=1", "ppo.tis_cap=2.0"]
    out = _launch(tmp_path / "ok", critic, actor, "--rollout-gpus", "cpu", "--rollout-procs", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "server ready at grpc://127.0.0.1:" in out.stdout and "stopping the critic server" in out.stdout
    assert "step 3 " in out.stdout and (tmp_path / "ok" / "log" / "critic_server.log").is_file()
    assert "1 rollout worker(s) on cpu" in out.stdout and "rollout: 1 worker(s) joined" in out.stdout
    worker_log = (tmp_path / "ok" / "log" / "rollout_1.log").read_text()
    assert "stopped by the trainer after 4 batch(es)" in worker_log, worker_log
    # An actor that fails at start (a key it does not know) stops the server; its code is kept.
    critic, actor = roles(tmp_path / "bad")
    bad = _launch(tmp_path / "bad", critic, [*actor, "ppo.no_such_key=1"])
    assert bad.returncode != 0 and "stopping the critic server" in bad.stdout, bad.stderr[-3000:]
    # A server that dies mid-run (SIGKILLed at its critic_train of step 2) stops the actor, which
    # would otherwise wait for it to come back.
    critic, actor = roles(tmp_path / "died")
    died = _launch(tmp_path / "died", critic, actor, ALIGNER_SERVER_FAULT_AT="train@2")
    assert died.returncode == 1, died.stdout[-2000:] + died.stderr[-3000:]
    assert "the critic server exited" in died.stderr and "while the actor ran" in died.stderr


@pytest.mark.server
@pytest.mark.subprocess
def test_a_server_that_does_not_start_starts_no_actor(tmp_path):
    out = _launch(tmp_path, [*CRITIC, "optim.lr=-1"], ACTOR)
    assert out.returncode == 1 and "the critic server did not start" in out.stderr
    assert "optim.lr" in out.stderr and "actor on" not in out.stdout
