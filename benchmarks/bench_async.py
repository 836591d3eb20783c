"""Generation and training overlapped: one run on a rollout worker of its own at staleness k = 1
(``--modes``: also k = 2), beside k = 0 on a worker (the synchronous algorithm, generated
elsewhere) and the in-process run (the actor's own rank generates), in one run of this script.
``k1-overlap`` is k = 1 with the weight push running while the step reads the weights
(``rollout.overlap_push=true``; the same run, timed differently), ``k1-scored`` k = 1 with the
worker asking the server for its batch's scores (``rollout.score_on_workers=true``; the same run
again, the trainer no longer waiting for them: ``critic_wait_share``), ``k1-partial`` k = 1 with
the worker taking each version pushed while it generates at the next token boundary
(``rollout.schedule=dynamic rollout.partial=true``: ``token_staleness``, ``swapped_token_frac``).

A critic-free GRPO run on the sort task (six digits) against a reward-only server with a light
reward function (``--advantage gae``: GAE against the server's critic); on two cores the trainer
(this process) has one and the worker the other, and the server may run on either (pinned to the
trainer's core, its answers stalled half a second whenever the trainer's core was busy: at 20-26
of 60 steps with the push overlapped). Each mode runs the same steps from the same seed. Reported per mode: the median step time (after two warm-up steps), the wall time, the
time and the episodes to a target reward (the mean score over three steps), the trainer's
share of the step spent waiting for rollouts and for the push (and for the scores:
``critic_wait_share``), the worker's idle share, the
push's share of the step (``push/step_frac``), the share of the push the step did not wait for
(``push/hidden_frac``) and the seconds it waited for it (``push/wait_s``), and the last steps'
score.

    .venv/bin/python benchmarks/bench_async.py [--steps 60] [--target 0.25] [--modes in-process,k0,k1,k2]
        [--advantage grpo|gae] [--seeds 1234,1,2,3,4]    # modes: in-process,k0,k1,k1-overlap,k1-scored,k1-partial,k2

With several ``--seeds`` every mode runs once per seed, and a last table gives each mode's mean
episodes to the target and its ratio to k = 0's (a run that never reaches it counts as its
steps + 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 256
SETTINGS = [
    "data.task=sort",
    "data.num_digits=6",
    "data.num_prompts=4096",
    "model.max_seq_len=16",
    "generation.max_new_tokens=7",
    f"ppo.global_batch_size={BATCH}",
    "ppo.mini_batch_size=128",
    "ppo.micro_batch_size=128",
    "ppo.ppo_epochs=1",
    "ppo.init_kl_coef=0.0",
    "ppo.tis_cap=2.0",
    "optim.lr=2e-3",
    "optim.min_lr=2e-3",
    "optim.warmup_steps=2",
    "precision=fp32",
    "validation.interval=0",
    "validation.before_train=false",
    "checkpoint.save_interval=0",
    "checkpoint.resume=none",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]
"""Both sides' config (the worker reads the same)."""
MODES = {
    "in-process": (0, 0, True, False, False),
    "k0": (1, 0, True, False, False),
    "k1": (1, 1, False, False, False),
    "k1-overlap": (1, 1, True, False, False),
    "k1-scored": (1, 1, False, True, False),
    "k1-partial": (1, 1, False, False, True),
    "k2": (1, 2, False, False, False),
}
"""Mode -> (rollout workers, max_staleness, rollout.overlap_push, rollout.score_on_workers,
rollout.partial with rollout.schedule=dynamic)."""


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


ESTIMATORS = {
    "grpo": ["ppo.advantage=grpo", "ppo.samples_per_prompt=8"],
    "gae": ["ppo.advantage=gae", "ppo.samples_per_prompt=1"],
}
"""``--advantage``: critic-free GRPO against a reward-only server, or GAE against a critic."""


