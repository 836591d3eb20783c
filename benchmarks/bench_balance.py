"""Data-parallel prompt balancing: what it does to the slowest rank's rollout log-prob forward.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balance.py [--steps 15] [--dp 2]

Copy-task prompts of 1 to 6 digits (so responses differ in length as prompts do) are dealt to
``--dp`` ranks per step, once as contiguous slices of the drawn order (``data.balance_dp=false``)
and once balanced (longest first, snake order: each rank's share is the same mix of lengths, and
sorted). Each rank's rows are its prompts with their correct answers and end-of-sequence, and the
rollout log-prob forward runs on them as the trainer runs it (micro-batches cut to their longest
row). Every rank's share is timed in this one process, one after the other, and a step costs what
its slowest rank costs, since the ranks meet at the next collective. Prints JSON and a table: per
global batch size, the slowest rank's forward in ms, and the ranks' token imbalance (the largest
rank's tokens over the mean).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _rows(tok, share: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [tok.encode(p) + tok.encode(p.rstrip(":")) + [tok.eos_id] for p in share]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), tok.pad_id)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens, torch.tensor([len(s) for s in seqs])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15, help="steps per case (the first 3 are warm-up)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    args = ap.parse_args(argv)

    from aligner import distributed
    from aligner.actor.config import ActorConfig
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.actor.prompts import PromptSampler
    from aligner.models import forward, gpt
    from aligner.tasks import get_task
    from aligner.tokenizers import CharTokenizer

    torch.set_num_threads(1)
    state = distributed.initialize(distributed.ParallelConfig(), seed=1)
    cfg, tok = ActorConfig(), CharTokenizer()
    model = gpt.build_policy(cfg.model)
    forward.set_forward(model, "auto")
    prompts = [get_task("copy", 1 + i % 6).prompts(1, seed=i)[0] for i in range(4000)]
    lengths = [len(tok.encode(p)) for p in prompts]
    lp = PolicyLogprobs.for_actor(cfg, state, tok)
    results = []
    for micro, global_batch in ((8, 64), (16, 256)):
        row = {"global_batch": global_batch, "micro_batch": micro, "dp": args.dp}
        for balanced in (False, True):
            ranks = [
                PromptSampler(
                    prompts, global_batch, r, args.dp, seed=5, lengths=lengths if balanced else None
                )
                for r in range(args.dp)
            ]
            slowest, imbalance = [], []
            for _ in range(args.steps):
                costs, tokens_per_rank = [], []
                for sampler in ranks:
                    tokens, n = _rows(tok, sampler.next_batch())
                    t0 = time.perf_counter()
                    lp.no_grad(model, tokens, micro, lengths=n)
                    costs.append(time.perf_counter() - t0)
                    tokens_per_rank.append(int(n.sum()))
                slowest.append(max(costs))
                imbalance.append(max(tokens_per_rank) * args.dp / sum(tokens_per_rank))
            key = "balanced" if balanced else "contiguous"
            row[f"{key}_ms"] = 1000 * statistics.mean(slowest[3:])
            row[f"{key}_imbalance"] = statistics.mean(imbalance)
        results.append(row)
    distributed.destroy()

    print(json.dumps({"balance": results}, indent=1))
    print(
        "\n| global batch | micro | contiguous: slowest rank ms (imbalance) | balanced: slowest rank ms (imbalance) |"
    )
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['global_batch']} | {r['micro_batch']} | {r['contiguous_ms']:.1f} ({r['contiguous_imbalance']:.3f}) "
            f"| {r['balanced_ms']:.1f} ({r['balanced_imbalance']:.3f}) |"
        )
    return {"balance": results}


if __name__ == "__main__":
    main()
