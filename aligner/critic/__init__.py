"""The critic/reward server and its client.

- :mod:`aligner.critic.protocol`: the wire contract (model names, tensors, validation) both sides import;
- :mod:`aligner.critic.client`: :class:`~aligner.critic.client.RemoteCriticClient`, what the actor uses;
- :mod:`aligner.critic.service`: the critic, its optimiser and the reward source (no PyTriton);
- :mod:`aligner.critic.server`: binds the service to PyTriton (``servers/serve_critic.py`` runs it);
- :mod:`aligner.critic.config`: the server's configuration dataclasses (``configs/critic.yaml``);
- :mod:`aligner.critic.launch`: start a server process and wait until it is ready.

Importing the protocol or the client does not import torch.
"""
