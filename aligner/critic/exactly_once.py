"""The exactly-once rules of ``critic_train``: each step id is applied once, in increasing order.

The actor sends ``critic_train`` without waiting for it and retries on a lost connection, so the
same step may arrive twice. :class:`AppliedSteps` remembers the last applied step and the
results of the most recent ones: a repeated step id gets the result it got the first time and
changes nothing (:meth:`AppliedSteps.kept`); a step older than the last applied one gets its
kept result, or is rejected when that result is no longer kept (:meth:`AppliedSteps.check_new`).
The service checks fencing between the two (docs/design.md, "Wire protocol"). The last step and
the kept results travel in the critic's checkpoint, so a resumed server answers repeats exactly
as the one that saved.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aligner.wire.protocol import TRAIN, ProtocolError, TrainResult

__all__ = ["AppliedSteps", "CACHED_RESULTS"]

CACHED_RESULTS = 64
"""How many recent train results are kept for replies to repeated step ids."""


class AppliedSteps:
    """The last applied train step and the kept results of the latest :data:`CACHED_RESULTS`."""

    def __init__(self) -> None:
        self.last = -1
        """The last applied step; -1 before the first."""
        self.results: OrderedDict[int, TrainResult] = OrderedDict()
        """Results by step id, oldest first."""

    def kept(self, step: int) -> TrainResult | None:
        """The result ``step`` got when it was applied, if it is still kept (a repeat), else None."""
        return self.results.get(step)

    def check_new(self, step: int) -> None:
        """The in-order rule: a step that is not kept must be new (``> last``).

        Raises:
            ProtocolError: ``step`` is not new and its result is no longer kept.
        """
        if step <= self.last:
            raise ProtocolError(
                TRAIN,
                "step",
                f"a step > {self.last} (the last applied step), or "
                f"one of the last {CACHED_RESULTS} applied steps (whose results are kept)",
                f"step={step}",
            )

    def record(self, step: int, result: TrainResult) -> None:
        """``step`` was applied with ``result``: it becomes the last, and the oldest kept result
        beyond :data:`CACHED_RESULTS` is dropped."""
        self.results[step] = result
        while len(self.results) > CACHED_RESULTS:
            self.results.popitem(last=False)
        self.last = step

    def to_json(self) -> dict[str, dict[str, Any]]:
        """The kept results as JSON (step ids as strings, oldest first)."""
        return {str(k): v.to_dict() for k, v in self.results.items()}

    def restore(self, last: int, results: dict[str, dict[str, Any]]) -> None:
        """Take back the state a checkpoint saved (``last``, the loaded step, and :meth:`to_json`'s
        ``results``). Results of steps after ``last`` are dropped: the weights loaded have not
        applied them, so those steps must be applied again, not answered from here (a checkpoint
        written before saves had to be labelled with the step held may carry some)."""
        self.last = int(last)
        kept = sorted(((int(k), v) for k, v in results.items() if int(k) <= self.last), key=lambda kv: kv[0])
        self.results = OrderedDict((k, TrainResult(**v)) for k, v in kept)
