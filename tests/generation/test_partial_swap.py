"""Weights swapped between decode steps (``NativeEngine.generate(..., between_steps=...)``, what
a rollout worker does with ``rollout.partial``): the hook runs before each step that computes
response token k >= 1; weights it writes in place are read from the next step on, the KV cache
of the tokens before is kept.

The naive reference: a version B that differs from A only in the final norm (applied after the
last layer, so the keys and values of every position are the same under A and B). Tokens
before the swap then have A's full-forward log-probs, the tokens from the swap on B's, and the
tokens themselves are what the sampler drew from those. A swap of the same weights changes
nothing, bit for bit; an engine that owns its weights takes the swap as a zero-copy one does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _generation_parts import engine as _engine
from _generation_parts import tiny_model

from aligner import distributed
from aligner.generation import SamplingParams
from aligner.models.forward import policy_logits

warnings.filterwarnings("ignore", category=UserWarning)

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [3, 3, 3, 3, 13]]
SAMPLING = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, stop_token_ids=())


@pytest.fixture(scope="module")
def ps():
    state = distributed.initialize(distributed.ParallelConfig(), seed=1234)
    yield state
    distributed.destroy()


def _final_norm(model) -> torch.nn.Parameter:
    return model.decoder.final_layernorm.weight


def _swapper(model, at: int, new_norm: torch.Tensor, calls: list[int]):
    """A hook that writes ``new_norm`` into the final norm before the step of token ``at``."""

    def hook(k: int) -> bool:
        calls.append(k)
        if k != at:
            return False
        with torch.no_grad():
            _final_norm(model).copy_(new_norm)
        return True

    return hook


def _logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s-1]: each next token's log-prob under the full forward of ``model``."""
    with torch.no_grad():
        logits = policy_logits(model.eval(), tokens).float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_a_swap_of_the_same_weights_changes_nothing(ps):
    model = tiny_model(0)
    engine = _engine(model, ps)
    plain = engine.generate(PROMPTS, SAMPLING)
    calls: list[int] = []
    swapped = engine.generate(
        PROMPTS, SAMPLING, _swapper(model, 3, _final_norm(model).detach().clone(), calls)
    )
    assert calls == list(range(1, SAMPLING.max_new_tokens))  # before each step of tokens 1..K-1
    for f in ("tokens", "lengths", "logprobs", "ended", "prompt_lengths"):
        assert torch.equal(getattr(plain, f), getattr(swapped, f)), f


@pytest.mark.parametrize("weights", ["shared", "owned"])
def test_tokens_from_the_swap_on_are_the_new_version_s_over_the_old_cache(ps, weights):
    at = 4
    model = tiny_model(0)
    a = _final_norm(model).detach().clone()
    b = a * 3.0  # sharper: the sampled tokens differ from A's after the swap
    engine = _engine(model, ps, weights=weights)
    engine.refit(model)
    plain = engine.generate(PROMPTS, SAMPLING)
    out = engine.generate(PROMPTS, SAMPLING, _swapper(model, at, b, []))
    assert torch.equal(_final_norm(model).detach(), b)

    with torch.no_grad():
        _final_norm(model).copy_(a)
    under_a = _logprobs(model, out.tokens)
    with torch.no_grad():
        _final_norm(model).copy_(b)
    under_b = _logprobs(model, out.tokens)

    changed = False
    for i in range(len(PROMPTS)):
        p, n = int(out.prompt_lengths[i]), int(out.lengths[i])
        for k in range(n - p):
            t = p - 1 + k  # the transition that emits response token k
            want = under_a[i, t] if k < at else under_b[i, t]
            assert abs(float(out.logprobs[i, t]) - float(want)) < 1e-5, (i, k)
        m = min(at, n - p)
        # before the swap: A's own generation, token for token
        assert torch.equal(out.tokens[i, : p + m], plain.tokens[i, : p + m])
        changed |= not torch.equal(out.tokens[i, :n], plain.tokens[i, :n])
    assert changed  # the swap took effect


def test_a_swap_needs_the_lean_decoder(ps):
    model = tiny_model(0)
    engine = _engine(model, ps, backend="megatron")
    with pytest.raises(ValueError, match="needs the lean decoder"):
        engine.generate(PROMPTS, SAMPLING, lambda k: False)
