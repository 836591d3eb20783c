"""``ppo.reference_on_cpu``: the reference's weights stay on the CPU between forwards and visit the
policy's device for each forward, through one function (``aligner.actor.reference.move_weights``).

What runs here is a CPU: the visit is a move from the kept CPU copy to the CPU, which still goes
through that function and must leave the log-probs unchanged and the module pointing at the kept
copy afterwards. On a GPU the same code copies to the device (pinned memory, non-blocking)."""

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
    policy = gpt.build_policy(cfg.model)
    forward.set_forward(policy, "auto", 1)
    tokens = torch.randint(0, tok.sample_vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    try:
        yield cfg, state, tok, policy, tokens
    finally:
        destroy()


def _reference(cfg, policy):
    reference = gpt.build_policy(cfg.model)
    gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy), what="reference model")
    forward.set_forward(reference, "auto", 1)
    return reference.eval().requires_grad_(False)


def test_an_offloaded_reference_gives_the_same_logprobs_and_stays_on_its_cpu_copy(setup, monkeypatch):
    cfg, state, tok, policy, tokens = setup
    lp = PolicyLogprobs.for_actor(cfg, state, tok)
    want, _ = lp.no_grad(_reference(cfg, policy), tokens, 2)

    moves: list[tuple[str, bool]] = []
    real = ref_mod.move_weights

    def watched(module, device, host):
        real(module, device, host)
        on_host = all(p.data_ptr() == host[n].data_ptr() for n, p in module.named_parameters())
        moves.append((torch.device(device).type, on_host))

    monkeypatch.setattr(ref_mod, "move_weights", watched)
    module = _reference(cfg, policy)
    held = ReferenceModel(module, torch.device("cpu"), offload=True)
    assert moves == [("cpu", True)]  # offloaded at construction: the module reads the kept copy
    assert set(held.host) >= {n for n, _ in module.named_parameters()}
    with held.on_device() as m:
        assert m is module
        got, _ = lp.no_grad(m, tokens, 2)
    assert torch.equal(got, want)
    assert [d for d, _ in moves] == ["cpu", "cpu", "cpu"]  # there for the forward, then back
    assert moves[-1][1]  # the weights are the kept CPU copy again
    assert all(p.device.type == "cpu" for p in module.parameters())

    with pytest.raises(RuntimeError, match="inside the forward"), held.on_device():
        raise RuntimeError("inside the forward")
    assert len(moves) == 5 and moves[-1] == ("cpu", True)  # moved back when the block raised


def test_a_reference_on_its_device_is_never_moved(setup, monkeypatch):
    cfg, state, tok, policy, tokens = setup
    monkeypatch.setattr(ref_mod, "move_weights", lambda *a: pytest.fail("moved a reference kept on device"))
    module = _reference(cfg, policy)
    held = ReferenceModel(module, state.device, offload=False)
    with held.on_device() as m:
        assert m is module
    assert held.host == {}
