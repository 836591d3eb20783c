"""The frozen reference policy, and where its weights live between its forwards.

With ``ppo.reference_on_cpu`` on an accelerator, the reference's weights stay in (pinned) CPU
memory, and each of its forwards (the rollout's reference log-probs, step 4 of docs/design.md,
"Roles and data flow"; validation's KL) runs inside :meth:`ReferenceModel.on_device`, which
copies them to the policy's device for that forward and afterwards points the module back at
the CPU copy (the weights are frozen: nothing is copied back). Every move goes through
:func:`move_weights`. Without the option, or when the policy itself runs on the CPU, the module
stays where it is and :meth:`ReferenceModel.on_device` moves nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["ReferenceModel", "move_weights"]

CPU = torch.device("cpu")


def _weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name (a shared tensor once)."""
    return itertools.chain(module.named_parameters(), module.named_buffers())


def move_weights(module: nn.Module, device: torch.device, host: dict[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of ``module`` at its weights on ``device``: on the CPU,
    the kept copies in ``host`` themselves; elsewhere, copies of them made on ``device``. The
    module objects stay the same (only their ``.data`` changes), so a forward that reads the
    parameters at each call (``aligner.models.fused``) sees the move."""
    for name, t in _weights(module):
        src = host[name]
        # Asynchronous from pinned memory: the forward's kernels queue behind the copies on the
        # same stream, and the CPU copy is never written, so nothing needs waiting for.
        t.data = src if device == CPU else src.to(device, non_blocking=True)


class ReferenceModel:
    """The frozen reference ``module``, whose forwards run on ``device`` (the policy's).

    ``offload``: keep its weights on the CPU between forwards (``ppo.reference_on_cpu``);
    they are copied to ``device`` by :meth:`on_device` for the forward."""

    def __init__(self, module: nn.Module, device: torch.device, *, offload: bool) -> None:
        self.module, self.device, self.offload = module, torch.device(device), offload
        self.host: dict[str, torch.Tensor] = {}
        """The CPU weights by parameter or buffer name (empty without ``offload``)."""
        if offload:
            pin = torch.cuda.is_available()  # pinned pages: faster, asynchronous copies to the GPU
            for name, t in _weights(module):
                host = t.detach().to(CPU, copy=True)
                self.host[name] = host.pin_memory() if pin else host
            move_weights(module, CPU, self.host)  # the device copies are freed here

    @contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        """The module with its weights on ``device`` for the ``with`` block; back on the CPU
        afterwards (also when the block raises)."""
        if not self.offload:
            yield self.module
            return
        move_weights(self.module, self.device, self.host)
        try:
            yield self.module
        finally:
            move_weights(self.module, CPU, self.host)
