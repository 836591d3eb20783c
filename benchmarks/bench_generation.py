"""Decoding throughput: NativeEngine (its lean and its Megatron-forward backends, and the lean
one on weights it owns) vs the no-cache reference vs HF ``generate`` (``LlamaForCausalLM``
holding the same weights, exported through :func:`aligner.models.hf.iter_hf_tensors`), same
batch, dtype and threads; and the cost of a refit (ms per refit, MB copied into the engine on a
rank) for the same model: zero-copy (the training layout), owned weights at TP=1 from a TP=1
fp32 policy (fp32 and bf16), and owned TP=1 weights on each of two processes from a TP=2 policy
(gloo; the stream's all-gathers included).

    .venv/bin/python benchmarks/bench_generation.py [--dtype bf16] [--new 192] [--sample] [--json out.json]

Prints one JSON object and a table. Tokens/s counts generated tokens (batch x new tokens;
the eos id is set outside the vocabulary so every sample runs to max_new_tokens). Engines run
interleaved, round by round, and the medians are reported: wall-clock tokens/s, and tokens per
CPU-second of this process (steadier than wall time on a shared machine; with two threads it
counts both). Greedy runs also report how many of HF's tokens ours reproduces (fp32: all of
them, until an exact tie; bf16: until the first rounding difference flips an argmax). Refits
are timed ``--refits`` times each and the median is reported.
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
from aligner.generation import NativeEngine, SamplingParams, generate_no_cache  # noqa: E402
from aligner.models.config import ModelConfig  # noqa: E402
from aligner.models.gpt import build_policy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=680)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample", action="store_true", help="sample at temperature 1 instead of greedy")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list to skip: native, native_lean, native_megatron, native_lean_owned, no_cache, hf, "
        "refit, refit_tp2",
    )
    ap.add_argument("--refits", type=int, default=10, help="refits timed per refit case")
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ps = distributed.initialize(seed=1234)
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=args.prompt + args.new,
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab, (args.batch, args.prompt), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=args.new, greedy=not args.sample, seed=0)
    eos = args.vocab  # outside the vocabulary: never sampled, every sample runs to the end
    n_tokens = args.batch * args.new
    results: dict[str, dict] = {}

    def record(name: str, times: list[float], cpu_times: list[float]) -> None:
        med, cpu_med = statistics.median(times), statistics.median(cpu_times)
        results[name] = {
            "seconds_median": round(med, 4),
            "seconds_all": [round(t, 4) for t in times],
            "tokens_per_s": round(n_tokens / med, 1),
            "ms_per_step": round(1000 * med / args.new, 3),
            "cpu_seconds_median": round(cpu_med, 4),
            "tokens_per_cpu_s": round(n_tokens / cpu_med, 1),
        }

    policy = build_policy(cfg, params_dtype=dtype)
    runners: dict[str, object] = {}
    engines: dict[str, NativeEngine] = {}
    for backend in ("lean", "megatron"):
        if "native" in skip or f"native_{backend}" in skip:
            continue
        engine = NativeEngine(
            policy, pad_id=0, eos_id=eos, max_seq_len=cfg.max_seq_len, parallel_state=ps, backend=backend
        )
        engines[backend] = engine
        runners[f"native_{backend}"] = lambda engine=engine: engine.generate(
            prompts, sp
        ).response_lengths.sum()
    if not {"native", "native_lean", "native_lean_owned"} & skip:
        owned = NativeEngine(
            policy, pad_id=0, eos_id=eos, max_seq_len=cfg.max_seq_len, parallel_state=ps, weights="owned"
        )
        runners["native_lean_owned"] = lambda: owned.generate(prompts, sp).response_lengths.sum()
    outputs: dict[str, torch.Tensor] = {}
    if "hf" not in skip:
        from transformers import LlamaForCausalLM

        from aligner.models.hf import iter_hf_tensors
        from aligner.models.hf_config import hf_config_from_model_config

        weights = {k: v.clone() for k, v in iter_hf_tensors(policy, cfg, "llama")}
        for attn in ("sdpa", "eager"):
            hcfg = hf_config_from_model_config(cfg, "LlamaForCausalLM")
            hcfg._attn_implementation = attn
            hf = LlamaForCausalLM(hcfg).to(dtype).eval()
            hf.load_state_dict(weights, strict=True)
            ids = torch.tensor(prompts)
            mask = torch.ones_like(ids)

            def run_hf(hf=hf, ids=ids, mask=mask, name=f"hf_generate_{attn}"):
                with torch.inference_mode():
                    out = hf.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        max_new_tokens=args.new,
                        min_new_tokens=args.new,
                        do_sample=args.sample,
                        temperature=1.0,
                        top_k=None,
                        top_p=None,
                        eos_token_id=None,
                        pad_token_id=0,
                    )
                outputs[name] = out
                return (out.shape[1] - ids.shape[1]) * ids.shape[0]

            runners[f"hf_generate_{attn}"] = run_hf
    # Interleave the engines round by round so that load from other processes on a shared
    # machine hits them alike; report medians of wall time and of this process's CPU time.
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    for name, fn in runners.items():
        got = int(fn())  # warm-up
        if got != n_tokens:
            raise RuntimeError(f"{name} generated {got} tokens, expected {n_tokens}")
    for _ in range(args.repeats):
        for name, fn in runners.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    for name in runners:
        record(name, wall[name], cpu[name])
    if not args.sample and "native_lean" in runners and outputs:
        ours = engines["lean"].generate(prompts, sp).tokens
        for name, out in outputs.items():
            same = (ours[:, args.prompt :] == out[:, args.prompt :]).cumprod(dim=1).sum(dim=1).float()
            results[name]["greedy_prefix_agreement"] = round(float(same.mean()) / args.new, 4)
    if "no_cache" not in skip:
        c0, t0 = time.process_time(), time.perf_counter()
        generate_no_cache(policy, prompts, sp, pad_id=0, eos_id=eos, max_seq_len=cfg.max_seq_len)
        record("no_cache_reference", [time.perf_counter() - t0], [time.process_time() - c0])

    refit = {} if "refit" in skip else bench_refit(cfg, ps, args.refits, tp2="refit_tp2" not in skip)

    report = {
        "config": {
            "batch": args.batch,
            "prompt": args.prompt,
            "new_tokens": args.new,
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "mode": "sample" if args.sample else "greedy",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": results,
        "refit": refit,
    }
    print(json.dumps(report, indent=2))
    print(f"\n{'engine':<22}{'tokens/s':>10}{'ms/step':>9}{'s (median)':>12}{'tokens/cpu-s':>14}")
    for name, r in results.items():
        print(
            f"{name:<22}{r['tokens_per_s']:>10.0f}{r['ms_per_step']:>9.2f}{r['seconds_median']:>12.3f}"
            f"{r['tokens_per_cpu_s']:>14.0f}"
        )
    if refit:
        print(f"\n{'refit':<28}{'ms/refit':>10}{'MB/rank':>10}{'stream MB':>11}")
        for name, r in refit.items():
            print(f"{name:<28}{r['ms_per_refit']:>10.2f}{r['mbytes']:>10.2f}{r['stream_mbytes']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    distributed.destroy()
    return report


def _refit_row(engine: NativeEngine, policy, n: int) -> dict:
    """Median wall time of ``n`` refits of ``engine`` from ``policy`` and what each moved."""
    times = []
    for _ in range(n):
        engine.refit(policy)
        times.append(engine.last_refit.seconds)
    cost = engine.last_refit
    return {
        "ms_per_refit": round(1000 * statistics.median(times), 3),
        "ms_all": [round(1000 * t, 3) for t in times],
        "mbytes": round(cost.bytes / 1e6, 3),
        "stream_mbytes": round(cost.stream_bytes / 1e6, 3),
        "owned": cost.owned,
    }


def bench_refit(cfg: ModelConfig, ps, n: int, tp2: bool = True) -> dict:
    """Refit cost of an fp32 TP=1 policy into a zero-copy engine and into owned fp32 and bf16
    weights; with ``tp2``, of a TP=2 policy into owned TP=1 weights on both of two processes."""
    policy = build_policy(cfg)
    common = dict(pad_id=0, eos_id=cfg.vocab_size, max_seq_len=cfg.max_seq_len, parallel_state=ps)
    out = {
        "zero_copy_fp32": _refit_row(NativeEngine(policy, **common), policy, n),
        "owned_tp1_fp32_from_tp1_fp32": _refit_row(
            NativeEngine(policy, weights="owned", **common), policy, n
        ),
        "owned_tp1_bf16_from_tp1_fp32": _refit_row(NativeEngine(policy, dtype="bf16", **common), policy, n),
    }
    if tp2:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "refit_tp2.json")
            mp.spawn(
                _refit_tp2_worker,
                args=(distributed.free_port(), cfg.to_dict(), n, path, torch.get_num_threads()),
                nprocs=2,
                join=True,
            )
            with open(path) as f:
                out.update(json.load(f))
    return out


def _refit_tp2_worker(rank: int, port: int, cfg: dict, n: int, path: str, threads: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, threads // 2))
    ps = distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=2), seed=1234)
    try:
        mcfg = ModelConfig.from_dict(cfg)
        policy = build_policy(mcfg)
        common = dict(pad_id=0, eos_id=mcfg.vocab_size, max_seq_len=mcfg.max_seq_len, parallel_state=ps)
        rows = {
            "owned_tp1_fp32_from_tp2_fp32": _refit_row(
                NativeEngine(policy, generation_tp=1, **common), policy, n
            ),
            "owned_tp1_bf16_from_tp2_fp32": _refit_row(
                NativeEngine(policy, generation_tp=1, dtype="bf16", **common), policy, n
            ),
        }
        if rank == 0:
            with open(path, "w") as f:
                json.dump(rows, f)
        distributed.barrier()
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
