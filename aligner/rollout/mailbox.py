"""A rollout worker's commands from the trainer, taken off the ``commands`` channel as they come
by a thread of their own, so that the trainer's sends never wait for the batch a worker is
generating, and a version announced meanwhile can be taken at the next token boundary
(``rollout.partial``).

The worker's main thread handles the commands in the order they came (:meth:`Mailbox.get`),
but for one exception: :meth:`Mailbox.take_weights` takes a ``weights`` announcement out of turn
when only ``generate`` asks wait before it (never past a ``regroup``, ``reset`` or ``stop``: the
version would then be received on the wrong channels or against the wrong numbering). After a
``regroup`` the thread waits for the main thread to move to the new channels
(:meth:`Mailbox.moved`) before it reads on; after ``stop`` it ends. The trainer bounds what is
outstanding (the asks of ``rollout.max_staleness`` + 1 steps), so the queue stays small.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from aligner.generation.remote import RolloutLinks
from aligner.peer_group import recv_message

__all__ = ["Mailbox"]

Command = tuple[dict[str, Any], dict[str, torch.Tensor]]


class Mailbox:
    """The commands of ``links`` (the worker's end), read on a daemon thread."""

    def __init__(self, links: RolloutLinks, name: str = "commands") -> None:
        self._queue: collections.deque[Command] = collections.deque()
        self._ready = threading.Condition()
        self._links = links
        self._moved = threading.Event()
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        links = self._links
        while True:
            try:
                meta, tensors = recv_message(links.commands, 0)
            except RuntimeError as e:  # the trainer went away: said once the queue before is handled
                self._put(({"op": "_gone", "message": str(e)}, {}))
                return
            op = meta.get("op")
            self._put((meta, tensors))
            if op == "stop":
                return
            if op == "regroup":  # read on only on the new channels
                self._moved.wait()
                self._moved.clear()
                links = self._links

    def _put(self, item: Command) -> None:
        with self._ready:
            self._queue.append(item)
            self._ready.notify_all()

    def get(self) -> Command:
        """The next command, waiting for it; raises RuntimeError once the trainer went away."""
        with self._ready:
            self._ready.wait_for(lambda: bool(self._queue))
            meta, tensors = self._queue.popleft()
        if meta.get("op") == "_gone":
            raise RuntimeError(f"the trainer went away: {meta['message']}")
        return meta, tensors

    def take_weights(self) -> dict[str, Any] | None:
        """A ``weights`` announcement that only ``generate`` asks come before, taken out of the
        queue (the asks keep their place), or None."""
        with self._ready:
            for i, (meta, _) in enumerate(self._queue):
                op = meta.get("op")
                if op == "weights":
                    del self._queue[i]
                    return meta
                if op != "generate":
                    return None
        return None

    def moved(self, links: RolloutLinks) -> None:
        """The main thread moved to ``links`` (after a ``regroup``): read on there."""
        self._links = links
        self._moved.set()
