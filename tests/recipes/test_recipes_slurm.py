"""The SLURM recipe (examples/slurm/ppo_hetjob.sbatch): two heterogeneous-job components, the
critic launched first and waited for, then the actor against it, and SIGTERM stopping both in
order. The script runs under stand-in ``srun``/``scontrol`` commands (tests/_recipes.py) that
record what it launches. The layouts the tests run are in test_recipes_layouts.py.
"""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import time

from _recipes import (
    ACTOR_ENTRY,
    CRITIC_ENTRY,
    SBATCH,
    _after,
    _log,
    _slurm_env,
    actor_config,
    critic_config,
    torchrun,
)

from aligner.critic import wait as wait_cli


def sbatch_components() -> list[dict[str, str]]:
    """The #SBATCH options of each hetjob component, as {option: value}."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    components: list[dict[str, str]] = [{}]
    for line in lines:
        if line.startswith("#SBATCH"):
            opt = line.split(None, 1)[1]
            if opt == "hetjob":
                components.append({})
            else:
                key, _, value = opt.partition("=")
                components[-1][key] = value
    return components


def test_sbatch_script_is_valid_bash_with_two_components():
    check = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    components = sbatch_components()
    assert len(components) == 2, "one critic component, one actor component"
    for component in components:
        assert {"--nodes", "--gpus-per-node", "--cpus-per-task"} <= set(component)
    signal_opt = "--signal=" + components[0]["--signal"]
    assert re.fullmatch(r"--signal=B:TERM@\d+", signal_opt), (
        "SIGTERM to the batch script, which stops both roles"
    )


def test_sbatch_launches_the_critic_then_the_actor_against_it(tmp_path, schemas):
    env = _slurm_env(tmp_path)
    run = subprocess.run(
        ["bash", str(SBATCH), "+recipe=digits", "ppo.num_steps=10", "ppo.micro_batch_size=32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    log = _log(tmp_path)
    starts = {e["role"]: e for e in log if e["event"] == "start"}
    assert len(starts) == 3 == len([e for e in log if e["event"] == "start"])
    critic, wait, actor = starts["critic"], starts["other"], starts["actor"]
    assert (critic["cmd"], wait["cmd"], actor["cmd"]) == ("srun", "python", "srun")
    assert log.index(wait) < log.index(actor), "the actor starts only once the critic is ready"

    # The critic: component 0, torchrun with as many processes as its TP size and its GPUs.
    components = sbatch_components()
    assert "--het-group=0" in critic["args"]
    assert f"--gpus-per-node={components[0]['--gpus-per-node']}" in critic["args"]
    assert f"--cpus-per-task={components[0]['--cpus-per-task']}" in critic["args"]
    tr = torchrun(_after(critic["args"], "-m"))
    assert tr.nproc_per_node == components[0]["--gpus-per-node"]
    assert tr.max_restarts == 3, "a critic rank that dies or hangs: torchrun starts the server again"
    assert tr.training_script == CRITIC_ENTRY
    ccfg = critic_config(tr.training_script_args)
    assert ccfg.server.host == "0.0.0.0" and ccfg.checkpoint.save_on_sigterm
    assert ccfg.server.http_port is None, "HTTP stays off"
    # One run token file in the run's shared folder, mode 0600, named by both roles.
    token_file = tmp_path / "run" / "run_token"
    assert ccfg.server.run_token_file == str(token_file)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text().strip()) == 64
    assert token_file.read_text().strip() not in run.stdout + run.stderr + json.dumps(log)
    assert int(tr.nproc_per_node) == ccfg.parallel.world_size
    url = f"grpc://gpu-c01:{ccfg.server.grpc_port}"

    # The wait: the readiness CLI, on the critic's address, watching the critic's step.
    assert wait["args"][:2] == ["-m", "aligner.critic.wait"]
    wargs = wait_cli._parser().parse_args(wait["args"][2:])
    assert wargs.url == url and wargs.pid == critic["pid"]

    # The actor: component 1 on both of its nodes, the critic's address from the job, same checkpoints.
    assert "--het-group=1" in actor["args"] and "--nodes=2" in actor["args"]
    assert actor["url"] == url
    assert f"--gpus-per-node={components[1]['--gpus-per-node']}" in actor["args"]
    assert f"--cpus-per-task={components[1]['--cpus-per-task']}" in actor["args"]
    tr = torchrun(_after(actor["args"], "-m"))
    assert tr.training_script == ACTOR_ENTRY and tr.nnodes == "2"
    assert tr.nproc_per_node == components[1]["--gpus-per-node"]
    assert tr.rdzv_endpoint.startswith("gpu-a01:")
    acfg = actor_config(tr.training_script_args, world_size=2 * int(tr.nproc_per_node))
    assert acfg.critic.url is None and acfg.ppo.num_steps == 10
    assert acfg.critic.run_token_file == str(token_file)
    assert acfg.checkpoint.dir == ccfg.checkpoint.dir == str(tmp_path / "run" / "checkpoints")
    assert acfg.checkpoint.resume == ccfg.checkpoint.resume == "auto"
    # At the end, the critic is stopped with SIGTERM (it saves before it exits).
    assert log[-1] == {"event": "TERM", "role": "critic"}


def test_sbatch_sigterm_stops_the_actor_then_the_critic(tmp_path):
    env = _slurm_env(tmp_path, STUB_ACTOR_BLOCK="1")
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not any(e.get("role") == "actor" for e in _log(tmp_path)):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the actor never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@N sends before the time limit
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    terms = [e["role"] for e in _log(tmp_path) if e["event"] == "TERM"]
    assert terms == ["actor", "critic"]


def test_sbatch_starts_rollout_workers_beside_the_actor_on_its_nodes(tmp_path, schemas):
    """ROLLOUT_WORKERS_PER_NODE=2 of ROLLOUT_TP=2 on the actor's two nodes: a step of 4 worker
    tasks (two GPUs and ROLLOUT_CPUS each, a torchrun of two processes) before the actor, each
    worker given the actor's overrides, the worker count and size, the store on the actor's first
    node and its own rank (SLURM_PROCID + 1); the actor keeps the CPUs the workers leave and hosts
    that store."""
    env = _slurm_env(
        tmp_path, ROLLOUT_WORKERS_PER_NODE="2", ROLLOUT_TP="2", SLURM_CPUS_PER_TASK_HET_GROUP_1="24"
    )
    overrides = ["+recipe=digits", "rollout.max_staleness=1", "ppo.tis_cap=2.0", "ppo.micro_batch_size=32"]
    run = subprocess.run(
        ["bash", str(SBATCH), *overrides], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 rollout worker(s)" in run.stdout
    log = _log(tmp_path)
    starts = [e for e in log if e["event"] == "start"]
    assert sorted(e["role"] for e in starts) == ["actor", "critic", "other", "rollout"]
    rollout, actor = (next(e for e in starts if e["role"] == r) for r in ("rollout", "actor"))
    assert {"event": "TERM", "role": "rollout"} in log  # stopped at the end, before the critic
    assert log.index({"event": "TERM", "role": "rollout"}) < log.index({"event": "TERM", "role": "critic"})
    assert {
        "--het-group=1",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-task=2",
        "--cpus-per-task=4",
    } <= set(rollout["args"])
    assert "--cpus-per-task=16" in actor["args"]  # 24 less the workers' 2 x 4

    tr = torchrun(_after(actor["args"], "-m"))
    acfg = actor_config(tr.training_script_args, world_size=2 * int(tr.nproc_per_node))
    assert (acfg.rollout.workers, acfg.rollout.address, acfg.rollout.max_staleness) == (4, "gpu-a01:29650", 1)

    # What each task of the step runs: the command line srun was given, run as its task would.
    bash_at = rollout["args"].index("bash")
    command = rollout["args"][bash_at:]
    for procid in (0, 3):
        done = subprocess.run(command, env={**env, "SLURM_PROCID": str(procid)}, timeout=60)
        assert done.returncode == 0
    workers = [e for e in _log(tmp_path)[len(log) :] if e["event"] == "start"]
    assert [e["role"] for e in workers] == ["rollout", "rollout"]
    for procid, w in zip((0, 3), workers):
        assert w["args"][:2] == ["-m", "torch.distributed.run"]
        wtr = torchrun(_after(w["args"], "-m"))
        assert (wtr.standalone, wtr.nproc_per_node, wtr.module) == (True, "2", True)
        assert wtr.training_script == "aligner.rollout.worker"
        wcfg = actor_config(wtr.training_script_args, world_size=1)
        assert wcfg.rollout.worker_rank == procid + 1 and wcfg.rollout.tensor_parallel_size == 2
        assert (wcfg.rollout.workers, wcfg.rollout.address) == (acfg.rollout.workers, acfg.rollout.address)
        assert wcfg.rollout.max_staleness == 1 and wcfg.model == acfg.model  # the actor's overrides
