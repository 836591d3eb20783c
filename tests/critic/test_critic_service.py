"""The critic service's rules in-process (no Triton): values and function rewards, training
applied exactly once and in order, the infer forward reused as the first training pass, and who
may write against which critic step (fencing, the run token, a load's step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _critic_service import _batch, _service, assert_values_of_real_positions

from aligner.checkpoint import complete_steps
from aligner.models.forward import token_values
from aligner.tasks.digits import sort_reward
from aligner.wire import protocol as P


def test_infer_values_and_function_rewards(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    out = svc.infer(tokens, lengths, pl)
    assert out.values.shape == (4, tokens.shape[1] - 1) and out.values.dtype == np.float32
    np.testing.assert_allclose(out.rewards, sort_reward(prompts, responses), rtol=0, atol=1e-6)
    ref = token_values(svc.critic, torch.from_numpy(tokens)).detach().numpy()
    assert_values_of_real_positions(out.values, ref, lengths, atol=1e-5)  # packed: to round-off


def test_train_is_applied_exactly_once_and_in_order(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    v0 = svc.infer(tokens, lengths, pl).values
    r5 = svc.train(tokens, lengths, returns, old_values, mask, 5)
    v1 = svc.infer(tokens, lengths, pl).values
    assert r5.applied_step == 5 and svc.critic_step == 5 and not np.array_equal(v0, v1)
    # The same step again: the same answer, nothing changes.
    assert svc.train(tokens, lengths, returns * 3, old_values, mask, 5) == r5
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v1)
    # Gaps are fine; an older step that was never applied is rejected and changes nothing.
    svc.train(tokens, lengths, returns, old_values, mask, 9)
    v2 = svc.infer(tokens, lengths, pl).values
    with pytest.raises(P.ProtocolError, match="field 'step'.*a step > 9"):
        svc.train(tokens, lengths, returns, old_values, mask, 7)
    assert svc.train(tokens, lengths, returns, old_values, mask, 5) == r5  # older but kept
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v2)


def test_rejected_train_applies_nothing(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    v0 = svc.infer(tokens, lengths, pl).values
    bad = returns.copy()
    bad[0, 0] = np.nan
    with pytest.raises(P.ProtocolError, match="'returns'"):
        svc.train(tokens, lengths, bad, old_values, mask, 0)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v0)
    assert svc.critic_step == -1 and not svc.optimizer.state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_kept_forward_owns_its_token_ids_whatever_becomes_of_the_request_s_memory(
    pstate, tmp_path, precision
):
    """PyTriton hands an answered request's input memory to the next request. The kept forward's
    graph holds the token ids for its backward: a kept forward that shared the request's memory
    (from_numpy on a CPU) gave an update with the same loss and another gradient once that
    memory was written over (seen with a rollout worker's request waiting across a train).
    Overwritten here in place, it changes nothing: the update is the recomputed one."""
    torch.manual_seed(0)
    on = _service(pstate, tmp_path / "on", precision)
    torch.manual_seed(0)
    off = _service(pstate, tmp_path / "off", precision, optim={"reuse_infer_forward": False})
    tokens, lengths, pl, returns, _, mask, *_ = _batch(on, b=6)
    results = []
    for svc in (on, off):
        request = tokens.copy()  # the request's own memory
        values = svc.infer(request, lengths, pl).values
        request[:] = (request + 3) % svc.tokenizer.vocab_size  # the next request's ids, in its place
        results.append(svc.train(tokens, lengths, returns, values, mask, 1))
    assert on.reused_forwards == 1 and results[0] == results[1]
    for (name, a), b in zip(on.critic.named_parameters(), off.critic.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_infer_forward_is_reused_as_the_first_training_pass(pstate, tmp_path, precision):
    """critic_train right after critic_infer of the same tokens takes the kept forward as its
    first pass: the same values and the same update as recomputing it (bit for bit), one
    forward fewer. Other tokens, a load, or a train in between mean a recompute."""
    torch.manual_seed(0)
    on = _service(pstate, tmp_path / "on", precision, optim={"epochs": 2})
    torch.manual_seed(0)
    off = _service(pstate, tmp_path / "off", precision, optim={"epochs": 2, "reuse_infer_forward": False})
    assert on.reuse_infer_forward and not off.reuse_infer_forward
    tokens, lengths, pl, returns, _, mask, *_ = _batch(on, b=6)
    other = _batch(on, b=6, seed=1)[0]

    def step(svc, n, infer_tokens=tokens):
        values = svc.infer(infer_tokens, lengths, pl).values
        if infer_tokens is not tokens:
            values = svc.infer(tokens, lengths, pl).values
            svc.infer(infer_tokens, lengths, pl)  # the last infer is of other tokens
        return values, svc.train(tokens, lengths, returns, values, mask, n)

    for n, infer_tokens in ((1, tokens), (2, tokens), (3, other)):
        (v_on, r_on), (v_off, r_off) = step(on, n, infer_tokens), step(off, n, infer_tokens)
        np.testing.assert_array_equal(v_on, v_off)
        assert r_on == r_off
    assert on.reused_forwards == 2 and off.reused_forwards == 0
    for (name, a), b in zip(on.critic.named_parameters(), off.critic.parameters()):
        assert torch.equal(a, b), name
    # A load drops what was kept: the train after it recomputes.
    on.save(3)
    on.infer(tokens, lengths, pl)
    on.load(3)
    on.train(tokens, lengths, returns, returns, mask, 4)
    assert on.reused_forwards == 2
    # Several minibatches: nothing is kept.
    many = _service(pstate, tmp_path / "many", precision, optim={"num_minibatches": 2})
    assert not many.reuse_infer_forward
    many.infer(tokens, lengths, pl)
    assert many.update.kept is None


# ------------------------------------------------------------------------------------------------
# Who may write, and against which critic step (docs/design.md, "Wire protocol")
# ------------------------------------------------------------------------------------------------


def _state(svc, tokens, lengths, pl):
    """What a refused request must leave alone: the critic step, the values, the optimizer."""
    moments = [v.clone() for st in svc.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return svc.critic_step, svc.infer(tokens, lengths, pl).values, moments


def _same_state(a, b) -> None:
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    assert len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_a_stale_expected_step_is_fenced_and_applies_nothing(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    r1 = svc.train(tokens, lengths, returns, old_values, mask, 1, -1)  # a fresh server holds -1
    svc.train(tokens, lengths, returns, old_values, mask, 2, 1)
    before = _state(svc, tokens, lengths, pl)
    # The server "restarted" (or was rolled back) under a caller that believes it holds step 5.
    with pytest.raises(P.FencedError) as e:
        svc.train(tokens, lengths, returns, old_values, mask, 6, 5)
    assert str(e.value).startswith(
        "[critic-fenced] critic_train step 6: the request expects the server at critic step 5, "
        "but it holds critic step 2"
    )
    assert (e.value.expected_step, e.value.critic_step) == (5, 2)
    _same_state(before, _state(svc, tokens, lengths, pl))
    # Exactly once comes first: a retry of an applied step gets its kept result, whatever it expects.
    assert svc.train(tokens, lengths, returns * 3, old_values, mask, 1, 5) == r1
    # Fencing comes before the in-order rule: an old step against another critic step reads as
    # fenced; against the right one, as out of order.
    with pytest.raises(P.FencedError):
        svc.train(tokens, lengths, returns, old_values, mask, 0, 1)
    with pytest.raises(P.ProtocolError, match="field 'step'.*a step > 2"):
        svc.train(tokens, lengths, returns, old_values, mask, 0, 2)
    # Saving a step needs the server at the step it expects; nothing is written otherwise.
    with pytest.raises(
        P.FencedError, match=r"critic_save step 5: .* critic step 5, but it holds critic step 2"
    ):
        svc.save(5, 5)
    assert complete_steps(tmp_path / "ckpt", role="critic") == []
    svc.save(2, 2)
    _same_state(before, _state(svc, tokens, lengths, pl))
    assert complete_steps(tmp_path / "ckpt", role="critic") == [2]
    assert svc.train(tokens, lengths, returns, old_values, mask, 3, 2).applied_step == 3


def test_the_run_token_guards_every_mutating_call_and_is_never_shown(pstate, tmp_path):
    secret = "run-token-for-this-test"
    (tmp_path / "token").write_text(secret + "\n")
    svc = _service(pstate, tmp_path, server={"run_token_file": str(tmp_path / "token")})
    assert svc.info().run_token_required and svc.run_token == secret
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    svc.save(0, -1, run_token=secret)
    r0 = svc.train(tokens, lengths, returns, old_values, mask, 0, -1, run_token=P.run_token_array(secret))
    before = _state(svc, tokens, lengths, pl)  # infer and info need no token
    calls = {
        P.TRAIN: lambda tok: svc.train(tokens, lengths, returns, old_values, mask, 1, 0, run_token=tok),
        P.SAVE: lambda tok: svc.save(0, 0, run_token=tok),
        P.LOAD: lambda tok: svc.load(0, run_token=tok),
    }
    for model, call in calls.items():
        for tok, how in (("", "missing"), (P.run_token_array(""), "missing"), ("guess-123", "wrong")):
            with pytest.raises(P.UnauthorizedError) as e:
                call(tok)
            msg = str(e.value)
            assert msg.startswith(f"[critic-unauthorized] {model}: the run token is {how};"), msg
            assert secret not in msg and "guess" not in msg
    # The token is checked after the contract and before exactly-once: a repeat of step 0
    # without it is refused too, and a malformed request is a contract error whatever its token.
    with pytest.raises(P.UnauthorizedError):
        svc.train(tokens, lengths, returns, old_values, mask, 0, -1, run_token="")
    with pytest.raises(P.ProtocolError, match="field 'mask'"):
        svc.train(tokens, lengths, returns, old_values, mask * 2, 1, 0, run_token="")
    _same_state(before, _state(svc, tokens, lengths, pl))
    meta = json.loads((tmp_path / "ckpt" / "step_00000000" / "critic" / "meta.json").read_text())
    assert meta["critic_step"] == -1  # the refused save wrote nothing over it
    assert svc.train(tokens, lengths, returns, old_values, mask, 0, 7, run_token=secret) == r0


def test_a_load_leaves_the_server_at_the_loaded_step(pstate, tmp_path):
    """The critic saved as step N is the critic after step N: loading it (the initial critic,
    saved as step 0 before any train, too) leaves the server at critic step N."""
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    assert svc.critic_step == -1
    svc.save(0)  # what checkpoint.save_initial writes at start-up
    svc.train(tokens, lengths, returns, old_values, mask, 1, -1)
    svc.load(0)
    assert svc.critic_step == P.critic_step_after_load(0) == 0
    with pytest.raises(P.FencedError, match="holds critic step 0"):
        svc.train(tokens, lengths, returns, old_values, mask, 1, -1)
    assert svc.train(tokens, lengths, returns, old_values, mask, 1, 0).applied_step == 1
