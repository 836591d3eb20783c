"""Packed sequences (``aligner.models.packing``) and the packed forwards of
``aligner.models.forward``.

- The layout: tokens, bounds, positions, and the way back to padded rows (plain and shifted).
- The micro-batch plan: contiguous runs in order, under a token budget and a row cap.
- The packed forwards against the padded ones at every real position: logits, values, scores
  and every parameter's gradient, fused (varlen attention) and Megatron (unpacked into padded
  rows of the micro-batch), Llama-style, grouped-query, GPT-2-style (learned positions) and
  Qwen3-style models, fp32 to 1e-5 and bf16 (measured on a CPU, torch 2.13, all of these cases:
  fp32 outputs at most 1.6e-6 apart, gradients within 7.1e-7 of the padded ones, relative in
  norm; bf16 fused 0.023 and 8.8e-3); the last layer from a start position; TP=2.
- No attention across rows: a row's outputs do not move when the rows packed with it change,
  and an attention that crosses rows is caught.
- The varlen flash kernel's glue (layout, GQA, both signatures of ``varlen_attn``), against a
  reference kernel on the CPU: the GPU itself runs it in ``pytest -m gpu``.
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
from aligner.models import attention, forward, fused, gpt, lora
from aligner.models.config import ModelConfig
from aligner.models.packing import pack, plan_micro_batches

S = 19
TOKENS = torch.randint(0, 40, (4, S), generator=torch.Generator().manual_seed(0))
LENGTHS = torch.tensor([5, 19, 1, 11])
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 0.125}
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
    torch.manual_seed(0)
    model = HEADS[head](_cfg(**ARCHS[arch]), params_dtype=dtype)
    with torch.no_grad():  # q/k norms away from 1, so a norm read from the wrong tensor shows
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _real(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """``[b, s]`` bool: the real positions."""
    return torch.arange(s)[None, :] < lengths[:, None]


@pytest.fixture(scope="module", autouse=True)
def _world():
    torch.set_num_threads(1)
    distributed.initialize()
    yield


# -- the layout -----------------------------------------------------------------------------


def test_pack_lays_the_rows_end_to_end():
    rows = pack(TOKENS, LENGTHS)
    assert rows.tokens.shape == (1, 36) and rows.total == 36 and rows.rows == 4 and rows.max_len == 19
    want = torch.cat([TOKENS[i, :n] for i, n in enumerate(LENGTHS.tolist())])
    assert torch.equal(rows.tokens[0], want)
    assert rows.cu_seqlens.dtype == torch.int32 and rows.cu_seqlens.tolist() == [0, 5, 24, 25, 36]
    assert rows.bounds == [0, 5, 24, 25, 36] and rows.lengths.dtype == torch.int64
    assert torch.equal(rows.position_ids[0], torch.cat([torch.arange(n) for n in LENGTHS.tolist()]))
    assert rows.last_positions().tolist() == [4, 23, 24, 35]
    # Back to padded rows: the real tokens where they were, the fill elsewhere.
    padded = rows.padded(pad_id=-1, s=S)
    assert torch.equal(padded[_real(LENGTHS, S)], TOKENS[_real(LENGTHS, S)])
    assert (padded[~_real(LENGTHS, S)] == -1).all()
    assert torch.equal(rows.repack(TOKENS), rows.tokens) and rows.padded().shape == (4, 19)


def test_unpack_and_unpack_shifted():
    """Per-position values go back to ``[b, s]``; next-token quantities to ``[b, s-1]``, each row's
    last position dropped; ``start`` takes the positions at or past it only; gradients flow."""
    rows = pack(TOKENS, LENGTHS)
    x = torch.arange(1.0, 37.0, requires_grad=True)
    xs = x.view(1, 36, 1).expand(1, 36, 3)  # a trailing dimension comes along
    out = rows.unpack(xs, S + 2, fill=-1.0)
    assert out.shape == (4, S + 2, 3)
    assert out[0, :5, 0].tolist() == [1, 2, 3, 4, 5] and out[0, 5, 0] == -1 and out[2, 0, 0] == 25
    shifted = rows.unpack_shifted(x.unsqueeze(0), S)
    assert shifted.shape == (4, S - 1)
    assert shifted[0].tolist() == [1, 2, 3, 4] + [0] * 14  # position 4 (the last) predicts nothing
    assert not shifted[2].any()  # a row of one token predicts nothing
    assert shifted[1].tolist() == list(range(6, 24))
    # The next tokens: each position's successor in its row (a placeholder at a row's end).
    want = torch.where(_real(LENGTHS - 1, S - 1), TOKENS[:, 1:], -1)
    assert torch.equal(rows.unpack_shifted(rows.next_tokens(), S, fill=-1), want)
    # From a start: the forwards then return only positions >= start.
    at = rows.positions_from(3)
    assert rows.positions_from(0) is None and rows.position_ids[0, at].min() == 3 and at.numel() == 2 + 16 + 8
    part = rows.unpack(x[at].unsqueeze(0), S, start=3)
    assert torch.equal(part[:, 3:], out[:, 3:S, 0].masked_fill(~_real(LENGTHS, S)[:, 3:], 0.0))
    assert not part[:, :3].any()
    part_shifted = rows.unpack_shifted(x[at].unsqueeze(0), S, start=3)
    assert torch.equal(part_shifted[:, 3:], shifted[:, 3:]) and not part_shifted[:, :3].any()
    shifted.sum().backward()
    assert x.grad.tolist() == [1.0 if p < n - 1 else 0.0 for n in LENGTHS.tolist() for p in range(n)]


def test_pack_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 19\]"):
        pack(TOKENS, torch.tensor([5, 20, 1, 1]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 19\]"):
        pack(TOKENS, torch.tensor([5, 0, 1, 1]))
    with pytest.raises(ValueError, match="expected 4, one per row"):
        pack(TOKENS, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="shorter than the longest packed row"):
        pack(TOKENS, LENGTHS).unpack(torch.zeros(1, 36), 10)


def test_plan_micro_batches():
    lengths = [5, 7, 3, 10, 2, 2, 9]
    plan = plan_micro_batches(lengths, 12)
    assert [p.tolist() for p in plan] == [[0, 1], [2], [3, 4], [5, 6]]
    assert all(p.dtype == torch.int64 for p in plan)
    # Contiguous, in order, every row once; within the budget, or alone when longer.
    assert torch.equal(torch.cat(plan), torch.arange(7))
    assert [p.tolist() for p in plan_micro_batches(torch.tensor([30, 4, 40, 1]), 12)] == [[0], [1], [2], [3]]
    assert [p.tolist() for p in plan_micro_batches(lengths, 100, max_rows=3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p.tolist() for p in plan_micro_batches(lengths, 100)] == [list(range(7))]
    assert plan_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="max_tokens=0"):
        plan_micro_batches(lengths, 0)


# -- packed forwards against padded ones ---------------------------------------------------


def _padded_out(model, head: str, tokens, lengths, start: int = 0) -> torch.Tensor:
    """The padded forward at the real positions (values: positions ``< length - 1`` that
    ``[b, s-1]`` holds; from ``start`` on with ``start``): ``[N, ...]`` in row order."""
    if head == "reward":
        return forward.sequence_scores(model, tokens, lengths)
    s = tokens.shape[1]
    if head == "lm":
        out = forward.policy_logits(model, tokens, start)  # [b, s - start, v]
        return out[_real(lengths, s)[:, start:]]
    out = forward.token_values(model, tokens, start)  # [b, s-1]
    keep = _real(lengths, s)[:, :-1] & (torch.arange(s - 1) >= start)
    return out[keep]


def _packed_out(model, head: str, tokens, lengths, start: int = 0) -> torch.Tensor:
    """The packed forward at the same positions, in the same order."""
    rows = pack(tokens, lengths)
    s = tokens.shape[1]
    if head == "reward":
        return forward.sequence_scores_packed(model, rows)
    if head == "lm":
        out = forward.policy_logits_packed(model, rows, start)  # [1, T', v]
        return rows.unpack(out, s, start=start)[_real(lengths, s) & (torch.arange(s) >= start)]
    out = forward.token_values_packed(model, rows, start)  # [1, T]
    assert not out[0, rows.position_ids[0] < start].any()
    keep = _real(lengths, s)[:, :-1] & (torch.arange(s - 1) >= start)
    return rows.unpack(out, s)[:, :-1][keep]


def _run(model, fn, head, tokens, lengths, start=0):
    model.zero_grad(set_to_none=True)
    out = fn(model, head, tokens, lengths, start)
    w = torch.linspace(0.5, 1.5, out.numel(), device=out.device).view_as(out)
    (out.float() * w).sum().backward()
    return out.detach().float(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _same_grads(got, want, tol, where=()):
    assert got.keys() == want.keys()
    for name in want:
        err = float((got[name] - want[name]).float().norm() / want[name].float().norm().clamp_min(1e-30))
        assert err < tol, (*where, f"{name}: relative gradient difference {err:.2e} >= {tol}")


def _compare_packed(model, head, dtype, tokens, lengths, start=0, where=()):
    """Packed against padded, each in the model's current forward mode."""
    out0, g0 = _run(model, _padded_out, head, tokens, lengths, start)
    out1, g1 = _run(model, _packed_out, head, tokens, lengths, start)
    torch.testing.assert_close(out1, out0, atol=OUT_TOL[dtype], rtol=0, msg=lambda m: f"{where}: {m}")
    _same_grads(g1, g0, GRAD_TOL[dtype], where)


