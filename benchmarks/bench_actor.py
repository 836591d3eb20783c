"""The actor's PPO step, end to end against a real critic/reward server, split by phase.

A fixed tiny configuration (the demo's model, the sort-6 task, batch 256): the server and the
actor each on one core. Reports seconds per phase (generate, log-probs, critic wait, policy
update), generated tokens per second with the KV cache and by full recompute without it,
and the share of the step the actor spends idle waiting on the server.

    .venv/bin/python benchmarks/bench_actor.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("timers/generate", "timers/logprobs", "timers/critic_wait", "timers/train", "timers/step")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="PPO steps (the first 2 are warm-up)")
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from aligner.critic.launch import start_server
    from aligner.metrics import read_metrics

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[0]})  # the server inherits this core
    tmp = Path(tempfile.mkdtemp(prefix="bench-actor-"))
    server = start_server(
        [
            "server.grpc_port=0",
            "server.metrics_port=null",
            "model.max_seq_len=16",
            "optim.lr=1e-3",
            "reward.fn=aligner.tasks.digits:sort_reward",
            f"log.dir={tmp / 'critic'}",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
        ],
        log_path=tmp / "server.log",
    )
    try:
        if len(cores) >= 2:
            os.sched_setaffinity(0, {cores[1]})  # the actor (this process) on the other core
        from aligner.actor.run import run

        with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
            dcfg = compose(
                "actor",
                overrides=[
                    "+recipe=digits",
                    f"critic.url={server.url}",
                    f"logging.run_dir={tmp / 'actor'}",
                    f"ppo.num_steps={args.steps}",
                    f"ppo.global_batch_size={args.batch}",
                    "logging.progress_bar=false",
                    "logging.tensorboard=false",
                ],
            )
        cfg = OmegaConf.to_object(dcfg)
        run(cfg)
    finally:
        server.stop()
    rows = read_metrics(str(tmp / "actor" / "metrics.jsonl"))[2:]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    result = {f"{k.split('/')[1]}_s": mean(k) for k in PHASES}
    result["critic_idle_share"] = result["critic_wait_s"] / result["step_s"]
    result["tokens_per_s_kv_cache"] = mean("throughput/tokens_per_s")
    result["tokens_per_s_no_cache"] = _no_cache_tokens_per_s(cfg, args.batch)
    result["batch"] = args.batch
    result["steps_measured"] = len(rows)
    print(json.dumps(result, indent=2))
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v:12.4f}" if isinstance(v, float) else f"{k:<{width}}  {v:>12}")
    return result


def _no_cache_tokens_per_s(cfg, batch: int) -> float:
    """The same sampling done by full recompute at every step (the reference decoder)."""
    from aligner import distributed
    from aligner.generation.engine import SamplingParams
    from aligner.generation.no_cache import generate_no_cache
    from aligner.models import gpt
    from aligner.tasks import get_task
    from aligner.tokenizers import build_tokenizer

    tok = build_tokenizer(cfg.tokenizer, cfg.init_from)
    distributed.initialize(cfg.parallel, seed=cfg.seed)
    try:
        model = gpt.build_policy(cfg.model)
        prompts = [tok.encode(p) for p in get_task(cfg.data.task, cfg.data.num_digits).prompts(batch, seed=0)]
        sp = SamplingParams(max_new_tokens=cfg.generation.max_new_tokens, seed=1)
        t = time.perf_counter()
        out = generate_no_cache(
            model,
            prompts,
            sp,
            pad_id=tok.pad_id,
            eos_id=tok.eos_id,
            max_seq_len=cfg.model.max_seq_len,
            vocab_size=tok.sample_vocab_size,
        )
        dt = time.perf_counter() - t
        return float(out.response_lengths.sum()) / dt
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
