"""The roles on one node: ``aligner-launch`` starts the critic/reward server on the GPUs named
for it, waits until it serves, runs the actor on the others (and rollout workers on theirs, with
``--rollout-gpus``), and stops all of them when the actor or the server ends.

    aligner-launch --critic-gpus 0 --actor-gpus 1,2,3 \\
        --critic +server_recipe=gsm8k_ppo_qwen2.5_0.5b -- +recipe=gsm8k_ppo_qwen2.5_0.5b
    aligner-launch --critic-gpus 0 --actor-gpus 1 --rollout-gpus 2,3 -- \\
        +recipe=... rollout.max_staleness=1 ppo.tis_cap=2.0       # 1 GPU trains, 2 generate

- ``--critic-gpus`` / ``--actor-gpus``: comma-separated device indices (``CUDA_VISIBLE_DEVICES``
  of that role), or ``cpu`` (no GPU visible). A role on several devices runs under torchrun, one
  process per device (the server's are its TP x DP ranks, the actor's its TP x PP x DP ranks).
  The two sets must not overlap (``--share-gpus`` allows it, for a small model on one GPU).
- ``--critic ARG``: one Hydra override of the server (repeatable); everything after ``--`` goes
  to the actor. The server listens on a free loopback port unless ``server.grpc_port`` is given,
  and the actor is pointed at it (``critic.url``).
- ``--rollout-gpus``: one rollout worker (``aligner-rollout``) per device named, or ``cpu`` with
  ``--rollout-procs N``; each gets the actor's overrides, and the actor hosts their store on a
  free loopback port (``rollout.workers``, ``rollout.address`` and each ``rollout.worker_rank``
  are set by the launcher). Their output goes to ``<--log-dir>/rollout_<rank>.log``.
  ``--rollout-tp G``: each worker is G processes generating tensor-parallel (under torchrun), on
  G consecutive devices of ``--rollout-gpus`` (``rollout.tensor_parallel_size``).
- The server's stderr goes to ``<--log-dir>/critic_server.log`` (default ``runs/launch``).
- The actor's exit code is the launcher's; a server that does not start is 1 before the actor
  starts; a server that dies while the actor runs stops the actor (SIGTERM, then SIGKILL after
  ``--grace-s``) and the launcher exits 1. SIGINT or SIGTERM to the launcher stops both.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from aligner.critic.launch import ServerProcess, start_server
from aligner.wire.readiness import ServerStartError

__all__ = ["main", "parse_devices", "role_env", "actor_command", "rollout_command"]

ACTOR_MODULE = "aligner.actor.run"
ROLLOUT_MODULE = "aligner.rollout.worker"


def parse_devices(text: str, flag: str) -> list[str] | None:
    """``"0,1"`` -> ``["0", "1"]``; ``"cpu"`` -> None. ValueError naming ``flag`` otherwise."""
    text = text.strip()
    if text.lower() == "cpu":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(
            f"{flag}={text!r}: expected distinct device indices separated by commas (e.g. 0,1) or 'cpu'"
        )
    return parts


def role_env(devices: list[str] | None) -> dict[str, str]:
    """The environment a role's processes get: its devices only (none for ``cpu``)."""
    return {"CUDA_VISIBLE_DEVICES": "" if devices is None else ",".join(devices)}


def actor_command(nproc: int, url: str, overrides: Sequence[str], python: str = sys.executable) -> list[str]:
    """``python -m aligner.actor.run`` (under torchrun for ``nproc`` > 1) pointed at ``url``."""
    head = [python]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*head, "-m", ACTOR_MODULE, f"critic.url={url}", *overrides]


