"""The native generation engine (single process): KV-cache decoding against a full recompute,
log-probs against the training forward, sampling controls, stop conditions, errors, refit.

The lean decoder's attention is ``scaled_dot_product_attention`` and the full forward's
Megatron's (or the fused forward's SDPA over the whole sequence), so they agree to round-off.
Measured on a CPU (torch 2.13): fp32 logits at most 7.2e-6 apart over 35 teacher-forced steps,
fp32 log-probs of greedy generations at most 3.1e-6 from the full recompute's (Megatron's own
KV cache: 3.1e-6 too); bf16 log-probs at most 0.058 from Megatron's bf16 training forward and
0.046 from the fused one (Megatron rounds the attention scores to bf16, the kernels keep them in
fp32). Tolerances are a few times those: :data:`LOGIT_TOL`, 1e-5 on fp32 log-probs,
:data:`BF16_LOGPROB_TOL`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _generation_parts import MAX_LEN, TOK, tiny_cfg, tiny_model
from _generation_parts import engine as _engine

from aligner import distributed
from aligner.generation import GenerationEngine, NativeEngine, SamplingParams, generate_no_cache
from aligner.generation.decode_steps import CompiledDecodeStep
from aligner.generation.decoder import LeanDecoder
from aligner.generation.sampling import sample_next
from aligner.models.forward import policy_logits
from aligner.models.fused import compile_available
from aligner.models.gpt import build_policy
from aligner.models.local_spec import unsupported_reason

warnings.filterwarnings("ignore", category=UserWarning)

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [3, 3, 3, 3, 13]]
BACKENDS = ["lean", "megatron"]
LOGIT_TOL = 3e-5  # fp32 logits of the lean decoder against the full forward's
BF16_LOGPROB_TOL = 0.15  # bf16 log-probs of generation against the bf16 training forward's


@pytest.fixture(scope="module")
def ps():
    state = distributed.initialize(distributed.ParallelConfig(), seed=1234)
    yield state
    distributed.destroy()


@pytest.fixture(scope="module")
def model(ps):
    return tiny_model(0)


def _reference(model, prompts, sampling, eos_id=TOK.eos_id):
    return generate_no_cache(
        model, prompts, sampling, pad_id=TOK.pad_id, eos_id=eos_id, max_seq_len=MAX_LEN, tokenizer=TOK
    )


def _full_logits(model, tokens):
    with torch.no_grad():
        return policy_logits(model.eval(), tokens).float()


def _check_layout(out, pad_id=TOK.pad_id):
    """Right padding, lengths, zero log-probs outside the response mask."""
    b, s = out.tokens.shape
    assert out.tokens.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert out.logprobs.shape == (b, s - 1) and out.ended.dtype == torch.bool
    assert int(out.lengths.max()) == s
    mask = out.response_mask().bool()
    for i in range(b):
        n, p = int(out.lengths[i]), int(out.prompt_lengths[i])
        assert (out.tokens[i, n:] == pad_id).all()
        assert (out.logprobs[i][~mask[i]] == 0).all()
        assert mask[i].sum() == n - p


# -- KV cache vs full recompute ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_kv_cache_equals_full_recompute(model, ps, backend):
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    out = _engine(model, ps, backend).generate(PROMPTS, sp)
    ref = _reference(model, PROMPTS, sp)
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.lengths, ref.lengths) and torch.equal(out.ended, ref.ended)
    assert out.prompt_lengths.tolist() == [len(p) for p in PROMPTS]
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    _check_layout(out)
    # Batching prompts of different lengths (ragged on lean, teacher-forced on megatron)
    # changes nothing per sample.
    for i, p in enumerate(PROMPTS):
        alone = _engine(model, ps, backend).generate([p], sp)
        assert alone.tokens[0].tolist() == out.tokens[i, : alone.tokens.shape[1]].tolist()


# Qwen3-style: heads 32 wide (not 64 / 4) with per-head q/k norms. Llama 3.1-style: RoPE
# frequencies scaled (llama3) for an original context of 16, which generation runs past, and
# heads 24 wide.
QWEN3 = dict(num_query_groups=2, kv_channels=32, qk_layernorm=True)
LLAMA3_ROPE = dict(kv_channels=24, rope_scaling="llama3", rope_original_max_position=16)


def _with_qk_norms_moved(m):
    """q/k norm weights away from 1, so a norm read from the wrong tensor shows."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize(
    "arch",
    [
        dict(num_query_groups=2),
        dict(num_query_groups=1, add_qkv_bias=True),
        dict(
            normalization="LayerNorm",
            activation="gelu",
            position_embedding="learned_absolute",
            add_bias_linear=True,
            tie_embeddings=True,
        ),
        QWEN3,
        LLAMA3_ROPE,
    ],
    ids=["gqa", "mqa_qkv_bias", "gpt2_like", "qwen3", "llama3_rope"],
)
def test_lean_path_matches_recompute_on_other_architectures(ps, arch):
    m = _with_qk_norms_moved(tiny_model(1, **arch))
    assert unsupported_reason(m) is None
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    out = _engine(m, ps, "lean").generate(PROMPTS, sp)
    ref = _reference(m, PROMPTS, sp)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", [QWEN3, LLAMA3_ROPE], ids=["qwen3", "llama3_rope"])
