"""Ragged batches in the native engine (single process): prompts of very mixed lengths,
prefilled in one forward, every row generating from the first step, stopped rows compacted
out of the batch. Every result must equal decoding each prompt alone and the full-recompute
reference, greedy and sampled; the lean decoder's per-row positions must give the full
forward's logits. Tolerances as in ``test_generation.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _generation_parts import MAX_LEN, TOK, tiny_cfg, tiny_model
from _generation_parts import engine as _engine

from aligner import distributed
from aligner.generation import SamplingParams, generate_no_cache
from aligner.generation import steppers as steppers_mod
from aligner.generation.decoder import LeanDecoder, attention_spans
from aligner.generation.steppers import LeanStepper
from aligner.models.config import ModelConfig
from aligner.models.forward import policy_logits, set_forward
from aligner.models.fused import compile_available
from aligner.models.gpt import build_policy

warnings.filterwarnings("ignore", category=UserWarning)

LOGIT_TOL = 3e-5
BF16_LOGPROB_TOL = 0.15
NEW = 12


def _mixed(n: int = 40, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of lengths 1..n in a shuffled order: with ``MAX_LEN`` 48 and ``NEW`` 12,
    the longest ones run into max_seq_len before max_new_tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = (torch.randperm(n, generator=g) + 1).tolist()
    return [torch.randint(2, TOK.vocab_size, (p,), generator=g).tolist() for p in lens]


MIXED = _mixed()


def _cfg(**kw) -> ModelConfig:
    return tiny_cfg(**{"num_query_groups": 2, **kw})


@pytest.fixture(scope="module")
def ps():
    state = distributed.initialize(distributed.ParallelConfig(), seed=1234)
    yield state
    distributed.destroy()


def _model(seed: int = 0, **kw):
    return tiny_model(seed, **{"num_query_groups": 2, **kw})


@pytest.fixture(scope="module")
def model(ps):
    return _model(20)


def _reference(model, prompts, sampling, eos_id):
    return generate_no_cache(
        model, prompts, sampling, pad_id=TOK.pad_id, eos_id=eos_id, max_seq_len=MAX_LEN, tokenizer=TOK
    )


@pytest.fixture(scope="module")
def eos(model, ps):
    """A token the model emits at a rate that ends some greedy responses early and leaves
    others running to max_new_tokens or max_seq_len."""
    out = _engine(model, ps, eos_id=TOK.vocab_size + 5).generate(
        MIXED, SamplingParams(max_new_tokens=NEW, seed=1)
    )
    resp = torch.cat([torch.tensor(r) for r in out.responses()])
    for tok in torch.bincount(resp).argsort(descending=True).tolist():
        greedy = _engine(model, ps, eos_id=tok).generate(
            MIXED, SamplingParams(max_new_tokens=NEW, greedy=True)
        )
        if _stops_are_mixed(greedy):
            return tok
    raise AssertionError("no token gives mixed stops")


def _same(a, b, tol=1e-5):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.ended, b.ended)
    assert torch.equal(a.prompt_lengths, b.prompt_lengths)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=tol, rtol=0)


def _stops_are_mixed(out) -> bool:
    """Some rows ended on eos before max_new_tokens, some ran to max_new_tokens, some into
    max_seq_len."""
    n = out.response_lengths
    return bool(
        (out.ended & (n < NEW)).any() and (~out.ended & (n == NEW)).any() and (out.lengths == MAX_LEN).any()
    )


# -- the engine on mixed lengths ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["lean", "megatron"])
def test_mixed_lengths_greedy_equal_recompute_and_each_prompt_alone(model, ps, eos, backend):
    sp = SamplingParams(max_new_tokens=NEW, greedy=True)
    engine = _engine(model, ps, backend, eos_id=eos)
    out = engine.generate(MIXED, sp)
    _same(out, _reference(model, MIXED, sp, eos))
    assert _stops_are_mixed(out)
    for i in range(0, len(MIXED), 7):
        alone = engine.generate([MIXED[i]], sp)
        n = int(alone.lengths[0])
        assert alone.tokens[0].tolist() == out.tokens[i, :n].tolist() and int(out.lengths[i]) == n
        torch.testing.assert_close(alone.logprobs[0, : n - 1], out.logprobs[i, : n - 1], atol=1e-5, rtol=0)


def test_mixed_lengths_sampled_equal_recompute_and_megatron(model, ps, eos):
    """Every engine draws prompt i's token k with the same random number, so sampled outputs
    agree token for token across backends and with the full recompute."""
    sp = SamplingParams(max_new_tokens=NEW, top_k=6, top_p=0.95, temperature=0.8, seed=3)
    lean = _engine(model, ps, eos_id=eos).generate(MIXED, sp)
    assert _stops_are_mixed(lean)
    _same(lean, _engine(model, ps, "megatron", eos_id=eos).generate(MIXED, sp))
    _same(lean, _reference(model, MIXED, sp, eos))


def test_a_row_samples_the_same_whatever_the_other_prompts(model, ps, eos):
    """What a row samples depends on the seed, its index and the batch size, not on the other
    prompts (their lengths decide when rows start, stop and leave the batch)."""
    sp = SamplingParams(max_new_tokens=NEW, temperature=1.2, seed=8)
    engine = _engine(model, ps, eos_id=eos)
    a = engine.generate(MIXED[:10], sp)
    others = _mixed(10, seed=5)
    b = engine.generate([MIXED[0]] + others[1:6] + [MIXED[6]] + others[7:], sp)
    for i in (0, 6):
        assert a.responses()[i] == b.responses()[i]
    assert a.responses() != b.responses()


@pytest.mark.parametrize("backend", ["lean", "megatron"])
def test_stop_strings_on_mixed_lengths(model, ps, eos, backend):
    engine = _engine(model, ps, backend, eos_id=TOK.vocab_size + 5)
    full = engine.generate(MIXED, SamplingParams(max_new_tokens=NEW, greedy=True))
    # A character in about half the responses: some are cut, some are not.
    rows_with = torch.zeros(TOK.vocab_size)
    for r in full.responses():
        rows_with[sorted(set(r))] += 1
    rows_with[:2] = float("inf")  # pad and eos decode to nothing
    stop = TOK.decode([int((rows_with - len(MIXED) / 2).abs().argmin())])
    sp = SamplingParams(max_new_tokens=NEW, greedy=True, stop_strings=(stop,))
    out = engine.generate(MIXED, sp)
    assert torch.equal(out.tokens, _reference(model, MIXED, sp, TOK.vocab_size + 5).tokens)
    cut = 0
    for r_full, r_cut, ended in zip(full.responses(), out.responses(), out.ended.tolist()):
        assert r_full[: len(r_cut)] == r_cut
        if stop in TOK.decode(r_full):
            cut += 1
            assert ended and TOK.decode(r_cut).endswith(stop) and stop not in TOK.decode(r_cut[:-1])
        else:
            assert r_cut == r_full and not ended
    assert 5 <= cut <= len(MIXED) - 5


def _spy_compact(monkeypatch):
    """Record the batch size after every compaction, and the decoder's copies of the cache."""
    sizes, copies = [], []
    compact, lean_compact = LeanStepper.compact, LeanDecoder.compact

    def spy(self, index, keep):
        sizes.append(len(keep))
        return compact(self, index, keep)

    def spy_lean(self, index):
        copies.append(int(index.numel()))
        return lean_compact(self, index)

    monkeypatch.setattr(LeanStepper, "compact", spy)
    monkeypatch.setattr(LeanDecoder, "compact", spy_lean)
    return sizes, copies


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_stopped_rows_leave_the_batch_and_change_nothing(model, ps, eos, monkeypatch, decode_step):
    """Rows that stop leave the batch (eager: every time one stops, no copy of the cache;
    fixed shapes: powers of two, halving, the cache gathered each time), and the outputs are
    those of a run that never compacts."""
    sp = SamplingParams(max_new_tokens=NEW, top_k=5, seed=4)
    monkeypatch.setattr(LeanStepper, "rows_after", lambda self, live: None)  # never
    kept = _engine(model, ps, eos_id=eos, decode_step="eager").generate(MIXED, sp)
    monkeypatch.undo()
    sizes, copies = _spy_compact(monkeypatch)
    out = _engine(model, ps, eos_id=eos, decode_step=decode_step).generate(MIXED, sp)
    _same(out, kept)
    assert sizes and sizes == sorted(sizes, reverse=True) and sizes[-1] < len(MIXED) // 2
    if decode_step == "static":
        assert all(s & (s - 1) == 0 for s in sizes) and all(a == 2 * b for a, b in zip(sizes, sizes[1:]))
        assert copies == sizes
    else:
        assert len(sizes) >= 5 and len(copies) < len(sizes) / 2


