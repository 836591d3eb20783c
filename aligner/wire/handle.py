"""What the actor needs of the critic/reward server: the calls it makes, as a protocol.

The actor's trainer and checkpointer are written against :class:`CriticHandle`, never against
the client class; :class:`aligner.wire.client.RemoteCriticClient` satisfies it structurally
(without naming it), and a test fake may too. Beside the wire contract
(:mod:`aligner.wire.protocol`) this is what the actor imports of :mod:`aligner.wire`; only its
composition root (``aligner.actor.run``) builds the client.

The requests map to the server's models (docs/design.md, "Wire protocol"): ``infer`` to
``critic_infer`` (step 3 of "Roles and data flow"), ``train`` to ``critic_train`` (step 6),
``save`` and ``load`` to ``critic_save`` and ``critic_load`` (checkpoints of both roles at the
same step), ``server_info`` to ``server_info``. Shapes: ``b`` batch, ``s`` padded length.

Results are typed: ``server_info`` gives a :class:`~aligner.wire.protocol.ServerInfo`, and
``train``'s future a :class:`~aligner.wire.protocol.TrainResult` (read its attributes;
``to_dict()`` where JSON is wanted, e.g. in a checkpoint).

What the calls raise is part of the contract, so the errors the actor acts on are named here
too (defined in :mod:`aligner.wire.errors`): :class:`CriticRestartedError` (the server is not
the one the actor trained with: the actor rolls both roles back, or stops, per
``critic.on_restart``), :class:`CriticTimeoutError` (a wait on the server ran out of time) and
their base :class:`CriticError`; a wrong or missing run token is the protocol's
``UnauthorizedError``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np

from aligner.wire.errors import CriticError, CriticRestartedError, CriticTimeoutError
from aligner.wire.protocol import ServerInfo, TrainResult

__all__ = ["CriticHandle", "CriticError", "CriticRestartedError", "CriticTimeoutError"]


@runtime_checkable
class CriticHandle(Protocol):
    """The critic/reward server as the actor calls it."""

    url: str
    """Where the server is (named in messages and recorded in checkpoints)."""

    def server_info(self) -> ServerInfo:
        """The server's current state: protocol version, vocabulary, critic step, checkpoint steps."""
        ...

    def check_compatible(self, vocab_size: int, max_seq_len: int, tokenizer_fingerprint: str) -> None:
        """Raise naming every field where the actor's vocabulary, sequence length or tokenizer
        differ from the server's."""
        ...

    def infer(
        self,
        tokens: Any,
        lengths: Any,
        prompt_lengths: Any,
        step: int | None = None,
        *,
        prompt_texts: list[str] | None = None,
        response_texts: list[str] | None = None,
        extras: list[str] | None = None,
        after_step: int | None = None,
    ) -> Future[tuple[np.ndarray, np.ndarray]]:
        """Values ``[b, s-1]`` and rewards ``[b]`` (float32) of ``tokens [b, s]`` with ``lengths``
        and ``prompt_lengths [b]``, without waiting; it sees every ``train`` submitted before it.
        ``step``: the actor's step the samples belong to, named in errors and timeouts.
        ``after_step``: the critic step the values must come from, the step of the last ``train``
        the run sent (by any handle: one rank trains, every rank infers) or of its ``load``; the
        server answers once it holds it. None: any step.
        ``prompt_texts`` and ``response_texts`` (``b`` strings: the response up to its
        end-of-sequence, special tokens skipped) are needed by a server whose reward model reads
        text (``server_info().infer_inputs``; ValueError without them); ``extras`` (``b``
        compact JSON objects: each sample's extra data-set columns) reach its reward function.
        The future's ``result()`` is bounded in time (CriticTimeoutError)."""
        ...

    def train(
        self, tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: int
    ) -> Future[TrainResult]:
        """One critic update for ``step`` (applied once, in order) from ``tokens [b, s]``,
        ``lengths [b]``, ``returns``, ``old_values`` and ``mask [b, s-1]``, without waiting; the
        future's result is the update's :class:`~aligner.wire.protocol.TrainResult`
        (``.loss``, ``.grad_norm``, ``.applied_step``, ``.explained_variance``,
        ``.value_clipfrac``), bounded in time like ``infer``'s. Fenced: the server must still
        hold the critic step the previous update left (else CriticRestartedError)."""
        ...

    def save(self, step: int) -> None:
        """The server saves the critic at ``step`` under its own checkpoint folder, after every
        ``train`` submitted before; blocks until written (CriticTimeoutError past the bound).
        Fenced: the server must hold critic step ``step`` (else CriticRestartedError)."""
        ...

    def load(self, step: int) -> None:
        """The server restores the critic and its optimizer saved at ``step``; blocks. Afterwards
        the server is expected at that step, and a restart found before counts as handled."""
        ...

    def close(self) -> None:
        """Wait for submitted requests, then release connections."""
        ...