def test_lean_decoder_logits_equal_the_full_forward(ps, arch, device):
    """Every step's logits, teacher-forced past the llama3 scaling's original context: the
    eager and the fixed-shape decode step, over the module's own tensors and over owned copies
    (what a refit streams), equal the full forward's at that position (Megatron's forward and
    the fused one)."""
    from aligner.generation.weights import OwnedWeights
    from aligner.models.forward import set_forward
    from aligner.models.layout import ParallelLayout, iter_megatron_tensors

    m = _with_qk_norms_moved(tiny_model(2, **arch)).eval().to(device)
    b, n = 2, 5
    tokens = torch.randint(2, TOK.vocab_size, (b, 40), generator=torch.Generator().manual_seed(0)).to(device)
    full = _full_logits(m, tokens)  # [b, 40, v]
    set_forward(m, "fused")
    torch.testing.assert_close(_full_logits(m, tokens), full, atol=LOGIT_TOL, rtol=0)
    set_forward(m, "megatron")
    owned = OwnedWeights(m, ParallelLayout())
    owned.load(iter_megatron_tensors(m))
    with torch.inference_mode():
        for source in (m, owned):
            for static in (False, True):
                lean = LeanDecoder(source)
                lean.begin(b, MAX_LEN)
                torch.testing.assert_close(
                    lean.prefill(tokens[:, :n]), full[:, n - 1], atol=LOGIT_TOL, rtol=0
                )
                for pos in range(n, tokens.shape[1]):
                    tok = tokens[:, pos : pos + 1]
                    if static:
                        got = lean.decode_static(tok, torch.tensor([pos], device=device))
                    else:
                        got = lean.decode(tok, pos)
                    torch.testing.assert_close(got, full[:, pos], atol=LOGIT_TOL, rtol=0)
                lean.end()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_attends_only_to_the_filled_positions(ps, static, device):
    """A decode step reads the cache's positions up to its own and nothing past them (the eager
    step a slice, the fixed-shape one the whole capacity under a mask): large keys and values
    written past that position change nothing."""
    m = tiny_model(3, num_query_groups=2).eval().to(device)
    b, n, steps = 2, 4, 6
    tokens = torch.randint(2, TOK.vocab_size, (b, n + steps), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    got = {}
    with torch.inference_mode():
        for poisoned in (False, True):
            lean = LeanDecoder(m, keep_cache=False)
            lean.begin(b, MAX_LEN)
            lean.reserve(MAX_LEN)
            lean.prefill(tokens[:, :n])
            out = []
            for pos in range(n, n + steps):
                if poisoned:
                    for L in lean.layers:
                        L.k[:, :, pos:].fill_(1e4)
                        L.v[:, :, pos:].fill_(-1e4)
                tok = tokens[:, pos : pos + 1]
                if static:
                    out.append(lean.decode_static(tok, torch.tensor([pos], device=device)))
                else:
                    out.append(lean.decode(tok, pos))
            got[poisoned] = torch.stack(out)
            lean.end()
    assert torch.equal(got[True], got[False])


def test_engine_options_do_not_change_results(model, ps):
    """The lean backend with MKL or oneDNN linears, and a sparse all-done check (the GPU
    setting), give the same tokens as the default."""
    sp = SamplingParams(max_new_tokens=20, top_k=6, seed=4)
    base = _engine(model, ps).generate(PROMPTS, sp)
    for kw in (dict(cpu_linear="default"), dict(check_every=3), dict(backend="megatron")):
        other = _engine(model, ps, **kw).generate(PROMPTS, sp)
        assert torch.equal(base.tokens, other.tokens), kw
        torch.testing.assert_close(base.logprobs, other.logprobs, atol=1e-5, rtol=0)


# Megatron's local-spec norms keep fp32 weights in a bf16 model; torch warns on every such call.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logprobs_match_the_bf16_training_forward(ps, backend):
    torch.manual_seed(6)
    m = build_policy(tiny_cfg(num_query_groups=2), params_dtype=torch.bfloat16)
    from aligner.models.forward import set_forward

    out = _engine(m, ps, backend).generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=0))
    for training_forward in ("megatron", "fused"):
        set_forward(m, training_forward)
        logp = torch.log_softmax(_full_logits(m, out.tokens), dim=-1)
        expect = logp[:, :-1].gather(-1, out.tokens[:, 1:].unsqueeze(-1)).squeeze(-1) * out.response_mask()
        torch.testing.assert_close(out.logprobs, expect, atol=BF16_LOGPROB_TOL, rtol=0)


