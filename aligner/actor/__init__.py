"""The actor: its entry point, its configuration, the trainer recipe, the pieces the recipe moves
tensors between, and its checkpoints. What it sees of the server is :mod:`aligner.wire`.

- :mod:`aligner.actor.run`: the entry point (``python -m aligner.actor.run``;
  ``examples/train_actor.py`` forwards to it) and the composition root, as numbered build steps;
- :mod:`aligner.actor.config`: the typed config behind ``actor.yaml`` and its checks (the
  ``generation`` section's is :mod:`aligner.generation.config`);
- :mod:`aligner.actor.trainer`: :class:`~aligner.actor.trainer.PPOTrainer`, the loop as the numbered
  steps of docs/design.md ("Roles and data flow");
- :mod:`aligner.actor.prompts`: reading prompt files and the seeded order steps draw them in;
- :mod:`aligner.actor.datasets`: the ``data`` section's config and the prompt set read from it
  (chat templates, length filtering, the extras that travel with each prompt);
- :mod:`aligner.actor.sources`: where a data set's rows come from (files, folders, hub names) and
  its splits and slices;
- :mod:`aligner.actor.model_source`: the policy's architecture and tokenizer (``init_from``);
- :mod:`aligner.actor.critic_link`: the critic server seen from the actor's ranks;
- :mod:`aligner.actor.logprobs`: log-probs and entropies over this rank's vocabulary shard;
- :mod:`aligner.actor.optimizer`: the policy's AdamW, learning-rate schedule and frozen layers;
- :mod:`aligner.actor.rollout`: the rollout and the step record its metrics come from;
- :mod:`aligner.actor.policy_update`: the PPO update of the policy (step 7), epochs x minibatches;
- :mod:`aligner.actor.pipeline`: forwards and backwards through Megatron's pipeline schedule (PP > 1);
- :mod:`aligner.actor.reference`: the frozen reference model and where its weights live;
- :mod:`aligner.actor.checkpointing`: checkpoints of both roles at one step, and exact resume;
- :mod:`aligner.actor.resume`: the step a run resumes from, at start-up and after a server restart.

The maths it runs (log-probs, KL estimators, reward shaping, GAE, losses, KL controllers) is
:mod:`aligner.rl`, shared with the critic server. Nothing is imported here so that importing
the package stays cheap.
"""
