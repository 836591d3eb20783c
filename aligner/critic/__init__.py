"""The critic/reward server and its client.

The contracts, which the actor imports (and nothing else of this package):

- :mod:`aligner.critic.protocol`: the wire contract (model names, tensors, validation) both sides import;
- :mod:`aligner.critic.handle`: :class:`~aligner.critic.handle.CriticHandle`, the calls the actor makes.

The client side:

- :mod:`aligner.critic.client`: :class:`~aligner.critic.client.RemoteCriticClient`, what the actor uses;
  :mod:`aligner.critic.transport`: its connections and bounded futures; :mod:`aligner.critic.errors`:
  the errors it raises (beside the service's own);
- :mod:`aligner.critic.launch`: start a server process and wait until it is ready;
- :mod:`aligner.critic.wait`: ``python -m aligner.critic.wait``, the readiness check the recipes run.

The server:

- :mod:`aligner.critic.server`: the entry point (``python -m aligner.critic.server``, the
  ``aligner-serve-critic`` script; ``servers/serve_critic.py`` forwards to it), which binds the
  service to PyTriton and runs its lifecycle;
- :mod:`aligner.critic.config`: the server's configuration dataclasses (``critic.yaml`` of
  :mod:`aligner.configs`);
- :mod:`aligner.critic.service`: :class:`~aligner.critic.service.CriticService`, the critic, its
  optimiser and the reward source behind one lock (no PyTriton), composed of
- :mod:`aligner.critic.exactly_once`: each train step id applied once, in order, and the kept results;
- :mod:`aligner.critic.value_update`: the forward and the value update, with the infer forward it reuses;
- :mod:`aligner.critic.peers`: the operations rank 0 broadcasts to the other ranks, and the heartbeat;
- :mod:`aligner.critic.replicas`: the data-parallel replicas behind the one front end: each one's
  rows, and the values gathered back on rank 0;
- :mod:`aligner.critic.checkpointing`: the critic's checkpoints and the shard exchange between ranks;
- :mod:`aligner.critic.rewards`: reward functions and reward models, and where the critic's weights
  come from; :mod:`aligner.critic.errors`: the service's errors; :mod:`aligner.critic.metrics`:
  its metrics and request statistics; :mod:`aligner.critic.faults`: the crash points tests set;
- :mod:`aligner.critic.host`: the environment, stale workspaces and free ports a server needs
  before Triton starts.

:mod:`aligner.critic.testing` holds the helpers the tests and benchmarks share. Importing the
protocol or the client does not import torch.
"""
