"""The fused forward (``aligner.models.fused``) against Megatron's own forward.

LM logits must be identical (the fused path keeps Megatron's rounding order), values and
scores equal to fp32 round-off (the fp32 head's matrix product sees a batch-first layout,
which can change its summation order); every parameter's
gradient must agree to fp32 round-off in fp32 and to bf16 round-off in bf16 (gradient sums
run in another order). Covered: LM, value and reward heads; Llama-style (RMSNorm, SwiGLU,
RoPE), grouped-query attention, GPT-2-style (LayerNorm, GELU, learned positions, biases, tied
embeddings), Qwen3-style (heads of their own width, q/k norms, llama3-scaled RoPE); the
compiled variant; TP=2 in two processes against the TP=2 Megatron forward.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from aligner import distributed
from aligner.models import forward, fused, gpt
from aligner.models.config import ModelConfig

ARCHS = {
    "llama": dict(),
    "gqa": dict(num_query_groups=2),
    "gpt2": dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding="learned_absolute",
        add_bias_linear=True,
        tie_embeddings=True,
    ),
    # Qwen3-style: heads 32 wide (not 64 / 4), per-head q/k RMSNorm, and Llama 3.1's RoPE
    # scaling with an original context of 8 (the tokens run past it).
    "qwen3": dict(
        num_query_groups=2,
        kv_channels=32,
        qk_layernorm=True,
        rope_scaling="llama3",
        rope_original_max_position=8,
    ),
}
HEADS = {"lm": gpt.build_policy, "value": gpt.build_critic, "reward": gpt.build_reward_model}
TOKENS = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(0))
LENGTHS = torch.tensor([5, 17, 9])


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=40,
        max_seq_len=32,
        init_method_std=0.1,
        **kw,
    )


def _build(head: str, arch: str, dtype: torch.dtype = torch.float32):
    """``head``'s model of ``arch`` (seeded); q/k norm weights moved away from 1, so a norm
    read from the wrong tensor shows."""
    torch.manual_seed(0)
    model = HEADS[head](_cfg(**ARCHS[arch]), params_dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _output(model, head: str, tokens=TOKENS) -> torch.Tensor:
    if head == "lm":
        return forward.policy_logits(model, tokens)
    if head == "value":
        return forward.token_values(model, tokens)
    return forward.sequence_scores(model, tokens, LENGTHS)


def _run(model, head: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = _output(model, head)
    # A loss that weights every output element differently, so every gradient path is used.
    w = torch.linspace(0.5, 1.5, out.numel()).view_as(out)
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _same_output(got: torch.Tensor, want: torch.Tensor, head: str) -> None:
    if head == "lm":
        assert torch.equal(got, want), f"logits differ: max {float((got - want).abs().max())}"
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, where=()) -> None:
    """Every parameter's gradient within ``tol`` of ``want``'s, relative to its norm."""
    assert got.keys() == want.keys()
    for name in want:
        err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30))
        assert err < tol, (*where, f"{name}: relative gradient difference {err:.2e} >= {tol}")


def _compare(model, head: str, mode: str, grad_tol: float) -> None:
    forward.set_forward(model, "megatron")
    out0, g0 = _run(model, head)
    assert forward.set_forward(model, mode) == (mode, None)
    out1, g1 = _run(model, head)
    _same_output(out1, out0, head)
    _same_grads(g1, g0, grad_tol)


@pytest.fixture(scope="module", autouse=True)
def _world():
    torch.set_num_threads(1)
    distributed.initialize()
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("head", list(HEADS))
def test_fused_equals_megatron(arch, head, dtype):
    model = _build(head, arch, dtype)
    _compare(model, head, "fused", grad_tol=1e-5 if dtype == torch.float32 else 2e-2)


def test_broken_attention_is_caught():
    """The comparison can fail: a fused forward without the causal mask differs."""
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg())
    forward.set_forward(model, "fused")
    good = forward.policy_logits(model, TOKENS)
    fast = model.aligner_fused
    n = TOKENS.shape[1]
    fast._tables[(n, torch.float32, TOKENS.device)] = fast._tables_for(n, torch.float32, TOKENS.device)[
        :2
    ] + (torch.zeros(n, n),)
    bad = forward.policy_logits(model, TOKENS)
    assert not torch.allclose(good[:, :-1], bad[:, :-1], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_in_chunks_changes_nothing(monkeypatch, dtype):
    """Attention computed a few (batch x head) rows at a time, as long sequences are on a CPU,
    gives the same logits and gradients, bit for bit, as all rows at once; so does the
    no-grad forward, which keeps no probabilities."""
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg(num_query_groups=2), params_dtype=dtype)
    forward.set_forward(model, "fused")
    b, n = TOKENS.shape
    q = torch.empty(b * 4, n, 16, dtype=dtype)  # batch x heads rows
    assert fused.attention_rows_per_chunk(q) == b * 4  # this small a case: one chunk
    out1, grads1 = _run(model, "lm")
    monkeypatch.setattr(fused, "_CHUNK_BYTES", 5 * n * n * q.element_size())
    assert fused.attention_rows_per_chunk(q) == 5  # chunks of 5, 5 and 2 rows
    out5, grads5 = _run(model, "lm")
    assert torch.equal(out5, out1)
    for name, g in grads1.items():
        assert torch.equal(grads5[name], g), name
    with torch.no_grad():
        assert torch.equal(forward.policy_logits(model, TOKENS), out1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("head", ["lm", "value"])
def test_last_layer_from_start_changes_nothing_it_keeps(arch, head, dtype):
    """``start`` computes the last layer's queries, MLP and head only from that position on:
    the outputs it keeps are the full forward's (logits bit-identical; values to fp32
    round-off, as :func:`_same_output`), for both Megatron's forward (sliced) and the fused
    one, and a loss that ignores the positions before it gets the same gradients to round-off
    (the weight gradients sum fewer rows)."""
    model = _build(head, arch, dtype)
    start = 6
    fwd = {"lm": forward.policy_logits, "value": forward.token_values}[head]
    first = start if head == "lm" else 0  # token_values pads its [b, s-1] with zeros instead

    def run(s):
        model.zero_grad(set_to_none=True)
        out = fwd(model, TOKENS, s)
        w = torch.linspace(0.5, 1.5, out.numel()).view_as(out)
        if head == "value":
            w[:, :start] = 0.0  # the loss a masked value loss is: nothing before start
        (out * w).sum().backward()
        return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    for mode in ("megatron", "fused"):
        forward.set_forward(model, mode)
        full, _ = run(0)
        part, g_part = run(start)
        assert part.shape[1] == full.shape[1] - first
        _same_output(part[:, start - first :], full[:, start:], head)
        if head == "value":
            assert not part[:, :start].any()  # zeros, not values
        if mode == "megatron":
            want_out, want_grads = part, g_part
    _same_output(part, want_out, head)
    _same_grads(g_part, want_grads, 1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match="expected 0 <= start < 17"):
        fwd(model, TOKENS, 17)


def test_compiled_trimmed_forwards_are_bounded(monkeypatch):
    """Each compiled ``start`` is one more compile: past ``MAX_TRIMMED_COMPILES`` of them a new
    start takes the nearest compiled one below it (or the full forward), sliced to what was
    asked. Nothing is compiled here: torch.compile compiles at the first call."""
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "MAX_TRIMMED_COMPILES", 2)
    spec = fused._Spec(gpt.build_policy(_cfg()), 1)
    assert fused._compiled_fn(spec, 0)[0] == 0
    assert fused._compiled_fn(spec, 8)[0] == 8
    assert fused._compiled_fn(spec, 4)[0] == 4
    assert fused._compiled_fn(spec, 12)[0] == 8  # two trimmed variants exist: nearest below
    assert fused._compiled_fn(spec, 6)[0] == 4
    assert fused._compiled_fn(spec, 3)[0] == 0
    assert fused._compiled_fn(spec, 8)[1] is fused._compiled_fn(spec, 9)[1]
    names = {fn._torchdynamo_orig_callable.__code__.co_name for fn in fused._COMPILED.values()}
    assert names == {"forward", "forward_lm_from_4", "forward_lm_from_8"}  # each its own dynamo state


def test_scores_at_each_last_token_only():
    """The reward forward runs the last layer at one position per sequence: the same scores and
    gradients as reading the full forward there, whatever the lengths; bad positions are named."""
    torch.manual_seed(0)
    model = gpt.build_reward_model(_cfg(num_query_groups=2))
    forward.set_forward(model, "fused")
    full = model.aligner_fused(TOKENS)[..., 0]  # [b, s]
    for lengths in (LENGTHS, torch.tensor([1, 2, 17]), torch.tensor([17, 17, 17])):
        idx = lengths - 1
        torch.testing.assert_close(
            forward.sequence_scores(model, TOKENS, lengths),
            full.gather(1, idx.unsqueeze(1))[:, 0],
            atol=1e-6,
            rtol=1e-6,
        )
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 17\)"):
        model.aligner_fused.at(TOKENS, torch.tensor([0, 3, 17]))
    with pytest.raises(ValueError, match="one position per sequence"):
        model.aligner_fused.at(TOKENS, torch.tensor([0, 3]))


def test_follows_weight_updates():
    """The fused forward reads the parameters at every call (optimizer steps, loads)."""
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg())
    forward.set_forward(model, "fused")
    before = forward.policy_logits(model, TOKENS)
    with torch.no_grad():
        model.decoder.layers[0].mlp.linear_fc2.weight.mul_(3.0)
    after = forward.policy_logits(model, TOKENS)
    forward.set_forward(model, "megatron")
    assert torch.equal(after, forward.policy_logits(model, TOKENS))
    assert not torch.equal(before, after)


def test_auto_falls_back_with_the_reason():
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg(hidden_dropout=0.1))
    taken, why = forward.set_forward(model, "auto")
    assert taken == "megatron" and "dropout" in why
    assert model.aligner_fused is None
    with pytest.raises(ValueError, match="dropout"):
        forward.set_forward(model, "fused")
    with pytest.raises(ValueError, match="expected one of"):
        forward.set_forward(model, "fast")
    plain = gpt.build_policy(_cfg())
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        forward.set_forward(plain, "compiled", tensor_parallel_size=2)


@pytest.mark.skipif(fused.compile_available() is not None, reason=str(fused.compile_available()))
def test_compiled_equals_megatron():
    """torch.compile fuses the element-wise work differently: outputs agree to round-off.
    bf16 only (the default precision): a compile takes 15-30 s here."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = gpt.build_critic(_cfg(num_query_groups=2), params_dtype=dtype)
    forward.set_forward(model, "megatron")
    out0, g0 = _run(model, "value")
    forward.set_forward(model, "compiled")
    out1, g1 = _run(model, "value")
    # bf16: a few units in the last place of values up to about 1 (one value of this head is 0.027
    # apart, some 10 units of bf16's 2^-8 there).
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(out1, out0, atol=tol, rtol=tol)
    _same_grads(g1, g0, tol)
    with torch.no_grad():  # the inference graph, and a new shape
        torch.testing.assert_close(
            forward.token_values(model, TOKENS[:, :9]),
            out0[:, :8],
            atol=tol,
            rtol=tol,
        )
        # The last layer from position 5 on: a variant of its own.
        part = forward.token_values(model, TOKENS, 5)
        torch.testing.assert_close(part[:, 5:], out0[:, 5:], atol=tol, rtol=tol)
        assert not part[:, :5].any()
    # A reward model's scores, the last layer at each sequence's last token only: one compiled
    # variant for any lengths.
    torch.manual_seed(0)
    rm = gpt.build_reward_model(_cfg(num_query_groups=2), params_dtype=dtype)
    for lengths in (LENGTHS, torch.tensor([17, 2, 11])):
        with torch.no_grad():
            forward.set_forward(rm, "megatron")
            want = forward.sequence_scores(rm, TOKENS, lengths)
            forward.set_forward(rm, "compiled")
            torch.testing.assert_close(forward.sequence_scores(rm, TOKENS, lengths), want, atol=tol, rtol=tol)