# -- log-probs ---------------------------------------------------------------------------


def _most_generated(out) -> int:
    resp = torch.cat([torch.tensor(r) for r in out.responses()])
    return int(torch.bincount(resp).argmax())


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_equal_training_forward_and_eos_ends(model, ps, backend):
    from aligner.rl import gather_logprobs

    temperature = 0.7
    probe = _engine(model, ps, backend).generate(PROMPTS * 2, SamplingParams(max_new_tokens=20, seed=3))
    eos = _most_generated(probe)  # a token this model emits often: samples end on it
    engine = _engine(model, ps, backend, eos_id=eos)
    out = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=20, temperature=temperature, seed=11))
    _check_layout(out)
    logp = torch.log_softmax(_full_logits(model, out.tokens) / temperature, dim=-1)
    expect = logp[:, :-1].gather(-1, out.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = out.response_mask()
    torch.testing.assert_close(out.logprobs, expect * mask, atol=1e-4, rtol=0)
    trainer = gather_logprobs(_full_logits(model, out.tokens)[:, :-1], out.tokens[:, 1:], temperature)
    torch.testing.assert_close(out.logprobs, trainer * mask, atol=1e-4, rtol=0)
    assert out.ended.any(), "expected some samples to end on eos"
    for i, resp in enumerate(out.responses()):
        assert eos not in resp[:-1]  # nothing generated after eos
        assert bool(out.ended[i]) == (resp[-1] == eos)
        if not out.ended[i]:
            assert len(resp) == 20


def test_outputs_are_ordinary_tensors_usable_in_training(model, ps):
    out = _engine(model, ps).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    assert not out.tokens.is_inference() and not out.logprobs.is_inference()
    model.train()
    loss = policy_logits(model, out.tokens).float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def test_mode_restored_after_generation(model, ps):
    model.train()
    _engine(model, ps).generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True))
    assert all(m.training for m in model.modules())
    model.eval()
    _engine(model, ps).generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True))
    assert not any(m.training for m in model.modules())


# -- sampling controls -------------------------------------------------------------------


def test_top_k_1_equals_greedy(model, ps):
    engine = _engine(model, ps)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, greedy=True))
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_k=1, temperature=1.3, seed=5))
    assert torch.equal(greedy.tokens, top1.tokens)


