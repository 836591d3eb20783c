"""Device hygiene of the packed critic server (``max_tokens_per_micro_batch``), on the ``meta``
device standing in for CUDA (tests/_device_check.py): the packing indices are built on the host
and moved once, nothing of the packed forwards, the micro-batch weights or the unpacking mixes a
CPU tensor with a device one, and the plan reads only host lengths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _critic_service import _batch
from _device_check import DEVICE, meta_host_reads

from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import tiny_config
from aligner.distributed import ParallelConfig, destroy, initialize


@pytest.fixture(scope="module")
def world():
    state = initialize(ParallelConfig(), seed=3)
    try:
        yield dataclasses.replace(state, device=DEVICE)
    finally:
        destroy()


def test_the_packed_service_infers_and_trains_on_the_device(world, tmp_path):
    """Two minibatches and two epochs (the later pass from the loss's start), a budget that
    splits the rows; then one minibatch with the rows in one micro-batch (the kept forward)."""
    for name, optim, budget in (
        ("split", {"epochs": 2, "num_minibatches": 2}, 16),
        ("whole", {"epochs": 2}, 4096),
    ):
        with meta_host_reads():
            cfg = tiny_config(tmp_path / name, optim=optim)
            cfg.update(precision="fp32", max_tokens_per_micro_batch=budget)
            svc = CriticService(build_config(cfg), world)
            assert svc.update.max_tokens == budget
            tokens, lengths, pl, returns, old_values, mask, _, _ = _batch(svc, b=6)
            out = svc.infer(tokens, lengths, pl)
            assert isinstance(out.values, np.ndarray) and out.values.shape == (6, tokens.shape[1] - 1)
            assert (svc.update.kept is not None) == (name == "whole")
            assert svc.train(tokens, lengths, returns, old_values, mask, 1).applied_step == 1
            svc.close()
