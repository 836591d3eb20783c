"""TRL's side of the TRL comparison: TRL 1.12's ``PPOTrainer`` (``trl.experimental.ppo``) on a
case's shared inputs, in this process, with its generation and rollout forwards timed. Needs the
``bench`` extra; :func:`trl_available` says whether it is installed."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.vs_trl.cases import KL_COEF, LR, Case


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
        from trl.experimental.ppo import PPOTrainer  # noqa: F401
    except Exception:
        return False
    return True


def run_trl(case: Case, inputs: dict[str, str], args, out: Path) -> dict:
    """TRL 1.12 ``PPOTrainer`` on the same models, tokenizer and prompts, in this process."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix=f"bench-trl-{case.name}-", dir=args.workdir))
    steps = args.warmup + args.updates
    tok = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    prompts = [json.loads(line)["prompt"] for line in open(inputs["prompts"])]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts[: case.batch * steps]]
    dataset = Dataset.from_dict({"input_ids": ids})
    bf16 = args.precision == "bf16"
    if bf16 and not args.trl_as_configured:
        # PPOTrainer builds its own Accelerator without a mixed_precision argument: its bf16 flag
        # reaches it only through this variable (otherwise the run is silently fp32).
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    kw = {"attn_implementation": args.trl_attn, "dtype": torch.float32}
    # Trained models stay fp32 (autocast computes in bf16; fp32 master weights, as ours); the
    # frozen reference and reward model are loaded in bf16, as a bf16 run would.
    frozen = {**kw, "dtype": torch.bfloat16 if bf16 else torch.float32}
    policy = transformers.LlamaForCausalLM.from_pretrained(inputs["policy"], **kw)
    ref = transformers.LlamaForCausalLM.from_pretrained(inputs["policy"], **frozen)
    value = transformers.LlamaForSequenceClassification.from_pretrained(inputs["reward"], num_labels=1, **kw)
    reward = transformers.LlamaForSequenceClassification.from_pretrained(
        inputs["reward"], num_labels=1, **frozen
    )
    config = PPOConfig(
        output_dir=str(work),
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=case.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=case.ppo_epochs,
        local_rollout_forward_batch_size=case.batch,
        total_episodes=case.batch * steps,
        response_length=case.new_tokens,
        stop_token="eos",
        temperature=1.0,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        gamma=1.0,
        lam=0.95,
        learning_rate=LR,
        lr_scheduler_type="constant",
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1234,
    )

    # Time generation: the trainer calls this module-level function once per update.
    gen_times: list[float] = []
    real_batch_generation = trl_ppo.batch_generation

    def timed_batch_generation(*a, **k):
        t = time.perf_counter()
        result = real_batch_generation(*a, **k)
        gen_times.append(time.perf_counter() - t)
        return result

    trl_ppo.batch_generation = timed_batch_generation

    # Time the rollout's no-grad forwards (reference, value, reward); the rest of an update
    # after generation is the PPO epochs (and TRL's bookkeeping).
    rollout_times: list[float] = []
    real_forward, real_get_reward = trl_ppo.forward, trl_ppo.get_reward

    def timed(fn):
        def wrapper(*a, **k):
            if torch.is_grad_enabled():
                return fn(*a, **k)
            t = time.perf_counter()
            result = fn(*a, **k)
            rollout_times.append(time.perf_counter() - t)
            return result

        return wrapper

    trl_ppo.forward, trl_ppo.get_reward = timed(real_forward), timed(real_get_reward)

    stamps: list[float] = []
    logs_seen: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs:
                logs_seen.append(dict(logs))

    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        callbacks=[Clock()],
    )
    t_start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t_start
    trl_ppo.batch_generation = real_batch_generation
    trl_ppo.forward, trl_ppo.get_reward = real_forward, real_get_reward
    all_stamps = [t_start, *stamps]
    per = [b - a for a, b in zip(all_stamps[:-1], all_stamps[1:])]
    measured = per[args.warmup :] or per
    gen = gen_times[args.warmup :] or gen_times
    gen_s = statistics.fmean(gen)
    per_update_forwards = len(rollout_times) // max(len(gen_times), 1)  # 3: reference, value, reward
    fwd = rollout_times[args.warmup * per_update_forwards :] or rollout_times
    fwd_s = sum(fwd) / max(len(fwd) // max(per_update_forwards, 1), 1)
    s_update = statistics.median(measured)
    result = {
        "system": "trl",
        "trl_version": trl.__version__,
        "case": asdict(case),
        "precision": str(trainer.accelerator.mixed_precision),
        "attn_implementation": args.trl_attn,
        "threads": threads,
        "s_per_update": s_update,
        "s_per_update_best": min(measured),
        "s_per_update_all": measured,
        "generate_s": gen_s,
        "gen_tokens_per_s": case.batch * case.new_tokens / gen_s,
        "phases_s": {"generate": gen_s, "forwards": fwd_s, "train": s_update - gen_s - fwd_s},
        "scores": [r["objective/scores"] for r in logs_seen if "objective/scores" in r],
        "wall_s": wall,
    }
    out.write_text(json.dumps(result, indent=2))
    return result
