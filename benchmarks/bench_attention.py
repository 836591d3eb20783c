"""Attention on a CPU: SDPA (``aligner.models.attention``, what the fused forward and the lean
decoder run) against Megatron's arithmetic (scores materialised with ``baddbmm``, an fp32
softmax, ``bmm``; keys and values repeated for grouped-query attention), inside the real
forwards: the fused forward and backward, the fused no-grad forward, and a generation call
of the lean decoder (prefill, then one decode step per position, eager).

    .venv/bin/python benchmarks/bench_attention.py [--dtype bf16] [--batch 16] [--seq 208]

Both variants run interleaved, round by round, on the same model; medians in ms. Prints one
JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner import distributed  # noqa: E402
from aligner.generation import decoder  # noqa: E402
from aligner.models import attention, fused  # noqa: E402
from aligner.models.config import ModelConfig  # noqa: E402
from aligner.models.gpt import build_policy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _scores_attention(q, k, v, scale, mask):
    """Megatron's DotProductAttention: ``q`` ``[b, h, m, d]``, ``k``, ``v`` ``[b, g, t, d]``
    repeated to ``h`` heads, scores ``[b, h, m, t]`` in the model dtype, fp32 softmax."""
    b, h, m, d = q.shape
    t, r = k.shape[2], h // k.shape[1]
    k = k.repeat_interleave(r, 1).reshape(b * h, t, d)
    v = v.repeat_interleave(r, 1).reshape(b * h, t, d)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(zero, q.reshape(b * h, m, d), k.transpose(1, 2), beta=0.0, alpha=scale)
    scores = scores.view(b, h, m, t).float()
    if mask is not None:
        scores = scores.masked_fill(~mask if mask.dtype == torch.bool else mask.isinf(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b * h, m, t)
    return torch.bmm(probs, v).view(b, h, m, d)


def _causal(q, k, v, scale):
    n = q.shape[2]
    return _scores_attention(q, k, v, scale, torch.ones(n, n, dtype=torch.bool, device=q.device).tril())


def _grouped(q, k, v, scale, mask=None):
    return _scores_attention(q, k, v, scale, mask)


def _use(kind: str) -> None:
    """Point the fused forward and the decoder at ``sdpa`` or ``scores`` attention."""
    causal, grouped = (
        (attention.causal_attention, attention.grouped_attention) if kind == "sdpa" else (_causal, _grouped)
    )
    for mod in (fused, decoder):
        mod.causal_attention, mod.grouped_attention = causal, grouped


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=208)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    state = distributed.initialize(distributed.ParallelConfig(), seed=0)
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    model = build_policy(cfg, params_dtype=DTYPES[args.dtype])
    fast = fused.FusedForward(model)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    lean = decoder.LeanDecoder(model)
    prompt = max(1, args.seq // 8)

    def train():
        model.zero_grad(set_to_none=True)
        fast(tokens).float().logsumexp(-1).mean().backward()

    def score():
        with torch.no_grad():
            fast(tokens)

    def generate():
        with torch.inference_mode():
            lean.begin(args.batch, args.seq)
            lean.prefill(tokens[:, :prompt])
            for pos in range(prompt, args.seq):
                lean.decode(tokens[:, pos : pos + 1], pos)
            lean.end()

    times: dict[str, list[float]] = {}
    for rnd in range(args.repeats + 1):  # round 0 warms up
        for kind in ("sdpa", "scores"):
            _use(kind)
            for name, fn in (("fwd_bwd", train), ("no_grad_fwd", score), ("generate", generate)):
                t = time.perf_counter()
                fn()
                if rnd:
                    times.setdefault(f"{name}_ms/{kind}", []).append(1e3 * (time.perf_counter() - t))
    _use("sdpa")
    distributed.destroy()
    result = {k: round(statistics.median(v), 2) for k, v in sorted(times.items())}
    result.update(vars(args), device=str(state.device))
    print(json.dumps(result, indent=2))
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    return result


if __name__ == "__main__":
    main()
