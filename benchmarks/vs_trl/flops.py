"""Model FLOPs utilisation for the TRL comparison: the FLOPs one PPO update needs (one work model
for both systems, :func:`update_flops`) and the matrix-product peak measured on this machine
(:func:`matmul_peak`) that they are set against."""

from __future__ import annotations

import time

from benchmarks.vs_trl.cases import Case


def forward_flops(case: Case, tokens: int, context: float, head: str) -> float:
    """Forward FLOPs of ``tokens`` token positions whose attention sees ``context`` positions on
    average (2 FLOPs per multiply-add; attention scores and context both counted)."""
    h, f, L = case.hidden, case.ffn, case.layers
    per_layer = 2 * (h * 3 * h + h * h + h * 2 * f + f * h) + 2 * 2 * context * h
    out = case.vocab if head == "lm" else 1
    return tokens * (L * per_layer + 2 * h * out)


def update_flops(case: Case) -> dict[str, float]:
    """Model FLOPs one PPO update needs (the same work model for both systems): generation, the
    reference, value and reward forwards, and per epoch policy + value forward and backward
    (backward = 2x forward). The rollout value forward is counted although our server takes it
    from its first training pass."""
    b, p, n = case.batch, case.prompt_len, case.new_tokens
    s = p + n
    gen = forward_flops(case, b * p, (p + 1) / 2, "lm") + forward_flops(case, b * n, p + n / 2, "lm")
    full_lm = forward_flops(case, b * s, (s + 1) / 2, "lm")
    full_v = forward_flops(case, b * s, (s + 1) / 2, "value")
    rollout = full_lm + 2 * full_v  # reference, value, reward
    train = case.ppo_epochs * 3 * (full_lm + full_v)
    return {"generate": gen, "rollout_forwards": rollout, "train": train, "total": gen + rollout + train}


def matmul_peak(threads: int, seconds: float = 1.5) -> dict[str, float]:
    """Best GFLOP/s of square torch.mm products (fp32 and bf16) on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for n in (512, 1024, 2048):
            if best and 2 * n**3 / (best * 1e9) > seconds / 3:
                break  # one product would outlast the budget (bf16 on a CPU without it)
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            torch.mm(a, b)
            deadline = time.perf_counter() + seconds / 3
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
        out[name] = round(best, 1)
    return out
