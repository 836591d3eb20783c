"""The critic service with packed micro-batches (``max_tokens_per_micro_batch``) against the same
critic unpacked, in-process (no Triton, one process; DP=2 is in test_critic_packing_dp.py).

Values and reward-model scores at every real position, train steps (loss, gradient norm,
explained variance, clip fraction) and the weights after them equal the unpacked ones to float
round-off, for both loss aggregations, one minibatch and several, a token budget that splits the
rows into several micro-batches and one that holds them all; the infer forward is reused as the
first training pass only when the rows fit one micro-batch, and changes nothing either way. A
request's packed results are its own: the same bits merged with others, after a load and in a
fresh service.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aligner.config_checks import ConfigError
from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import TINY_MODEL, digit_batch, tiny_config, train_arrays
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_reward_model
from aligner.tokenizers import build_tokenizer

CASES = {
    # One minibatch, two epochs: the first pass may be the kept infer forward. The unclipped loss:
    # the clip fraction counts ties (a value inside the clip range, its clipped copy rounded
    # again) that round-off decides, and here one of them turns.
    "one_minibatch": {"epochs": 2, "loss_agg": "token_mean", "value_clip_eps": None},
    # Three minibatches of 3, 3, 2 rows (shuffled), two epochs; later passes start at the loss.
    "minibatches_seq_mean": {"epochs": 2, "num_minibatches": 3, "loss_agg": "seq_mean_token_mean"},
}
#: Budgets: rows of 7 to 10 tokens two or three to a micro-batch, and all of them in one.
BUDGETS = {"split": 24, "whole": 4096}


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A reward model checkpoint (the critic starts from it, and it scores)."""
    root = tmp_path_factory.mktemp("rm")
    cfg = ModelConfig(**TINY_MODEL)
    torch.manual_seed(0)
    save_model_checkpoint(build_reward_model(cfg), cfg, root / "rm", role="reward")
    return root / "rm"


def _service(
    pstate, root, rm_dir, optim: dict, budget: int | None, model_forward: str = "auto"
) -> CriticService:
    cfg = tiny_config(root, optim={"lr": 1e-3, **optim}, reward={"model_path": str(rm_dir)})
    cfg["precision"] = "fp32"  # compared with the unpacked critic to float round-off
    cfg["max_tokens_per_micro_batch"] = budget
    cfg["model_forward"] = model_forward
    return CriticService(build_config(cfg), pstate)


def _batches():
    """Two steps' (tokens, lengths, prompt_lengths, returns, old_values, mask): 8 rows of 7 to 10
    tokens, padded to 14 (real padding, which packing drops)."""
    out = []
    for seed in (3, 4):
        tokens, lengths, pl, *_ = digit_batch(build_tokenizer("char"), 8, seed=seed, pad_to=14)
        out.append((tokens, lengths, pl, *train_arrays(lengths, pl, tokens.shape[1], seed=seed)))
    return out


def _run(svc: CriticService) -> dict:
    """Infer, train, infer again, for two steps; what the comparison covers."""
    out: dict = {"reused_before": svc.reused_forwards}
    for step, (tokens, lengths, pl, returns, old_values, mask) in enumerate(_batches(), start=1):
        res = svc.infer(tokens, lengths, pl)
        out[f"values{step}"], out[f"rewards{step}"] = res.values, res.rewards
        result = svc.train(tokens, lengths, returns, old_values, mask, step).to_dict()
        del result["train_ms"]  # a timing: the rest is compared bit for bit
        out[f"step{step}"] = result
    tokens, lengths, pl, *_ = _batches()[0]
    out["values_after"] = svc.infer(tokens, lengths, pl).values
    out["weights"] = [p.detach().clone() for p in svc.critic.parameters()]
    out["reused"] = svc.reused_forwards - out.pop("reused_before")
    return out


def _real(lengths: np.ndarray, s: int) -> np.ndarray:
    """``[b, s-1]``: the value positions of the real tokens (``t < length``)."""
    return np.arange(s - 1)[None, :] < lengths[:, None]


