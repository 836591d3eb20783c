"""The service's errors other than a broken contract: what it raises when a valid request cannot
be run.

A malformed request is a :class:`~aligner.wire.protocol.ProtocolError` instead (the wire
contract's error). Both reach the client as Triton errors; the marks in their messages tell
:class:`~aligner.wire.client.RemoteCriticClient` which is which, and it raises the client's errors
(:mod:`aligner.wire.errors`).

Also the server's refusal to start without PyTriton (the ``server`` extra).
"""

from __future__ import annotations

import importlib.util

from aligner.wire.protocol import (
    OVERLOADED_MARK,
    UNAVAILABLE_MARK,
    ProtocolError,
    mark_of,
    neutralize,
    wire_text,
)

__all__ = [
    "CriticServiceError",
    "ServiceClosedError",
    "OverloadedError",
    "RequestRewardError",
    "reward_only_refusal",
    "for_the_wire",
    "PYTRITON_MISSING",
    "PyTritonMissingError",
    "pytriton_missing",
]


class CriticServiceError(RuntimeError):
    """An operation failed for a reason other than a malformed request (the message says which)."""


class ServiceClosedError(CriticServiceError):
    """The service is shutting down; the request was not run (clients may retry elsewhere/later)."""

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE_MARK + "the critic server is shutting down; retry after it restarts")


class OverloadedError(CriticServiceError):
    """The work of a request would pass the server's memory budget (``server.memory_budget_gb``,
    :mod:`aligner.critic.budget`): nothing was run; clients back off and retry."""

    def __init__(self, model: str, budget: int, used: int, need: int) -> None:
        self.model, self.budget, self.used, self.need = model, budget, used, need
        mib = 1 << 20
        super().__init__(
            f"{OVERLOADED_MARK}{model}: the server's memory budget (server.memory_budget_gb) is "
            f"{budget / mib:.0f} MiB, {used / mib:.0f} MiB are in use and this request's work is "
            f"estimated at {need / mib:.0f} MiB; nothing was run: retry later, or send smaller requests"
        )


class RequestRewardError(CriticServiceError):
    """One request's samples could not be scored (by the reward function,
    :mod:`aligner.critic.reward_fn`, or by the reward model's tokenizer,
    :mod:`aligner.critic.reward_model`): that request fails alone, the requests merged with it get
    what they would get alone (docs/design.md, "Wire protocol")."""


def reward_only_refusal(model: str) -> ProtocolError:
    """What a server in ``mode=reward_only`` answers a request that needs the critic it does not
    hold (critic_train, critic_save, critic_load): a contract error on the field ``mode``."""
    return ProtocolError(
        model,
        "mode",
        "a server with a critic (mode=critic), which an actor with ppo.advantage=gae needs",
        "mode=reward_only: this server only scores responses and holds no critic to train, save or "
        "load; critic-free actors (ppo.advantage grpo, rloo or reinforce_pp) send none of these",
    )


def for_the_wire(error: BaseException, model: str) -> BaseException:
    """``error`` as it may leave the server's callable for ``model`` (Triton shows its message to
    the client): the contract's errors and the service's own with their message rebuilt by
    :func:`~aligner.wire.protocol.wire_text` (the mark their type chooses, the rest neutralized:
    no line break, no other mark), anything else wrapped in a :class:`CriticServiceError` naming
    its type (a failure of the server's, which carries no mark)."""
    if isinstance(error, (ProtocolError, CriticServiceError)):
        marks = {ServiceClosedError: UNAVAILABLE_MARK, OverloadedError: OVERLOADED_MARK}
        mark = marks.get(type(error)) or mark_of(error)
        error.args = (wire_text(str(error), mark),)
        return error
    return CriticServiceError(
        f"{model} failed on the critic server: {type(error).__name__}: {neutralize(str(error), 1000)}"
    )


# PyTriton (and the numpy < 2 it requires) is the server extra's, not a main dependency: the actor
# needs only the Triton client. Without it the server stops before building anything.
PYTRITON_MISSING = (
    "PyTriton is not installed: the critic server needs the server extra, "
    "pip install 'aligner-rlhf[server]' (from a checkout: pip install '.[server]')"
)


class PyTritonMissingError(ImportError):
    """The server was started in an environment without the ``server`` extra."""


def pytriton_missing() -> str | None:
    """:data:`PYTRITON_MISSING` when PyTriton cannot be imported here, else None."""
    return PYTRITON_MISSING if importlib.util.find_spec("pytriton") is None else None
