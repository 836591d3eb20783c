"""Packed sequences on the critic server: padded against packed rows of mixed lengths.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py [--quick] [--rows 48]
        [--min-len 16] [--max-len 768] [--budget 8192] [--rounds 3] [--dtype fp32|bf16]

The server's own code (:class:`aligner.critic.value_update.ValueUpdate`, DP=1) on a tiny fused
critic (2 layers, hidden 64), on rows whose lengths are uniform in ``[--min-len, --max-len]``,
right-padded to the longest:

- ``infer`` and ``train`` (one critic_train step: one minibatch, one epoch, a response mask over
  each row's second half): real tokens per second, unpacked (``max_tokens_per_micro_batch:
  null``, the whole batch in one padded forward) and packed (``--budget`` tokens per
  micro-batch), interleaved round by round, the median round;
- the memory of one training micro-batch (forward and backward of the value loss): a packed one
  at the token budget against a padded one of a fixed row count (``budget / max-len`` rows,
  rounded up: as many rows as fit the budget if every row were the longest), over every
  micro-batch of the batch, the largest and the smallest, and the bytes per real token (the
  same memory holds about ``padded length / mean length`` times the real tokens packed); on a GPU ``torch.cuda.max_memory_allocated`` above
  what was allocated before, on a CPU the bytes the forward saves for the backward (the
  activations; what a CPU run's peak grows by), counted by ``saved_tensors_hooks``;
- the packed attention on a CPU: the per-row loop ``aligner.models.attention`` runs against one
  SDPA over the whole packed micro-batch under a block-diagonal causal mask.

``--quick``: 16 rows of 16..384 tokens, a 2048-token budget, 2 rounds (seconds). Prints one JSON
object and a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner import distributed  # noqa: E402
from aligner.critic.config import CriticServerConfig  # noqa: E402
from aligner.critic.value_update import ValueUpdate  # noqa: E402
from aligner.models import attention  # noqa: E402
from aligner.models.config import ModelConfig  # noqa: E402
from aligner.models.forward import set_forward, token_values, token_values_packed  # noqa: E402
from aligner.models.gpt import build_critic  # noqa: E402
from aligner.models.packing import pack, plan_micro_batches  # noqa: E402
from aligner.precision import make_optimizer  # noqa: E402
from aligner.rl import value_loss  # noqa: E402
from aligner.wire.protocol import TrainRequest  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 14}


def _batch(rows: int, lo: int, hi: int, seed: int = 0):
    """tokens ``[b, s]`` (``s`` the longest row), lengths ``[b]``, and a train request's arrays
    (returns, old values, a mask over each row's second half) ``[b, s-1]``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, rows).astype(np.int64)
    s = int(lengths.max())
    tokens = np.zeros((rows, s), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(2, MODEL["vocab_size"], n)
    t = np.arange(s - 1)[None, :]
    mask = ((t >= lengths[:, None] // 2) & (t < lengths[:, None] - 1)).astype(np.float32)
    returns = (rng.normal(size=(rows, s - 1)) * mask).astype(np.float32)
    old = (rng.normal(size=(rows, s - 1)) * 0.1 * mask).astype(np.float32)
    return tokens, lengths, returns, old, mask


def _update(budget: int | None, dtype: str, state, seed: int = 0) -> ValueUpdate:
    cfg = CriticServerConfig(precision=dtype, max_tokens_per_micro_batch=budget)
    cfg.optim.lr = 1e-4
    cfg.optim.reuse_infer_forward = False  # the train step's own forward is what is measured
    torch.manual_seed(seed)
    critic = build_critic(ModelConfig(**MODEL, max_seq_len=1024)).to(state.device)
    opt = make_optimizer(critic, **cfg.optim.adamw(), precision=dtype)
    set_forward(critic, "fused")
    return ValueUpdate(critic, opt, None, cfg, state)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _throughput(args, state) -> dict:
    tokens, lengths, returns, old, mask = _batch(args.rows, args.min_len, args.max_len)
    real = int(lengths.sum())
    updates = {"padded": _update(None, args.dtype, state), "packed": _update(args.budget, args.dtype, state)}
    times: dict[str, dict[str, list[float]]] = {k: {"infer": [], "train": []} for k in updates}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, upd in updates.items():
            _sync(state.device)
            t0 = time.perf_counter()
            upd.forward(tokens, lengths)
            _sync(state.device)
            t1 = time.perf_counter()
            upd.train_step(TrainRequest(tokens, lengths, returns, old, mask, r))
            _sync(state.device)
            t2 = time.perf_counter()
            if r:
                times[name]["infer"].append(t1 - t0)
                times[name]["train"].append(t2 - t1)
    out = {
        "rows": args.rows,
        "padded_length": int(tokens.shape[1]),
        "real_tokens": real,
        "padded_positions": int(tokens.size),
        "micro_batches": len(plan_micro_batches(lengths, args.budget)),
    }
    for name in updates:
        for what in ("infer", "train"):
            sec = statistics.median(times[name][what])
            out[f"{what}_{name}_ms"] = round(1000 * sec, 1)
            out[f"{what}_{name}_tokens_per_s"] = round(real / sec)
    for what in ("infer", "train"):
        out[f"{what}_speedup"] = round(out[f"{what}_padded_ms"] / out[f"{what}_packed_ms"], 2)
    return out


def _measure(fn, device: torch.device) -> int:
    """Bytes one training micro-batch holds: ``fn()`` returns the loss; measured through its
    backward (GPU: peak allocated above the start) or as the bytes saved for the backward (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    saved: dict[int, int] = {}  # storage -> its bytes: views of one storage (rows, heads) count once

    def keep(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = fn()
    loss.backward()
    return sum(saved.values())


def _memory(args, state) -> dict:
    tokens, lengths, returns, old, mask = _batch(args.rows, args.min_len, args.max_len)
    upd = _update(None, args.dtype, state)
    dev = state.device
    t, ret, o, m = (torch.from_numpy(a).to(dev) for a in (tokens, returns, old, mask))
    s = tokens.shape[1]
    per_rows = math.ceil(args.budget / args.max_len)

    def padded(idx):
        return value_loss(token_values(upd.critic, t[idx]), o[idx], ret[idx], m[idx], agg="token_mean")[0]

    def packed(idx):
        rows = pack(t[idx], lengths[idx.numpy()])
        values = rows.unpack(token_values_packed(upd.critic, rows), s)[:, :-1]
        return value_loss(values, o[idx], ret[idx], m[idx], agg="token_mean")[0]

    fixed_rows = [torch.arange(a, min(a + per_rows, args.rows)) for a in range(0, args.rows, per_rows)]
    budgeted = plan_micro_batches(lengths, args.budget)
    real = int(lengths.sum())
    pad_bytes = [_measure(lambda i=i: padded(i), dev) for i in fixed_rows]
    pack_bytes = [_measure(lambda i=i: packed(i), dev) for i in budgeted]
    upd.optimizer.zero_grad(set_to_none=True)
    how = "peak_allocated" if dev.type == "cuda" else "saved_for_backward"
    return {
        "memory_measure": how,
        "padded_rows_per_micro_batch": per_rows,
        "padded_micro_batches": len(fixed_rows),
        "padded_micro_batch_max_mib": round(max(pad_bytes) / 2**20, 1),
        "padded_micro_batch_min_mib": round(min(pad_bytes) / 2**20, 1),
        "packed_micro_batches": len(budgeted),
        "packed_micro_batch_max_mib": round(max(pack_bytes) / 2**20, 1),
        "packed_micro_batch_min_mib": round(min(pack_bytes) / 2**20, 1),
        # What the memory buys: real tokens per micro-batch, and bytes per real token overall.
        "padded_real_tokens_per_micro_batch": round(real / len(fixed_rows)),
        "packed_real_tokens_per_micro_batch": round(real / len(budgeted)),
        "padded_kib_per_real_token": round(sum(pad_bytes) / real / 1024, 1),
        "packed_kib_per_real_token": round(sum(pack_bytes) / real / 1024, 1),
    }


def _attention(args) -> dict:
    """The per-row loop against one SDPA under a block-diagonal mask, on one micro-batch of
    about ``--budget`` tokens, 4 heads of 16 (the model's), CPU."""
    tokens, lengths, *_ = _batch(args.rows, args.min_len, args.max_len)
    first = plan_micro_batches(lengths, args.budget)[0]
    bounds = [0, *np.cumsum(lengths[first.numpy()]).tolist()]
    n = bounds[-1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 16, generator=gen) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    mask = attention.block_causal_mask(bounds)

    def loop():
        return attention.varlen_causal_attention(q, k, v, cu, bounds, int(lengths.max()), 0.25)

    def block():
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.25)[0].transpose(0, 1)

    torch.testing.assert_close(loop(), block(), atol=1e-5, rtol=0)
    out = {"attention_tokens": n, "attention_rows": len(bounds) - 1}
    for name, fn in (("loop", loop), ("block_mask", block)):
        ms = []
        for _ in range(max(args.rounds, 2)):
            t0 = time.perf_counter()
            fn()
            ms.append(1000 * (time.perf_counter() - t0))
        out[f"attention_{name}_ms"] = round(statistics.median(ms), 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 rows of 16..384 tokens, budget 2048, 2 rounds")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.max_len, args.budget, args.rounds = 16, 384, 2048, 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    state = distributed.initialize()
    try:
        result = {
            "device": str(state.device),
            "dtype": args.dtype,
            "lengths": f"uniform in [{args.min_len}, {args.max_len}]",
            "budget_tokens": args.budget,
            **_throughput(args, state),
            **_memory(args, state),
        }
        if state.device.type == "cpu":
            result.update(_attention(args))
    finally:
        distributed.destroy()
    print(json.dumps(result, indent=2))
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    return result


if __name__ == "__main__":
    main()
