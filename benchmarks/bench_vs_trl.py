"""Side by side: this project's actor + critic server against TRL 1.12's ``PPOTrainer``
(``trl.experimental.ppo``, the last release that has it) on identical PPO work.

    .venv/bin/python benchmarks/bench_vs_trl.py [--cases B1,B2] [--precision bf16|fp32] [--updates 3]

``make bench`` runs it (``make bench`` installs the ``bench`` extra: trl 1.12 and its
dependencies); without trl only our side runs. One invocation builds the shared inputs, then
runs each system in a fresh child process, case by case, and prints a JSON report and a table:
seconds per PPO update, generated tokens per second, TRL/ours ratios, the phase split, the
actor's idle share waiting on the server, and model FLOPs utilisation against the
matrix-product peak measured here (at the run's precision, on all cores).

Cases (a Llama-shaped model of 4 layers, hidden 256, 8 heads, FFN 680, vocabulary 512, built
from a config with seeded random weights, no download):

- B1: 64 prompts of 16 tokens, 48 new tokens, 4 PPO epochs, one minibatch;
- B2: the same with 192 new tokens and 1 PPO epoch.

The same work on both sides
---------------------------
- One HF folder per role, written once and loaded by both: the policy (``LlamaForCausalLM``;
  the reference starts as its copy) and a reward model (``LlamaForSequenceClassification``),
  which is also where the value model / critic starts, as TRL's examples and the N+
  implementation details do. A reward *model* (not a function), so both sides run its forward.
- One tokenizer folder (a word-level vocabulary of 512 built with ``tokenizers``, distinct
  ``<pad>`` and ``<eos>``), the same prompts (16 random word ids each).
- Sampling at temperature 1 over the full vocabulary; a response ends at ``<eos>`` on both
  sides (TRL ``stop_token="eos"``; ours always). Both keep decoding the whole batch until every
  row has stopped, and with 64 rows some row practically always runs to the limit, so both
  decode ``response_length`` steps: the decode work is identical, and generated tokens/s is
  counted as batch x response_length over the generation time on both sides.
- PPO: k1 KL penalty 0.05 against the reference, GAE (gamma 1, lambda 0.95), whitened
  advantages, ratio clip 0.2, clipped value loss (0.2), constant learning rate 3e-6 (TRL's
  default) for policy and value, AdamW, every PPO epoch one minibatch of all 64 samples, the
  value model trained for as many epochs as the policy.
- TRL runs with ``gradient_checkpointing=False`` (its ``PPOConfig`` turns it on by default,
  which recomputes every forward) and no sample generations or checkpoints; it is run with
  each attention implementation of ``--trl-attn`` (default ``sdpa`` and ``eager``: eager is the
  faster at 48 new tokens, sdpa at 192) and its fastest run is kept.

Known differences in the work: TRL reads the rollout log-probs from the generation scores;
our actor takes them from the first PPO pass's own forward (``ppo.reuse_rollout_forward``: with
one minibatch that forward runs on the rollout's weights and tokens, so its detached output is
the training forward's log-probs, and the entropy metric comes with it). TRL computes the
rollout values with a no-grad forward of the value model and trains it with fresh forwards;
our server keeps its ``critic_infer`` forward (with gradients) as the first training pass
(``optim.reuse_infer_forward``): one value forward fewer, which the FLOP count below still
counts (it is the work model of the algorithm, the same for both). TRL trains policy and value
with one optimizer on one summed loss (``vf_coef`` 0.1); we train them in two processes with
two optimizers: the same forwards, backwards and optimizer steps.

Precision
---------
``--precision bf16`` (default: the project's ``precision: auto`` on these CPUs, and
``PPOConfig``'s default ``bf16=True``) or ``fp32``; both sides run the same one. Ours: bf16
weights and compute with fp32 master weights in the actor and the server. TRL: its models
load in fp32 and train under torch autocast (fp32 master weights); the frozen reference and
reward model load in bf16. ``PPOTrainer`` builds its own ``Accelerator`` without passing the
precision on, so ``PPOConfig(bf16=True)`` alone runs fp32 on a CPU: this benchmark sets
``ACCELERATE_MIXED_PRECISION=bf16`` for it (``--trl-as-configured`` leaves that out, to
measure what the config alone gives). The report records what each side ran.

Forward
-------
``--model-forward`` (default ``compiled``) sets our actor's and server's ``model_forward``: the
fused forward under ``torch.compile``; with ``compiled`` the actor's decode step is compiled
too (``generation.decode_step=compiled``). The compiles (a few per process, one per graph and
shape) run in the warm-up updates, which are not measured; ``fused`` needs none. TRL runs its
models' eager forward, as ``PPOConfig``'s defaults (``torch_compile=False``) have it.

Threads
-------
Both systems get the whole machine. TRL is one process with ``--threads`` (default: all
cores) torch threads. Ours is two processes: the critic server with ``--server-threads``
(default 1) and the actor with ``--actor-threads`` (default: the cores left, at least 1),
raised to ``--gen-threads`` (default: all cores) while it generates, when the server has
normally finished the previous step's critic update and has nothing to do.

Timing
------
Each system runs ``--warmup`` updates (default 4: our processes compile a graph per new
sequence length in the first few, until their shapes go dynamic) and then ``--updates``
measured ones; seconds per update is the median wall time between the ends of consecutive
measured updates
(TRL: its ``on_step_end`` callback; ours: the metrics log's timestamps). On a shared machine
numbers move with other load: ``--repeats N`` runs N rounds, each system once per round in
alternating order (so that a slow spell falls on both systems' runs of a round), keeps each
system's best median, and also reports TRL's time over ours within each round and the median
of those ratios, and our actor's idle share in each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Case:
    """One benchmark shape."""

    name: str
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    ffn: int = 680
    vocab: int = 512
    batch: int = 64
    prompt_len: int = 16
    new_tokens: int = 48
    ppo_epochs: int = 4

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.new_tokens


CASES = {
    "B1": Case("B1", new_tokens=48, ppo_epochs=4),
    "B2": Case("B2", new_tokens=192, ppo_epochs=1),
    # A miniature for the smoke test: seconds, not minutes.
    "mini": Case("mini", layers=1, hidden=32, heads=2, ffn=64, vocab=64, batch=4, prompt_len=4, new_tokens=4),
}

LR = 3e-6
KL_COEF = 0.05


# -- shared inputs --------------------------------------------------------------------------


def build_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level HF tokenizer of exactly ``vocab`` ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
    ``<unk>`` 3, then ``t4`` .. ``t{vocab-1}``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    ids = {t: i for i, t in enumerate(specials)}
    ids.update({f"t{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))


def model_config(case: Case):
    from aligner.models.config import ModelConfig

    return ModelConfig(
        num_layers=case.layers,
        hidden_size=case.hidden,
        num_attention_heads=case.heads,
        ffn_hidden_size=case.ffn,
        vocab_size=case.vocab,
        max_seq_len=case.max_seq_len,
    )


def build_inputs(case: Case, root: Path, seed: int = 0) -> dict[str, str]:
    """Tokenizer, policy and reward HF folders and a prompt file for ``case`` under ``root``."""
    import torch
    import transformers

    from aligner.models.hf import hf_config_from_model_config

    root.mkdir(parents=True, exist_ok=True)
    paths = {k: str(root / k) for k in ("tokenizer", "policy", "reward")}
    paths["prompts"] = str(root / "prompts.jsonl")
    build_tokenizer(Path(paths["tokenizer"]), case.vocab)
    cfg = model_config(case)
    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    for role, arch, s in (
        ("policy", "LlamaForCausalLM", seed),
        ("reward", "LlamaForSequenceClassification", seed + 1),
    ):
        hcfg = hf_config_from_model_config(cfg, arch, base=ids)
        torch.manual_seed(s)
        model = getattr(transformers, arch)(hcfg).float()
        model.save_pretrained(paths[role])
    g = torch.Generator().manual_seed(seed + 2)
    # Enough prompts that no update repeats a prompt batch.
    n = case.batch * 64
    words = torch.randint(4, case.vocab, (n, case.prompt_len), generator=g).tolist()
    with open(paths["prompts"], "w") as f:
        for row in words:
            f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in row)}) + "\n")
    return paths


def matmul_peak(threads: int, seconds: float = 1.5) -> dict[str, float]:
    """Best GFLOP/s of square torch.mm products (fp32 and bf16) on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for n in (512, 1024, 2048):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            torch.mm(a, b)
            deadline = time.perf_counter() + seconds / 3
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
        out[name] = round(best, 1)
    return out


