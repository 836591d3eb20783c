"""One PPO step on mixed-length data, padded against packed, split by phase, actor and critic server.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_shapes.py [--quick] [--steps 6] [--warmup 2]
        [--batch 64] [--min-prompt 16] [--max-prompt 512] [--max-new-tokens 256]
        [--micro-batch 8] [--budget N] [--server-budget N] [--json out.json]

A JSONL prompt file of copy-task prompts (``"<digits>:"``, the built-in 'char' tokenizer) whose
lengths (characters, ':' included) are uniform in ``[--min-prompt, --max-prompt]``; responses of
at most ``--max-new-tokens`` tokens scored by ``aligner.tasks.digits:copy_reward``. The tiny
policy and critic from scratch (2 layers, hidden 64), ``model.max_seq_len`` = the longest prompt
+ ``--max-new-tokens``, every forward of the critic and the policy in fp32. A random policy ends
its responses early (end-of-sequence is one of 13 ids it samples), so responses as well as
prompts differ in length, and every row of a step is right-padded to the step's longest.

The same run twice, each side against a fresh server of its own (``aligner.critic.launch.
start_server``, on the first core, started just before its actor) and a fresh
actor (``examples/train_actor.py`` in a subprocess, on the second core), with the same seeds:

- ``padded``: the actor's ``ppo.max_tokens_per_micro_batch=null`` (micro-batches of
  ``--micro-batch`` rows) and the server's ``max_tokens_per_micro_batch=null`` (one padded
  forward per request);
- ``packed``: both set, the actor's to ``--budget`` (default ``--micro-batch`` x
  ``model.max_seq_len``: the tokens a padded micro-batch of the longest rows holds, so packed
  micro-batches hold at most a padded one's memory) and the server's to ``--server-budget``
  (default the same).

``ppo.mini_batch_size`` is half the batch (two minibatches), so neither side reuses the update's
first forward for the rollout's log-probs (``ppo.reuse_rollout_forward`` needs one minibatch and
is off when packed): both compute them in the ``logprobs`` phase.

Per side, the median over the steps after ``--warmup`` of the actor's ``timers/*`` from its
metrics.jsonl (seconds: ``generate``, ``logprobs`` (rollout and reference log-probs, the
critic's infer in flight), ``critic_wait`` (waiting for critic_infer's values and scores, and
for the previous critic_train), ``train`` (the PPO epochs), ``refit``, ``step``), the tokens of
a step (prompt tokens from the actor's own seeded prompt order, response tokens from
``response_length/mean``), the actor's training tokens per second (real tokens x PPO epochs /
``timers/train``), and the server's side from its ``<log.dir>/metrics.jsonl``:
``timers/critic_train_ms`` (one critic_train request, forward, backward and optimizer step; it
overlaps the actor's ``train`` phase) and ``server/critic_infer/latency_ms_mean`` (one
critic_infer execution: critic values and reward scores; it overlaps ``logprobs``). Step 1's
``objective/scores`` of the two sides are compared: the same seeds generate the same responses
from the same initial policy, so they must be equal.

``--quick``: prompts of 8..64 characters, 32 new tokens, batch 16, 2 steps (1 warm-up): a few
seconds of PPO per side; the wall time is mostly the servers' and the actors' start-up. Prints
one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("generate", "logprobs", "critic_wait", "train", "refit", "step")
SIDES = ("padded", "packed")


def _prompt_file(path: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` copy prompts of ``lo..hi`` characters (``':'`` included), written as JSONL."""
    rng = random.Random(seed)
    prompts = [
        "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi) - 1)) + ":" for _ in range(n)
    ]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def _start_server(name: str, args, tmp: Path, budget: int | None):
    from aligner.critic.launch import start_server

    side = tmp / name
    side.mkdir(parents=True, exist_ok=True)
    return start_server(
        [
            "server.grpc_port=0",
            "server.metrics_port=null",
            f"server.max_batch_size={max(256, args.batch)}",
            f"model.max_seq_len={args.max_prompt + args.max_new_tokens}",
            "optim.lr=1e-4",
            "reward.fn=aligner.tasks.digits:copy_reward",
            f"max_tokens_per_micro_batch={_null(budget)}",
            "precision=fp32",
            f"seed={args.seed}",
            f"log.dir={side / 'critic'}",
            "checkpoint.save_on_sigterm=false",
            "checkpoint.save_initial=false",
            "log.tensorboard=false",
        ],
        log_path=side / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )


def _run_actor(
    name: str, args, tmp: Path, prompts: Path, url: str, budget: int | None, core: int | None
) -> dict:
    from aligner.metrics import read_metrics

    side = tmp / name
    overrides = [
        "+recipe=digits",  # the tiny model's learning rate and PPO settings
        f"critic.url={url}",
        f"logging.run_dir={side / 'actor'}",
        f"data.prompt_file={prompts}",
        f"model.max_seq_len={args.max_prompt + args.max_new_tokens}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"ppo.num_steps={args.steps}",
        f"ppo.global_batch_size={args.batch}",
        f"ppo.mini_batch_size={args.batch // 2}",
        f"ppo.micro_batch_size={min(args.micro_batch, args.batch // 2)}",
        f"ppo.max_tokens_per_micro_batch={_null(budget)}",
        "validation.before_train=false",
        f"validation.interval={10 * args.steps}",
        f"checkpoint.save_interval={10 * args.steps}",
        "precision=fp32",
        f"seed={args.seed}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_actor.py"), *overrides],
        cwd=str(ROOT),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=None if core is None else (lambda: os.sched_setaffinity(0, {core})),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{name}: the actor exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    rows = read_metrics(str(side / "actor" / "metrics.jsonl"))
    critic_rows = read_metrics(str(side / "critic" / "metrics.jsonl"))
    return {"rows": rows, "critic_rows": critic_rows, "wall_s": wall}


