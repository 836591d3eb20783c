"""The advantage estimators side by side on the demo task (sort 6 digits), at the same number of
episodes (sampled responses): GAE against the critic server, and GRPO, RLOO and REINFORCE++
against a reward-only server.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_estimators.py [--steps 500] [--out runs/estimators]

Every run uses the demo's model, learning rate and batch of 256 responses per step; the group
estimators draw 32 prompts x 8 samples (GRPO also without its std normalisation: Dr. GRPO),
GAE and REINFORCE++ 256 prompts x 1. Prints JSON and a
table (the step and the episodes at which the 3-step mean reward first reaches 0.9, the final
3-step mean, the mean step time) and writes the learning curves to ``<out>/estimators.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 256
RUNS = {
    # name: (server mode, actor overrides)
    "gae": ("critic", ["ppo.advantage=gae"]),
    "grpo": ("reward_only", ["ppo.advantage=grpo", "ppo.samples_per_prompt=8"]),
    "dr_grpo": ("reward_only", ["ppo.advantage=grpo", "ppo.samples_per_prompt=8", "ppo.grpo_std_norm=false"]),
    "rloo": ("reward_only", ["ppo.advantage=rloo", "ppo.samples_per_prompt=8"]),
    "reinforce_pp": ("reward_only", ["ppo.advantage=reinforce_pp"]),
}


def _run(name: str, steps: int, out: Path) -> list[dict]:
    from aligner.critic.launch import start_server
    from aligner.metrics import read_metrics

    mode, overrides = RUNS[name]
    run_dir = out / name
    server = start_server(
        [
            "+server_recipe=digits",
            "server.grpc_port=0",
            "server.metrics_port=null",
            f"mode={mode}",
            "optim.lr=1e-3",
            f"log.dir={run_dir / 'critic'}",
            f"checkpoint.dir={run_dir / 'checkpoints'}",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
        ],
        log_path=run_dir / "server.log",
    )
    with server:
        cmd = [
            sys.executable,
            str(ROOT / "examples" / "train_actor.py"),
            "+recipe=digits",
            f"critic.url={server.url}",
            f"logging.run_dir={run_dir / 'actor'}",
            f"checkpoint.dir={run_dir / 'checkpoints'}",
            f"ppo.num_steps={steps}",
            "checkpoint.resume=none",
            "checkpoint.save_interval=0",
            "checkpoint.save_at_end=false",
            "checkpoint.keep_best=false",
            "validation.interval=0",
            "validation.before_train=false",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.log_interval=50",
            *overrides,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, cwd=str(ROOT), env=env, stdout=subprocess.DEVNULL)
    return [r for r in read_metrics(str(run_dir / "actor" / "metrics.jsonl")) if "objective/scores" in r]


def _first_reach(scores: list[float], level: float, window: int = 3) -> int | None:
    for i in range(window - 1, len(scores)):
        if sum(scores[i - window + 1 : i + 1]) / window >= level:
            return i + 1
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500, help="PPO steps per estimator (256 episodes each)")
    ap.add_argument("--out", default="runs/estimators", help="run folders and the PNG")
    ap.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    ap.add_argument(
        "--reuse", action="store_true", help="read the runs already under --out instead of running them again"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    results: dict[str, dict] = {}
    curves: dict[str, list[float]] = {}
    for name in args.only:
        if args.reuse:
            from aligner.metrics import read_metrics

            path = out / name / "actor" / "metrics.jsonl"
            rows = [r for r in read_metrics(str(path)) if "objective/scores" in r]
        else:
            rows = _run(name, args.steps, out)
        scores = [r["objective/scores"] for r in rows]
        curves[name] = scores
        reach = _first_reach(scores, 0.9)
        results[name] = {
            "steps_to_0.9": reach,
            "episodes_to_0.9": None if reach is None else reach * BATCH,
            "final_3step_mean": sum(scores[-3:]) / 3,
            "mean_step_s": sum(r["timers/step"] for r in rows) / len(rows),
        }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, scores in curves.items():
        smooth = [
            sum(scores[max(0, i - 4) : i + 1]) / len(scores[max(0, i - 4) : i + 1])
            for i in range(len(scores))
        ]
        ax.plot([BATCH * (i + 1) / 1000 for i in range(len(scores))], smooth, label=name)
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("episodes (thousands)")
    ax.set_ylabel("reward (5-step mean)")
    ax.set_title("sort 6 digits: advantage estimators at 256 episodes per step")
    ax.legend()
    out.mkdir(parents=True, exist_ok=True)
    png = out / "estimators.png"
    fig.savefig(png, dpi=110, bbox_inches="tight")
    print(json.dumps({"results": results, "png": str(png)}, indent=2))
    print(f"{'estimator':<14}{'steps to 0.9':>14}{'episodes':>10}{'final':>8}{'step s':>8}")
    for name, r in results.items():
        s = r["steps_to_0.9"]
        print(
            f"{name:<14}{s if s else '-':>14}{r['episodes_to_0.9'] or '-':>10}"
            f"{r['final_3step_mean']:>8.3f}{r['mean_step_s']:>8.3f}"
        )
    return results


if __name__ == "__main__":
    main()
