"""The critic service's own errors: what a valid request meets when it cannot be run.

A malformed request is a :class:`~aligner.critic.protocol.ProtocolError` instead (the wire
contract's error). Both reach the client as Triton errors; the marks in their messages tell
:class:`~aligner.critic.client.RemoteCriticClient` which is which.
"""

from __future__ import annotations

from aligner.critic.protocol import UNAVAILABLE_MARK

__all__ = ["CriticServiceError", "ServiceClosedError"]


class CriticServiceError(RuntimeError):
    """An operation failed for a reason other than a malformed request (the message says which)."""


class ServiceClosedError(CriticServiceError):
    """The service is shutting down; the request was not run (clients may retry elsewhere/later)."""

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE_MARK + "the critic server is shutting down; retry after it restarts")
