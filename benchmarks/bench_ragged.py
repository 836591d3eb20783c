"""Ragged batches: NativeEngine on a batch of mixed prompt and response lengths against a batch
of the same total tokens in equal lengths.

    .venv/bin/python benchmarks/bench_ragged.py [--quick] [--dtype bf16] [--backend lean] [--json out.json]

Full mode (the default) is the issue's case: ``--batch`` 64 prompts of lengths uniform in
``[16, 512]``, responses of up to 256 tokens sampled at temperature 1, each ending early on any
of ``--stops`` token ids (the tiny random model's next-token distribution is close to uniform,
so a response ends with probability about ``stops / vocab`` per token: 4 of 512 give responses
of ~110 tokens on average, from 1 to 256). The equal batch has every prompt as long as the mixed
batch's mean prompt and every response as long as its mean response (no stop tokens,
``max_new_tokens`` that mean), so both hold the same number of tokens. ``--quick`` scales it
down for a CPU (16 prompts of 16-128 tokens, responses up to 64, 8 stop ids).

Reported per batch: tokens/s counting every token of the batch (prompts and responses:
the work is the same in both), generated tokens/s, tokens per CPU-second of this process
(steadier on a shared machine), and the ratio mixed / equal of each (1.0: a ragged batch costs
what an equal one does). The two batches run interleaved, round by round, and the medians are
reported. The model is the tiny one of ``bench_generation.py`` (4 layers, hidden 256).

Also reported: each batch's forward steps (a call prefills once, then takes one decode step per
token of its longest response) and ``step_bound``, equal's steps over mixed's. A decode step
reads every weight whatever its rows, so where that read dominates (GPUs at any size this
benchmark runs; this tiny model on a CPU too: a step of 5 rows costs about 75% of one of 16)
the mixed batch cannot beat ``step_bound`` by much: its longest response sets its step count,
the mean sets the equal batch's. Sorting, span attention and dropping stopped rows are what
lift the ratio above that bound; going past it needs more prompts than rows in flight (refilling
the rows that stopped) or rollouts that do not wait for their longest row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner import distributed  # noqa: E402
from aligner.generation import NativeEngine, SamplingParams  # noqa: E402
from aligner.models.config import ModelConfig  # noqa: E402
from aligner.models.gpt import build_policy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL = dict(batch=64, min_prompt=16, max_prompt=512, new=256, stops=4)
QUICK = dict(batch=16, min_prompt=16, max_prompt=128, new=64, stops=8)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller case for a CPU (see the docstring)")
    for name in FULL:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=680)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--backend", choices=("auto", "lean", "megatron"), default="auto")
    ap.add_argument("--decode-step", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    case = dict(QUICK if args.quick else FULL)
    for name in FULL:
        if getattr(args, name) is not None:
            case[name] = getattr(args, name)

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ps = distributed.initialize(seed=1234)
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=case["max_prompt"] + case["new"],
    )
    policy = build_policy(cfg, params_dtype=dtype)
    engine = NativeEngine(
        policy,
        pad_id=0,
        eos_id=args.vocab,  # outside the vocabulary: only the stop ids end a sample
        max_seq_len=cfg.max_seq_len,
        parallel_state=ps,
        backend=args.backend,
        decode_step=args.decode_step,
    )
    g = torch.Generator().manual_seed(args.seed)
    b = case["batch"]
    lens = torch.randint(case["min_prompt"], case["max_prompt"] + 1, (b,), generator=g).tolist()
    mixed = [torch.randint(2, args.vocab, (n,), generator=g).tolist() for n in lens]
    stop_ids = tuple(range(args.vocab - case["stops"], args.vocab))
    sp_mixed = SamplingParams(max_new_tokens=case["new"], stop_token_ids=stop_ids, seed=args.seed)

    # The mixed batch's responses decide the equal batch's shape (the same total tokens).
    out = engine.generate(mixed, sp_mixed)
    resp = out.response_lengths.tolist()
    mean_prompt = round(sum(lens) / b)
    mean_resp = max(1, round(sum(resp) / b))
    equal = [
        torch.randint(2, args.vocab - case["stops"], (mean_prompt,), generator=g).tolist() for _ in range(b)
    ]
    sp_equal = SamplingParams(max_new_tokens=mean_resp, seed=args.seed)
    tokens = {"mixed": sum(lens) + sum(resp), "equal": b * (mean_prompt + mean_resp)}
    generated = {"mixed": sum(resp), "equal": b * mean_resp}
    runs = {
        "mixed": lambda: engine.generate(mixed, sp_mixed).response_lengths.sum(),
        "equal": lambda: engine.generate(equal, sp_equal).response_lengths.sum(),
    }
    for name, fn in runs.items():  # warm-up; the responses are the same every round (seeded)
        got = int(fn())
        if got != generated[name]:
            raise RuntimeError(f"{name}: generated {got} tokens, expected {generated[name]}")
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    steps = {"mixed": 1 + max(resp), "equal": 1 + mean_resp}  # the prefill + a step per further token
    results = {}
    for name in runs:
        med, cpu_med = statistics.median(wall[name]), statistics.median(cpu[name])
        results[name] = {
            "tokens": tokens[name],
            "generated": generated[name],
            "seconds_median": round(med, 4),
            "seconds_all": [round(t, 4) for t in wall[name]],
            "tokens_per_s": round(tokens[name] / med, 1),
            "generated_per_s": round(generated[name] / med, 1),
            "tokens_per_cpu_s": round(tokens[name] / cpu_med, 1),
            # The fastest round: what the code costs with the least interference from other
            # processes on a shared machine.
            "tokens_per_s_best": round(tokens[name] / min(wall[name]), 1),
            "forward_steps": steps[name],
            "ms_per_step": round(1000 * med / steps[name], 3),
        }
    m, e = results["mixed"], results["equal"]
    ratio = {
        k: round(m[k] / e[k], 3)
        for k in ("tokens_per_s", "generated_per_s", "tokens_per_cpu_s", "tokens_per_s_best")
    }
    ratio["step_bound"] = round(steps["equal"] / steps["mixed"], 3)
    report = {
        "config": {
            **case,
            "mode": "quick" if args.quick else "full",
            "mean_prompt": mean_prompt,
            "mean_response": mean_resp,
            "responses_min_max": [min(resp), max(resp)],
            "ended": int(out.ended.sum()),
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "backend": args.backend,
            "decode_step": args.decode_step,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": results,
        "ratio_mixed_over_equal": ratio,
    }
    print(json.dumps(report, indent=2))
    print(
        f"\n{'batch':<8}{'tokens':>8}{'tokens/s':>10}{'gen/s':>9}{'s (median)':>12}{'tokens/cpu-s':>14}"
        f"{'tokens/s best':>15}"
    )
    for name, r in results.items():
        print(
            f"{name:<8}{r['tokens']:>8}{r['tokens_per_s']:>10.0f}{r['generated_per_s']:>9.0f}"
            f"{r['seconds_median']:>12.3f}{r['tokens_per_cpu_s']:>14.0f}{r['tokens_per_s_best']:>15.0f}"
        )
    print(
        f"{'ratio':<8}{'':>8}{ratio['tokens_per_s']:>10.3f}{ratio['generated_per_s']:>9.3f}{'':>12}"
        f"{ratio['tokens_per_cpu_s']:>14.3f}{ratio['tokens_per_s_best']:>15.3f}"
    )
    print(
        f"forward steps: mixed {steps['mixed']}, equal {steps['equal']} "
        f"(step bound {ratio['step_bound']:.3f}); ms per step: mixed {results['mixed']['ms_per_step']:.2f}, "
        f"equal {results['equal']['ms_per_step']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    distributed.destroy()
    return report


if __name__ == "__main__":
    main()
