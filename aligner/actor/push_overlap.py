"""One weight push on a thread of its own, while the trainer goes on with work that only reads the
weights (``rollout.overlap_push``; docs/design.md, "Rollout workers").

The push reads the policy's parameters as it packs each bucket, so nothing may write them until
:meth:`PushInFlight.wait` has returned: the trainer waits right before its first optimizer step
(and before a checkpoint load, the next push or closing the channels). The thread uses only the
worker channels ``commands`` (the announcement, then the asks queued for it) and ``weights``,
process groups of their own that nothing else touches meanwhile; the trainer's own collectives
stay on its default world's groups.

On a GPU (an NCCL ``weights`` channel) the push's copies and broadcasts are queued on a CUDA
stream of its own, which first waits for everything queued on the trainer's stream so far (the
last optimizer step's writes); :meth:`PushInFlight.wait` makes the trainer's stream wait for the
push's stream, so that no later kernel overwrites a weight before the push has read it. (Not run
on this project's CPU machines: the tests exercise the gloo path only.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

__all__ = ["PushInFlight"]

T = TypeVar("T")


class PushInFlight(Generic[T]):
    """``fn()`` started on a thread (on ``device``'s side ``stream`` when it is a GPU): its result,
    or its exception with its own type and traceback, at :meth:`wait`. After ``fn``, the thread
    passes to ``send`` what was :meth:`queue`-d meanwhile, in order (the asks for the version
    pushed: a worker takes them only once it has it), until a send fails (:meth:`unsent` then
    holds it and the rest, for the caller to send again where a lost worker is handled)."""

    def __init__(
        self,
        fn: Callable[[], T],
        version: int,
        device: torch.device,
        stream: object = None,
        name: str = "push",
        send: Callable[[Any], None] | None = None,
    ) -> None:
        self.version, self.device, self.stream, self._send = version, device, stream, send
        self._result: T | None = None
        self._error: BaseException | None = None
        self._lock, self._queue, self._open = threading.Lock(), [], True
        if stream is not None:  # the push reads the weights as the trainer's stream leaves them now
            stream.wait_stream(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        # Grad mode, the current CUDA device and stream are the thread's own: set them here.
        try:
            with torch.no_grad():
                if self.stream is None:
                    self._result = fn()
                else:
                    with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                        self._result = fn()
            self._drain()
        except BaseException as e:  # raised again at wait(), on the caller's thread
            self._error = e
        finally:
            with self._lock:
                self._open = False

    def queue(self, item: Any) -> bool:
        """Have the thread send ``item`` after the push: True, or False once it no longer sends
        (the caller sends it)."""
        with self._lock:
            if self._open:
                self._queue.append(item)
            return self._open

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._open = False
                    return
                item = self._queue[0]
            try:
                self._send(item)
            except RuntimeError:  # a worker gone: left to the caller, with the rest
                return
            with self._lock:
                self._queue.pop(0)

    def unsent(self) -> list[Any]:
        """What was queued and not sent (after :meth:`settle`), taken."""
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def settle(self) -> None:
        """Wait for the thread (and the push's GPU stream), raising nothing."""
        self._thread.join()
        if self.stream is not None:
            # The trainer's later kernels (the optimizer step) after the push's reads of the weights.
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def wait(self) -> T:
        """The push's result once it has finished, or its error raised here."""
        self.settle()
        if self._error is not None:
            raise self._error
        return self._result
