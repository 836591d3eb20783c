"""The critic service's rules in-process (no Triton): exactly-once training, save/load, rewards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from aligner.checkpoint import complete_steps
from aligner.critic.config import build_config
from aligner.critic.errors import CriticServiceError
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.forward import sequence_scores, token_values
from aligner.models.gpt import build_reward_model, tensor_state_dict
from aligner.tasks.digits import sort_reward
from aligner.wire import protocol as P

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pstate():
    state = initialize(ParallelConfig(), seed=1234)
    yield state
    destroy()


def _service(pstate, root, precision: str | None = None, **sections) -> CriticService:
    cfg = tiny_config(root, **sections)
    if precision is not None:  # default: the config's 'auto'
        cfg["precision"] = precision
    return CriticService(build_config(cfg), pstate)


def _batch(svc, b=4, seed=0):
    tokens, lengths, pl, prompts, responses = digit_batch(svc.tokenizer, b, seed=seed)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=seed)
    return tokens, lengths, pl, returns, old_values, mask, prompts, responses


def test_infer_values_and_function_rewards(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    out = svc.infer(tokens, lengths, pl)
    assert out.values.shape == (4, tokens.shape[1] - 1) and out.values.dtype == np.float32
    np.testing.assert_allclose(out.rewards, sort_reward(prompts, responses), rtol=0, atol=1e-6)
    ref = token_values(svc.critic, torch.from_numpy(tokens)).detach().numpy()
    np.testing.assert_array_equal(out.values, ref)


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


def test_save_load_restores_weights_optimizer_and_bookkeeping(pstate, tmp_path):
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 2})
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    r1 = svc.train(tokens, lengths, returns, old_values, mask, 1)
    path = svc.save(1)
    assert path == tmp_path / "ckpt" / "step_00000001" / "critic"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["critic_step"] == 1 and meta["tensor_model_parallel_size"] == 1
    v_at_1 = svc.infer(tokens, lengths, pl).values
    svc.train(tokens, lengths, returns, old_values, mask, 2)
    r3 = svc.train(tokens, lengths, returns, old_values, mask, 3)
    svc.load(1)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v_at_1)
    assert svc.critic_step == 1 and svc.train(tokens, lengths, returns, old_values, mask, 1) == r1
    # Resume equals continuous: the optimiser state came back too.
    svc.train(tokens, lengths, returns, old_values, mask, 2)
    assert svc.train(tokens, lengths, returns, old_values, mask, 3) == r3
    # keep_last prunes only the critic's own sub-directories.
    (tmp_path / "ckpt" / "step_00000002" / "actor").mkdir(parents=True)
    for step in (2, 3, 4):
        svc.save(step)
    assert complete_steps(tmp_path / "ckpt", role="critic") == [3, 4]
    assert (tmp_path / "ckpt" / "step_00000002" / "actor").is_dir()
    assert not (tmp_path / "ckpt" / "step_00000001").exists()


def test_load_of_a_missing_step_changes_nothing(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_ = _batch(svc)
    v0 = svc.infer(tokens, lengths, pl).values
    with pytest.raises(P.ProtocolError, match="field 'step'.*complete critic checkpoint"):
        svc.load(42)
    svc.save(0)
    (tmp_path / "ckpt" / "step_00000000" / "critic" / "model_tp00_pp00.safetensors").write_bytes(b"garbage")
    with pytest.raises(CriticServiceError, match="cannot load critic step 0"):
        svc.load(0)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v0)


def test_reward_model_scores_are_added_and_critic_starts_from_it(pstate, tmp_path):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)
    rm = build_reward_model(cfg)
    save_model_checkpoint(rm, cfg, tmp_path / "rm", role="reward")
    svc = _service(  # fp32: compared exactly with the fp32 reward model below
        pstate,
        tmp_path,
        precision="fp32",
        reward={"model_path": str(tmp_path / "rm"), "model_mean": 0.5, "model_std": 2.0},
    )
    assert svc.init_source == "reward" and svc.info().reward["model_path"] == str(tmp_path / "rm")
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    out = svc.infer(tokens, lengths, pl)
    t = torch.from_numpy(tokens)
    scores = sequence_scores(rm, t, torch.from_numpy(lengths)).detach().numpy()
    expected = np.asarray(sort_reward(prompts, responses)) + (scores - 0.5) / 2.0
    np.testing.assert_allclose(out.rewards, expected, rtol=1e-6, atol=1e-6)
    # The critic is the reward model's weights: its value at length-1 is the raw score.
    values = token_values(rm, t).detach().numpy()
    np.testing.assert_array_equal(out.values, values)


def test_critic_from_policy_keeps_trunk_and_fresh_head(pstate, tmp_path):
    from aligner.models.gpt import build_policy

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)
    policy = build_policy(cfg)
    save_model_checkpoint(policy, cfg, tmp_path / "policy", role="policy")
    svc = _service(pstate, tmp_path, precision="fp32", init={"policy_path": str(tmp_path / "policy")})
    assert svc.init_source == "policy"
    own = tensor_state_dict(svc.critic)
    for k, v in tensor_state_dict(policy).items():
        if not k.startswith("output_layer."):
            assert torch.equal(own[k], v), k
    assert own["output_layer.weight"].shape == (1, 32)


def test_hf_sequence_classification_reward_model(pstate, tmp_path):
    """reward.hf_path: a HF reward model scores like HF itself (read at the last real token)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=14,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        num_labels=1,
        pad_token_id=13,
    )
    hf = transformers.LlamaForSequenceClassification(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")
    svc = _service(pstate, tmp_path, precision="fp32", reward={"hf_path": str(tmp_path / "hf"), "fn": None})
    assert svc.init_source == "reward" and svc.model_cfg.ffn_hidden_size == 88
    tokens, lengths, pl, *_ = _batch(svc, b=3)
    assert svc.tokenizer.pad_id == hf_cfg.pad_token_id  # HF finds the last token by the pad id
    out = svc.infer(tokens, lengths, pl)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits[:, 0].numpy()
    np.testing.assert_allclose(out.rewards, want, rtol=1e-5, atol=1e-5)


def test_resume_with_dropout_is_exact(pstate, tmp_path):
    """With dropout every random state the critic's training draws from comes back with a
    checkpoint: torch's generator (hidden dropout) and Megatron's model-parallel tracker
    (attention dropout), as well as Python's and NumPy's."""
    import random

    from megatron.core import tensor_parallel

    svc = _service(pstate, tmp_path, model={"hidden_dropout": 0.2, "attention_dropout": 0.2})
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    svc.train(tokens, lengths, returns, old_values, mask, 1)
    svc.save(1)
    r2 = svc.train(tokens, lengths, returns, old_values, mask, 2)
    r3 = svc.train(tokens, lengths, returns, old_values, mask, 3)
    v3 = svc.infer(tokens, lengths, pl).values
    after = (random.random(), float(np.random.rand()))

    def step_2_after_load(reseed) -> P.TrainResult:
        svc.load(1)
        reseed()
        return svc.train(tokens, lengths, returns, old_values, mask, 2)

    def reseed_tracker_only():
        cpu = torch.get_rng_state()
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        torch.set_rng_state(cpu)

    # Both generators feed the training step: hidden dropout draws from torch's generator,
    # attention dropout from the tracker.
    assert step_2_after_load(lambda: torch.manual_seed(99)) != r2
    assert step_2_after_load(reseed_tracker_only) != r2
    # Every generator somewhere else before the load, as in a restarted server.
    torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    svc.load(1)
    assert svc.train(tokens, lengths, returns, old_values, mask, 2) == r2
    assert svc.train(tokens, lengths, returns, old_values, mask, 3) == r3
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v3)
    assert (random.random(), float(np.random.rand())) == after


