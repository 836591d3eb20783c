"""What both roles import: the wire contract between the actor and the critic/reward server, and
the client the actor calls it through.

- :mod:`aligner.wire.protocol`: model names, tensors, typed requests and responses, validation,
  the contract's errors and the run token (the server checks what the client sends with it);
- :mod:`aligner.wire.handle`: :class:`~aligner.wire.handle.CriticHandle`, the calls the actor makes;
- :mod:`aligner.wire.errors`: what the client raises to the actor;
- :mod:`aligner.wire.client`: :class:`~aligner.wire.client.RemoteCriticClient`, the handle over
  Triton; :mod:`aligner.wire.transport`: its connections and bounded futures;
- :mod:`aligner.wire.readiness`: whether a server is ready, polled until a deadline.

Nothing here imports torch, the server or the actor (``tests/test_layering.py`` checks both).
"""