def rollout_command(
    rank: int, workers: int, address: str, overrides: Sequence[str], python: str = sys.executable, tp: int = 1
) -> list[str]:
    """``python -m aligner.rollout.worker`` as worker ``rank`` of ``workers``, joining ``address``
    (under torchrun, ``tp`` processes, for ``tp`` > 1)."""
    where = [f"rollout.workers={workers}", f"rollout.worker_rank={rank}", f"rollout.address={address}"]
    head = [python]
    if tp > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}"]
        where.append(f"rollout.tensor_parallel_size={tp}")
    return [*head, "-m", ROLLOUT_MODULE, *overrides, *where]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aligner-launch",
        description="The critic/reward server and the actor on one node; actor overrides after --.",
    )
    p.add_argument("--critic-gpus", required=True, help="the server's devices, e.g. 0 or 0,1; or cpu")
    p.add_argument("--actor-gpus", required=True, help="the actor's devices, e.g. 1,2,3; or cpu")
    p.add_argument("--critic-procs", type=int, default=None, help="server processes on cpu (default 1)")
    p.add_argument("--actor-procs", type=int, default=None, help="actor processes on cpu (default 1)")
    p.add_argument("--rollout-gpus", default=None, help="one rollout worker per device, e.g. 2,3; or cpu")
    p.add_argument("--rollout-procs", type=int, default=None, help="rollout workers on cpu (default 1)")
    p.add_argument(
        "--rollout-tp", type=int, default=1, help="processes (devices) per rollout worker, tensor-parallel"
    )
    p.add_argument("--critic", action="append", default=[], metavar="OVERRIDE", help="a server override")
    p.add_argument("--share-gpus", action="store_true", help="allow the two roles the same devices")
    p.add_argument("--log-dir", default="runs/launch", help="where the server's log goes")
    p.add_argument(
        "--ready-timeout-s", type=float, default=900.0, help="how long the server may take to start"
    )
    p.add_argument("--grace-s", type=float, default=60.0, help="how long a process may take to stop")
    return p


