"""A stand-in accelerator for tests on a CPU-only machine: the ``meta`` device.

A CPU run cannot see a CPU tensor meeting a CUDA one: everything is on the CPU. Tensors on the
meta device have shapes and dtypes but no data, exist on every torch build, and refuse to be
mixed with CPU tensors the way CUDA tensors do (an element-wise op with a CPU tensor that is not
a 0-dim scalar, ``cat``/``stack``, ``where``, ``index_fill`` with a CPU index all raise "Tensor on
device cpu is not on the expected device meta", and the reverse); like CUDA, they accept a CPU
index in advanced indexing and a 0-dim CPU scalar in arithmetic. So code run with its device set
to ``meta`` fails wherever it would mix devices on a GPU.

What meta tensors cannot do is give values to the host. Inside :func:`meta_host_reads` every
such read of a meta tensor (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``.cpu()``,
``.to("cpu")``, ``.numpy()``) returns a placeholder of its dtype (0.5, 1 or False; zeros on
the CPU): what the code computes from them is meaningless, but every device placement it makes
is real (``nonzero`` takes every element as nonzero). Code whose shapes follow from values it
reads (a batch cut to its longest row, as dynamic sampling's rows are) gets placeholder shapes
and may fail for that reason alone. Other ways of mixing devices that CUDA also allows (a CPU tensor moved explicitly) stay
allowed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["DEVICE", "meta_host_reads"]

DEVICE = torch.device("meta")


def _placeholder(t: torch.Tensor):
    if t.dtype == torch.bool:
        return False
    return 0.5 if t.dtype.is_floating_point else 1


@contextmanager
def meta_host_reads() -> Iterator[None]:
    """Host reads of meta tensors answered with placeholders, for the ``with`` block."""
    T = torch.Tensor
    real = {name: getattr(T, name) for name in ("item", "tolist", "cpu", "numpy", "to")}
    real_dunder = {name: T.__dict__.get(name) for name in ("__float__", "__int__", "__index__", "__bool__")}

    def scalar(cast):
        def read(self, *a, **k):
            if self.is_meta:
                return cast(_placeholder(self))
            return getattr(torch._C.TensorBase, read.name)(self, *a, **k)

        return read

    def item(self):
        return _placeholder(self) if self.is_meta else real["item"](self)

    def tolist(self):
        if not self.is_meta:
            return real["tolist"](self)
        return torch.full(self.shape, _placeholder(self), dtype=self.dtype).tolist()

    def cpu(self, *a, **k):
        return torch.zeros(self.shape, dtype=self.dtype) if self.is_meta else real["cpu"](self, *a, **k)

    def numpy(self, *a, **k):
        return cpu(self).numpy() if self.is_meta else real["numpy"](self, *a, **k)

    def to(self, *a, **k):
        if self.is_meta:
            device, dtype, _, _ = torch._C._nn._parse_to(*a, **k)
            if device is not None and device.type == "cpu":
                return torch.zeros(self.shape, dtype=dtype or self.dtype)
        return real["to"](self, *a, **k)

    patches = {"item": item, "tolist": tolist, "cpu": cpu, "numpy": numpy, "to": to}
    for name, cast in (("__float__", float), ("__int__", int), ("__index__", int), ("__bool__", bool)):
        fn = scalar(cast)
        fn.name = name
        patches[name] = fn
    from torch.fx.experimental import _config as fx_config

    try:
        for name, fn in patches.items():
            setattr(T, name, fn)
        # nonzero's output size depends on data: on meta tensors, take every element as nonzero.
        with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            yield
    finally:
        for name, fn in real.items():
            setattr(T, name, fn)
        for name, fn in real_dunder.items():
            if fn is None:
                delattr(T, name)
            else:
                setattr(T, name, fn)
