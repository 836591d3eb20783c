"""The actor's PPO loop: its configuration, the trainer recipe, the pieces the recipe moves
tensors between, and its checkpoints.

- :mod:`aligner.actor.config`: the typed config behind ``actor.yaml`` and its checks;
- :mod:`aligner.actor.trainer`: :class:`~aligner.actor.trainer.PPOTrainer`, the loop as the numbered
  steps of docs/design.md ("Roles and data flow");
- :mod:`aligner.actor.prompts`: reading prompt files and the seeded order steps draw them in;
- :mod:`aligner.actor.critic_link`: the critic server seen from the actor's ranks;
- :mod:`aligner.actor.logprobs`: log-probs and entropies over this rank's vocabulary shard;
- :mod:`aligner.actor.optimizer`: the policy's AdamW and learning-rate schedule;
- :mod:`aligner.actor.rollout`: the rollout and the step record its metrics come from;
- :mod:`aligner.actor.checkpointing`: checkpoints of both roles at one step, and exact resume.

The maths it runs (log-probs, KL estimators, reward shaping, GAE, losses, KL controllers) is
:mod:`aligner.rl`, shared with the critic server. Nothing is imported here so that importing
the package stays cheap.
"""
