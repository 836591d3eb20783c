"""The frozen reference policy, and where its weights live between its forwards.

With ``ppo.reference_on_cpu`` on an accelerator, the reference's weights stay in pinned CPU
memory, and each of its forwards (the rollout's reference log-probs, step 4 of docs/design.md,
"Roles and data flow"; validation's KL) runs inside :meth:`ReferenceModel.on_device`, which
points the module at device copies of them for that forward and afterwards back at the CPU
copy (the weights are frozen: nothing is copied back). The copy is issued on a side stream by
:meth:`ReferenceModel.prefetch`, which the trainer calls before the policy's own no-grad
forward: the host-to-device transfer then runs under that forward, and the reference's forward
waits only for what is left of it (``timers/reference_copy``: the copy's own time, from CUDA
events; ``timers/reference_wait``: what the forward waited). Without the option, or when the
policy itself runs on the CPU, the module stays where it is and nothing is copied.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["ReferenceModel", "move_weights"]

CPU = torch.device("cpu")


def _weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name (a shared tensor once)."""
    return itertools.chain(module.named_parameters(), module.named_buffers())


def move_weights(module: nn.Module, host: dict[str, torch.Tensor], device_copies: dict | None = None) -> None:
    """Point every parameter and buffer of ``module`` at ``device_copies[name]`` (None: at the
    kept CPU copies in ``host``). The module objects stay the same (only their ``.data``
    changes), so a forward that reads the parameters at each call (``aligner.models.fused``)
    sees the move."""
    for name, t in _weights(module):
        t.data = host[name] if device_copies is None else device_copies[name]


class ReferenceModel:
    """The frozen reference ``module``, whose forwards run on ``device`` (the policy's).

    ``offload``: keep its weights on the CPU between forwards (``ppo.reference_on_cpu``);
    they are copied to ``device`` for each forward (:meth:`prefetch`, :meth:`on_device`)."""

    def __init__(self, module: nn.Module, device: torch.device, *, offload: bool) -> None:
        self.module, self.device, self.offload = module, torch.device(device), offload
        if offload and self.device.type != "cuda":
            raise ValueError(f"ppo.reference_on_cpu needs the policy on a CUDA device, not {self.device}")
        self.host: dict[str, torch.Tensor] = {}
        """The CPU weights by parameter or buffer name (empty without ``offload``)."""
        self.seconds: dict[str, float] = {}
        """``timers/reference_copy`` and ``timers/reference_wait`` of the last forward, then
        cleared by :meth:`take_seconds`."""
        self._copies: dict[str, torch.Tensor] | None = None
        self._events: tuple | None = None
        if offload:
            for name, t in _weights(module):
                # Pinned pages: the copies to the GPU are asynchronous and run at full speed.
                self.host[name] = t.detach().to(CPU, copy=True).pin_memory()
            move_weights(module, self.host)  # the device copies are freed here
            self._stream = torch.cuda.Stream(device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes one forward copies to the device (0 without ``offload``)."""
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def prefetch(self) -> None:
        """Start copying the weights to the device on a side stream, without waiting (a no-op
        without ``offload``, or when a copy is already under way). Work queued on the current
        stream meanwhile (the policy's forward) overlaps the transfer."""
        if not self.offload or self._copies is not None:
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # The side stream starts after what the current stream has queued so far: the memory it
        # allocates may be a block the current stream freed a moment ago.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            start.record()
            self._copies = {name: t.to(self.device, non_blocking=True) for name, t in self.host.items()}
            end.record()
        self._events = (start, end)

    @contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        """The module with its weights on ``device`` for the ``with`` block (the copy started by
        :meth:`prefetch`, or one started here); back on the CPU afterwards, also when the block
        raises."""
        if not self.offload:
            yield self.module
            return
        self.prefetch()
        copies, (start, end) = self._copies, self._events
        current = torch.cuda.current_stream(self.device)
        t = time.perf_counter()
        end.synchronize()  # what the forward waits for is the copy's remainder, measured here
        self.seconds["timers/reference_wait"] = time.perf_counter() - t
        self.seconds["timers/reference_copy"] = start.elapsed_time(end) / 1e3
        current.wait_stream(self._stream)
        for x in copies.values():
            # Made on the side stream, used on the current one: their memory is not reused
            # before the current stream's work on them is done.
            x.record_stream(current)
        move_weights(self.module, self.host, copies)
        try:
            yield self.module
        finally:
            move_weights(self.module, self.host)
            self._copies, self._events = None, None

    def take_seconds(self) -> dict[str, float]:
        """The copy and wait seconds of the forwards since the last call (empty without ``offload``)."""
        out, self.seconds = self.seconds, {}
        return out
