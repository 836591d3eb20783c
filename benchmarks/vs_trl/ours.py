"""Our side of the TRL comparison: the critic/reward server in a child process and the actor
(the real ``examples/train_actor.py`` recipe) in this one, on a case's shared inputs, for the
warm-up and the measured updates; the result is read back from both roles' metrics logs."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.vs_trl.cases import KL_COEF, LR, Case

ROOT = Path(__file__).resolve().parents[2]


def _config_has(cls, key: str) -> bool:
    """Whether the dataclass ``cls`` has the dotted ``key`` (configs grow keys over time)."""
    import dataclasses
    import typing

    head, _, rest = key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if head not in fields:
        return False
    if not rest:
        return True
    sub = typing.get_type_hints(cls).get(head)
    return dataclasses.is_dataclass(sub) and _config_has(sub, rest)


def run_ours(case: Case, inputs: dict[str, str], args, out: Path) -> dict:
    """Critic server (child process) + actor (this process) for warmup + updates steps."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from aligner.actor.config import ActorConfig
    from aligner.critic.config import CriticServerConfig
    from aligner.critic.launch import start_server
    from aligner.metrics import read_metrics

    cores = os.cpu_count() or 1
    actor_threads = args.actor_threads or max(1, cores - args.server_threads)
    gen_threads = args.gen_threads or cores
    torch.set_num_threads(actor_threads)
    work = Path(tempfile.mkdtemp(prefix=f"bench-ours-{case.name}-", dir=args.workdir))
    steps = args.warmup + args.updates
    precision = {"actor": "fp32 (no precision key)", "server": "fp32 (no precision key)"}
    model_overrides = [  # the same model shape for the critic/reward server and the actor
        f"model.num_layers={case.layers}",
        f"model.hidden_size={case.hidden}",
        f"model.num_attention_heads={case.heads}",
        f"model.ffn_hidden_size={case.ffn}",
        f"model.vocab_size={case.vocab}",
        f"model.max_seq_len={case.max_seq_len}",
    ]
    server_overrides = [
        "server.grpc_port=0",
        "server.metrics_port=null",
        f"server.max_batch_size={max(case.batch, 8)}",
        *model_overrides,
        "reward.fn=null",
        f"reward.hf_path={inputs['reward']}",
        "init.source=reward",
        f"optim.lr={LR}",
        "optim.value_clip_eps=0.2",
        f"optim.epochs={case.ppo_epochs}",
        "optim.num_minibatches=1",
        f"tokenizer={inputs['tokenizer']}",
        f"log.dir={work / 'critic'}",
        "log.tensorboard=false",
        "checkpoint.save_on_sigterm=false",
    ]
    if _config_has(CriticServerConfig, "precision"):
        server_overrides.append(f"precision={args.precision}")
        precision["server"] = args.precision
    if args.model_forward == "compiled":
        from aligner.models.fused import compile_available

        why = compile_available()
        if why is not None:  # e.g. no C++ compiler: the same fused forward, uncompiled
            print(f"model_forward=compiled is not available ({why}); running 'fused'", flush=True)
            args.model_forward = "fused"
    if args.model_forward and _config_has(CriticServerConfig, "model_forward"):
        server_overrides.append(f"model_forward={args.model_forward}")
    actor_overrides = [
        *model_overrides,
        f"tokenizer={inputs['tokenizer']}",
        f"init_from={inputs['policy']}",
        f"data.prompt_file={inputs['prompts']}",
        f"generation.max_new_tokens={case.new_tokens}",
        # The critic server is idle while the actor generates: generation takes every core.
        f"generation.num_threads={gen_threads}",
        "generation.temperature=1.0",
        f"optim.lr={LR}",
        f"optim.min_lr={LR}",
        "optim.warmup_steps=0",
        f"ppo.num_steps={steps}",
        f"ppo.global_batch_size={case.batch}",
        f"ppo.mini_batch_size={case.batch}",
        f"ppo.micro_batch_size={case.batch}",
        f"ppo.ppo_epochs={case.ppo_epochs}",
        f"ppo.init_kl_coef={KL_COEF}",
        "ppo.kl_estimator=k1",
        f"logging.run_dir={work / 'actor'}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.log_interval=1000000",
    ]
    if _config_has(ActorConfig, "precision"):
        actor_overrides.append(f"precision={args.precision}")
        precision["actor"] = args.precision
    if args.model_forward and _config_has(ActorConfig, "model_forward"):
        actor_overrides.append(f"model_forward={args.model_forward}")
    if args.model_forward == "compiled" and _config_has(ActorConfig, "generation.decode_step"):
        actor_overrides.append("generation.decode_step=compiled")
    # Nothing but PPO updates: no validation rounds, no checkpoints.
    for key, value in (
        ("validation.interval", 0),
        ("validation.before_train", "false"),
        ("checkpoint.save_interval", 0),
        ("checkpoint.save_at_end", "false"),
        ("checkpoint.keep_best", "false"),
        ("checkpoint.resume", "none"),
    ):
        if _config_has(ActorConfig, key):
            actor_overrides.append(f"{key}={value}")
    actor_overrides += list(args.actor_override or [])

    server = start_server(
        server_overrides,
        log_path=work / "server.log",
        env={"OMP_NUM_THREADS": str(args.server_threads)},
    )
    try:
        from aligner.actor.run import run

        with initialize_config_dir(config_dir=str(ROOT / "aligner" / "configs"), version_base=None):
            dcfg = compose("actor", overrides=[f"critic.url={server.url}", *actor_overrides])
        cfg = OmegaConf.to_object(dcfg)
        t0 = time.time()
        run(cfg)
        wall = time.time() - t0
    finally:
        server.stop()
    rows = [r for r in read_metrics(str(work / "actor" / "metrics.jsonl")) if "timers/step" in r]
    measured = rows[args.warmup :]
    stamps = [r["time"] for r in rows]
    per_update = (
        [b - a for a, b in zip(stamps[args.warmup - 1 : -1], stamps[args.warmup :])] if args.warmup else []
    )
    if not per_update:  # no warm-up: the step timers are all there is
        per_update = [r["timers/step"] for r in measured]
    mean = lambda k: statistics.fmean(r[k] for r in measured)  # noqa: E731
    gen_s = mean("timers/generate")
    phases = {
        k.split("/")[1]: mean(k)
        for k in ("timers/generate", "timers/logprobs", "timers/critic_wait", "timers/train", "timers/step")
    }
    phases["other"] = phases["step"] - sum(v for k, v in phases.items() if k != "step")
    critic_rows = []
    cpath = work / "critic" / "metrics.jsonl"
    if cpath.exists():
        critic_rows = [r for r in read_metrics(str(cpath)) if "timers/critic_train_ms" in r]
    result = {
        "system": "ours",
        "case": asdict(case),
        "precision": precision,
        "threads": {"actor": actor_threads, "actor_generate": gen_threads, "server": args.server_threads},
        "s_per_update": statistics.median(per_update),
        "s_per_update_best": min(per_update),
        "s_per_update_all": per_update,
        "step_timer_s": phases["step"],
        "generate_s": gen_s,
        "gen_tokens_per_s": case.batch * case.new_tokens / gen_s,
        "sampled_tokens_per_s": mean("throughput/tokens_per_s"),
        "response_length": mean("response_length/mean"),
        "phases_s": phases,
        "idle_share": phases["critic_wait"] / phases["step"],
        "critic_train_s": (
            statistics.fmean(r["timers/critic_train_ms"] for r in critic_rows[args.warmup :]) / 1000
            if len(critic_rows) > args.warmup
            else None
        ),
        "scores": [r["objective/scores"] for r in rows],
        "wall_s": wall,
    }
    out.write_text(json.dumps(result, indent=2))
    return result