@pytest.mark.parametrize("mode", ["fused", "megatron"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_equals_padded(head, arch, mode, device):
    model = _build(head, arch).to(device)
    forward.set_forward(model, mode)
    _compare_packed(model, head, torch.float32, TOKENS.to(device), LENGTHS, where=(head, arch, mode))


@pytest.mark.parametrize("head", ["lm", "value", "reward"])
def test_packed_equals_padded_bf16(head, device):
    model = _build(head, "gqa", torch.bfloat16).to(device)
    forward.set_forward(model, "fused")
    _compare_packed(model, head, torch.bfloat16, TOKENS.to(device), LENGTHS, where=(head, "bf16"))


@pytest.mark.parametrize("mode", ["fused", "megatron"])
def test_packed_with_lora_and_recompute(mode):
    """LoRA adapters (unmerged, their own arithmetic in the fused forward) and full activation
    recompute (each layer run again in the backward, with the rows' bounds) pack alike."""
    torch.manual_seed(0)
    model = gpt.build_policy(_cfg(**ARCHS["qwen3"], recompute="full"))
    lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8), seed=1)
    with torch.no_grad():  # B starts at 0: move it, so that every adapter matters
        for p in lora.lora_parameters(model).values():
            p.add_(0.1 * torch.randn_like(p))
    forward.set_forward(model, mode)
    _compare_packed(model, "lm", torch.float32, TOKENS, LENGTHS, where=("lora", mode))