def _response_positions(out):
    for i in range(out.tokens.shape[0]):
        for t in range(int(out.prompt_lengths[i]) - 1, int(out.lengths[i]) - 1):
            yield i, t, int(out.tokens[i, t + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_tokens_lie_in_top_k_and_nucleus(ps, backend):
    m = tiny_model(2, init_method_std=0.05)  # flatter distributions: truncation matters
    engine = _engine(m, ps, backend, eos_id=TOK.vocab_size + 5)  # no eos: long responses
    prompts = PROMPTS * 4
    k, temperature = 3, 0.9
    out = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, top_k=k, temperature=temperature, seed=1)
    )
    logits = _full_logits(m, out.tokens)
    seen = set()
    for i, t, tok in _response_positions(out):
        assert tok in torch.topk(logits[i, t], k).indices.tolist()
        seen.add(tok)
    assert len(seen) > 1

    top_p = 0.6
    out = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, top_p=top_p, temperature=temperature, seed=2)
    )
    logits = _full_logits(m, out.tokens)
    ranks = []
    for i, t, tok in _response_positions(out):
        probs = torch.softmax(logits[i, t] / temperature, dim=-1)
        order = torch.argsort(probs, descending=True).tolist()
        rank = order.index(tok)
        mass_before = float(probs[order[:rank]].sum())
        assert mass_before < top_p + 1e-6, (rank, mass_before)
        ranks.append(rank)
    assert max(ranks) > 0  # the nucleus held more than the argmax somewhere


def test_seeds(model, ps):
    engine = _engine(model, ps, eos_id=TOK.vocab_size + 5)
    sp = SamplingParams(max_new_tokens=16, seed=123)
    a, b = engine.generate(PROMPTS, sp), engine.generate(PROMPTS, sp)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=124))
    assert not torch.equal(a.tokens, c.tokens)
    # Unseeded calls draw from torch's generator: reproducible under torch.manual_seed.
    torch.manual_seed(9)
    d = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))
    torch.manual_seed(9)
    e = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))
    assert torch.equal(d.tokens, e.tokens)


def test_sampler_frequencies_match_the_tempered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 6).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0.8, top_k=4)
    tok, lp = sample_next(logits, sp, g)
    tempered = torch.softmax(logits[0] / 0.8, dim=-1)
    torch.testing.assert_close(lp, tempered.log()[tok])  # log-probs of the untruncated distribution
    keep = torch.topk(tempered, 4).indices
    trunc = torch.zeros(6)
    trunc[keep] = tempered[keep] / tempered[keep].sum()
    freq = torch.bincount(tok, minlength=6).float() / tok.numel()
    assert (freq - trunc).abs().max() < 0.015


# -- stop conditions and limits ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_strings_cut_the_response(model, ps, backend):
    engine = _engine(model, ps, backend, eos_id=TOK.vocab_size + 5)
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    full = engine.generate(PROMPTS, sp)
    resp = full.responses()[1]
    stop = TOK.decode(resp[2:4])  # a 2-character string inside sample 1's response
    out = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=16, greedy=True, stop_strings=(stop, "never"))
    )
    _check_layout(out)
    for i, (r_full, r_cut) in enumerate(zip(full.responses(), out.responses())):
        text = TOK.decode(r_full)
        if stop in text:
            assert out.ended[i]
            cut_text = TOK.decode(r_cut)
            assert cut_text.endswith(stop) and cut_text.count(stop) == 1
            assert r_full[: len(r_cut)] == r_cut
            assert stop not in TOK.decode(r_cut[:-1])  # cut right after the stop string
        else:
            assert r_cut == r_full and not out.ended[i]
    assert out.ended[1] and len(out.responses()[1]) <= 4
    torch.testing.assert_close(out.logprobs, full.logprobs[:, : out.logprobs.shape[1]] * out.response_mask())


def test_stop_token_ids(model, ps):
    engine = _engine(model, ps, eos_id=TOK.vocab_size + 5)
    full = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, greedy=True))
    stop = full.responses()[0][3]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, greedy=True, stop_token_ids=(stop,)))
    r = out.responses()[0]
    assert r[-1] == stop and stop not in r[:-1] and out.ended[0] and len(r) <= 4


