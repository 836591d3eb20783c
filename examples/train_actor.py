"""The actor, run as a script: forwards to ``python -m aligner.actor.run``.

    python examples/train_actor.py critic.url=grpc://127.0.0.1:8001
    ALIGNER_CRITIC_URL=grpc://critic:8001 torchrun --nproc_per_node 2 examples/train_actor.py \
        parallel.tensor_model_parallel_size=2

The same command line as the module: Hydra overrides of ``actor.yaml`` (:mod:`aligner.configs`),
checked by :class:`aligner.actor.config.ActorConfig` before any model is built.
"""

from __future__ import annotations

import os
import sys

# Runnable from a checkout that is not installed: the repository root holds the `aligner` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aligner.actor.run import main  # noqa: E402

if __name__ == "__main__":
    main()