# -- model FLOPs ----------------------------------------------------------------------------


def forward_flops(case: Case, tokens: int, context: float, head: str) -> float:
    """Forward FLOPs of ``tokens`` token positions whose attention sees ``context`` positions on
    average (2 FLOPs per multiply-add; attention scores and context both counted)."""
    h, f, L = case.hidden, case.ffn, case.layers
    per_layer = 2 * (h * 3 * h + h * h + h * 2 * f + f * h) + 2 * 2 * context * h
    out = case.vocab if head == "lm" else 1
    return tokens * (L * per_layer + 2 * h * out)


def update_flops(case: Case) -> dict[str, float]:
    """Model FLOPs one PPO update needs (the same work model for both systems): generation, the
    reference, value and reward forwards, and per epoch policy + value forward and backward
    (backward = 2x forward). The rollout value forward is counted although our server takes it
    from its first training pass."""
    b, p, n = case.batch, case.prompt_len, case.new_tokens
    s = p + n
    gen = forward_flops(case, b * p, (p + 1) / 2, "lm") + forward_flops(case, b * n, p + n / 2, "lm")
    full_lm = forward_flops(case, b * s, (s + 1) / 2, "lm")
    full_v = forward_flops(case, b * s, (s + 1) / 2, "value")
    rollout = full_lm + 2 * full_v  # reference, value, reward
    train = case.ppo_epochs * 3 * (full_lm + full_v)
    return {"generate": gen, "rollout_forwards": rollout, "train": train, "total": gen + rollout + train}


