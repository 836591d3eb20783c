"""``make demo``: the critic/reward server and the actor on one machine, on the CPU.

Starts ``python -m aligner.critic.server`` (a tiny critic plus the sort task's reward function), waits
for its ``READY`` line, runs ``examples/train_actor.py`` against it to train a policy from
random initialisation to sort 6 digits, and always stops the server, however the actor ends.
The actor prints a progress bar, a summary table and the path of a reward/KL plot.

Extra arguments are passed to the actor as Hydra overrides, e.g.
``python examples/demo.py ppo.num_steps=50 data.task=copy``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aligner.critic.launch import start_server  # noqa: E402
from aligner.wire.readiness import ServerStartError  # noqa: E402

RUN_DIR = ROOT / "runs" / "demo"

# The demo's presets (aligner/configs/recipe/demo.yaml, server_recipe/demo.yaml): a tiny critic and
# policy from scratch on the sort task; here on a free port and under this checkout's runs/demo.
ACTOR_PRESET = "+recipe=demo"
SERVER_OVERRIDES = [
    "+server_recipe=demo",
    "server.grpc_port=0",
    "server.metrics_port=null",
    f"log.dir={RUN_DIR / 'critic'}",
    f"checkpoint.dir={RUN_DIR / 'checkpoints'}",  # both roles save under one root
]


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pin_to(core: int | None):
    """One core per role (one thread each): two busy processes sharing two cores with two
    threads each run many times slower than one thread each on its own core."""
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def main(argv: list[str]) -> int:
    task_overrides = [a for a in argv if a.startswith("data.task=")]
    server_overrides = list(SERVER_OVERRIDES)
    if task_overrides:
        task = task_overrides[-1].split("=", 1)[1]
        server_overrides = [o for o in server_overrides if not o.startswith("reward.fn=")]
        server_overrides.append(f"reward.fn=aligner.tasks.digits:{task}_reward")
    if not any(a.startswith("checkpoint.resume=") for a in argv):
        shutil.rmtree(RUN_DIR / "checkpoints", ignore_errors=True)  # each demo starts over
    cores = _cores()
    server_core, actor_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    if server_core is not None:
        os.sched_setaffinity(0, {server_core})  # the server inherits the launcher's core
    print("starting the critic/reward server ...", flush=True)
    try:
        server = start_server(
            server_overrides, log_path=RUN_DIR / "critic_server.log", env={"OMP_NUM_THREADS": "1"}
        )
    except ServerStartError as e:
        print(f"the critic server did not start:\n{e}", file=sys.stderr)
        return 1
    print(f"critic server ready at {server.url} (log: {RUN_DIR / 'critic_server.log'})", flush=True)
    try:
        cmd = [
            sys.executable,
            str(ROOT / "examples" / "train_actor.py"),
            ACTOR_PRESET,
            f"critic.url={server.url}",
            f"logging.run_dir={RUN_DIR / 'actor'}",
            f"checkpoint.dir={RUN_DIR / 'checkpoints'}",
            # Each demo starts over; pass checkpoint.resume=auto to continue the last one instead.
            *([] if any(a.startswith("checkpoint.resume=") for a in argv) else ["checkpoint.resume=none"]),
            *argv,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.call(cmd, cwd=str(ROOT), env=env, preexec_fn=_pin_to(actor_core))
    except KeyboardInterrupt:
        return 130
    finally:
        print("stopping the critic server ...", flush=True)
        server.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