def _procs(devices: list[str] | None, procs: int | None, flag: str) -> int:
    if devices is not None:
        if procs is not None and procs != len(devices):
            raise ValueError(f"{flag}={procs}: one process per device ({len(devices)} devices named)")
        return len(devices)
    if procs is not None and procs < 1:
        raise ValueError(f"{flag}={procs}: expected at least 1")
    return procs or 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    actor_overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, actor_overrides = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        critic_gpus = parse_devices(args.critic_gpus, "--critic-gpus")
        actor_gpus = parse_devices(args.actor_gpus, "--actor-gpus")
        rollout_gpus = parse_devices(args.rollout_gpus, "--rollout-gpus") if args.rollout_gpus else None
        sets = {"--critic-gpus": critic_gpus, "--actor-gpus": actor_gpus, "--rollout-gpus": rollout_gpus}
        for i, (a, da) in enumerate(sets.items()):
            for b, db in list(sets.items())[i + 1 :]:
                shared = sorted(set(da or ()) & set(db or ()), key=int)
                if shared and not args.share_gpus:
                    raise ValueError(
                        f"{a} and {b} share device(s) {','.join(shared)}: give each role its own, or "
                        "pass --share-gpus (the roles' memory on one device)"
                    )
        critic_procs = _procs(critic_gpus, args.critic_procs, "--critic-procs")
        actor_procs = _procs(actor_gpus, args.actor_procs, "--actor-procs")
        workers, tp = 0, args.rollout_tp
        if tp < 1:
            raise ValueError(f"--rollout-tp={tp}: expected at least 1")
        if args.rollout_gpus and rollout_gpus is None:  # cpu
            workers = _procs(None, args.rollout_procs, "--rollout-procs")
        elif args.rollout_gpus:
            if len(rollout_gpus) % tp:
                raise ValueError(
                    f"--rollout-tp={tp} does not divide the {len(rollout_gpus)} device(s) of --rollout-gpus: "
                    "each worker takes that many"
                )
            workers = len(rollout_gpus) // tp
            if args.rollout_procs not in (None, workers):
                raise ValueError(
                    f"--rollout-procs={args.rollout_procs}: {workers} worker(s) of {tp} device(s) each on "
                    f"--rollout-gpus={args.rollout_gpus}"
                )
        elif args.rollout_procs is not None or tp > 1:
            raise ValueError(
                "--rollout-procs, --rollout-tp: name the workers' devices with --rollout-gpus (or cpu)"
            )
    except ValueError as e:
        parser.error(str(e))
    bad = [o for o in actor_overrides if o.startswith(("critic.url=", "+critic.url="))]
    if bad:
        parser.error(f"{bad[0]}: the launcher points the actor at the server it starts")
    placed = ("rollout.workers=", "rollout.address=", "rollout.worker_rank=", "rollout.tensor_parallel_size=")
    bad = [o for o in actor_overrides if workers and o.lstrip("+").startswith(placed)]
    if bad:
        parser.error(f"{bad[0]}: the launcher places the rollout workers (--rollout-gpus)")
    overrides = list(args.critic)
    if not any(o.lstrip("+").startswith("server.grpc_port=") for o in overrides):
        overrides.append("server.grpc_port=0")
    log_dir = Path(args.log_dir)
    print(f"aligner-launch: starting the critic/reward server on {args.critic_gpus} ...", flush=True)
    try:
        server = start_server(
            overrides,
            nproc=critic_procs,
            log_path=log_dir / "critic_server.log",
            ready_timeout_s=args.ready_timeout_s,
            env=role_env(critic_gpus),
        )
    except ServerStartError as e:
        print(f"aligner-launch: the critic server did not start:\n{e}", file=sys.stderr, flush=True)
        return 1
    print(f"aligner-launch: server ready at {server.url}; actor on {args.actor_gpus}", flush=True)
    started: list[subprocess.Popen] = []
    if workers:
        from aligner.distributed import spare_port

        address, same = f"127.0.0.1:{spare_port()}", list(actor_overrides)
        actor_overrides = [*same, f"rollout.workers={workers}", f"rollout.address={address}"]
        log_dir.mkdir(parents=True, exist_ok=True)
        for w in range(1, workers + 1):
            env = role_env(None if rollout_gpus is None else rollout_gpus[(w - 1) * tp : w * tp])
            log = open(log_dir / f"rollout_{w}.log", "w")  # noqa: SIM115 - the child holds it
            started.append(
                subprocess.Popen(
                    # The server's address too: workers that score (rollout.score_on_workers) ask it.
                    rollout_command(w, workers, address, [*same, f"critic.url={server.url}"], tp=tp),
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        print(
            f"aligner-launch: {workers} rollout worker(s) on {args.rollout_gpus}"
            f"{f' ({tp} processes each, tensor-parallel)' if tp > 1 else ''}, joining {address}",
            flush=True,
        )
    return _run_actor(
        server, actor_command(actor_procs, server.url, actor_overrides), actor_gpus, args.grace_s, started
    )


def _run_actor(
    server: ServerProcess,
    cmd: list[str],
    devices: list[str] | None,
    grace_s: float,
    workers: Sequence[subprocess.Popen] = (),
) -> int:
    """Run the actor to its end while watching the server; stop all of them, whatever happens
    (the rollout workers stop on their own when the actor tells them)."""
    actor = subprocess.Popen(cmd, env={**os.environ, **role_env(devices)}, start_new_session=True)
    server_died = threading.Event()
    done = threading.Event()

    def watch() -> None:  # the server gone while the actor runs: the actor cannot go on
        while not done.wait(1.0):
            if server.returncode is not None:
                server_died.set()
                _stop(actor, grace_s)
                return

    watcher = threading.Thread(target=watch, daemon=True, name="aligner-launch-watch")
    watcher.start()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def forward(signum, _frame) -> None:  # to the actor's group: torchrun and its workers
        _signal(actor, signum)

    for s in previous:
        signal.signal(s, forward)
    try:
        code = actor.wait()
    finally:
        done.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(actor, grace_s)
        for w in workers:
            _stop(w, grace_s)
        print("aligner-launch: stopping the critic server ...", flush=True)
        server.stop(timeout=grace_s)
    if server_died.is_set():
        print(
            f"aligner-launch: the critic server exited (code {server.returncode}) while the actor "
            f"ran; its log: {server.log_path}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return code


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a role's process group, SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