def test_eager_gathers_rows_when_gaps_cut_too_many_spans(model, ps, eos, monkeypatch):
    """With at most 3 attention spans allowed, the gaps stopped rows leave force the eager
    step to gather the live rows' cache together, and nothing changes."""
    from aligner.generation import decoder as decoder_mod

    sp = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=2)
    base = _engine(model, ps, eos_id=eos).generate(MIXED, sp)
    spans = decoder_mod.attention_spans
    monkeypatch.setattr(
        steppers_mod, "attention_spans", lambda ends, rows=None: spans(ends, rows, max_spans=3)
    )
    _, copies = _spy_compact(monkeypatch)
    _same(_engine(model, ps, eos_id=eos).generate(MIXED, sp), base)
    assert len(copies) >= 2


needs_compile = pytest.mark.skipif(
    compile_available() is not None, reason=f"torch.compile unavailable: {compile_available()}"
)


@pytest.mark.parametrize(
    "decode_step", ["static", pytest.param("compiled", marks=[needs_compile, pytest.mark.slow])]
)
def test_fixed_shape_steps_equal_eager_on_mixed_lengths(model, ps, eos, decode_step):
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=6)
    eager = _engine(model, ps, eos_id=eos, decode_step="eager").generate(MIXED[:16], sp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed compile warns and falls back: fail instead
        other = _engine(model, ps, eos_id=eos, decode_step=decode_step).generate(MIXED[:16], sp)
    _same(other, eager)


def test_prefill_in_several_forwards(model, ps, eos, monkeypatch):
    """A batch over the prefill's token budget is prefilled in several forwards of whole rows."""
    sp = SamplingParams(max_new_tokens=NEW, greedy=True)
    one = _engine(model, ps, eos_id=eos).generate(MIXED, sp)
    calls = []
    prefill = LeanDecoder.prefill
    monkeypatch.setattr(
        LeanDecoder, "prefill", lambda self, *a, **k: calls.append(a[1]) or prefill(self, *a, **k)
    )
    monkeypatch.setattr(steppers_mod, "PREFILL_TOKENS", 100)
    several = _engine(model, ps, eos_id=eos).generate(MIXED, sp)
    _same(several, one)
    assert len(calls) > 5 and all(sum(c) <= 100 or len(c) == 1 for c in calls)
    assert sorted(p for c in calls for p in c) == sorted(len(p) for p in MIXED)


# Megatron's local-spec norms keep fp32 weights in a bf16 model; torch warns on every such call.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_bf16_mixed_lengths_logprobs_match_the_bf16_training_forward(ps):
    torch.manual_seed(21)
    m = build_policy(_cfg(), params_dtype=torch.bfloat16)
    out = _engine(m, ps, eos_id=TOK.vocab_size + 5).generate(
        MIXED, SamplingParams(max_new_tokens=NEW, seed=0)
    )
    for training_forward in ("megatron", "fused"):
        set_forward(m, training_forward)
        with torch.no_grad():
            logits = policy_logits(m.eval(), out.tokens).float()
        logp = torch.log_softmax(logits, dim=-1)
        expect = logp[:, :-1].gather(-1, out.tokens[:, 1:].unsqueeze(-1)).squeeze(-1) * out.response_mask()
        torch.testing.assert_close(out.logprobs, expect, atol=BF16_LOGPROB_TOL, rtol=0)
    set_forward(m, "megatron")


# -- the decoder's per-row positions -----------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize(
    "arch",
    [dict(), dict(position_embedding="learned_absolute", qk_layernorm=True)],
    ids=["rope", "learned_qk"],
)
def test_ragged_prefill_and_decode_equal_the_full_forward(ps, static, arch):
    """Rows of prompt lengths 9, 1, 17, 4, 9 (not sorted: equal lengths apart), each then
    teacher-forced one position per step at its own position: every step's logits equal the
    full forward's at that row and position, through one span or one span per row (masked).
    Halfway, rows 1 and 4 stop: the eager step leaves them out of its batch (their cache rows
    unread, the others' written in place), the fixed-shape one gathers rows 0, 2, 3 (and a
    repeat of row 3, filling a batch of 4) into the front of the cache."""
    m = _model(22, **arch).eval()
    lens = [9, 1, 17, 4, 9]
    b, n = len(lens), 40
    tokens = torch.randint(2, TOK.vocab_size, (b, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = policy_logits(m, tokens).float()  # causal: position t sees tokens[:, :t+1] only
    rows, cache_rows = list(range(b)), None
    with torch.inference_mode():
        lean = LeanDecoder(m, keep_cache=False, chunk=8)
        lean.begin(b, MAX_LEN)
        got = lean.prefill(tokens[:, : max(lens)], lens)
        torch.testing.assert_close(got, full[torch.arange(b), torch.tensor(lens) - 1], atol=LOGIT_TOL, rtol=0)
        for s in range(20):
            if s == 8:
                rows = [0, 2, 3, 3] if static else [0, 2, 3]
                if static:
                    lean.compact(torch.tensor(rows))
                else:
                    cache_rows = rows
            at = [lens[i] + s for i in rows]
            tok = tokens[rows, at].unsqueeze(1)
            pos = torch.tensor(at)
            if static:
                got = lean.decode_static(tok, pos)
            elif cache_rows is None:
                got = lean.decode(
                    tok, pos, attention_spans([p + 1 for p in at], ratio=1.0) if s % 2 else None
                )
            else:
                spans = attention_spans([p + 1 for p in at], cache_rows, ratio=0.0 if s % 2 else 1.0)
                assert len(spans) == (2 if s % 2 else 3)  # the gap between cache rows 0 and 2 cuts
                got = lean.decode(tok, pos, spans, torch.tensor(cache_rows))
            torch.testing.assert_close(got, full[rows, at], atol=LOGIT_TOL, rtol=0)
        lean.end()


def test_attention_spans():
    ends = [40, 39, 31, 30, 29, 12, 12, 5, 1]
    spans = attention_spans(ends, ratio=0.75)
    assert spans == [
        (0, 4, 0, 40, True),
        (4, 5, 4, 29, False),
        (5, 7, 5, 12, False),
        (7, 8, 7, 5, False),
        (8, 9, 8, 1, False),
    ]
    capped = attention_spans(ends, ratio=0.75, max_spans=2)
    assert capped == [(0, 4, 0, 40, True), (4, 9, 4, 29, True)]
    assert attention_spans([7] * 5) == [(0, 5, 0, 7, False)]
    # Cache rows with gaps: a gap always ends a span; too many gaps for max_spans: None.
    rows = [0, 1, 2, 5, 6, 9, 10, 11, 12]
    assert attention_spans(ends, rows, ratio=0.0) == [
        (0, 3, 0, 40, True),
        (3, 5, 5, 30, True),
        (5, 9, 9, 12, True),
    ]
    assert attention_spans(ends, rows, ratio=0.0, max_spans=3) is not None
    assert attention_spans(ends, rows, ratio=0.0, max_spans=2) is None
    for order in ([3, 9, 1, 9, 4], list(range(1, 30))):  # any order: spans cover every row's range
        spans = attention_spans(order, ratio=0.5)
        assert [r for s in spans for r in range(s[0], s[1])] == list(range(len(order)))
        assert all(order[r] <= end for r0, r1, _, end, _ in spans for r in range(r0, r1))


class _CpuGraph:
    """Stands in for :class:`~aligner.generation.decode_steps.CudaGraphDecodeStep` on a CPU: the
    same static buffers and warm-up runs (which write each row's next slot before the
    "capture"), then :meth:`LeanDecoder.decode_static` per replay."""

    captured: list[int] = []

    def __init__(self, lean, pos, pool=None):
        lean.reserve(lean.max_len)
        self.lean, self.batch = lean, int(pos.numel())
        self.tokens = torch.zeros(self.batch, 1, dtype=torch.int64)
        self.pos = pos.clone()
        for _ in range(2):
            lean.decode_static(self.tokens, self.pos)
        _CpuGraph.captured.append(self.batch)

    def __call__(self, tokens, pos):
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        return self.lean.decode_static(self.tokens, self.pos)


def test_graph_mode_recaptures_per_batch_size(model, ps, eos, monkeypatch):
    """The graph mode's bookkeeping, on a CPU: a capture after the prefill and after every
    halving of the batch, at the positions the next step writes (the warm-up runs' writes are
    overwritten), and the eager step's outputs."""
    sp = SamplingParams(max_new_tokens=NEW, top_p=0.9, seed=9)
    eager = _engine(model, ps, eos_id=eos).generate(MIXED, sp)
    monkeypatch.setattr(steppers_mod, "CudaGraphDecodeStep", _CpuGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    engine = _engine(model, ps, eos_id=eos)
    monkeypatch.setattr(engine, "_lean_decode_step", lambda: "graph")
    _CpuGraph.captured = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns and falls back: fail instead
        _same(engine.generate(MIXED, sp), eager)
    sizes = _CpuGraph.captured
    assert sizes[0] == len(MIXED) and len(sizes) >= 2
    assert all(s & (s - 1) == 0 and 2 * s <= a for a, s in zip(sizes, sizes[1:]))