@pytest.mark.parametrize("mode", ["fused", "megatron"])
@pytest.mark.parametrize("head", ["lm", "value"])
def test_packed_from_a_start(head, mode):
    """With ``start`` the packed forwards return (logits) or fill (values) only the positions at
    or past it in each row, as the padded ones do, gradients alike; a row shorter than the
    start contributes nothing."""
    model = _build(head, "qwen3")
    forward.set_forward(model, mode)
    _compare_packed(model, head, torch.float32, TOKENS, LENGTHS, start=6, where=(head, mode))
    if head == "lm":
        rows = pack(TOKENS, LENGTHS)
        assert forward.policy_logits_packed(model, rows, 6).shape == (1, 13 + 5, 40)


def test_the_packed_rope_tables_serve_longer_rows_later():
    """The fused forward keeps the longest RoPE tables it built: a batch of short rows after a
    long one reads the same entries as a forward of its own."""
    model = _build("value", "qwen3")
    forward.set_forward(model, "fused")
    short = pack(TOKENS[:, :6], torch.tensor([3, 6, 1, 2]))
    alone = forward.token_values_packed(model, short)
    forward.token_values_packed(model, pack(TOKENS, LENGTHS))  # tables for 19 positions
    assert torch.equal(forward.token_values_packed(model, short), alone)


@pytest.mark.skipif(fused.compile_available() is not None, reason=str(fused.compile_available()))
def test_compiled_mode_runs_packed_eagerly():
    """A compiled fused forward runs packed rows with the eager function: nothing compiles, the
    fused forward's numbers bit for bit."""
    model = _build("value", "gqa")
    forward.set_forward(model, "fused")
    want = forward.token_values_packed(model, pack(TOKENS, LENGTHS))
    assert forward.set_forward(model, "compiled") == ("compiled", None)
    before = dict(fused._COMPILED)  # earlier tests in this process may have compiled this spec
    assert torch.equal(forward.token_values_packed(model, pack(TOKENS, LENGTHS)), want)
    assert model.aligner_fused._packed_fn is not None
    assert dict(fused._COMPILED) == before, "the packed call compiled something"


# -- no attention across rows ------------------------------------------------------------------


@pytest.mark.parametrize("head", ["lm", "value"])
def test_a_rows_outputs_ignore_the_rows_packed_with_it(head, device):
    """Row 1's outputs are the same whatever rows come before and after it (other tokens, other
    lengths, none at all), to the GEMMs' round-off over another number of rows."""
    model = _build(head, "gqa").to(device)
    forward.set_forward(model, "fused")
    fn = forward.policy_logits_packed if head == "lm" else forward.token_values_packed
    row = TOKENS[1:2].to(device)

    def row_out(before: torch.Tensor, after: torch.Tensor, lb: int, la: int) -> torch.Tensor:
        tokens = torch.cat([before, row, after]).to(device)
        rows = pack(tokens, torch.tensor([lb, S, la]))
        with torch.no_grad():
            return fn(model, rows)[0, lb : lb + S]

    gen = torch.Generator().manual_seed(3)
    alone = fn(model, pack(row, torch.tensor([S]))).detach()[0]
    for lb, la in ((19, 19), (1, 7), (12, 2)):
        before, after = (torch.randint(0, 40, (1, S), generator=gen).to(device) for _ in range(2))
        torch.testing.assert_close(row_out(before, after, lb, la), alone, atol=1e-6, rtol=0)


