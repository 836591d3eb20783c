"""The Hydra configurations of the two entry points, shipped inside the package as data.

- ``critic.yaml``: the critic/reward server (``python -m aligner.critic.server``), backed by
  :class:`aligner.critic.config.CriticServerConfig`;
- ``actor.yaml``: the actor (``examples/train_actor.py``), backed by
  :class:`aligner.actor.config.ActorConfig`.

Hydra finds them as ``config_path="pkg://aligner.configs"`` (:data:`CONFIG_PATH`), so they are
found wherever the package is installed. This module holds no code beyond that name.
"""

CONFIG_PATH = "pkg://aligner.configs"
"""Hydra's ``config_path`` for this package's YAML files."""
