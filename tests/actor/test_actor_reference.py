"""``ppo.reference_on_cpu``: the reference's weights stay in pinned CPU memory between forwards
and visit the policy's device for each forward, copied on a side stream (``prefetch``) while the
policy's own forward runs. The copy itself needs CUDA: the test of it is marked ``gpu``; on a
CPU the option has no effect, and a reference on its device is never moved."""

from __future__ import annotations

import pytest
import torch

from aligner.actor import reference as ref_mod
from aligner.actor.config import ActorConfig
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.reference import ReferenceModel
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.models import forward, gpt
from aligner.tokenizers import CharTokenizer


@pytest.fixture(scope="module")
def setup():
    cfg = ActorConfig()
    state = initialize(ParallelConfig(), seed=5)
    tok = CharTokenizer()
    policy = gpt.build_policy(cfg.model).to(state.device)
    forward.set_forward(policy, "auto", 1)
    tokens = torch.randint(0, tok.sample_vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    try:
        yield cfg, state, tok, policy, tokens.to(state.device)
    finally:
        destroy()


def _reference(cfg, policy, device):
    reference = gpt.build_policy(cfg.model)
    gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy), what="reference model")
    forward.set_forward(reference, "auto", 1)
    return reference.to(device).eval().requires_grad_(False)


@pytest.mark.gpu
def test_an_offloaded_reference_gives_the_same_logprobs_and_stays_on_its_pinned_copy(setup):
    cfg, state, tok, policy, tokens = setup
    lp = PolicyLogprobs.for_actor(cfg, state, tok)
    want, _ = lp.no_grad(_reference(cfg, policy, state.device), tokens, 2)

    module = _reference(cfg, policy, state.device)
    held = ReferenceModel(module, state.device, offload=True)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in module.parameters())
    assert held.nbytes == sum(t.numel() * t.element_size() for t in held.host.values()) > 0
    held.prefetch()  # the copy runs while the policy's forward does
    lp.no_grad(policy, tokens, 2)
    with held.on_device() as m:
        assert m is module and all(p.device == state.device for p in module.parameters())
        got, _ = lp.no_grad(m, tokens, 2)
    assert torch.equal(got, want)
    assert all(p.data_ptr() == held.host[n].data_ptr() for n, p in module.named_parameters())
    seconds = held.take_seconds()
    assert set(seconds) == {"timers/reference_copy", "timers/reference_wait"}
    assert seconds["timers/reference_copy"] > 0 and held.take_seconds() == {}

    with pytest.raises(RuntimeError, match="inside the forward"), held.on_device():
        raise RuntimeError("inside the forward")
    assert all(p.device.type == "cpu" for p in module.parameters())  # back when the block raised


def test_offloading_needs_a_cuda_device(setup):
    cfg, state, tok, policy, tokens = setup
    with pytest.raises(ValueError, match="reference_on_cpu needs the policy on a CUDA device"):
        ReferenceModel(_reference(cfg, policy, "cpu"), torch.device("cpu"), offload=True)


def test_a_reference_on_its_device_is_never_moved(setup, monkeypatch):
    cfg, state, tok, policy, tokens = setup
    monkeypatch.setattr(ref_mod, "move_weights", lambda *a: pytest.fail("moved a reference kept on device"))
    module = _reference(cfg, policy, state.device)
    held = ReferenceModel(module, state.device, offload=False)
    held.prefetch()
    with held.on_device() as m:
        assert m is module
    assert held.host == {} and held.nbytes == 0 and held.take_seconds() == {}