def test_attention_across_rows_is_caught(monkeypatch):
    """The comparison can fail: a packed attention that is causal over the whole packed sequence
    (rows see the rows before them) is far outside the tolerance."""
    model = _build("value", "gqa")
    forward.set_forward(model, "fused")
    want = _padded_out(model, "value", TOKENS, LENGTHS)

    def across(q, k, v, cu, bounds, max_len, scale):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    monkeypatch.setattr(fused, "varlen_causal_attention", across)
    bad = _packed_out(model, "value", TOKENS, LENGTHS)
    assert float((bad - want).detach().abs().max()) > 100 * OUT_TOL[torch.float32]


# -- the varlen kernel's glue --------------------------------------------------------------


def _reference_varlen(with_window: bool, with_gqa: bool):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` (its documented semantics, one
    SDPA per row), with the older (``is_causal``) or newer (``window_size``) signature."""
    calls = []

    def core(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, causal, gqa):
        assert query.is_contiguous() and key.is_contiguous() and cu_seq_q.dtype == torch.int32 and causal
        assert gqa or key.shape[1] == query.shape[1]
        calls.append((tuple(query.shape), tuple(key.shape), gqa))
        bounds = cu_seq_q.tolist()
        out = [
            F.scaled_dot_product_attention(
                query[a:e].transpose(0, 1),
                key[a:e].transpose(0, 1),
                value[a:e].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            ).transpose(0, 1)
            for a, e in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(out)

    if with_window:

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
        ):
            return core(
                query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size == (-1, 0), enable_gqa
            )

    elif with_gqa:  # never made: an is_causal signature with enable_gqa, for the combination

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            is_causal=False,
            scale=None,
            enable_gqa=False,
        ):
            return core(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, enable_gqa)

    else:

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
            return core(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, False)

    return varlen_attn, calls


@pytest.mark.parametrize("with_window,with_gqa", [(True, True), (False, False), (False, True)])
def test_the_varlen_kernel_glue(monkeypatch, with_window, with_gqa):
    """Where the varlen kernel applies (a GPU, fp16/bf16) the fused forward hands it the packed
    queries, keys and values laid out as it takes them, tells it "causal" as its signature
    does, and without ``enable_gqa`` gives every query head its group's keys: the forward's
    outputs are the per-row loop's."""
    varlen_mod = pytest.importorskip("torch.nn.attention.varlen")
    varlen_attn, calls = _reference_varlen(with_window, with_gqa)

    monkeypatch.setattr(varlen_mod, "varlen_attn", varlen_attn)
    attention._varlen_api.cache_clear()
    model = _build("value", "gqa")
    forward.set_forward(model, "fused")
    rows = pack(TOKENS, LENGTHS)
    want = forward.token_values_packed(model, rows)
    assert not calls
    try:
        monkeypatch.setattr(attention, "_varlen_applies", lambda q: True)
        got = forward.token_values_packed(model, rows)
    finally:
        attention._varlen_api.cache_clear()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert calls == [((36, 4, 16), (36, 2 if with_gqa else 4, 16), with_gqa)] * 2  # two layers


def test_the_varlen_kernel_applies_on_gpus_in_half_precision_only():
    q = torch.zeros(3, 4, 16)
    assert not attention._varlen_applies(q) and not attention._varlen_applies(q.bfloat16())
    assert attention._varlen_kernel(q, q) is None


@pytest.mark.gpu
def test_varlen_flash_kernel_on_a_gpu():
    """On a GPU in bf16, the varlen flash kernel (where this torch has it) gives the per-row
    loop's attention."""
    if attention._varlen_api() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn with a scale")
    gen = torch.Generator().manual_seed(0)
    rows = pack(TOKENS, LENGTHS)
    q = torch.randn(rows.total, 4, 16, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(rows.total, 2, 16, generator=gen).cuda().bfloat16() for _ in range(2))
    cu = rows.cu_seqlens.cuda()
    got = attention.varlen_causal_attention(q, k, v, cu, rows.bounds, rows.max_len, 0.25)
    assert attention._varlen_kernel(q, k) is not None
    want = attention.varlen_causal_attention(
        q.float(), k.float(), v.float(), cu, rows.bounds, rows.max_len, 0.25
    )
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


# -- TP=2 ---------------------------------------------------------------------------------------


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
                for mode in ("fused", "megatron"):
                    forward.set_forward(model, mode, tensor_parallel_size=2)
                    _compare_packed(
                        model, head, torch.float32, TOKENS, LENGTHS, where=(head, arch, mode, rank)
                    )
    finally:
        distributed.destroy()


@pytest.mark.multiprocess
def test_tp2_packed_equals_padded():
    mp.spawn(_tp_worker, args=(distributed.free_port(),), nprocs=2, join=True)
