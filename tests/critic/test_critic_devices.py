"""Device hygiene of the critic server, on a CPU-only machine: the real ``CriticService`` (the
critic, its training, the reward function, a checkpoint) on the ``meta`` device standing in for
CUDA (tests/_device_check.py). What arrives from the wire (NumPy) must be moved to the device
once and what leaves must come back to the host; a CPU tensor meeting a device one raises here,
as it would on a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _critic_service import _batch, _service
from _device_check import DEVICE, meta_host_reads

from aligner.distributed import ParallelConfig, destroy, initialize


@pytest.fixture(scope="module")
def world():
    state = initialize(ParallelConfig(), seed=3)
    try:
        yield dataclasses.replace(state, device=DEVICE)
    finally:
        destroy()


def test_the_service_infers_trains_and_saves_with_its_models_on_the_device(world, tmp_path):
    with meta_host_reads():
        svc = _service(world, tmp_path, precision="fp32")
        assert all(p.device == DEVICE for p in svc.critic.parameters())
        tokens, lengths, pl, returns, old_values, mask, _, _ = _batch(svc)
        out = svc.infer(tokens, lengths, pl)
        assert isinstance(out.values, np.ndarray) and out.values.shape == (4, tokens.shape[1] - 1)
        assert isinstance(out.rewards, np.ndarray) and out.rewards.shape == (4,)
        result = svc.train(tokens, lengths, returns, old_values, mask, 1)
        assert result.applied_step == 1
        svc.save(1)
        svc.close()
    assert (tmp_path / "ckpt").exists()
