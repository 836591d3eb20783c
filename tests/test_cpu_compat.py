"""The CPU redirections for megatron-core: present exactly where needed, effective, and never
applied on a machine with CUDA. If a megatron-core upgrade moves or removes one of the call
sites, the guard test below fails and says which, so the redirection list is revisited."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aligner import cpu_compat

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only redirections")


@pytest.mark.parametrize("module_name", sorted(cpu_compat.REDIRECTED_CALL_SITES))
def test_call_sites_still_exist(module_name):
    """Each redirection exists because megatron-core has this CUDA-only call; if it is gone,
    the redirection is stale (or the module moved): revisit cpu_compat."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    for fragment in cpu_compat.REDIRECTED_CALL_SITES[module_name]:
        assert fragment in source, (
            f"megatron-core changed: {module_name} no longer contains {fragment!r}; "
            "update aligner/cpu_compat.py REDIRECTED_CALL_SITES"
        )


def test_no_new_literal_cuda_factories_in_used_modules():
    """Modules on our forward/backward/generation path that are not redirected must not
    create tensors on a literal CUDA device (a new one would crash on CPU)."""
    used = [
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.transformer.transformer_block",
        "megatron.core.transformer.transformer_layer",
        "megatron.core.transformer.attention",
        "megatron.core.transformer.dot_product_attention",
        "megatron.core.transformer.mlp",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.fusions.fused_softmax",
        "megatron.core.models.common.embeddings.language_model_embedding",
        "megatron.core.inference.contexts.static_context",
    ]
    pattern = re.compile(r"""device\s*=\s*["']cuda["']""")
    offenders = []
    for name in used:
        src = inspect.getsource(importlib.import_module(name))
        offenders += [f"{name}: {m.group(0)}" for m in pattern.finditer(src)]
    assert not offenders, f"new CUDA-only tensor factories in megatron-core: {offenders}"


def test_redirections_make_megatron_run_on_cpu():
    from aligner import distributed
    from aligner.models import forward, gpt
    from aligner.models.config import ModelConfig

    distributed.initialize(distributed.ParallelConfig(), seed=3)
    try:
        assert cpu_compat.is_applied()
        assert torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.transformer.utils import get_default_causal_mask

        mask = get_default_causal_mask(4)
        assert mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]

        # The model-parallel RNG tracker forks the CPU generator and restores it.
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)
        with get_cuda_rng_tracker().fork():
            b = torch.rand(3)
        assert not torch.equal(a, b)  # the forked stream advanced

        model = gpt.build_policy(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2))
        logits = forward.policy_logits(model, torch.randint(0, 16, (2, 6)))
        logits.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        distributed.destroy()


@pytest.mark.subprocess
def test_not_applied_when_cuda_is_available():
    """On a CUDA machine nothing is patched (simulated in a fresh interpreter)."""
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "from aligner import cpu_compat\n"
        "assert cpu_compat.apply() is False\n"
        "assert torch.cuda.current_device is orig\n"
        "import megatron.core.transformer.utils as u\n"
        "assert u.torch is torch\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
