"""The critic/reward server. What the actor sees of it (the wire contract, the client) is
:mod:`aligner.wire`, which this package imports and never the other way round.

- :mod:`aligner.critic.server`: the entry point (``python -m aligner.critic.server``, the
  ``aligner-serve-critic`` script; ``servers/serve_critic.py`` forwards to it), which binds the
  service to PyTriton and runs its lifecycle;
- :mod:`aligner.critic.config`: the server's configuration dataclasses (``critic.yaml`` of
  :mod:`aligner.configs`; its ``limits`` section in :mod:`aligner.critic.config_limits`);
- :mod:`aligner.critic.security`: the run token the server requires (generated beyond loopback),
  and what ``server_info`` tells a caller without it;
- :mod:`aligner.critic.probe`: ``python -m aligner.critic.probe``, the health check of the
  container probes;
- :mod:`aligner.critic.service`: :class:`~aligner.critic.service.CriticService`, the critic, its
  optimiser and the reward source behind one lock (no PyTriton), with the rules (exactly once,
  fencing, infer, train, save and load);
- :mod:`aligner.critic.build`: the service's parts built from the configuration: the models, the
  optimiser, the reward sources, where the critic's weights start (``init.source``), and the
  collaborators it is composed of:
- :mod:`aligner.critic.exactly_once`: each train step id applied once, in order, and the kept results;
- :mod:`aligner.critic.ordering`: each critic_infer answered once the critic step it names is applied;
- :mod:`aligner.critic.value_update`: the forward and the value update, with the infer forward it reuses;
- :mod:`aligner.critic.peers`: the operations rank 0 broadcasts to the other ranks, and the heartbeat;
- :mod:`aligner.critic.replicas`: the data-parallel replicas behind the one front end: each one's
  rows, and the values gathered back on rank 0;
- :mod:`aligner.critic.checkpointing`: the critic's checkpoints and the shard exchange between ranks;
- :mod:`aligner.critic.reward_fn`: reward functions (loaded by import path, called by their
  signature's convention); :mod:`aligner.critic.reward_model`: a frozen reward model (one that
  reads text with its own tokenizer included), and the checks of the model folders the
  configuration names;
- :mod:`aligner.critic.errors`: the service's errors; :mod:`aligner.critic.metrics`: its metrics
  and request statistics;
- :mod:`aligner.critic.host`: the environment, stale workspaces and free ports a server needs
  before Triton starts;
- :mod:`aligner.critic.launch`: start a server process and wait until it is ready (the demo, tests,
  benchmarks); :mod:`aligner.critic.wait`: ``python -m aligner.critic.wait``, the readiness check
  the recipes run.

:mod:`aligner.critic.testing` holds the helpers the tests and benchmarks share.
"""
