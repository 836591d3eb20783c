"""Typed configuration of the actor (backs ``configs/actor.yaml``).

One small dataclass per component, each field with a one-line docstring. Cross-field checks
run once, before any model is built, and report every problem together.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from aligner.distributed import ParallelConfig
from aligner.generation.engine import DECODE_STEPS
from aligner.models.config import FORWARD_MODES, ConfigError, ModelConfig

__all__ = [
    "ActorConfig",
    "DataConfig",
    "GenerationConfig",
    "PPOConfig",
    "OptimConfig",
    "CriticClientConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "ValidationConfig",
    "ConfigError",
    "validate_actor_config",
    "load_prompts",
]


@dataclass
class DataConfig:
    """Where prompts come from."""

    task: str | None = "sort"
    """Built-in task ('copy', 'reverse', 'sort'); ignored when prompt_file is set."""
    num_digits: int = 6
    """Digits per prompt for the built-in tasks."""
    prompt_file: str | None = None
    """A JSONL file of {"prompt": ...} lines, used instead of a built-in task."""
    num_prompts: int = 100_000
    """Prompts drawn from a built-in task (an epoch of data)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (with the run's seed)."""


@dataclass
class GenerationConfig:
    """How responses are sampled during rollouts."""

    max_new_tokens: int = 8
    """Longest response, end-of-sequence included."""
    temperature: float = 1.0
    """Sampling temperature; the training forward divides logits by the same value."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    stop_strings: list[str] = field(default_factory=list)
    """Extra strings that end a response."""
    num_threads: int | None = None
    """CPU threads while generating (restored afterwards): decoding is bound by per-step overhead,
    so a CPU actor may generate on more threads than it trains on; None keeps torch's setting.
    When it exceeds the training threads, the cores are taken to be shared with the critic
    server: each step waits for the server's pending critic update before generating (counted
    in ``timers/critic_wait``)."""
    decode_step: str = "auto"
    """The native engine's decode step: ``auto`` (a CUDA graph on a GPU at TP=1, else eager),
    ``eager``, ``static``, ``graph`` (CUDA), or ``compiled`` (``torch.compile``, TP=1; on a CPU
    about 1.5x the eager step's tokens/s, after a compile of seconds per batch shape)."""


@dataclass
class OptimConfig:
    """Adam with linear warmup and cosine decay, for the policy."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 5
    """Optimizer steps of linear warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_eps: float = 1e-5
    """Adam epsilon (1e-5 as in the N+ implementation details, not torch's 1e-8)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    trainable_last_n_layers: int | None = None
    """Train only the last N transformer layers (and the final norm and LM head); None = all."""


@dataclass
class PPOConfig:
    """The PPO algorithm: batch sizes, KL control, advantage estimation and the losses."""

    num_steps: int = 100
    """PPO steps (rollout + update) to run."""
    global_batch_size: int = 64
    """Prompts per step, over all data-parallel ranks."""
    mini_batch_size: int = 32
    """Prompts per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 32
    """Prompts per forward/backward on one rank (gradient accumulation below the minibatch)."""
    ppo_epochs: int = 2
    """Passes over the rollout batch per step."""
    reuse_rollout_forward: bool = True
    """With one minibatch of one micro-batch per rank and a dropout-free forward
    (``model_forward`` fused or compiled), the rollout's log-probs come from the first PPO
    pass's own forward (its output, detached) instead of a separate no-grad forward of the same
    weights on the same tokens: one policy forward fewer per step, and the first ratio is
    exactly 1."""
    clip_eps: float = 0.2
    """Policy ratio clip (lower side, and upper side unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (DAPO's clip-higher); None = clip_eps."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss for negative advantages (Ye et al. 2020)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    loss_agg: str = "token_mean"
    """'token_mean' or 'seq_mean_token_mean'."""
    init_kl_coef: float = 0.02
    """Initial beta of the per-token KL penalty (0 skips the reference model)."""
    adaptive_kl: bool = False
    """Use Ziegler et al.'s adaptive controller instead of a fixed beta."""
    kl_target: float = 6.0
    """Target KL of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon of the adaptive controller."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward: 'k1', 'abs' or 'k3'."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda for the advantages."""
    value_lam: float | None = None
    """GAE lambda for the value targets (None = lam)."""
    whiten_advantages: bool = True
    """Whiten advantages over the global batch."""
    score_clip: float | None = None
    """Clip scores to [-c, c] before shaping (None = off)."""
    normalize_scores: bool = False
    """Normalise scores with running mean/std across steps."""
    missing_eos_penalty: float | None = None
    """Added to the score of responses that never emitted end-of-sequence (None = off)."""
    reference_on_cpu: bool = False
    """Keep the frozen reference model on the CPU (saves accelerator memory)."""


@dataclass
class CriticClientConfig:
    """How the actor reaches the critic/reward server."""

    url: str | None = None
    """grpc://HOST:PORT or http://HOST:PORT; falls back to $ALIGNER_CRITIC_URL."""
    timeout_s: float = 120.0
    """Per-request timeout."""
    ready_timeout_s: float = 120.0
    """How long to wait for the server to become ready at start-up."""
    retries: int = 5
    """Retries with backoff for requests that are safe to repeat."""


@dataclass
class LoggingConfig:
    """Where and how often the run reports."""

    run_dir: str = "runs/actor"
    """Directory for metrics.jsonl, TensorBoard events and plots."""
    log_interval: int = 1
    """Print a console line every N steps (the progress bar updates every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    progress_bar: bool = True
    """Show a progress bar with reward, KL and step time."""


@dataclass
class CheckpointConfig:
    """Checkpoints of the run under ``<dir>/step_XXXXXXXX/actor/`` (the critic server writes
    ``.../critic/`` beside it when it shares the folder), and resuming from them."""

    dir: str | None = None
    """Root of the run's checkpoints; None = <logging.run_dir>/checkpoints."""
    save_interval: int = 0
    """Save every N steps (0 = only at the end)."""
    save_at_end: bool = True
    """Save after the last step."""
    keep_last: int = 3
    """Actor checkpoints kept (older ones are removed once a newer one is complete); 0 keeps all."""
    keep_best: bool = True
    """When validation reaches a new best val/scores, save that step and keep it as 'best'
    (never pruned; <dir>/best links to it)."""
    resume: str = "auto"
    """'auto': continue from the newest step both roles completed (fresh if none); 'none': start
    fresh; or a checkpoint folder (<dir>/step_XXXXXXXX) to continue from."""
    export_hf: str | None = None
    """At the end, export the policy as a Hugging Face folder here (None = no export)."""
    export_arch: str | None = None
    """HF architecture of the export (default: the one recorded when the policy was imported, else llama)."""


@dataclass
class ValidationConfig:
    """Greedy generation on a fixed prompt set, scored by the server."""

    interval: int = 0
    """Validate every N steps (0 = never)."""
    before_train: bool = False
    """Also validate the initial policy, logged at step 0."""
    num_prompts: int = 64
    """Evaluation prompts drawn from the built-in task (fixed; independent of the batch sizes)."""
    prompt_file: str | None = None
    """A JSONL file of {"prompt": ...} lines to validate on instead (default: the training
    prompt_file's first num_prompts lines, or the built-in task with its own seed)."""
    seed: int = 20_231
    """Seed that draws the built-in task's evaluation prompts (distinct from training's)."""
    num_samples: int = 4
    """Prompts and responses shown in the samples table (console, val_samples.jsonl, TensorBoard)."""


@dataclass
class ActorConfig:
    """Everything the actor needs."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=14, max_seq_len=32
        )
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    critic: CriticClientConfig = field(default_factory=CriticClientConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    tokenizer: str = "char"
    """'char' (the built-in digit vocabulary) or a HF tokenizer folder."""
    init_from: str | None = None
    """A policy checkpoint folder (ours or HF) to start from; None = random init."""
    seed: int = 1234
    """Seed for weights, data order and sampling."""
    precision: str = "auto"
    """'bf16' (bf16 weights and compute for policy, reference and generation; fp32 master weights,
    gradients and Adam state; log-probs, KL, GAE and losses in fp32), 'fp32', or 'auto' (bf16
    where the GPU or CPU computes it natively)."""
    model_forward: str = "auto"
    """How the full-sequence forwards (log-probs, reference, training) run the policy and the
    reference: 'fused' (``aligner.models.fused``: Megatron's arithmetic in fewer ops on the same
    parameters), 'compiled' (fused under torch.compile, TP=1: faster steps after a compile of
    seconds to a minute per shape), 'megatron' (the modules' own forward), or 'auto' (fused
    where the architecture allows it, else megatron)."""


def _problems_positive(obj: Any, prefix: str, names: tuple[str, ...]) -> list[str]:
    out = []
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"{prefix}.{n}={v!r}: expected a positive integer")
    return out


def validate_actor_config(cfg: ActorConfig, world_size: int = 1, vocab_size: int | None = None) -> None:
    """Check every cross-field constraint; raise one :class:`ConfigError` listing all problems."""
    e: list[str] = []
    p, g, o = cfg.ppo, cfg.generation, cfg.optim
    e += _problems_positive(
        p, "ppo", ("num_steps", "global_batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs")
    )
    e += _problems_positive(g, "generation", ("max_new_tokens",))
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    if pp != 1:
        e.append(
            f"parallel.pipeline_model_parallel_size={pp}: the actor runs tensor and data parallel; "
            "pipeline parallelism is supported by the models and checkpoints but not yet by the PPO "
            "loop: use 1"
        )
    if world_size % (tp * pp):
        e.append(f"world size {world_size} is not divisible by tensor x pipeline parallel size {tp * pp}")
    dp = max(world_size // (tp * pp), 1)
    if not e:
        if p.global_batch_size % p.mini_batch_size:
            e.append(
                f"ppo.global_batch_size ({p.global_batch_size}) must be divisible by ppo.mini_batch_size "
                f"({p.mini_batch_size})"
            )
        if p.mini_batch_size % dp:
            e.append(
                f"ppo.mini_batch_size ({p.mini_batch_size}) must be divisible by the data-parallel size "
                f"({dp})"
            )
        elif (p.mini_batch_size // dp) % p.micro_batch_size:
            e.append(
                f"ppo.mini_batch_size per data-parallel rank ({p.mini_batch_size // dp}) must be divisible "
                f"by ppo.micro_batch_size ({p.micro_batch_size})"
            )
        if p.global_batch_size % dp:
            e.append(
                f"ppo.global_batch_size ({p.global_batch_size}) must be divisible by the data-parallel "
                f"size ({dp})"
            )
    if not 0 < p.clip_eps < 1:
        e.append(f"ppo.clip_eps={p.clip_eps!r}: expected a value in (0, 1)")
    if p.clip_eps_high is not None and p.clip_eps_high <= 0:
        e.append(f"ppo.clip_eps_high={p.clip_eps_high!r}: expected > 0 or null")
    if p.dual_clip is not None and p.dual_clip <= 1:
        e.append(f"ppo.dual_clip={p.dual_clip!r}: expected a constant > 1 or null")
    if p.loss_agg not in ("token_mean", "seq_mean_token_mean"):
        e.append(f"ppo.loss_agg={p.loss_agg!r}: expected 'token_mean' or 'seq_mean_token_mean'")
    if p.kl_estimator not in ("k1", "abs", "k3"):
        e.append(f"ppo.kl_estimator={p.kl_estimator!r}: expected 'k1', 'abs' or 'k3'")
    if p.init_kl_coef < 0:
        e.append(f"ppo.init_kl_coef={p.init_kl_coef!r}: expected >= 0")
    for name in ("gamma", "lam"):
        v = getattr(p, name)
        if not 0 <= v <= 1:
            e.append(f"ppo.{name}={v!r}: expected a value in [0, 1]")
    if p.value_lam is not None and not 0 <= p.value_lam <= 1:
        e.append(f"ppo.value_lam={p.value_lam!r}: expected a value in [0, 1] or null")
    if g.temperature <= 0:
        e.append(f"generation.temperature={g.temperature!r}: expected > 0")
    if not 0 < g.top_p <= 1:
        e.append(f"generation.top_p={g.top_p!r}: expected a value in (0, 1]")
    if g.num_threads is not None and g.num_threads < 1:
        e.append(f"generation.num_threads={g.num_threads!r}: expected an integer >= 1 or null")
    if g.decode_step not in DECODE_STEPS:
        e.append(f"generation.decode_step={g.decode_step!r}: expected one of {list(DECODE_STEPS)}")
    if g.top_k < 0:
        e.append(f"generation.top_k={g.top_k!r}: expected >= 0")
    if cfg.precision not in ("auto", "bf16", "fp32"):
        e.append(f"precision={cfg.precision!r}: expected 'auto', 'bf16' or 'fp32'")
    if cfg.model_forward not in FORWARD_MODES:
        e.append(f"model_forward={cfg.model_forward!r}: expected one of {list(FORWARD_MODES)}")
    if o.lr <= 0:
        e.append(f"optim.lr={o.lr!r}: expected > 0")
    if o.min_lr < 0 or o.min_lr > o.lr:
        e.append(f"optim.min_lr={o.min_lr!r}: expected a value in [0, optim.lr={o.lr}]")
    if o.warmup_steps < 0:
        e.append(f"optim.warmup_steps={o.warmup_steps!r}: expected >= 0")
    if o.trainable_last_n_layers is not None and not 1 <= o.trainable_last_n_layers <= cfg.model.num_layers:
        e.append(
            f"optim.trainable_last_n_layers={o.trainable_last_n_layers!r}: expected 1..model.num_layers "
            f"({cfg.model.num_layers}) or null"
        )
    if vocab_size is not None and cfg.model.vocab_size != vocab_size:
        e.append(
            f"model.vocab_size={cfg.model.vocab_size} does not match the tokenizer's vocabulary "
            f"({vocab_size}); set model.vocab_size={vocab_size}"
        )
    d = cfg.data
    if d.prompt_file is None:
        if d.task not in ("copy", "reverse", "sort"):
            e.append(f"data.task={d.task!r}: expected 'copy', 'reverse' or 'sort' (or set data.prompt_file)")
        else:
            need = d.num_digits + 1 + g.max_new_tokens
            if need > cfg.model.max_seq_len:
                e.append(
                    f"prompt ({d.num_digits + 1} tokens) + generation.max_new_tokens ({g.max_new_tokens}) = "
                    f"{need} exceeds model.max_seq_len ({cfg.model.max_seq_len})"
                )
            if g.max_new_tokens < d.num_digits + 1:
                e.append(
                    f"generation.max_new_tokens={g.max_new_tokens} cannot hold the answer to a "
                    f"{d.num_digits}-digit {d.task} task plus end-of-sequence ({d.num_digits + 1})"
                )
    elif not os.path.isfile(d.prompt_file):
        e.append(f"data.prompt_file={d.prompt_file!r}: file does not exist")
    c, v = cfg.checkpoint, cfg.validation
    for obj, prefix, names in (
        (c, "checkpoint", ("save_interval", "keep_last")),
        (v, "validation", ("interval", "num_samples")),
    ):
        for n in names:
            x = getattr(obj, n)
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                e.append(f"{prefix}.{n}={x!r}: expected an integer >= 0")
    if not isinstance(v.num_prompts, int) or v.num_prompts < 1:
        e.append(f"validation.num_prompts={v.num_prompts!r}: expected a positive integer")
    if c.resume not in ("auto", "none") and not os.path.isdir(c.resume):
        e.append(
            f"checkpoint.resume={c.resume!r}: expected 'auto', 'none' or an existing checkpoint folder "
            "(<checkpoint.dir>/step_XXXXXXXX)"
        )
    if v.prompt_file is not None and not os.path.isfile(v.prompt_file):
        e.append(f"validation.prompt_file={v.prompt_file!r}: file does not exist")
    e += [f"model: {m}" for m in cfg.model.problems(tp, pp)]
    if e:
        raise ConfigError("invalid actor config:\n  " + "\n  ".join(e))


def load_prompts(path: str, tokenizer: Any, max_prompt_tokens: int) -> list[str]:
    """Read a JSONL prompt file, checking every line; errors name the line and the problem."""
    prompts: list[str] = []
    errors: list[str] = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as ex:
                errors.append(f"{path}:{i}: not valid JSON ({ex.msg})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                errors.append(
                    f'{path}:{i}: expected an object with a non-empty string "prompt", got {line.strip()[:80]}'
                )
                continue
            try:
                n = len(tokenizer.encode(obj["prompt"]))
            except ValueError as ex:
                errors.append(f"{path}:{i}: {ex}")
                continue
            if n > max_prompt_tokens:
                errors.append(
                    f"{path}:{i}: prompt has {n} tokens, more than the {max_prompt_tokens} that fit "
                    "(model.max_seq_len - generation.max_new_tokens)"
                )
                continue
            prompts.append(obj["prompt"])
            if len(errors) >= 20:
                break
    if errors:
        raise ConfigError("bad prompt file:\n  " + "\n  ".join(errors))
    if not prompts:
        raise ConfigError(
            f'data.prompt_file={path!r} holds no prompts: expected JSONL lines like {{"prompt": "..."}}'
        )
    return prompts
