"""The check's command line and its order: the environment, the GPU tests, the PPO run; then one
JSON report, printed and written to ``--out``.

    python -m aligner.gpu_check                  # full on a GPU; --reduced where there is none
    python -m aligner.gpu_check --reduced        # tiny model on the CPU, tests only collected
    python -m aligner.gpu_check --recompute --distributed-optimizer --set generation.decode_step=eager

Each section runs even when one before it failed; a failed section holds its error and the end
of its traceback, and the report's ``ok`` is false. The exit status is 0 when ``ok``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "parse_args", "run_check", "FULL", "REDUCED"]

# The two sizes of the check: the defaults of the options of the same names.
FULL = {
    "steps": 20,
    "batch": 64,
    "mini_batch": 32,
    "micro_batch": 8,
    "max_new_tokens": 128,
    "prompt_min": 16,
    "prompt_max": 256,
    "precision": "bf16",
    "pytest_timeout": 180.0,
    "budget": 240.0,
}
REDUCED = {
    "steps": 3,
    "batch": 8,
    "mini_batch": 4,
    "micro_batch": 4,
    "max_new_tokens": 8,
    "prompt_min": 4,
    "prompt_max": 24,
    "precision": "fp32",
    "pytest_timeout": 120.0,
    "budget": 120.0,
}

ROOT = Path(__file__).resolve().parents[2]
"""The source tree the package runs from (its ``tests/`` are the suite the check runs)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aligner.gpu_check",
        description="One-command GPU check: environment, pytest -m gpu, a short PPO run; one JSON report.",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--reduced", action="store_true", help="tiny model on the CPU (default without CUDA)")
    size.add_argument("--full", action="store_true", help="the Qwen2.5-0.5B-shaped run (default with CUDA)")
    p.add_argument("--out", default="runs/gpu_check.json", help="where the JSON report is written")
    p.add_argument("--steps", type=int, help="PPO steps (full 20, reduced 3)")
    p.add_argument("--batch", type=int, help="samples per step (ppo.global_batch_size; full 64, reduced 8)")
    p.add_argument("--mini-batch", type=int, help="ppo.mini_batch_size (full 32, reduced 4)")
    p.add_argument("--micro-batch", type=int, help="ppo.micro_batch_size (full 8, reduced 4)")
    p.add_argument("--max-new-tokens", type=int, help="generation.max_new_tokens (full 128, reduced 8)")
    p.add_argument("--prompt-min", type=int, help="shortest prompt in tokens (full 16, reduced 4)")
    p.add_argument("--prompt-max", type=int, help="longest prompt in tokens (full 256, reduced 24)")
    p.add_argument(
        "--precision", choices=("bf16", "fp32"), help="both roles' precision (full bf16, reduced fp32)"
    )
    p.add_argument("--budget", type=float, help="seconds of PPO steps after which no step starts (full 240)")
    p.add_argument("--pytest-timeout", type=float, help="seconds for pytest -m gpu (full 180)")
    p.add_argument("--skip-pytest", action="store_true", help="leave out section b")
    p.add_argument("--skip-ppo", action="store_true", help="leave out section c")
    p.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        metavar="VALUE",
        help="model.recompute=VALUE on both roles (default full; needs a tree that has the key)",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="optim.use_distributed_optimizer=true on both roles (needs a tree that has the key)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an actor.yaml override")
    p.add_argument(
        "--critic-set", action="append", default=[], metavar="KEY=VALUE", help="a critic config key (dotted)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--keep-workdir", action="store_true", help="keep the tokenizer, prompts and run folders")
    args = p.parse_args(argv)
    args.reduced = args.reduced or (not args.full and not torch.cuda.is_available())
    for key, default in (REDUCED if args.reduced else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    for item in args.set + args.critic_set:
        if "=" not in item:
            p.error(f"--set/--critic-set {item!r}: expected KEY=VALUE")
    return args


def _section(report: dict[str, Any], name: str, fn: Callable[[dict[str, Any]], None]) -> None:
    """Run one section into ``report[name]``, keeping what it filled in and its error."""
    print(f"== gpu_check: {name}", flush=True)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    report[name] = out
    try:
        fn(out)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        report["problems"].append(f"{name}: {out['error']}")
        print(out["traceback"], file=sys.stderr, flush=True)
    out.setdefault("seconds", round(time.perf_counter() - t0, 2))


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Sections a, b and c in order; the report."""
    from aligner.gpu_check.environment import describe, yardsticks
    from aligner.gpu_check.pytest_run import run_gpu_tests
    from aligner.gpu_check.workload import QWEN_0_5B, TINY

    t0 = time.perf_counter()
    # The device the roles will run on (distributed.initialize picks CUDA wherever there is one).
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    report: dict[str, Any] = {
        "check": "aligner.gpu_check",
        "mode": "reduced" if args.reduced else "full",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "options": {k: v for k, v in vars(args).items() if k not in ("full",)},
        "problems": [],
    }
    sticks: dict[str, Any] = {}

    def environment(out: dict[str, Any]) -> None:
        out.update(describe(device))
        sticks.update(yardsticks(device, dtype, args.reduced))
        sticks["datasheet"] = (out.get("gpu") or {}).get("datasheet")
        out["measured"] = dict(sticks)
        missing = [
            k for k in ("megatron-core", "hydra-core", "omegaconf", "datasets") if out["packages"][k] is None
        ]
        if missing:
            raise RuntimeError(f"not installed: {missing} (make gpu-wheels here, then make gpu-check there)")

    def pytest(out: dict[str, Any]) -> None:
        out.update(run_gpu_tests(ROOT, collect_only=args.reduced, timeout_s=args.pytest_timeout))
        if out.get("timed_out"):
            raise RuntimeError(f"pytest -m gpu ran past its {args.pytest_timeout:g} s")
        if args.reduced and not out.get("collected"):
            raise RuntimeError("pytest -m gpu collected no test: the gpu marks are missing")
        if not args.reduced and (out.get("failed") or out.get("errors")):
            raise RuntimeError(
                f"{out.get('failed')} failed, {out.get('errors')} errors: {out.get('failing')}"
            )

    def ppo(out: dict[str, Any]) -> None:
        from aligner.gpu_check.ppo_run import PPOOptions, parse_value, run_ppo

        opts = PPOOptions(
            shape=TINY if args.reduced else QWEN_0_5B,
            steps=args.steps,
            global_batch=args.batch,
            mini_batch=args.mini_batch,
            micro_batch=args.micro_batch,
            max_new_tokens=args.max_new_tokens,
            prompt_min=args.prompt_min,
            prompt_max=args.prompt_max,
            precision=args.precision,
            budget_s=args.budget,
            seed=args.seed,
            recompute=args.recompute,
            distributed_optimizer=args.distributed_optimizer,
            actor_overrides=list(args.set),
            critic_overrides={k: parse_value(v) for k, v in (x.split("=", 1) for x in args.critic_set)},
        )
        out["shape"] = opts.shape.keys()
        workdir = Path(tempfile.mkdtemp(prefix="aligner-gpu-check-"))
        try:
            run_ppo(opts, workdir, sticks, out)
        finally:
            if args.keep_workdir:
                out["workdir"] = str(workdir)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        if out.get("steps_done", 0) < 1:
            raise RuntimeError("no PPO step ran")

    _section(report, "environment", environment)
    if not args.skip_pytest:
        _section(report, "pytest", pytest)
    if not args.skip_ppo:
        _section(report, "ppo", ppo)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    report["ok"] = not report["problems"]
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if torch.cuda.is_available():
        # The models are initialised on the host before they move to the GPU: with the one thread
        # the Makefile gives every process (for the 2-core CI machines), three 0.5B models take
        # tens of seconds more to build on the GPU machine's 16 cores.
        torch.set_num_threads(min(8, os.cpu_count() or 1))
    report = run_check(args)
    text = json.dumps(report, indent=2, default=str)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, out)
    print(text, flush=True)
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'}; report written to {out}", flush=True)
    return 0 if report["ok"] else 1
