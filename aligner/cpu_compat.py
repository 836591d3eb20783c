"""Run megatron-core on a CPU-only torch build.

megatron-core assumes CUDA in a handful of places: ``torch.cuda.current_device()`` as a
tensor device, ``torch.cuda.synchronize()``, tensor factories with a literal
``device="cuda"``, and an RNG tracker built on the CUDA generator. Each of these raises
``Torch not compiled with CUDA enabled`` on a CPU wheel. This module redirects exactly
those, and nothing else, and only when CUDA is absent: on a GPU machine
:func:`apply` does nothing, so the GPU path is megatron-core unmodified.

Every redirection is listed in :data:`REDIRECTED_CALL_SITES`; ``tests/test_cpu_compat.py``
checks that megatron-core still contains those call sites (and nothing new of the same kind in
the modules we use), so an upgrade that changes what is needed fails loudly instead of
crashing deep inside a training step.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from typing import Any

import torch

__all__ = ["apply", "is_applied", "needs_redirection", "REDIRECTED_CALL_SITES", "CpuRNGStatesTracker"]

# Modules whose literal ``device="cuda"`` tensor factories are sent to the CPU instead.
# (module, the source fragment that makes it necessary)
REDIRECTED_CALL_SITES: dict[str, tuple[str, ...]] = {
    # Default causal mask, used whenever attention_mask is None (always, in generation).
    "megatron.core.transformer.utils": ('device="cuda"',),
    # Token counters in the pipeline schedules.
    "megatron.core.pipeline_parallel.schedules": ('device="cuda"',),
    # Shape exchange and receive buffers between pipeline stages.
    "megatron.core.pipeline_parallel.p2p_communication": (
        "torch.cuda.current_device()",
        "torch.cuda.synchronize()",
    ),
    # Output buffers of the tensor-parallel all-gathers.
    "megatron.core.tensor_parallel.mappings": ("torch.cuda.current_device()",),
    # RoPE frequencies are placed on the current device.
    "megatron.core.models.common.embeddings.rotary_pos_embedding": ("torch.cuda.current_device()",),
    # The model-parallel RNG tracker reads and writes the CUDA generator.
    "megatron.core.tensor_parallel.random": ("torch.cuda.get_rng_state()", "_set_cuda_rng_state("),
    # Tied embeddings under pipeline parallelism: the last stage's copy is moved to the GPU
    # before the first/last-stage all-reduce.
    "megatron.core.models.common.language_module.language_module": ("weight.data = weight.data.cuda()",),
}

_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)

# megatron-core announces its fallbacks to plain PyTorch on every import; they are expected here.
for _message in (
    ".*Apex is not installed.*",
    ".*Transformer Engine and Apex are not installed.*",
    ".*full scope is deprecated.*",
    ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
):
    warnings.filterwarnings("ignore", message=_message)

_lock = threading.Lock()
_applied = False


def needs_redirection() -> bool:
    """True when torch has no usable CUDA device (the only case where we patch)."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _applied


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare int means a CUDA ordinal to torch


class _CpuTorch:
    """Stands in for the ``torch`` module inside one megatron module: tensor factories asked
    for a CUDA device get the CPU instead; every other attribute is torch's own."""

    def __init__(self) -> None:
        self._wrapped: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr
        wrapped = self._wrapped.get(name)
        if wrapped is None:

            def wrapped(*args: Any, __f: Any = attr, **kwargs: Any) -> Any:
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return __f(*args, **kwargs)

            self._wrapped[name] = wrapped
        return wrapped


class CpuRNGStatesTracker:
    """The model-parallel RNG tracker of ``megatron.core.tensor_parallel.random``, on the CPU
    generator: named states are forked in and out of ``torch``'s default generator, as the
    original does with the CUDA generator (same seeds, same semantics)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device: Any = None) -> None:
    return None


def apply() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent and thread-safe.

    Returns True when the redirections are active (CPU), False on a CUDA machine.
    """
    global _applied
    if not needs_redirection():
        return False
    with _lock:
        if _applied:
            return True
        # Process-wide: on a CPU-only build these two functions can only raise, so nothing
        # that works today changes behaviour by being redirected.
        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize

        proxy = _CpuTorch()
        for module_name in REDIRECTED_CALL_SITES:
            module = importlib.import_module(module_name)
            if module_name == "megatron.core.tensor_parallel.random":
                _patch_rng(module)
            elif module_name.endswith("language_module.language_module"):
                _patch_tied_embedding_setup(module)
            else:
                module.torch = proxy  # type: ignore[attr-defined]
        _applied = True
    return True


def _patch_tied_embedding_setup(module: Any) -> None:
    cls = module.LanguageModule
    orig = cls.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self, *args: Any, **kwargs: Any) -> Any:
        # Only for the duration of this call: ``Tensor.cuda`` keeps the tensor where it is.
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = saved  # type: ignore[method-assign]

    setup_embeddings_and_output_layer.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_rng(random_mod: Any) -> None:
    random_mod.CudaRNGStatesTracker = CpuRNGStatesTracker
    random_mod._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random_mod._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    orig_seed = random_mod.model_parallel_cuda_manual_seed

    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        # The original seeds the CUDA generator first; on CPU the default generator is the one
        # dropout and init draw from, and it is seeded by our distributed set-up.
        if not isinstance(random_mod._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
            random_mod._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            random_mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        kwargs.pop("force_reset_rng", None)
        with _no_cuda_manual_seed():
            orig_seed(seed, *args, **kwargs)

    model_parallel_cuda_manual_seed.__wrapped__ = orig_seed  # type: ignore[attr-defined]
    random_mod.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    # Re-exported from the package namespace too.
    tp = importlib.import_module("megatron.core.tensor_parallel")
    tp.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


@contextlib.contextmanager
def _no_cuda_manual_seed():
    saved = torch.cuda.manual_seed
    torch.cuda.manual_seed = lambda seed: None
    try:
        yield
    finally:
        torch.cuda.manual_seed = saved
