"""The critic/reward server, run as a script: forwards to ``python -m aligner.critic.server``.

    python servers/serve_critic.py                                   # READY grpc://127.0.0.1:8001
    python servers/serve_critic.py server.grpc_port=9001 reward.fn=aligner.tasks.digits:copy_reward
    torchrun --nproc_per_node 2 servers/serve_critic.py parallel.tensor_model_parallel_size=2

The same command line as the module and the ``aligner-serve-critic`` script: Hydra overrides of
``critic.yaml`` (:mod:`aligner.configs`), checked by :class:`aligner.critic.config.CriticServerConfig`.
"""

from __future__ import annotations

import os
import sys

# Runnable from a checkout that is not installed: the repository root holds the `aligner` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads

from aligner.critic.server import main  # noqa: E402

if __name__ == "__main__":
    main()