def test_checkpoint_with_only_torch_rng_still_loads(pstate, tmp_path):
    """Checkpoints written before every RNG was saved hold torch's CPU state alone."""
    from aligner.checkpoint import load_tensors, save_tensors

    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_ = _batch(svc)
    path = svc.save(0)
    rng = load_tensors(path / "rng_tp00_pp00.safetensors")
    assert {"torch_cpu", "python", "numpy_keys"} <= set(rng)
    save_tensors(path / "rng_tp00_pp00.safetensors", {"torch_cpu": rng["torch_cpu"]})
    expected = torch.rand(3)
    torch.manual_seed(7)
    svc.load(0)
    assert torch.equal(torch.rand(3), expected)


def test_rng_states_are_checked_before_a_load_applies_anything(pstate, tmp_path, caplog):
    """A malformed RNG shard fails the load with nothing applied; device states that do not fit
    this process (saved on another kind of device) are left out with a warning."""
    from aligner.checkpoint import load_tensors, save_tensors

    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    path = svc.save(0)
    file = path / "rng_tp00_pp00.safetensors"
    rng = load_tensors(file)
    svc.train(tokens, lengths, returns, old_values, mask, 1)
    v1 = svc.infer(tokens, lengths, pl).values
    save_tensors(file, {k: v for k, v in rng.items() if k != "numpy_pos"})
    with pytest.raises(CriticServiceError, match=r"rank 0: RNG states \['numpy_pos'\] are missing"):
        svc.load(0)
    assert svc.critic_step == 1
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v1)
    # A CUDA-sized tracker state on this CPU server: the portable states come back, with a warning.
    tracker = {k: torch.zeros(16, dtype=torch.uint8) for k in rng if k.startswith("tracker.")}
    assert tracker
    save_tensors(file, {**{k: v for k, v in rng.items() if not k.startswith("tracker.")}, **tracker})
    saved = torch.Generator()
    saved.set_state(rng["torch_cpu"])
    expected = torch.rand(3, generator=saved)
    with caplog.at_level("WARNING", logger="aligner.critic"):
        svc.load(0)
    assert svc.critic_step == P.critic_step_after_load(0) and torch.equal(torch.rand(3), expected)
    cpu_state = rng["torch_cpu"].numel()  # this CPU server's tracker states are CPU generator states
    assert f"tracker.model-parallel-rng [16] here [{cpu_state}]" in caplog.text


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


