"""The real critic service in this process, as the actor's :class:`~aligner.wire.handle.CriticHandle`.

The GPU machine has no PyTriton (its bundled Triton server is far over what can travel there) and
no tritonclient, so the check does not serve the critic: :class:`InProcessCritic` calls a
:class:`~aligner.critic.service.CriticService` directly, with the client's compatibility check, and
times each call and measures its peak device memory. Calls run synchronously on the caller's
thread, so the futures it returns are already done: the critic's work is not overlapped with the
actor's as it is with a server on other GPUs (``critic_infer`` lands inside the actor's
``timers/logprobs``, ``critic_train`` in no phase of its own, only ``timers/step``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from aligner.critic.service import CriticService
from aligner.gpu_check.measure import PeakMemory, sync
from aligner.wire.errors import CriticIncompatibleError
from aligner.wire.protocol import ServerInfo, TrainResult
from aligner.wire.readiness import compatibility_problems
from aligner.wire.requests import float32s, int64s

__all__ = ["InProcessCritic"]


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _failed(error: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(error)
    return f


class InProcessCritic:
    """A :class:`CriticService` held in this process, called as the actor calls a server.

    ``seconds`` holds each call's wall time by call name (``infer``, ``train``), device work
    included; ``peaks`` (a :class:`PeakMemory`) the role ``critic``'s peak memory."""

    url = "inprocess://critic"

    def __init__(self, service: CriticService, peaks: PeakMemory) -> None:
        self.service = service
        self.peaks = peaks
        self.seconds: dict[str, list[float]] = {"infer": [], "train": []}

    def _timed(self, name: str, fn, *args, **kwargs) -> Any:
        sync(self.service.device)
        t0 = time.perf_counter()
        with self.peaks.role("critic"):
            out = fn(*args, **kwargs)
            sync(self.service.device)
        self.seconds[name].append(time.perf_counter() - t0)
        return out

    # -- the calls of CriticHandle -------------------------------------------------------------

    def server_info(self) -> ServerInfo:
        return self.service.info()

    def check_compatible(self, vocab_size: int, max_seq_len: int, tokenizer_fingerprint: str) -> None:
        """The client's check (:meth:`RemoteCriticClient.check_compatible`): the same vocabulary
        and tokenizer, and a sequence length the service takes."""
        problems = compatibility_problems(self.service.info(), vocab_size, max_seq_len, tokenizer_fingerprint)
        if problems:
            raise CriticIncompatibleError(
                "the in-process critic is incompatible with the actor: " + "; ".join(problems)
            )

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
    ) -> Future[tuple[np.ndarray, np.ndarray]]:
        try:
            out = self._timed(
                "infer",
                self.service.infer,
                int64s(tokens),
                int64s(lengths),
                int64s(prompt_lengths),
                prompt_texts=prompt_texts,
                response_texts=response_texts,
                extras=extras,
            )
        except Exception as e:  # the client delivers errors through the future, too
            return _failed(e)
        return _done((out.values, out.rewards))

    def train(
        self, tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: int
    ) -> Future[TrainResult]:
        try:
            result = self._timed(
                "train",
                self.service.train,
                int64s(tokens),
                int64s(lengths),
                float32s(returns),
                float32s(old_values),
                float32s(mask),
                step,
            )
        except Exception as e:
            return _failed(e)
        return _done(result)

    def save(self, step: int) -> None:
        self.service.save(step)

    def load(self, step: int) -> None:
        self.service.load(step)

    def close(self) -> None:
        """Nothing to release: the check closes the service itself, after the actor."""
        return None