# -- TP=2 ---------------------------------------------------------------------------------


def _tp_worker(rank: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=2), seed=5)
        # 40 tokens split 20/20; 4 heads in 2 groups: one group per rank.
        for head in ("lm", "value", "reward"):
            for arch in ("gqa", "gpt2", "qwen3"):
                model = _build(head, arch)
                forward.set_forward(model, "megatron")
                out0, g0 = _run(model, head)
                assert forward.set_forward(model, "fused", tensor_parallel_size=2) == ("fused", None)
                out1, g1 = _run(model, head)
                _same_output(out1, out0, head)
                _same_grads(g1, g0, 1e-5, where=(head, arch))
    finally:
        distributed.destroy()


@pytest.mark.multiprocess
def test_tp2_fused_equals_megatron():
    mp.spawn(_tp_worker, args=(distributed.free_port(),), nprocs=2, join=True)


def test_trainer_log_probs_from_the_first_masked_position():
    """The actor computes log-probs and entropies from the first position any response mask
    covers (hand-worked: prompts of 3 and 5 tokens -> transition 2): equal to the full
    forward's there and after, 0 before."""
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.rl import loss_start, response_mask

    mask = response_mask(torch.tensor([6, 8]), torch.tensor([3, 5]), 8)
    assert mask[0].nonzero().flatten().tolist() == [2, 3, 4]
    assert loss_start(mask) == 2
    assert loss_start(mask[1:]) == 4
    assert loss_start(torch.zeros(2, 7)) == 0
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg())
    forward.set_forward(model, "fused")
    actor = PolicyLogprobs(temperature=0.7, group=None, vocab_start=0, pad_from=None)
    tokens = TOKENS[:2, :8]
    full = forward.policy_logits(model, tokens)
    part = forward.policy_logits(model, tokens, 2)
    pairs = {
        "logprobs": (
            actor.sequence_logprobs(full, tokens),
            actor.sequence_logprobs(part, tokens, 2),
        ),
        "entropy": (actor.entropy(full), actor.entropy(part, 2)),
    }
    for name, (want, got) in pairs.items():
        assert got.shape == want.shape == (2, 7), name
        assert torch.equal(got[:, 2:], want[:, 2:]) and not got[:, :2].any(), name