# ------------------------------------------------------------------------------------------------
# One request's bad samples fail that request alone
# ------------------------------------------------------------------------------------------------


def test_one_requests_bad_samples_fail_only_that_request(pstate, tmp_path):
    """Merged requests (as Triton's batcher merges them) whose reward function fails on one
    request's samples: that request gets an error naming the function and the sample, the others
    what they would get alone. Through the server's callable, the failing request's response is
    its error output; alone, it is an error."""
    from aligner.critic.reward_fn import RewardFunctionError
    from aligner.critic.server import CriticTritonServer
    from aligner.critic.testing import encode_samples

    fn = "aligner.critic.testing:picky_reward"
    svc = _service(pstate, tmp_path, precision="fp32", reward={"fn": fn})
    good = [(["12:", "3:"], ["12", "3"]), (["45:", "789:"], ["45", "798"])]
    bad = {  # what goes wrong -> (prompts, responses), the failing sample, the words
        "raises": ((["1:", "2", "3:"], ["1", "2", "3"]), 1, "ValueError: prompt '2' has no ':'"),
        "nan": ((["1:", "2:"], ["1", ","]), 1, "its score is nan"),
        "inf": ((["1:"], [",,"]), 0, "its score is inf"),
        "count": ((["12:", "1:", "2:"], ["12", ",,,", "2"]), 1, "it returned 2 scores for 3 samples"),
    }

    def request(prompts, responses):
        return P.InferRequest(*encode_samples(svc.tokenizer, prompts, responses, pad_to=8))

    alone = [svc.infer(*request(*g).to_wire().values()) for g in good]
    for what, (samples, sample, words) in bad.items():
        reqs = [request(*good[0]), request(*samples), request(*good[1])]
        out = svc.infer_many(reqs)
        err = out[1]
        assert isinstance(err, RewardFunctionError), what
        assert str(err) == f"reward function {fn!r} failed on sample {sample} of the request: " + err.detail
        assert words in str(err), (what, str(err))
        for got, want in zip((out[0], out[2]), alone):
            np.testing.assert_array_equal(got.values, want.values)
            np.testing.assert_array_equal(got.rewards, want.rewards)
        with pytest.raises(RewardFunctionError, match=f"failed on sample {sample} of the request"):
            svc.infer(*reqs[1].to_wire().values())
        # The server's callable, as PyTriton calls it with a merged execution.
        server = CriticTritonServer(svc, svc.cfg, tmp_path)
        wire = server.infer_fn([r.to_wire() for r in reqs])
        assert set(wire[1]) == {"error"} and wire[1]["error"].shape == (len(samples[0]), 1)
        assert {e.decode() for e in wire[1]["error"].ravel()} == {str(err)}
        for got, want in zip((wire[0], wire[2]), alone):
            np.testing.assert_array_equal(got["values"], want.values)
            assert set(got["error"].ravel()) == {b""}
        with pytest.raises(RewardFunctionError):
            server.infer_fn([reqs[1].to_wire()])  # alone in its execution: its own error