# -- our system -----------------------------------------------------------------------------


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

    from aligner.critic.config import CriticServerConfig
    from aligner.critic.launch import start_server
    from aligner.metrics import read_metrics
    from aligner.ppo.config import ActorConfig

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
        "server.http_port=0",
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
        import importlib.util

        spec = importlib.util.spec_from_file_location("train_actor", ROOT / "examples" / "train_actor.py")
        entry = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(entry)
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
            dcfg = compose("actor", overrides=[f"critic.url={server.url}", *actor_overrides])
        cfg = OmegaConf.to_object(dcfg)
        t0 = time.time()
        entry.run(cfg)
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
        "response_length": mean("rollout/response_length"),
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


# -- TRL ------------------------------------------------------------------------------------


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


# -- driver ---------------------------------------------------------------------------------


def _child(role: str, case: str, inputs: Path, out: Path, args, attn: str) -> dict | None:
    cmd = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--cases",
        case,
        "--inputs",
        str(inputs),
        "--result",
        str(out),
        "--warmup",
        str(args.warmup),
        "--updates",
        str(args.updates),
        "--precision",
        args.precision,
        "--server-threads",
        str(args.server_threads),
        "--trl-attn",
        attn,
        "--workdir",
        str(args.workdir),
    ]
    for flag in ("threads", "actor_threads", "gen_threads"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for o in args.actor_override or []:
        cmd += ["--actor-override", o]
    cmd += ["--model-forward", args.model_forward]
    if args.trl_as_configured:
        cmd.append("--trl-as-configured")
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # each child sets its own thread counts
    print(f"--- {role} {case}" + (f" (attention: {attn})" if role == "trl" else ""), flush=True)
    rc = subprocess.call(cmd, env=env, cwd=str(ROOT))
    if rc != 0 or not out.exists():
        print(f"{role} {case}: failed (exit code {rc})", file=sys.stderr, flush=True)
        return None
    return json.loads(out.read_text())


def round_ratios(rounds: list[dict[str, float]]) -> list[float]:
    """TRL's seconds per update over ours, for each round in which both systems ran."""
    return [x["trl"] / x["ours"] for x in rounds if x.get("ours") and x.get("trl")]


def report(results: dict, peaks: dict[str, float], precision: str) -> str:
    peak = peaks[precision]
    lines = [
        f"matmul peak here: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s "
        f"(MFU below against {precision})",
        f"{'case':<5}{'system':<7}{'s/update':>10}{'gen tok/s':>11}{'MFU':>7}  phases (s)",
    ]
    for case, r in results.items():
        flops = update_flops(CASES[case])["total"]
        for system in ("ours", "trl"):
            x = r.get(system)
            if x is None:
                lines.append(f"{case:<5}{system:<7}{'-':>10}{'-':>11}{'-':>7}  (not run)")
                continue
            mfu = flops / x["s_per_update"] / (peak * 1e9)
            ph = "  ".join(f"{k} {v:.3f}" for k, v in x["phases_s"].items() if k != "step")
            if system == "ours":
                ph += f"  idle {100 * x['idle_share']:.1f}%"
            lines.append(
                f"{case:<5}{system:<7}{x['s_per_update']:>10.3f}{x['gen_tokens_per_s']:>11.0f}"
                f"{100 * mfu:>6.1f}%  {ph}"
            )
        if r.get("ours") and r.get("trl"):
            o, t = r["ours"], r["trl"]
            lines.append(
                f"{case:<5}{'TRL/ours':<9}{t['s_per_update'] / o['s_per_update']:>8.2f}x"
                f"{o['gen_tokens_per_s'] / t['gen_tokens_per_s']:>10.2f}x  (seconds per update; tokens/s ours/TRL)"
            )
        paired = round_ratios(r.get("rounds", []))
        if len(paired) > 1:
            lines.append(
                f"{case:<5}{'rounds':<9}"
                + ", ".join(f"{x:.2f}x" for x in paired)
                + f"  (TRL/ours within each round; median {statistics.median(paired):.2f}x)"
            )
        idle = [x["ours_idle"] for x in r.get("rounds", []) if "ours_idle" in x]
        if len(idle) > 1:
            lines.append(
                f"{case:<5}{'idle':<9}"
                + ", ".join(f"{100 * x:.1f}%" for x in idle)
                + "  (our actor's share of the step waiting on the server, each round)"
            )
    return "\n".join(lines)


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
        from trl.experimental.ppo import PPOTrainer  # noqa: F401
    except Exception:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="B1,B2", help=f"comma list of {list(CASES)}")
    ap.add_argument("--systems", default="ours,trl", help="comma list: ours, trl")
    ap.add_argument("--warmup", type=int, default=4, help="updates run before the measured ones")
    ap.add_argument("--updates", type=int, default=3, help="measured updates")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per case, each running every system once (best median kept)",
    )
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--threads", type=int, default=None, help="TRL's torch threads (default: all cores)")
    ap.add_argument("--server-threads", type=int, default=1, help="our critic server's threads")
    ap.add_argument(
        "--actor-threads", type=int, default=None, help="our actor's threads (default: cores left)"
    )
    ap.add_argument("--gen-threads", type=int, default=None, help="our actor's threads while generating")
    ap.add_argument(
        "--trl-attn",
        default="sdpa,eager",
        help="attn_implementation(s) of TRL's HF models, comma separated: each is run, the fastest kept",
    )
    ap.add_argument(
        "--trl-as-configured",
        action="store_true",
        help="do not route TRL's bf16 flag to its Accelerator (PPOConfig(bf16=True) then runs fp32 on a CPU)",
    )
    ap.add_argument(
        "--model-forward",
        default="compiled",
        help="our actor's and server's model_forward (auto, fused, compiled, megatron; '' = their default)",
    )
    ap.add_argument("--actor-override", action="append", help="extra Hydra override for our actor")
    ap.add_argument("--workdir", default=None, help="where inputs and runs go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the JSON report here")
    ap.add_argument("--role", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # library deprecation chatter; the report is the output

    if args.role is not None:  # a child: one system, one case
        case = CASES[args.cases]
        inputs = json.loads(Path(args.inputs).read_text())
        fn = run_ours if args.role == "ours" else run_trl
        fn(case, inputs, args, Path(args.result))
        return 0

    cases = [c for c in args.cases.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    bad = [c for c in cases if c not in CASES] + [s for s in systems if s not in ("ours", "trl")]
    if bad:
        print(f"unknown case(s)/system(s) {bad}", file=sys.stderr)
        return 2
    if "trl" in systems and not trl_available():
        print(
            "trl 1.12 is not installed: TRL's side is skipped. Install the bench extra: "
            "pip install -e '.[bench]'",
            flush=True,
        )
        systems = [s for s in systems if s != "trl"]
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-vs-trl-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    peaks = matmul_peak(args.threads or cores)
    results: dict[str, dict] = {}
    for name in cases:
        case = CASES[name]
        folder = Path(args.workdir) / f"inputs-{name}"
        inputs = build_inputs(case, folder)
        (folder / "inputs.json").write_text(json.dumps(inputs))
        results[name] = {}
        rounds: list[dict[str, float]] = []
        # Round by round (each system once per round), so that a slow spell of the machine
        # falls on both systems' runs of a round rather than on all of one system's; the order
        # alternates, so that going first or second is no system's advantage.
        for rep in range(args.repeats):
            this_round: dict[str, float] = {}
            for system in systems if rep % 2 == 0 else systems[::-1]:
                attns = [a for a in args.trl_attn.split(",") if a] if system == "trl" else ["-"]
                for attn in attns:
                    out = folder / f"{system}-{attn}-{rep}.json"
                    got = _child(system, name, folder / "inputs.json", out, args, attn)
                    if got is None:
                        continue
                    s = got["s_per_update"]
                    this_round[system] = min(this_round.get(system, s), s)
                    if system == "ours":
                        this_round["ours_idle"] = got["idle_share"]
                    best = results[name].get(system)
                    if best is None or s < best["s_per_update"]:
                        results[name][system] = got
            rounds.append(this_round)
        for system in systems:
            results[name].setdefault(system, None)
        results[name]["rounds"] = rounds
    flops = {name: update_flops(CASES[name]) for name in cases}
    full = {
        "precision": args.precision,
        "matmul_peak_gflops": peaks,
        "cores": cores,
        "model_flops_per_update": flops,
        "results": results,
    }
    print(json.dumps(full, indent=2))
    print()
    print(report(results, peaks, args.precision))
    if args.json:
        Path(args.json).write_text(json.dumps(full, indent=2))
    failed = any(r.get(s) is None for r in results.values() for s in systems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