def test_max_new_tokens_and_max_seq_len(model, ps):
    engine = _engine(model, ps, eos_id=TOK.vocab_size + 5)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, greedy=True))
    assert out.response_lengths.tolist() == [5] * len(PROMPTS) and not out.ended.any()
    long_prompt = [2 + i % 10 for i in range(MAX_LEN - 3)]
    out = engine.generate([long_prompt, [4, 5]], SamplingParams(max_new_tokens=10, greedy=True))
    assert out.lengths.tolist() == [MAX_LEN, 12] and out.tokens.shape == (2, MAX_LEN)
    assert not out.ended.any()


def test_padded_vocabulary_is_never_sampled(ps):
    m = tiny_model(3, make_vocab_size_divisible_by=8)  # 14 -> 16 rows
    assert m.output_layer.weight.shape[0] == 16
    with torch.no_grad():
        m.output_layer.weight[14:] = 5.0 * m.output_layer.weight[:2].abs().sum(0)  # huge padded logits
    for greedy in (True, False):
        out = _engine(m, ps).generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=greedy, seed=0))
        assert int(out.tokens.max()) < TOK.vocab_size


# -- errors ------------------------------------------------------------------------------


def test_errors(model, ps):
    engine = _engine(model, ps)
    sp = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"prompt 1 has {MAX_LEN + 2} tokens but max_seq_len is {MAX_LEN}"):
        engine.generate([[2, 3], [2] * (MAX_LEN + 2)], sp)
    with pytest.raises(ValueError, match="prompt 0 has 48 tokens"):
        engine.generate([[2] * MAX_LEN], sp)
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], sp)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[2], []], sp)
    with pytest.raises(ValueError, match="prompt 0 contains token id 99"):
        engine.generate([[2, 99]], sp)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        NativeEngine(model, pad_id=0, eos_id=1, max_seq_len=MAX_LEN).generate(
            [[2]], SamplingParams(stop_strings=("1",))
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.5),
        ("temperature", 0.0),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("greedy", 1),
        ("stop_token_ids", (1, -2)),
        ("stop_strings", ("",)),
        ("seed", "x"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"{field}="):
        SamplingParams(**{field: value})


# -- refit -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_refit_sees_new_weights(ps, backend):
    m = tiny_model(4)
    engine = _engine(m, ps, backend)
    assert isinstance(engine, GenerationEngine)
    sp = SamplingParams(max_new_tokens=12, greedy=True)
    before = engine.generate(PROMPTS, sp)
    with torch.no_grad():  # an optimizer step, in place
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    engine.refit(m)
    after = engine.generate(PROMPTS, sp)
    assert not torch.equal(before.tokens, after.tokens)
    assert torch.equal(after.tokens, _reference(m, PROMPTS, sp).tokens)
    other = tiny_model(5)  # a different module object
    engine.refit(other)
    assert engine.model is other
    assert torch.equal(engine.generate(PROMPTS, sp).tokens, _reference(other, PROMPTS, sp).tokens)


# -- decode loop: static step, cache reuse, early exit, threads ------------------------------


@pytest.mark.parametrize("greedy", [True, False])
def test_static_decode_step_equals_eager(model, ps, greedy):
    """The fixed-shape step (what a CUDA graph replays) computes what the eager step does."""
    sp = SamplingParams(max_new_tokens=20, greedy=greedy, seed=7)
    eager = _engine(model, ps, decode_step="eager").generate(PROMPTS, sp)
    static = _engine(model, ps, decode_step="static").generate(PROMPTS, sp)
    assert torch.equal(eager.tokens, static.tokens)
    torch.testing.assert_close(eager.logprobs, static.logprobs, atol=1e-5, rtol=0)
    if greedy:
        assert torch.equal(static.tokens, _reference(model, PROMPTS, sp).tokens)


needs_compile = pytest.mark.skipif(
    compile_available() is not None, reason=f"torch.compile unavailable: {compile_available()}"
)