# ------------------------------------------------------------------------------------------------
# Fault points (ALIGNER_SERVER_FAULT_AT): the server kills itself where the tests say
# ------------------------------------------------------------------------------------------------

_FAULT_SCRIPT = """
import sys
from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays
from aligner.distributed import ParallelConfig, initialize

svc = CriticService(build_config(tiny_config(sys.argv[1])), initialize(ParallelConfig(), seed=1))
tokens, lengths, pl, *_ = digit_batch(svc.tokenizer, 2)
returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1])
for step in (1, 2, 3):
    svc.infer(tokens, lengths, pl)
    svc.train(tokens, lengths, returns, old_values, mask, step)
    svc.save(step)
    print("done", step, flush=True)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("fault, last_done", [("infer@2", 2), ("train@2", 1), ("save@2", 1)])
def test_fault_points_kill_the_server_where_they_say(tmp_path, fault, last_done):
    import subprocess
    import sys

    from aligner.faults import SERVER

    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", SERVER.env: fault, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _FAULT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == -9, out.stderr[-2000:]
    assert out.stdout.split() == [w for s in range(1, last_done + 1) for w in ("done", str(s))]
    assert complete_steps(tmp_path / "ckpt", role="critic") == list(range(1, last_done + 1))
    if fault.startswith("save"):  # its shards were written, the folder never committed
        (tmp,) = (tmp_path / "ckpt" / "step_00000002").glob(".tmp.critic.*")
        assert (tmp / "model_tp00_pp00.safetensors").is_file() and not (tmp / "complete.json").exists()


# ------------------------------------------------------------------------------------------------
# Reward functions: two conventions, keyword arguments, extra columns
# ------------------------------------------------------------------------------------------------


def test_reward_fn_conventions_and_keyword_arguments():
    from aligner.critic.reward_fn import RewardArgumentError, RewardFn

    seen = {}

    def ours(prompts, responses):
        seen["ours"] = (prompts, responses)
        return [0.0] * len(prompts)

    def ours_kw(prompts, responses, prompt_ids=None, **kwargs):
        seen["ours_kw"] = (prompt_ids, kwargs)
        return [0.0] * len(prompts)

    def trlx(samples, prompts, outputs, **kwargs):
        seen["trlx"] = (samples, prompts, outputs, kwargs)
        return [0.0] * len(samples)

    def trlx_short(samples, **kwargs):
        seen["trlx_short"] = (samples, kwargs)
        return [0.0] * len(samples)

    def needs(prompts, responses, answer, scale=1.0):
        seen["needs"] = (answer, scale)
        return [0.0] * len(prompts)

    batch = (["1:", "2:"], ["1", "22"], [[2, 11], [3, 11]], [[2], [3, 3]])
    extras = [{"answer": "1", "prompts": "not passed"}, {"answer": "22", "level": 3}]
    RewardFn(ours, "m:ours")(*batch, extras)
    assert seen["ours"] == (["1:", "2:"], ["1", "22"])  # no keyword it does not take
    RewardFn(ours_kw, "m:ours_kw", {"clf": "/m"})(*batch, extras)
    assert seen["ours_kw"] == (
        [[2, 11], [3, 11]],
        {"response_ids": [[2], [3, 3]], "clf": "/m", "answer": ["1", "22"], "level": [None, 3]},
    )
    fn = RewardFn(trlx, "m:trlx")
    assert fn.convention == "trlx"
    fn(*batch, extras)
    assert seen["trlx"][:3] == (["1:1", "2:22"], ["1:", "2:"], ["1", "22"])
    assert sorted(seen["trlx"][3]) == ["answer", "level", "prompt_ids", "response_ids"]
    RewardFn(trlx_short, "m:trlx_short")(*batch, None)
    assert seen["trlx_short"][0] == ["1:1", "2:22"]
    assert sorted(seen["trlx_short"][1]) == ["outputs", "prompt_ids", "prompts", "response_ids"]
    fn = RewardFn(needs, "m:needs", {"scale": 2.0})
    assert fn.required_columns == ["answer"]
    fn(*batch, extras)
    assert seen["needs"] == (["1", "22"], 2.0)
    with pytest.raises(RewardArgumentError) as e:
        fn(*batch, [{"other": 1}, {}])
    assert "required parameter 'answer'" in str(e.value) and "columns: ['other']" in str(e.value)
    # Refused when loaded: a signature that cannot take a batch; a fn_kwargs key it does not take.
    for bad, words in (
        (lambda texts: texts, "signature <lambda>(texts) cannot take a batch"),
        (lambda prompts, responses, extra, /: [], "positional-only parameter 'extra' cannot be given"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            RewardFn(bad, "m:bad")
        assert "fn(samples, prompts, outputs, **kwargs)" in str(e.value)
    with pytest.raises(ValueError, match="fn_kwargs key 'answer' is not a parameter"):
        RewardFn(ours, "m:ours", {"answer": 1})
    with pytest.raises(ValueError, match="gets 'prompt_ids' from the batch"):
        RewardFn(ours_kw, "m:ours_kw", {"prompt_ids": 1})


def test_merged_requests_score_as_alone_whatever_columns_they_carry():
    """Requests with the same columns share one call; with other columns, or one that cannot
    fill a required parameter, each is scored alone (and that one fails alone)."""
    from aligner.critic.reward_fn import RewardArgumentError, score_requests
    from aligner.critic.testing import encode_samples
    from aligner.tokenizers import build_tokenizer

    tok = build_tokenizer("char")
    calls = []

    def fn(prompts, responses, answer, bonus=0.0):
        calls.append(len(prompts))
        return [
            float(r == a) + (b or 0.0)
            for r, a, b in zip(responses, answer, np.broadcast_to(bonus, len(answer)))
        ]

    def req(responses, extras):
        return (*encode_samples(tok, ["1:"] * len(responses), responses, pad_to=6), extras)

    a = req(["1", "2"], [{"answer": "1"}, {"answer": "1"}])
    b = req(["3"], [{"answer": "3"}])
    c = req(["4"], [{"answer": "4", "bonus": 0.5}])
    d = req(["5"], None)
    out = score_requests(fn, "m:fn", tok, [a, b])
    assert calls == [3] and [list(x) for x in out] == [[1.0, 0.0], [1.0]]
    calls.clear()
    out = score_requests(fn, "m:fn", tok, [a, c, d])
    assert calls == [2, 1] and [list(x) for x in out[:2]] == [[1.0, 0.0], [1.5]]
    assert isinstance(out[2], RewardArgumentError) and "columns: none" in str(out[2])


def test_a_reward_model_with_its_own_tokenizer_reads_the_texts(pstate, tmp_path, monkeypatch):
    """reward.tokenizer other than the policy's: the reward model scores prompt + response text
    tokenized its way (cut from the left to its max_seq_len); the critic keeps the policy's ids.
    Through the server's callable, requests with and without the optional inputs merge safely."""
    from aligner.actor.critic_link import sample_texts
    from aligner.critic.server import CriticTritonServer
    from aligner.critic.testing import encode_samples
    from aligner.tokenizers import build_tokenizer

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "h3_bonus_reward.py").write_text(
        "from aligner.tasks.digits import sort_reward\n"
        "def score(prompts, responses, bonus=None, **_):\n"
        "    bonus = bonus or [None] * len(prompts)\n"
        "    return [s + (b or 0.0) for s, b in zip(sort_reward(prompts, responses), bonus)]\n"
    )
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    rm_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=8)
    rm = build_reward_model(rm_cfg)
    save_model_checkpoint(rm, rm_cfg, tmp_path / "rm", role="reward")
    reward_spec = "char:9876543210:,"  # the reward model's ids: another alphabet than the policy's
    svc = _service(
        pstate,
        tmp_path,
        precision="fp32",
        reward={
            "fn": "h3_bonus_reward:score",
            "python_path": [str(mods)],
            "model_path": str(tmp_path / "rm"),
            "tokenizer": reward_spec,
            "model_mean": 0.5,
            "model_std": 2.0,
        },
        init={"source": "fresh"},
    )
    assert svc.infer_inputs == ["extras", "prompt_text", "response_text"] == svc.info().infer_inputs
    assert svc.limits.max_seq_len == 32  # the critic's: the reward model cuts its own sequences
    policy, reward_tok = svc.tokenizer, build_tokenizer(reward_spec)
    prompts, responses = ["314:", "90:", "123456:"], ["134", "09", "123456"]  # the last: 13 > 8 chars
    tokens, lengths, pl = encode_samples(policy, prompts, responses, pad_to=16)
    assert sample_texts(policy, tokens, lengths, pl) == (prompts, responses)
    texts = {"prompt_texts": prompts, "response_texts": responses}
    out = svc.infer(tokens, lengths, pl, **texts, extras=['{"bonus":1.5}', "{}", "{}"])
    scores = []
    for p, r in zip(prompts, responses):
        ids = reward_tok.encode(p + r)[-8:]
        with torch.no_grad():
            scores.append(float(sequence_scores(rm, torch.tensor([ids]), torch.tensor([len(ids)]))[0]))
    want = np.asarray(sort_reward(prompts, responses)) + [1.5, 0, 0] + (np.asarray(scores) - 0.5) / 2.0
    np.testing.assert_allclose(out.rewards, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(
        out.values, token_values(svc.critic, torch.from_numpy(tokens)).detach().numpy()
    )
    text = svc.info().reward["text"]
    assert (text["tokenizer"], text["rows"], text["truncated"]) == (reward_spec, 3, 1)
    with pytest.raises(P.ProtocolError, match="field 'prompt_text'.*reads text with its own tokenizer"):
        svc.infer(tokens, lengths, pl)

    # Merged by Triton's batcher: each request is read with its own optional inputs.
    def wire(rows, **optional):
        req = P.InferRequest(tokens[rows], lengths[rows], pl[rows])
        for name, values in optional.items():
            setattr(req, name, [values[i] for i in rows])
        return req.to_wire()

    full = wire([0, 1], prompt_texts=prompts, response_texts=responses, extras=['{"bonus":1.5}', "{}"])
    no_extras = wire([2], prompt_texts=prompts, response_texts=responses)
    no_texts = wire([1], extras=["{}", "{}", "{}"])
    server = CriticTritonServer(svc, svc.cfg, tmp_path)
    alone = [server.infer_fn([w])[0] for w in (full, no_extras)]
    merged = server.infer_fn([full, no_extras])
    for got, want_wire in zip(merged, alone):
        np.testing.assert_allclose(got["rewards"], want_wire["rewards"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["values"], want_wire["values"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(merged[0]["rewards"].ravel(), want[:2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(merged[1]["rewards"].ravel(), want[2:], rtol=0, atol=1e-5)
    with pytest.raises(P.ProtocolError) as e:
        server.infer_fn([full, no_texts])  # the valid one retries (batch peer)
    assert "field 'prompt_text'" in str(e.value) and P.BATCH_PEER_MARK in str(e.value)
    with pytest.raises(P.ProtocolError, match="field 'prompt_text'"):
        server.infer_fn([no_texts])


def test_critic_from_a_hf_causal_lm_takes_its_trunk_and_architecture(pstate, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=14,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=24,
    )
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    svc = _service(pstate, tmp_path, precision="fp32", init={"policy_path": str(tmp_path / "hf")})
    assert svc.init_source == "policy" and svc.info().extra["init_source"] == "policy"
    c = svc.model_cfg  # the folder's architecture, not model.*
    assert (c.ffn_hidden_size, c.num_query_groups, c.max_seq_len, c.normalization) == (48, 2, 24, "RMSNorm")
    from aligner.models.hf import import_hf

    policy, _ = import_hf(tmp_path / "hf", role="policy")
    own = tensor_state_dict(svc.critic)
    for k, v in tensor_state_dict(policy).items():
        if not k.startswith("output_layer."):
            assert torch.equal(own[k], v), k
    assert own["output_layer.weight"].shape == (1, 32)  # the value head, fresh


def test_a_reward_model_reading_text_never_seeds_the_critic(pstate, tmp_path):
    """The critic reads the policy's ids: a reward model with its own tokenizer cannot be its
    starting point. 'auto' starts the critic fresh (or from init.policy_path); 'reward' is refused."""
    from aligner.critic.errors import CriticServiceError

    rm_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=8)
    save_model_checkpoint(build_reward_model(rm_cfg), rm_cfg, tmp_path / "rm", role="reward")
    reward = {"model_path": str(tmp_path / "rm"), "tokenizer": "char:9876543210:,"}
    svc = _service(pstate, tmp_path / "auto", precision="fp32", reward=reward)
    assert svc.init_source == "fresh" and "prompt_text" in svc.infer_inputs
    with pytest.raises(CriticServiceError, match="init.source='reward': the reward model reads text"):
        _service(pstate, tmp_path / "reward", precision="fp32", reward=reward, init={"source": "reward"})


def test_reward_tokens_chat_template_special_tokens_and_left_truncation(tmp_path):
    """The reward model's ids: prompt + response with the tokenizer's special tokens (a BOS here),
    or the chat template's text of a user and an assistant turn; cut from the left past max_len;
    a sample that makes no token is refused naming it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers

    from aligner.critic.reward_model import RewardTextError, RewardTokens
    from aligner.tokenizers import build_tokenizer

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.train_from_iterator(
        ["0123456789:, UA|"], trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}|{{ m['content'] }}{% endfor %}"
    )
    fast.save_pretrained(tmp_path / "tok")
    hf = build_tokenizer(str(tmp_path / "tok"))
    ids = {c: fast.convert_tokens_to_ids(c) for c in "<s> 1 2 : 3 U A |".split()}

    plain = RewardTokens(hf, "tok", max_len=5)
    tokens, lengths = plain.encode(["1:", "12:"], ["2", "3"])
    assert tokens.tolist() == [
        [ids["<s>"], ids["1"], ids[":"], ids["2"], 0],
        [ids["<s>"], ids["1"], ids["2"], ids[":"], ids["3"]],
    ]
    assert lengths.tolist() == [4, 5] and (plain.rows, plain.truncated) == (2, 0)
    tokens, lengths = plain.encode(["12:"], ["33"])  # 6 ids: the BOS is cut
    assert tokens.tolist() == [[ids["1"], ids["2"], ids[":"], ids["3"], ids["3"]]] and plain.truncated == 1

    chat = RewardTokens(hf, "tok", max_len=32, chat_template=True)
    tokens, lengths = chat.encode(["1:"], ["2"])
    want = [ids["<s>"], ids["U"], ids["|"], ids["1"], ids[":"], ids["A"], ids["|"], ids["2"]]
    assert tokens[0, : lengths[0]].tolist() == want
    with pytest.raises(
        ValueError, match="reward.chat_template=true, but the reward tokenizer 'char' has no chat"
    ):
        RewardTokens(build_tokenizer("char"), "char", max_len=8, chat_template=True)
    with pytest.raises(
        RewardTextError, match="tokenizer 'char' failed on sample 1 of the request: .*no token"
    ):
        RewardTokens(build_tokenizer("char"), "char", max_len=8).encode(["1:", ""], ["2", ""])


def test_a_reward_only_server_needs_no_model_section(pstate, tmp_path):
    """mode=reward_only builds no model: its unused model section neither refuses a larger
    tokenizer nor bounds the samples' length (a reward function takes any)."""
    from aligner.critic.build import REWARD_ONLY_MAX_SEQ_LEN

    cfg = tiny_config(tmp_path)
    cfg.update(mode="reward_only", tokenizer="char:0123456789:,abcdefghijklmnopqrstuvwxyz")
    svc = CriticService(build_config(cfg), pstate)
    assert svc.critic is None and svc.limits.max_seq_len == REWARD_ONLY_MAX_SEQ_LEN
    assert svc.limits.vocab_size == 40 > svc.cfg.model.vocab_size
    tokens, lengths, pl, *_, prompts, responses = _batch(svc)
    np.testing.assert_allclose(
        svc.infer(tokens, lengths, pl).rewards, sort_reward(prompts, responses), atol=1e-6
    )