def _compare(got: dict, want: dict, what: str) -> None:
    for step, (tokens, lengths, *_) in enumerate(_batches(), start=1):
        real = _real(lengths, tokens.shape[1])
        np.testing.assert_allclose(got[f"values{step}"][real], want[f"values{step}"][real], rtol=0, atol=1e-5)
        assert not got[f"values{step}"][~real].any(), f"{what}: packed values past a row's length are 0"
        np.testing.assert_allclose(got[f"rewards{step}"], want[f"rewards{step}"], rtol=0, atol=1e-5)
        g, w = got[f"step{step}"], want[f"step{step}"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (what, step, g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (what, step, g, w)
        assert g["explained_variance"] == pytest.approx(w["explained_variance"], abs=1e-5), (what, step)
        assert g["value_clipfrac"] == pytest.approx(w["value_clipfrac"], abs=1e-6), (what, step, g, w)
    tokens, lengths, *_ = _batches()[0]
    real = _real(lengths, tokens.shape[1])
    np.testing.assert_allclose(got["values_after"][real], want["values_after"][real], rtol=0, atol=1e-5)
    for a, b in zip(got["weights"], want["weights"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_packed_steps_equal_unpacked_steps(pstate, tmp_path, rm_dir, case):
    torch.manual_seed(0)
    want = _run(_service(pstate, tmp_path / "plain", rm_dir, CASES[case], None))
    for name, budget in BUDGETS.items():
        torch.manual_seed(0)
        svc = _service(pstate, tmp_path / name, rm_dir, CASES[case], budget)
        got = _run(svc)
        _compare(got, want, f"{case}, budget {name}")
        # One minibatch: the infer forward is the first pass when the rows fit one micro-batch.
        reused = 2 if case == "one_minibatch" and name == "whole" else 0
        assert got["reused"] == reused and want["reused"] == (2 if case == "one_minibatch" else 0), name


def test_packed_megatron_forward_equals_unpacked(pstate, tmp_path, rm_dir):
    """Megatron's module forward packs by padding each micro-batch to its own longest row: the
    same values, scores and steps."""
    optim = CASES["minibatches_seq_mean"]
    torch.manual_seed(0)
    want = _run(_service(pstate, tmp_path / "plain", rm_dir, optim, None, "megatron"))
    torch.manual_seed(0)
    svc = _service(pstate, tmp_path / "packed", rm_dir, optim, BUDGETS["split"], "megatron")
    assert svc.critic.aligner_fused is None
    _compare(_run(svc), want, "megatron forward")


def test_the_kept_forward_changes_nothing_packed(pstate, tmp_path, rm_dir):
    """Packed, with the rows in one micro-batch: reusing the infer forward gives the same values
    and steps as recomputing it, bit for bit (the same packed forward either way)."""
    optim = CASES["one_minibatch"]
    torch.manual_seed(0)
    on = _run(_service(pstate, tmp_path / "on", rm_dir, optim, BUDGETS["whole"]))
    torch.manual_seed(0)
    off = _run(
        _service(pstate, tmp_path / "off", rm_dir, {**optim, "reuse_infer_forward": False}, BUDGETS["whole"])
    )
    assert on.pop("reused") == 2 and off.pop("reused") == 0
    for key in on:
        if key.startswith("step"):
            assert on[key] == off[key], key
        elif key == "weights":
            assert all(torch.equal(a, b) for a, b in zip(on[key], off[key]))
        else:
            np.testing.assert_array_equal(on[key], off[key], err_msg=key)


def test_a_budget_below_one_is_refused(tmp_path):
    cfg = tiny_config(tmp_path)
    for bad in (0, -5):
        cfg["max_tokens_per_micro_batch"] = bad
        with pytest.raises(ConfigError, match=f"max_tokens_per_micro_batch={bad}: expected an integer >= 1"):
            build_config(cfg)
    cfg["max_tokens_per_micro_batch"] = None
    assert build_config(cfg).max_tokens_per_micro_batch is None


def test_packed_results_depend_on_the_request_alone_not_on_merging_or_history(pstate, tmp_path, rm_dir):
    """Packed, a request's values and rewards are the same bits alone, merged with another request
    (before it or after it), after a train, save and load of the critic step it saw, and in a
    fresh service that loads that step; a train redone after the load is the same step, bit for
    bit (its micro-batch plan and permutation depend on its rows and step id alone). What the
    fault suite's restarted servers rely on to end as the uninterrupted run."""
    from aligner.wire.protocol import validate_infer

    optim = CASES["minibatches_seq_mean"]
    (tokens, lengths, pl, *train1), (other, olengths, opl, *train2) = _batches()
    torch.manual_seed(0)
    svc = _service(pstate, tmp_path / "a", rm_dir, optim, BUDGETS["split"])
    svc.train(tokens, lengths, *train1, 1)
    svc.save(1)

    def infer_all(s: CriticService) -> list:
        req, oth = (
            validate_infer(t, n, p, s.limits) for t, n, p in ((tokens, lengths, pl), (other, olengths, opl))
        )
        alone = s.infer(tokens, lengths, pl)
        merged = [s.infer_many([req, oth])[0], s.infer_many([oth, req])[1]]
        return [(r.values, r.rewards) for r in (alone, *merged)]

    def train_and_weights(s: CriticService) -> tuple[dict, list]:
        result = s.train(other, olengths, *train2, 2).to_dict()
        del result["train_ms"]
        return result, [p.detach().clone() for p in s.critic.parameters()]

    want = infer_all(svc)
    for values, rewards in want[1:]:  # merged, in either order: the request's own bits
        np.testing.assert_array_equal(values, want[0][0])
        np.testing.assert_array_equal(rewards, want[0][1])
    want_step, want_weights = train_and_weights(svc)
    svc.load(1)  # the same critic step again: the same bits
    torch.manual_seed(1)  # the global RNG is not what any of it draws from
    fresh = _service(pstate, tmp_path / "a", rm_dir, optim, BUDGETS["split"])
    fresh.load(1)
    for s, what in ((svc, "after a load"), (fresh, "in a fresh service")):
        for values, rewards in infer_all(s):
            np.testing.assert_array_equal(values, want[0][0], err_msg=what)
            np.testing.assert_array_equal(rewards, want[0][1], err_msg=what)
        step, weights = train_and_weights(s)
        assert step == want_step, what
        assert all(torch.equal(a, b) for a, b in zip(weights, want_weights)), what