@needs_compile
@pytest.mark.slow  # torch.compile builds C++ kernels: tens of seconds on a fresh machine
def test_compiled_decode_step_equals_eager(ps):
    """The compiled step (fixed shapes, attention as fused sums) computes what the eager step
    does: the same greedy tokens as the full recompute, the same samples, log-probs to fp32
    round-off; a second call with another batch size compiles again and is still right."""
    m = tiny_model(12, num_query_groups=2)
    engine = _engine(m, ps, decode_step="compiled")
    for greedy in (True, False):
        sp = SamplingParams(max_new_tokens=20, greedy=greedy, seed=3)
        eager = _engine(m, ps, decode_step="eager").generate(PROMPTS, sp)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed compile warns and falls back: fail instead
            out = engine.generate(PROMPTS, sp)
        assert torch.equal(out.tokens, eager.tokens)
        torch.testing.assert_close(out.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    assert engine._lean.max_len == MAX_LEN  # the capacity bucket, capped at max_seq_len
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    assert torch.equal(engine.generate(PROMPTS[:3], sp).tokens, _reference(m, PROMPTS[:3], sp).tokens)


@needs_compile
@pytest.mark.slow  # torch.compile builds C++ kernels: tens of seconds on a fresh machine
def test_compiled_step_grows_its_capacity_with_the_sequence(ps):
    """The compiled step attends over a capacity that doubles from ``bucket`` as positions
    fill (8, 16, 32, then max_len 48), each its own compile; at every position its logits are
    the eager step's, across every growth of the cache."""
    m = tiny_model(13, num_query_groups=2)
    b, n = 3, 5
    prompt = torch.randint(2, TOK.vocab_size, (b, n), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(2, TOK.vocab_size, (b, MAX_LEN - n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager, compiled = LeanDecoder(m, chunk=8), LeanDecoder(m, chunk=8)
        eager.begin(b, MAX_LEN)
        compiled.begin(b, MAX_LEN)
        step = CompiledDecodeStep(compiled, b, bucket=8)
        assert [step.capacity_for(p) for p in (0, 7, 8, 15, 16, 31, 32, 47)] == [8, 8, 16, 16, 32, 32, 48, 48]
        torch.testing.assert_close(compiled.prefill(prompt), eager.prefill(prompt), atol=1e-5, rtol=0)
        seen = []
        for i in range(MAX_LEN - n):
            tok = steps[:, i : i + 1]
            got = step(tok, n + i)
            seen.append(compiled.capacity)
            torch.testing.assert_close(got, eager.decode(tok, n + i), atol=1e-5, rtol=0)
        assert sorted(set(seen)) == [8, 16, 32, 48]
        with pytest.raises(ValueError, match="bucket=0"):
            CompiledDecodeStep(compiled, b, bucket=0)


@pytest.mark.parametrize(
    "arch",
    [dict(num_query_groups=2), dict(position_embedding="learned_absolute")],
    ids=["gqa", "learned_pos"],
)
def test_static_decode_step_on_other_architectures(ps, arch):
    m = tiny_model(8, **arch)
    sp = SamplingParams(max_new_tokens=12, greedy=True)
    out = _engine(m, ps, decode_step="static").generate(PROMPTS, sp)
    assert torch.equal(out.tokens, _reference(m, PROMPTS, sp).tokens)


def test_cache_is_kept_across_calls_and_grows(ps):
    """On a CPU the cache storage outlives a call (reused when large enough, grown when not),
    and what a call leaves in it never changes the next call's results."""
    m = tiny_model(9)
    engine = _engine(m, ps, eos_id=TOK.vocab_size + 5)
    sp = SamplingParams(max_new_tokens=30, greedy=True)  # the capacity grows past one chunk
    first = engine.generate(PROMPTS, sp)
    store = engine._lean._store
    assert store and engine._lean.layers == []  # weights unbound, storage kept
    again = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, greedy=True))
    assert engine._lean._store is store  # smaller request: same buffers
    assert again.responses() == [r[:8] for r in first.responses()[:2]]
    bigger = engine.generate(PROMPTS * 3, sp)
    assert engine._lean._store is not store  # more rows: a larger store replaced it
    assert torch.equal(bigger.tokens[: len(PROMPTS)], first.tokens)
    fresh = _engine(m, ps, eos_id=TOK.vocab_size + 5, keep_cache=False)
    out = fresh.generate(PROMPTS * 3, sp)
    assert fresh._lean._store == []  # released after the call
    assert torch.equal(out.tokens, bigger.tokens)


def test_loop_exits_when_every_row_has_stopped(model, ps):
    """Rows that stop end the loop early: no decode step runs after the last row's stop."""
    prompts = [[2, 3, 4], [5, 6, 7], [8, 9, 10]]  # equal lengths: all rows start sampling together
    engine = _engine(model, ps)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, greedy=True))  # builds the decoder
    calls = []
    decode = engine._lean.decode
    engine._lean.decode = lambda *a: calls.append(a) or decode(*a)
    every_token_stops = tuple(range(TOK.vocab_size))
    out = engine.generate(
        prompts, SamplingParams(max_new_tokens=20, stop_token_ids=every_token_stops, seed=0)
    )
    assert out.response_lengths.tolist() == [1, 1, 1] and out.ended.all()
    assert calls == []  # stopped after the first sampled token: no decode step
    out = engine.generate(prompts, SamplingParams(max_new_tokens=20, greedy=True))
    n = out.response_lengths.tolist()
    assert out.ended.all() and max(n) < 20  # every row ends on eos before max_new_tokens
    assert len(calls) == max(n) - 1  # a decode step for each token after the first, then stop


