"""The critic/reward server: Hydra entry that binds the critic service to PyTriton.

    python servers/serve_critic.py                                   # READY grpc://127.0.0.1:8001
    python servers/serve_critic.py server.grpc_port=9001 reward.fn=aligner.tasks.digits:copy_reward
    torchrun --nproc_per_node 2 servers/serve_critic.py parallel.tensor_model_parallel_size=2

Configuration: ``configs/critic.yaml``, backed by :class:`aligner.critic.config.CriticServerConfig`
(unknown keys and ill-typed values are errors that name the key). Hydra writes nothing into the
working directory (no outputs/ folder, no .hydra/, no log file); the server's own logs and
metrics go to ``log.dir``.
"""

from __future__ import annotations

import os
import sys

# Runnable as a script from anywhere: the repository root holds the `aligner` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from aligner.critic.config import ConfigError, CriticServerConfig, build_config  # noqa: E402

ConfigStore.instance().store(name="critic_schema", node=CriticServerConfig)


@hydra.main(config_path="../configs", config_name="critic", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        checked = build_config(cfg)
    except ConfigError as e:
        print(f"critic server: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from aligner.critic.server import run_server

    sys.exit(run_server(checked))


if __name__ == "__main__":
    main()
