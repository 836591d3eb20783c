"""The fused forward (``aligner.models.fused``) against Megatron's own forward.

The fused path's attention is ``scaled_dot_product_attention`` and Megatron's is ``baddbmm``, an
fp32 softmax and ``bmm``, so outputs and gradients agree to round-off, not bit for bit.
Measured on a CPU (torch 2.13, the models below, outputs up to about 3.4 in size): fp32 logits,
values and scores at most 1.7e-6 apart, every parameter's gradient within 1.1e-6 of Megatron's
(relative, in norm); bf16 outputs at most 0.041 apart (about 3 units in the last place at 2-4:
Megatron rounds the scores to bf16, the kernels keep them in fp32) and gradients within 2.8e-2.
The tolerances (:data:`OUT_TOL`, :data:`GRAD_TOL`) are a few times those, for other machines'
kernels.

Covered: LM, value and reward heads; Llama-style (RMSNorm, SwiGLU, RoPE), grouped-query
attention, GPT-2-style (LayerNorm, GELU, learned positions, biases, tied embeddings),
Qwen3-style (heads of their own width, q/k norms, llama3-scaled RoPE); activation recompute
(the same gradients bit for bit, fused and Megatron, with LoRA too); the compiled variant; TP=2
in two processes against the TP=2 Megatron forward. The single-process comparisons run on
CUDA too (``pytest -m gpu``).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from _model_archs import ARCHS, HEADS

from aligner import distributed
from aligner.models import forward, fused, gpt, lora
from aligner.models.config import ModelConfig

TOKENS = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(0))
LENGTHS = torch.tensor([5, 17, 9])
#: Largest difference allowed between the fused forward's outputs and Megatron's (absolute).
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 0.125}
#: Largest difference allowed between their gradients (relative, in norm).
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-2}


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


def _output(model, head: str) -> torch.Tensor:
    dev = next(model.parameters()).device
    tokens = TOKENS.to(dev)
    if head == "lm":
        return forward.policy_logits(model, tokens)
    if head == "value":
        return forward.token_values(model, tokens)
    return forward.sequence_scores(model, tokens, LENGTHS.to(dev))


def _run(model, head: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = _output(model, head)
    # A loss that weights every output element differently, so every gradient path is used.
    w = torch.linspace(0.5, 1.5, out.numel(), device=out.device).view_as(out)
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _same_output(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    torch.testing.assert_close(got, want, atol=OUT_TOL[dtype], rtol=0)


def _same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, where=()) -> None:
    """Every parameter's gradient within ``tol`` of ``want``'s, relative to its norm."""
    assert got.keys() == want.keys()
    for name in want:
        err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30))
        assert err < tol, (*where, f"{name}: relative gradient difference {err:.2e} >= {tol}")


def _compare(model, head: str, mode: str, dtype: torch.dtype) -> None:
    forward.set_forward(model, "megatron")
    out0, g0 = _run(model, head)
    assert forward.set_forward(model, mode) == (mode, None)
    out1, g1 = _run(model, head)
    _same_output(out1, out0, dtype)
    _same_grads(g1, g0, GRAD_TOL[dtype])


@pytest.fixture(scope="module", autouse=True)
def _world():
    torch.set_num_threads(1)
    distributed.initialize()
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("head", list(HEADS))
def test_fused_equals_megatron(arch, head, dtype, device):
    model = _build(head, arch, dtype).to(device)
    _compare(model, head, "fused", dtype)


def test_broken_attention_is_caught(monkeypatch):
    """The comparison can fail: a fused forward whose attention is not causal is far outside
    the tolerance."""
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg())
    want = forward.policy_logits(model, TOKENS)  # Megatron's forward
    monkeypatch.setattr(
        fused, "causal_attention", lambda q, k, v, scale: F.scaled_dot_product_attention(q, k, v, scale=scale)
    )
    forward.set_forward(model, "fused")
    bad = forward.policy_logits(model, TOKENS)
    assert float((bad[:, :-1] - want[:, :-1]).detach().abs().max()) > 100 * OUT_TOL[torch.float32]


# -- activation recompute -------------------------------------------------------------------


def _saved_bytes(model, head: str) -> int:
    """Bytes the forward saves for the backward (outside checkpointed regions)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _output(model, head)
    return sum(sizes)


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mode", ["megatron", "fused"])
def test_recompute_gives_the_same_gradients(mode, adapters, device):
    """``recompute: full`` keeps only each layer's input for the backward, which runs the layer
    again: the same outputs and gradients, bit for bit on a CPU (the same kernels on the same
    inputs; a GPU's backward kernels may sum in another order each time), and a small part of
    the bytes saved. Megatron's recompute (reentrant) and the fused one (non-reentrant) both;
    with LoRA the embeddings are frozen, and the adapters in the layers still get gradients."""
    arch = dict(ARCHS["qwen3"])
    models = {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        m = gpt.build_policy(_cfg(**arch, recompute=recompute))
        if adapters:
            lora.apply_lora(m, lora.LoraConfig(rank=4, alpha=8), seed=1)
            with torch.no_grad():  # B starts at 0: move it, so every adapter gradient is nonzero
                for p in lora.lora_parameters(m).values():
                    p.add_(0.1 * torch.randn_like(p))
        models[recompute] = m.to(device)
    assert models["full"].config.recompute_granularity == "full"
    assert models["none"].config.recompute_granularity is None
    models["full"].load_state_dict(models["none"].state_dict())
    results = {}
    for recompute, m in models.items():
        assert forward.set_forward(m, mode) == (mode, None)
        results[recompute] = (*_run(m, "lm"), _saved_bytes(m, "lm"))
    (out0, g0, saved0), (out1, g1, saved1) = results["none"], results["full"]
    assert g1.keys() == g0.keys() and len(g0) == (16 if adapters else len(list(models["none"].parameters())))
    if device.type == "cpu":
        assert torch.equal(out1, out0)
        for name in g0:
            assert torch.equal(g1[name], g0[name]), name
    else:
        _same_output(out1, out0)
        _same_grads(g1, g0, GRAD_TOL[torch.float32])
    assert saved1 < saved0 / 4, (saved1, saved0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("head", ["lm", "value"])
def test_last_layer_from_start_changes_nothing_it_keeps(arch, head, dtype):
    """``start`` computes the last layer's queries, MLP and head only from that position on:
    the outputs it keeps are the full forward's (Megatron's forward, sliced: bit for bit; the
    fused one, whose last layer then attends under a mask, with another kernel: to
    :data:`OUT_TOL`), and a loss that ignores the positions before it gets the same gradients
    to round-off (the weight gradients sum fewer rows)."""
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
        if mode == "megatron":
            assert torch.equal(part[:, start - first :], full[:, start:])
        _same_output(part[:, start - first :], full[:, start:], dtype)
        if head == "value":
            assert not part[:, :start].any()  # zeros, not values
        if mode == "megatron":
            want_out, want_grads = part, g_part
    _same_output(part, want_out, dtype)
    _same_grads(g_part, want_grads, GRAD_TOL[dtype])
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


def test_scores_at_each_last_token_only(device):
    """The reward forward runs the last layer at one position per sequence: the same scores as
    reading the full forward there, whatever the lengths; bad positions are named."""
    torch.manual_seed(0)
    model = gpt.build_reward_model(_cfg(num_query_groups=2)).to(device)
    forward.set_forward(model, "fused")
    tokens = TOKENS.to(device)
    full = model.aligner_fused(tokens)[..., 0]  # [b, s]
    for lengths in (LENGTHS, torch.tensor([1, 2, 17]), torch.tensor([17, 17, 17])):
        idx = lengths.to(device) - 1
        _same_output(forward.sequence_scores(model, tokens, lengths), full.gather(1, idx.unsqueeze(1))[:, 0])
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
    _same_output(after, forward.policy_logits(model, TOKENS))
    assert not torch.allclose(before, after, atol=100 * OUT_TOL[torch.float32])


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
@pytest.mark.slow  # torch.compile builds C++ kernels: tens of seconds on a fresh machine
def test_compiled_equals_megatron():
    """torch.compile fuses the element-wise work differently: outputs agree with Megatron's
    to the tolerances of the eager fused forward. bf16 only (the default precision): a compile
    takes 15-30 s here."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = gpt.build_critic(_cfg(num_query_groups=2), params_dtype=dtype)
    forward.set_forward(model, "megatron")
    out0, g0 = _run(model, "value")
    forward.set_forward(model, "compiled")
    out1, g1 = _run(model, "value")
    tol = OUT_TOL[dtype]
    torch.testing.assert_close(out1, out0, atol=tol, rtol=tol)
    _same_grads(g1, g0, GRAD_TOL[dtype])
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
                if (head, arch) == ("lm", "gqa"):
                    out0s, g0s = out0, g0
                assert forward.set_forward(model, "fused", tensor_parallel_size=2) == ("fused", None)
                out1, g1 = _run(model, head)
                _same_output(out1, out0)
                _same_grads(g1, g0, GRAD_TOL[torch.float32], where=(head, arch))
        # Recompute at TP=2: Megatron's (its collectives run again in the backward) and the
        # fused one, against the same model without it.
        torch.manual_seed(0)
        model = gpt.build_policy(_cfg(**ARCHS["gqa"], recompute="full"))
        model.load_state_dict(_build("lm", "gqa").state_dict())
        for mode in ("megatron", "fused"):
            assert forward.set_forward(model, mode, tensor_parallel_size=2) == (mode, None)
            out1, g1 = _run(model, "lm")
            _same_output(out1, out0s)
            _same_grads(g1, g0s, GRAD_TOL[torch.float32], where=("recompute", mode))
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
        torch.testing.assert_close(got[:, 2:], want[:, 2:], atol=OUT_TOL[torch.float32], rtol=0)
        assert not got[:, :2].any(), name