def test_num_threads_applies_to_generation_only(model, ps):
    before = torch.get_num_threads()
    seen = []
    engine = _engine(model, ps, num_threads=before + 1)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, greedy=True))
    decode = engine._lean.decode
    engine._lean.decode = lambda *a: seen.append(torch.get_num_threads()) or decode(*a)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, greedy=True))
    assert seen and set(seen) == {before + 1}
    assert torch.get_num_threads() == before
    assert torch.equal(
        out.tokens, _engine(model, ps).generate(PROMPTS, SamplingParams(max_new_tokens=4, greedy=True)).tokens
    )


# Megatron's local-spec norms may keep fp32 weights in a bf16 model; torch warns on every such call.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize(
    "decode_step", ["eager", "static", pytest.param("compiled", marks=[needs_compile, pytest.mark.slow])]
)
def test_bf16_greedy_follows_the_bf16_recompute(ps, decode_step):
    """bf16 greedy decoding with the cache picks the argmax of the bf16 full forward at every
    step, up to near ties (cache and full forward add in different orders)."""
    torch.manual_seed(10)
    m = build_policy(tiny_cfg(num_query_groups=2), params_dtype=torch.bfloat16)
    sp = SamplingParams(max_new_tokens=16, greedy=True)
    out = _engine(m, ps, decode_step=decode_step).generate(PROMPTS, sp)
    ref = _reference(m, PROMPTS, sp)
    logits = _full_logits(m, out.tokens)
    same = 0
    for i, p in enumerate(PROMPTS):
        ours, theirs = out.responses()[i], ref.responses()[i]
        for t, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:  # a near tie under the recompute's own logits at that position
                row = logits[i, len(p) - 1 + t]
                assert float(row.max() - row[a]) < 0.1, (i, t, float(row.max() - row[a]))
                break
            same += 1
    assert same >= 0.75 * sum(len(r) for r in ref.responses())


def test_decode_step_errors(model, ps):
    with pytest.raises(ValueError, match="decode_step='fast'"):
        _engine(model, ps, decode_step="fast")
    with pytest.raises(ValueError, match="num_threads=0"):
        _engine(model, ps, num_threads=0)
    if compile_available() is not None:
        with pytest.raises(ValueError, match="decode_step='compiled' is not available"):
            _engine(model, ps, decode_step="compiled").generate(PROMPTS, SamplingParams(max_new_tokens=2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="decode_step='graph' needs a CUDA device"):
            _engine(model, ps, decode_step="graph").generate(PROMPTS, SamplingParams(max_new_tokens=2))


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(ps):
    torch.manual_seed(11)
    m = build_policy(tiny_cfg(num_query_groups=2)).cuda()
    sp = SamplingParams(max_new_tokens=20, greedy=True)
    eager = _engine(m, ps, decode_step="eager").generate(PROMPTS, sp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns and falls back: fail instead
        graph = _engine(m, ps, decode_step="graph").generate(PROMPTS, sp)
    assert torch.equal(eager.tokens, graph.tokens)
    torch.testing.assert_close(eager.logprobs, graph.logprobs, atol=1e-4, rtol=0)
