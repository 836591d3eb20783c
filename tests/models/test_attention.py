"""The attention the fused forward and the lean decoder share (``aligner.models.attention``),
against a plain float64 loop: causal, grouped-query (query head ``i`` reads group ``i // r``),
queries from a start position or one per sequence laid out by group, the layout back to
``[b, m, heads * d]``; and no ``[b, heads, n, n]`` tensor saved for the backward."""

from __future__ import annotations

import pytest
import torch

from aligner.models.attention import causal_attention, grouped_attention, heads_last, queries_by_group

B, N, D = 2, 11, 8


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first: int = 0) -> torch.Tensor:
    """``q`` ``[b, h, m, d]`` at positions ``first..first+m-1``, ``k``, ``v`` ``[b, g, n, d]`` ->
    ``[b, h, m, d]``: for each head and position, a float64 softmax over the keys it sees."""
    b, h, m, d = q.shape
    r = h // k.shape[1]
    out = torch.zeros(b, h, m, d, dtype=torch.float64)
    q, k, v = (t.double().cpu() for t in (q, k, v))
    for i in range(b):
        for j in range(h):
            for t in range(m):
                pos = first + t
                scores = (k[i, j // r, : pos + 1] @ q[i, j, t]) * scale  # [pos + 1]
                out[i, j, t] = torch.softmax(scores, dim=0) @ v[i, j // r, : pos + 1]
    return out


def _qkv(h: int, g: int, device, n: int = N, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, n, D, generator=gen)
    k, v = (torch.randn(B, g, n, D, generator=gen) for _ in range(2))
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("h,g", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_causal_attention_equals_the_loop(h, g, device):
    q, k, v = _qkv(h, g, device)
    got = causal_attention(q, k, v, 0.3)
    assert got.shape == (B, h, N, D)
    torch.testing.assert_close(got.double().cpu(), _naive(q, k, v, 0.3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("h,g", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_queries_by_group_from_a_start_and_one_per_sequence(h, g, device):
    """The fused forward's last layer: queries from position ``start`` on under those rows of
    the causal mask, or one query per sequence under its own row, each laid out as the rows of
    its group, give the full causal attention's rows there."""
    r = h // g
    q, k, v = _qkv(h, g, device, seed=1)
    full = _naive(q, k, v, 0.25)  # [b, h, n, d]
    allowed = torch.ones(N, N, dtype=torch.bool, device=device).tril()
    # [b, h, n, d] -> [b, n, g, r, d], the layout of the fused QKV projection's queries.
    by_position = q.view(B, g, r, N, D).permute(0, 3, 1, 2, 4)
    start = 4
    rows = queries_by_group(by_position[:, start:])  # [b, g, r * (n - start), d]
    assert rows.shape == (B, g, r * (N - start), D)
    ctx = grouped_attention(rows, k, v, 0.25, allowed[start:].repeat(r, 1))
    got = heads_last(ctx, h)  # [b, n - start, h * d]
    want = full[:, :, start:].transpose(1, 2).reshape(B, N - start, h * D)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=0)

    idx = torch.tensor([3, 10], device=device)
    at = torch.arange(B, device=device)
    ctx = grouped_attention(
        queries_by_group(by_position[at, idx].unsqueeze(1)), k, v, 0.25, allowed[idx].view(B, 1, 1, N)
    )
    want = full[at.cpu(), :, idx.cpu()].reshape(B, 1, h * D)  # [b, 1, h * d]
    torch.testing.assert_close(heads_last(ctx, h).double().cpu(), want, atol=1e-5, rtol=0)


def test_no_scores_are_saved_for_the_backward(device):
    """Only tensors of the inputs' size (and per-row statistics) are kept: never one of
    ``[b, heads, n, n]``, which Megatron's attention keeps (its probabilities). On a GPU in
    bf16, the precision flash attention takes."""
    n = 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(4, 2, device, n=n))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = causal_attention(q, k, v, 0.3)
    out.sum().backward()
    assert sizes and max(sizes) <= B * 4 * n * D < B * 4 * n * n
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
