"""What the client raises to the actor (the actor reaches them through
:mod:`aligner.wire.handle`, the calls it makes). The server's own errors are in
:mod:`aligner.critic.errors`; they reach the client as Triton errors, which
:class:`~aligner.wire.client.RemoteCriticClient` classifies into these.
"""

from __future__ import annotations

from typing import Any

from aligner.wire.protocol import ServerInfo

__all__ = [
    "CriticError",
    "CriticRequestError",
    "CriticServerError",
    "CriticUnavailableError",
    "CriticIncompatibleError",
    "CriticTimeoutError",
    "CriticRestartedError",
]


class CriticError(RuntimeError):
    """Base of the client's errors."""


class CriticRequestError(CriticError, ValueError):
    """The server rejected the request as breaking the contract (not retried); names the field."""


class CriticServerError(CriticError):
    """The server failed to run a valid request (e.g. the reward function raised); not retried."""


class CriticUnavailableError(CriticError, ConnectionError):
    """The server could not be reached (or stayed unavailable) through every retry."""


class CriticIncompatibleError(CriticError):
    """The server's vocabulary, sequence length, tokenizer or protocol differ from the actor's."""


class CriticTimeoutError(CriticError, TimeoutError):
    """A wait on the server ran out of time (``critic.wait_timeout_s``, or ``ready_timeout_s`` for
    readiness): a hung server, not a lost one. Names the call, the step and the address."""

    def __init__(
        self, call: str, url: str, timeout_s: float, *, step: int | None = None, what: str = ""
    ) -> None:
        self.call, self.url, self.timeout_s, self.step = call, url, timeout_s, step
        at = f" of step {step}" if step is not None else ""
        super().__init__(
            f"{call}{at} to the critic server at {url}: no answer within {timeout_s:g} s"
            + (f" ({what})" if what else "")
        )


class CriticRestartedError(CriticError):
    """The server is not the one the actor has been training with: after a reconnect it is
    another instance, or it refused a request whose expected critic step it no longer holds
    (``FencedError``). Carries the server's :class:`~aligner.wire.protocol.ServerInfo` as read
    when this was detected (``critic_step``, ``checkpoint_steps``, ``instance_id``) and the
    critic step the actor expected it to hold."""

    def __init__(
        self,
        url: str,
        info: ServerInfo | None,
        expected_step: int | None,
        *,
        call: str,
        reason: str,
    ) -> None:
        self.url, self.info, self.expected_step, self.call, self.reason = (
            url,
            info,
            expected_step,
            call,
            reason,
        )
        held = (
            f"it holds critic step {info.critic_step} (instance {info.instance_id or '?'}, checkpoints at "
            f"steps {list(info.checkpoint_steps)})"
            if info is not None
            else "its state could not be read"
        )
        expected = "an unknown step" if expected_step is None else f"critic step {expected_step}"
        super().__init__(
            f"the critic server at {url} was restarted or rolled back ({call}: {reason}): {held}, "
            f"the actor expected {expected}"
        )

    @property
    def critic_step(self) -> int | None:
        """The critic step the server holds (None when its state could not be read)."""
        return None if self.info is None else self.info.critic_step

    @property
    def checkpoint_steps(self) -> list[int]:
        """The steps of the server's complete critic checkpoints."""
        return [] if self.info is None else [int(s) for s in self.info.checkpoint_steps]

    @property
    def instance_id(self) -> str | None:
        """The id of the server process that answered."""
        return None if self.info is None else self.info.instance_id

    def to_json(self) -> dict[str, Any]:
        """What other ranks need to raise the same error (:meth:`from_json`)."""
        return {
            "url": self.url,
            "info": None if self.info is None else self.info.to_json().decode(),
            "expected_step": self.expected_step,
            "call": self.call,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CriticRestartedError:
        info = None if d["info"] is None else ServerInfo.from_json(d["info"])
        return cls(d["url"], info, d["expected_step"], call=d["call"], reason=d["reason"])
