"""What both roles import: the wire contract between the actor and the critic/reward server, and
the client the actor calls it through.

- :mod:`aligner.wire.protocol`: model names, tensors, typed requests and responses, validation,
  the contract's errors and the run token (the server checks what the client sends with it);
- :mod:`aligner.wire.handle`: :class:`~aligner.wire.handle.CriticHandle`, the calls the actor
  makes, and what they return and raise;
- :mod:`aligner.wire.errors`: what the client raises to the actor;
- :mod:`aligner.wire.client`: :class:`~aligner.wire.client.RemoteCriticClient`, the handle over
  Triton (ordering, retries, fencing, bounded waits), and the server's URL
  (``$ALIGNER_CRITIC_URL``);
- :mod:`aligner.wire.requests`: the client's requests as checked, typed requests cut to the
  server's batch size, and its responses read back;
- :mod:`aligner.wire.transport`: the client's connections, its bounded futures, and which of
  its errors (or a retry) a failed attempt means;
- :mod:`aligner.wire.readiness`: whether a server is ready, polled until a deadline.

Nothing here imports torch, the server or the actor (``tests/test_layering.py`` checks both).
"""