def _run_sides(args, tmp: Path, prompts: Path, budgets: dict[str, tuple[int | None, int | None]]) -> dict:
    """Each side in turn: a fresh server on the first core, then its actor on the second (where
    there are two), then the server stopped."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    core = cores[1] if len(cores) >= 2 else None
    runs = {}
    for k, (actor_budget, server_budget) in budgets.items():
        try:
            if len(cores) >= 2:
                os.sched_setaffinity(0, {cores[0]})  # the server (and its children) inherit it
            server = _start_server(k, args, tmp, server_budget)
        finally:
            if len(cores) >= 2:
                os.sched_setaffinity(0, set(cores))
        try:
            runs[k] = _run_actor(k, args, tmp, prompts, server.url, actor_budget, core)
        finally:
            server.stop()
    return runs


def _prompt_tokens_per_step(prompts: list[str], args) -> list[int]:
    """The prompt tokens of each step: the actor's own seeded order (one data-parallel rank)."""
    from aligner.actor.prompts import PromptSampler

    sampler = PromptSampler(prompts, args.batch, 0, 1, args.seed)
    return [sum(map(len, sampler.next_rows(1)[0])) for _ in range(args.steps)]


def _null(v: int | None) -> str:
    return "null" if v is None else str(v)


def _summary(run: dict, args, prompts: list[str]) -> dict:
    rows = run["rows"]
    measured = rows[args.warmup :]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out: dict = {
        f"{p}_s": round(statistics.median([r.get(f"timers/{p}", 0.0) for r in measured]), 4) for p in PHASES
    }
    prompt_tok = _prompt_tokens_per_step(prompts, args)[args.warmup : len(rows)]
    resp_tok = [r["response_length/mean"] * args.batch for r in measured]
    out["prompt_tokens"] = round(mean(prompt_tok))
    out["response_tokens"] = round(mean(resp_tok))
    out["response_length_mean"] = round(mean([r["response_length/mean"] for r in measured]), 2)
    real = [p + r for p, r in zip(prompt_tok, resp_tok)]
    out["train_tokens_per_s"] = round(
        statistics.median([args.ppo_epochs * t / r["timers/train"] for t, r in zip(real, measured)])
    )
    crit = run["critic_rows"][args.warmup :] or run["critic_rows"]
    if crit:
        out["critic_train_s"] = round(
            statistics.median([r["timers/critic_train_ms"] for r in crit]) / 1000, 4
        )
        lat = [
            r["server/critic_infer/latency_ms_mean"]
            for r in crit
            if "server/critic_infer/latency_ms_mean" in r
        ]
        if lat:
            out["critic_infer_s"] = round(statistics.median(lat) / 1000, 4)
    out["step1_scores"] = rows[0]["objective/scores"]
    out["step1_response_length"] = rows[0]["response_length/mean"]
    out["actor_wall_s"] = round(run["wall_s"], 1)
    out["steps_measured"] = len(measured)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="prompts 8..64, 32 new tokens, batch 16, 2 steps")
    ap.add_argument(
        "--steps", type=int, default=6, help="PPO steps per side, the first --warmup not measured"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16, help="prompt characters, ':' included")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8, help="padded micro-batch rows (the actor)")
    ap.add_argument("--budget", type=int, default=None, help="packed tokens per micro-batch (the actor)")
    ap.add_argument("--server-budget", type=int, default=None, help="packed tokens per forward (the server)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.min_prompt, args.max_prompt, args.max_new_tokens = 8, 64, 32
        args.batch, args.steps, args.warmup = 16, 2, 1
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup}: expected 0 <= warmup < --steps {args.steps}")
    args.ppo_epochs = 2  # actor.yaml's ppo.ppo_epochs
    seq = args.max_prompt + args.max_new_tokens
    budget = args.budget or args.micro_batch * seq
    server_budget = args.server_budget or budget
    tmp = Path(tempfile.mkdtemp(prefix="bench-shapes-"))
    prompts = tmp / "prompts.jsonl"
    prompt_list = _prompt_file(prompts, args.batch * args.steps, args.min_prompt, args.max_prompt)
    runs = _run_sides(args, tmp, prompts, {"padded": (None, None), "packed": (budget, server_budget)})
    sides = {k: _summary(v, args, prompt_list) for k, v in runs.items()}
    result = {
        "prompt_lengths": f"uniform in [{args.min_prompt}, {args.max_prompt}]",
        "max_new_tokens": args.max_new_tokens,
        "max_seq_len": seq,
        "batch": args.batch,
        "padded_micro_batch_rows": min(args.micro_batch, args.batch // 2),
        "actor_budget_tokens": budget,
        "server_budget_tokens": server_budget,
        "steps": args.steps,
        "warmup": args.warmup,
        "step1_scores_equal": sides["padded"]["step1_scores"] == sides["packed"]["step1_scores"],
        "padded": sides["padded"],
        "packed": sides["packed"],
        "speedup": {
            k: round(sides["padded"][k] / sides["packed"][k], 2)
            for k in (*(f"{p}_s" for p in PHASES), "critic_train_s", "critic_infer_s")
            if k in sides["padded"] and k in sides["packed"] and sides["packed"][k] > 0
        },
        "run_dir": str(tmp),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    keys = list(sides["padded"])
    width = max(map(len, keys))
    print(f"\n{'':<{width}}  {'padded':>12}  {'packed':>12}  {'padded/packed':>13}")
    for k in keys:
        a, b = sides["padded"][k], sides["packed"].get(k)
        ratio = result["speedup"].get(k, "")
        print(f"{k:<{width}}  {a:>12}  {b:>12}  {ratio:>13}")
    return result


if __name__ == "__main__":
    main()