def one_run(
    mode: str, steps: int, url: str, tmp: Path, cores: list[int], settings: list[str], name: str
) -> list[dict]:
    """One mode's run in ``tmp / name`` (the worker on ``cores[1]`` when there are two); its
    metrics rows."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from aligner.actor.run import run
    from aligner.distributed import spare_port
    from aligner.metrics import read_metrics

    workers, k, overlap, scored, partial = MODES[mode]
    address = f"127.0.0.1:{spare_port()}"
    rollout = [f"rollout.workers={workers}", f"rollout.max_staleness={k}", f"rollout.address={address}"]
    rollout.append(f"rollout.overlap_push={str(overlap).lower()}")
    if partial:  # the worker takes versions pushed mid-batch
        rollout += ["rollout.schedule=dynamic", "rollout.partial=true"]
    if scored:  # the worker asks the server for its batch's scores
        rollout += ["rollout.score_on_workers=true", f"critic.url={url}"]
    run_dir = tmp / name
    with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
        dcfg = compose(
            "actor",
            overrides=[
                *settings,
                *rollout,
                f"critic.url={url}",
                f"ppo.num_steps={steps}",
                f"logging.run_dir={run_dir}",
                f"checkpoint.dir={run_dir / 'ckpt'}",
            ],
        )
    worker = None
    if workers:
        pin = (lambda: os.sched_setaffinity(0, {cores[1]})) if len(cores) >= 2 else None
        worker = subprocess.Popen(
            [sys.executable, "-m", "aligner.rollout.worker", *settings, *rollout, "rollout.worker_rank=1"],
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            preexec_fn=pin,
            cwd=str(tmp),
        )
    try:
        run(OmegaConf.to_object(dcfg))
    finally:
        if worker is not None:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    return read_metrics(str(run_dir / "metrics.jsonl"))


def summarize(rows: list[dict], target: float, batch: int) -> dict:
    rows = [r for r in rows if "objective/scores" in r]
    t0 = rows[0]["time"] - rows[0]["timers/step"]
    scores = [r["objective/scores"] for r in rows]
    hit = next((i for i in range(2, len(rows)) if sum(scores[i - 2 : i + 1]) / 3 >= target), None)
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows[2:])  # noqa: E731
    wait = statistics.fmean(
        r.get("rollout/trainer_wait_frac", (r["timers/generate"] + r["timers/refit"]) / r["timers/step"])
        for r in rows[2:]
    )
    push = "push/step_frac" in rows[-1]
    return {
        "step_s": statistics.median(r["timers/step"] for r in rows[2:]),
        "wall_s": rows[-1]["time"] - t0,
        "time_to_target_s": None if hit is None else rows[hit]["time"] - t0,
        "episodes_to_target": None if hit is None else (hit + 1) * batch,
        "trainer_wait_share": wait,
        "worker_idle_share": mean("rollout/worker_idle_frac")
        if "rollout/worker_idle_frac" in rows[-1]
        else None,
        "push_step_frac": mean("push/step_frac") if push else None,
        "push_hidden_frac": mean("push/hidden_frac") if push else None,
        "push_wait_s": statistics.median(r["push/wait_s"] for r in rows[2:]) if push else None,
        "critic_wait_share": mean("timers/critic_wait") / mean("timers/step"),
        "token_staleness": mean("rollout/token_staleness") if "rollout/token_staleness" in rows[-1] else None,
        "swapped_token_frac": mean("rollout/swapped_token_frac") if "rollout/swaps" in rows[-1] else None,
        "final_score": statistics.fmean(scores[-3:]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--target", type=float, default=0.25, help="mean score over three steps")
    ap.add_argument("--modes", default="in-process,k0,k1", help=f"comma list of {list(MODES)}")
    ap.add_argument("--advantage", choices=list(ESTIMATORS), default="grpo")
    ap.add_argument("--seeds", default=None, help="comma list of seeds (default: the config's)")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: expected some of {list(MODES)}")

    import torch

    from aligner.critic.launch import start_server

    torch.set_num_threads(1)
    cores = _cores()
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    server = start_server(
        [
            "server.grpc_port=0",
            "server.metrics_port=null",
            *(
                ["mode=reward_only"]
                if args.advantage == "grpo"
                else ["model.max_seq_len=16", "optim.lr=1e-3"]
            ),
            "reward.fn=aligner.tasks.digits:sort_reward",
            f"log.dir={tmp / 'server'}",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
        ],
        log_path=tmp / "server.log",
    )
    if len(cores) >= 2:  # after the server started: it keeps both cores
        os.sched_setaffinity(0, {cores[0]})
    results = {}
    try:
        for seed in seeds:
            for mode in modes:
                settings = [
                    *SETTINGS,
                    *ESTIMATORS[args.advantage],
                    *([f"seed={seed}"] if seed is not None else []),
                ]
                name = mode if seed is None else f"{mode}/{seed}"
                rows = one_run(mode, args.steps, server.url, tmp, cores, settings, name.replace("/", "-"))
                results[name] = summarize(rows, args.target, BATCH)
    finally:
        server.stop()
    print(
        json.dumps(
            {"cores": len(cores), "advantage": args.advantage, "steps": args.steps, "target": args.target}
            | {"results": results},
            indent=2,
        )
    )
    print(f"\n{'mode':<20}" + "".join(f"{k:>20}" for k in next(iter(results.values()))))
    for mode, r in results.items():
        cells = "".join(
            f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else v):>20}" for v in r.values()
        )
        print(f"{mode:<20}{cells}")
    if len(seeds) > 1:
        print(f"\n{'mode':<20}{'mean episodes to target':>26}{'ratio to k0':>14}  per seed")
        miss = (args.steps + 1) * BATCH
        eps = {m: [results[f"{m}/{s}"]["episodes_to_target"] or miss for s in seeds] for m in modes}
        for m, e in eps.items():
            ratio = statistics.fmean(e) / statistics.fmean(eps["k0"]) if "k0" in eps else float("nan")
            print(f"{m:<20}{statistics.fmean(e):>26.0f}{ratio:>14.2f}  {e}")
    return results


if __name__ == "__main__":
    main()
