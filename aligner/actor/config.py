"""Typed configuration of the actor (backs ``aligner/configs/actor.yaml``).

One small dataclass per component, each field with a one-line docstring; the ``data`` section's
is :class:`~aligner.actor.datasets.DataConfig` (beside its loader), the ``generation`` section's
:class:`~aligner.generation.config.GenerationConfig`. Cross-field checks run once, before any
model is built, and report every problem together.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from aligner.actor.datasets import DataConfig
from aligner.config_checks import ConfigError, Problems
from aligner.distributed import ParallelConfig
from aligner.generation.config import GenerationConfig
from aligner.metrics import WandbConfig
from aligner.models.config import FORWARD_MODES, ModelConfig
from aligner.models.lora import LoraConfig
from aligner.optim import OptimConfig
from aligner.rl import ESTIMATORS, GROUP_ESTIMATORS

__all__ = [
    "ActorConfig",
    "PPOConfig",
    "PolicyOptimConfig",
    "CriticClientConfig",
    "LoggingConfig",
    "ActorCheckpointConfig",
    "ValidationConfig",
    "validate_actor_config",
    "ON_RESTART",
]

ON_RESTART = ("resume", "fail")
"""What ``critic.on_restart`` may say."""


@dataclass
class PolicyOptimConfig(OptimConfig):
    """The policy's AdamW (the settings both roles share) with linear warmup and cosine decay."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 5
    """Optimizer steps of linear warmup."""
    trainable_last_n_layers: int | None = None
    """Train only the last N transformer layers (and the final norm and LM head); None = all."""

    def problems(self, prefix: str = "optim", num_layers: int | None = None) -> Problems:
        """Also checks ``trainable_last_n_layers`` against ``num_layers`` when given."""
        p = super().problems(prefix)
        p.expect(
            0 <= self.min_lr <= self.lr,
            f"{prefix}.min_lr",
            self.min_lr,
            f"a value in [0, {prefix}.lr={self.lr}]",
        )
        p.expect(self.warmup_steps >= 0, f"{prefix}.warmup_steps", self.warmup_steps, ">= 0")
        n = self.trainable_last_n_layers
        if num_layers is not None:
            p.expect(
                n is None or 1 <= n <= num_layers,
                f"{prefix}.trainable_last_n_layers",
                n,
                f"1..model.num_layers ({num_layers}) or null",
            )
        return p


@dataclass
class PPOConfig:
    """The PPO algorithm: batch sizes, KL control, advantage estimation and the losses.

    Which estimator when (``advantage``): ``gae`` with a critic server, the default (dense
    per-token credit from a learned value; costs a critic's forward and update per step);
    ``grpo`` with ``samples_per_prompt`` of 4-16 and a reward-only server, for verifiable
    rewards (math, code: scores of 0/1 that a group's samples compare well); ``rloo`` the same
    without GRPO's per-group scaling (unbiased); ``reinforce_pp`` critic-free at any
    ``samples_per_prompt``, one sample per prompt included (token-level returns of the KL-shaped
    rewards against the batch's mean)."""

    num_steps: int = 100
    """PPO steps (rollout + update) to run."""
    global_batch_size: int = 64
    """Samples (responses) per step, over all data-parallel ranks: each step draws
    global_batch_size / samples_per_prompt prompts."""
    mini_batch_size: int = 32
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 32
    """Samples per forward/backward on one rank (gradient accumulation below the minibatch)."""
    max_tokens_per_micro_batch: int | None = None
    """Packed sequences (``aligner.models.packing``): the policy's and the reference's forwards
    (the PPO update, the rollout's and the reference's log-probs, validation's) run over each
    rank's rows packed without padding, in micro-batches of consecutive rows of at most this
    many real tokens (a longer row alone) instead of micro_batch_size rows: the same loss,
    gradients and log-probs to float round-off (the loss is the global minibatch's whatever the
    cut), at the cost of the real tokens rather than rows x the longest row, and memory bounded
    by the budget. null: micro-batches of micro_batch_size rows. Under pipeline parallelism the
    micro-batches keep micro_batch_size rows (Megatron's schedule sends activations of one fixed
    shape between the stages). Packed, the rollout's log-probs take a forward of their own
    (reuse_rollout_forward needs the update's first pass to be one micro-batch of every row)."""
    samples_per_prompt: int = 1
    """Responses drawn for each prompt of a step, a group on one data-parallel rank with distinct
    sampling streams: 1 for PPO with a critic; 4-16 for 'grpo' and 'rloo' (which need >= 2: they
    compare a prompt's samples with each other)."""
    advantage: str = "gae"
    """The advantage estimator: 'gae' (the critic's values, PPO's default), or critic-free
    'grpo', 'rloo', 'reinforce_pp' (no critic values used, no critic_train sent: run the server
    with mode=reward_only). When to use which: the class docstring."""
    grpo_std_norm: bool = True
    """'grpo': divide each group's centred scores by the group's standard deviation; false is
    Dr. GRPO (no division, which would favour prompts whose samples barely differ)."""
    overlong_filtering: bool = False
    """Leave responses cut at generation.max_new_tokens without end-of-sequence out of the policy
    loss (DAPO; they still count in the score metrics): for long responses whose truncation says
    little about their quality. Only ended responses are then learned from: when those are mostly
    poor, the policy can learn never to end (``rollout/overlong_filtered`` shows it)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: responses longer than generation.max_new_tokens minus this
    many tokens get a score penalty growing linearly to overlong_penalty at the limit, so that the
    policy learns to finish before it is cut off (0 = off)."""
    overlong_penalty: float = 1.0
    """The soft overlong punishment's largest penalty (subtracted from the score at the limit)."""
    critic_warmup_steps: int = 0
    """The first N steps train only the critic on fresh rollouts, while the policy, its LR schedule
    and the KL controller stay as they are: for a fresh critic (a new value head) whose values
    would otherwise steer the first policy updates with noise. 'gae' only."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling ('grpo', 'rloo'): drop the groups whose scores are all equal (their
    advantages are 0: nothing to learn) and generate more prompts until every rank's batch is
    full again, for tasks where many prompts are always or never solved."""
    max_generation_rounds: int = 4
    """Dynamic sampling: the most generation rounds of one step; a batch still short after them is
    filled up with dropped groups."""
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
    """Keep the frozen reference model's weights on the CPU between its forwards; each forward
    (one per step for the rollout's KL, one per validation) copies them to the policy's device
    and drops that copy afterwards. What it saves: the reference's weights on the accelerator
    during generation and the PPO updates, where memory peaks (the peak becomes the larger of
    training's and the reference forward's, not their sum). What it costs: one host-to-device
    copy of the reference per forward (its parameter bytes, e.g. 2 GB for a 1B-parameter bf16
    model, some 0.1 s over PCIe 4 at pinned-memory speed) and its device memory again while that
    forward runs. No effect when the policy itself is on the CPU."""

    def problems(self, prefix: str = "ppo", max_new_tokens: int | None = None) -> Problems:
        """Each value on its own (the batch sizes' divisibility depends on the data-parallel
        size: :meth:`ActorConfig.problems`), and ``overlong_buffer`` against ``max_new_tokens``
        (``generation.max_new_tokens``) when given."""
        e = Problems()
        e.positive_ints(
            self,
            prefix,
            (
                "num_steps",
                "global_batch_size",
                "mini_batch_size",
                "micro_batch_size",
                "ppo_epochs",
                "samples_per_prompt",
            ),
        )
        e += self._estimator_problems(prefix, max_new_tokens)
        budget = self.max_tokens_per_micro_batch
        e.expect(
            budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1),
            f"{prefix}.max_tokens_per_micro_batch",
            budget,
            "an integer >= 1, or null (no packing)",
        )
        e.expect(0 < self.clip_eps < 1, f"{prefix}.clip_eps", self.clip_eps, "a value in (0, 1)")
        high, dual, vlam = self.clip_eps_high, self.dual_clip, self.value_lam
        e.expect(high is None or high > 0, f"{prefix}.clip_eps_high", high, "> 0 or null")
        e.expect(dual is None or dual > 1, f"{prefix}.dual_clip", dual, "a constant > 1 or null")
        e.expect(
            self.loss_agg in ("token_mean", "seq_mean_token_mean"),
            f"{prefix}.loss_agg",
            self.loss_agg,
            "'token_mean' or 'seq_mean_token_mean'",
        )
        e.expect(
            self.kl_estimator in ("k1", "abs", "k3"),
            f"{prefix}.kl_estimator",
            self.kl_estimator,
            "'k1', 'abs' or 'k3'",
        )
        e.expect(self.init_kl_coef >= 0, f"{prefix}.init_kl_coef", self.init_kl_coef, ">= 0")
        for name in ("gamma", "lam"):
            e.expect(
                0 <= getattr(self, name) <= 1, f"{prefix}.{name}", getattr(self, name), "a value in [0, 1]"
            )
        e.expect(vlam is None or 0 <= vlam <= 1, f"{prefix}.value_lam", vlam, "a value in [0, 1] or null")
        return e

    def _estimator_problems(self, prefix: str, max_new_tokens: int | None) -> Problems:
        """The advantage estimator, its groups, the overlong settings and the critic warm-up."""
        e = Problems()
        n, adv = self.samples_per_prompt, self.advantage
        e.expect(adv in ESTIMATORS, f"{prefix}.advantage", adv, f"one of {list(ESTIMATORS)}")
        valid_n = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        if valid_n and adv in GROUP_ESTIMATORS:
            e.expect(
                n >= 2,
                f"{prefix}.samples_per_prompt",
                n,
                f">= 2 with {prefix}.advantage={adv!r} (it compares the samples of one prompt)",
            )
        if valid_n:
            for name in ("global_batch_size",):  # minibatches per rank: ActorConfig.parallel_problems
                v = getattr(self, name)
                if isinstance(v, int) and v >= 1 and v % n:
                    e.append(
                        f"{prefix}.{name}={v}: expected a multiple of {prefix}.samples_per_prompt={n} "
                        "(whole groups of one prompt's samples)"
                    )
        e.non_negative_ints(self, prefix, ("critic_warmup_steps", "overlong_buffer"))
        e.positive_ints(self, prefix, ("max_generation_rounds",))
        if self.dynamic_sampling:
            e.expect(
                adv in GROUP_ESTIMATORS,
                f"{prefix}.dynamic_sampling",
                self.dynamic_sampling,
                f"false with {prefix}.advantage={adv!r} (it drops groups of equal scores: "
                f"{' or '.join(repr(a) for a in GROUP_ESTIMATORS)} only)",
            )
        w = self.critic_warmup_steps
        if isinstance(w, int) and w > 0:
            e.expect(
                adv == "gae",
                f"{prefix}.critic_warmup_steps",
                w,
                f"0 with {prefix}.advantage={adv!r} (only 'gae' has a critic to warm up)",
            )
        b = self.overlong_buffer
        if max_new_tokens is not None and isinstance(b, int) and b > 0:
            e.expect(
                b <= max_new_tokens,
                f"{prefix}.overlong_buffer",
                b,
                f"at most generation.max_new_tokens={max_new_tokens} (0 turns the penalty off)",
            )
        pen = self.overlong_penalty
        e.expect(
            isinstance(pen, (int, float)) and math.isfinite(pen) and pen >= 0,
            f"{prefix}.overlong_penalty",
            pen,
            "a finite number >= 0",
        )
        return e


@dataclass
class CriticClientConfig:
    """How the actor reaches the critic/reward server, how long it waits for it, and what it does
    when the server was restarted under it (docs/design.md, "Wire protocol")."""

    url: str | None = None
    """grpc://HOST:PORT or http://HOST:PORT; falls back to $ALIGNER_CRITIC_URL."""
    timeout_s: float = 120.0
    """Per-request timeout (one attempt of one request)."""
    ready_timeout_s: float = 120.0
    """How long to wait for the server to become ready, at start-up and after a lost connection."""
    wait_timeout_s: float = 600.0
    """Bounds every wait on a server result: an ``infer`` or ``train`` future, ``save``, ``load``,
    and one request's retries all together. Past it the actor stops with an error naming the call,
    the step and the server's address (a hung server never hangs the actor); a save cut short
    this way leaves the previous checkpoints as they were and the new step uncommitted."""
    retries: int = 5
    """Retries with backoff for requests that are safe to repeat."""
    on_restart: str = "resume"
    """When the server turns out to have been restarted (another instance after a reconnect, or a
    request fenced because the server no longer holds the critic step the actor expects):
    'resume' rolls both roles back to the newest step both checkpointed and redoes the steps
    after it (the run ends with the weights of an uninterrupted one); 'fail' stops, naming the
    server's critic step and the actor's."""
    max_restarts: int = 3
    """Most server restarts one run resumes from (on_restart=resume); one more stops it."""
    run_token_file: str | None = None
    """A file holding the run token, the secret the server requires for critic_train, critic_save
    and critic_load (its server.run_token_file); None: $ALIGNER_RUN_TOKEN, else no token. The
    file wins over the variable."""

    def problems(self, prefix: str = "critic") -> Problems:
        e = Problems()
        for name in ("timeout_s", "ready_timeout_s", "wait_timeout_s"):
            v = getattr(self, name)
            e.expect(v > 0 and math.isfinite(v), f"{prefix}.{name}", v, "a finite number of seconds > 0")
        e.non_negative_ints(self, prefix, ("retries", "max_restarts"))
        e.expect(
            self.on_restart in ON_RESTART,
            f"{prefix}.on_restart",
            self.on_restart,
            f"one of {list(ON_RESTART)}",
        )
        if self.run_token_file is not None:
            e.existing_file(
                f"{prefix}.run_token_file",
                self.run_token_file,
                "an existing file (or null: $ALIGNER_RUN_TOKEN, else no token)",
            )
        return e


@dataclass
class LoggingConfig:
    """Where and how often the run reports."""

    run_dir: str = "runs/actor"
    """Directory for metrics.jsonl, TensorBoard events, plots and run_config.json (the run's id,
    config and fingerprint); one run's: a command with another config does not resume into it."""
    log_interval: int = 1
    """Print a console line every N steps (the progress bar updates every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    progress_bar: bool = True
    """Show a progress bar with reward, KL and step time."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases as a third sink (off by default): the same metrics at the same steps, the
    validation samples as a table, this config as the run's config; a resume continues the run."""

    def problems(self, prefix: str = "logging") -> Problems:
        """The W&B settings' problems (a missing wandb package among them, when it is on)."""
        return self.wandb.problems(f"{prefix}.wandb")


@dataclass
class ActorCheckpointConfig:
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
    """'auto': continue from the newest step both roles completed (fresh if none), only when it was
    made with this config (``aligner.actor.fingerprint``); 'force': the same, whatever its config;
    'none': start fresh; or a checkpoint folder (<dir>/step_XXXXXXXX) to continue from."""
    export_hf: str | None = None
    """At the end, export the policy as a Hugging Face folder here (None = no export)."""
    export_arch: str | None = None
    """HF architecture of the export (default: the one recorded when the policy was imported, else llama)."""

    def problems(self, prefix: str = "checkpoint") -> Problems:
        e = Problems()
        e.non_negative_ints(self, prefix, ("save_interval", "keep_last"))
        e.expect(
            self.resume in ("auto", "force", "none") or os.path.isdir(self.resume),
            f"{prefix}.resume",
            self.resume,
            f"'auto', 'force', 'none' or an existing checkpoint folder (<{prefix}.dir>/step_XXXXXXXX)",
        )
        return e


@dataclass
class ValidationConfig:
    """Greedy generation on a fixed prompt set, scored by the server."""

    interval: int = 0
    """Validate every N steps (0 = never)."""
    before_train: bool = False
    """Also validate the initial policy, logged at step 0."""
    num_prompts: int = 64
    """Evaluation prompts (fixed; independent of the batch sizes): the first N of data.val_split,
    of prompt_file, or of the training data set, else N drawn from the built-in task."""
    prompt_file: str | None = None
    """A JSONL file of {"prompt": ...} lines to validate on, read like the training data set
    (data.prompt_column, data.extra_columns, data.chat_template); not with data.val_split.
    Default: data.val_split, else the training prompts' first num_prompts, else the built-in
    task with its own seed."""
    seed: int = 20_231
    """Seed that draws the built-in task's evaluation prompts (distinct from training's)."""
    num_samples: int = 4
    """Prompts and responses shown in the samples table (console, val_samples.jsonl, TensorBoard)."""

    def problems(self, prefix: str = "validation") -> Problems:
        e = Problems()
        e.non_negative_ints(self, prefix, ("interval", "num_samples"))
        e.positive_ints(self, prefix, ("num_prompts",))
        if self.prompt_file is not None:
            e.existing_file(f"{prefix}.prompt_file", self.prompt_file)
        return e


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
    optim: PolicyOptimConfig = field(default_factory=PolicyOptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on the policy (``aligner.models.lora``): with ``lora.rank`` > 0 only the
    adapters train (the reference stays the base model), refits and the HF export carry the
    merged weights, and checkpoints hold the adapters and their optimizer state."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    critic: CriticClientConfig = field(default_factory=CriticClientConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: ActorCheckpointConfig = field(default_factory=ActorCheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    tokenizer: str = "auto"
    """'char' (the built-in digit vocabulary), 'char:<alphabet>', a HF tokenizer folder, or 'auto':
    ``init_from``'s tokenizer when that folder holds one, else 'char'."""
    init_from: str | None = None
    """A policy checkpoint folder (ours or HF) to start from, which also decides the architecture
    (``model.*`` keys become checked overrides: ``aligner.actor.model_source``); None = random init
    of ``model``."""
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

    def problems(self, world_size: int = 1, vocab_size: int | None = None) -> Problems:
        """Every problem of this config for a run of ``world_size`` processes whose tokenizer has
        ``vocab_size`` ids: each section's own, then what the sections demand of each other."""
        e = self.ppo.problems("ppo", max_new_tokens=self.generation.max_new_tokens)
        e += self.parallel_problems(world_size)
        e += self.generation.problems("generation", vocab_size or self.model.vocab_size)
        e.expect(
            self.precision in ("auto", "bf16", "fp32"),
            "precision",
            self.precision,
            "'auto', 'bf16' or 'fp32'",
        )
        e.expect(
            self.model_forward in FORWARD_MODES,
            "model_forward",
            self.model_forward,
            f"one of {list(FORWARD_MODES)}",
        )
        e += self.optim.problems("optim", num_layers=self.model.num_layers)
        e += self.lora.problems("lora")
        if self.lora.enabled and self.lora.dropout and self.model_forward in ("fused", "compiled"):
            e.append(
                f"model_forward={self.model_forward!r}: the fused forward has no LoRA dropout "
                f"(lora.dropout={self.lora.dropout}); use model_forward=auto or megatron, or lora.dropout=0"
            )
        if vocab_size is not None and self.model.vocab_size < vocab_size:
            # A larger embedding than the tokenizer (Qwen2's padded vocabularies) is fine: the ids
            # beyond the tokenizer are never sampled nor scored.
            e.append(
                f"model.vocab_size={self.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({vocab_size}); set model.vocab_size >= {vocab_size}"
            )
        e += self.data.problems(self.generation.max_new_tokens, self.model.max_seq_len, "data")
        e += self.checkpoint.problems("checkpoint")
        e += self.critic.problems("critic")
        e += self.validation.problems("validation")
        e += self.logging.problems("logging")
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        e += [f"model: {m}" for m in self.model.problems(tp, pp)]
        e += self.generation.layout_problems(self.parallel, self.model)
        if self.generation.engine == "trtllm":
            g = self.generation
            e.expect(
                pp == 1,
                "generation.engine",
                g.engine,
                f"'native' with parallel.pipeline_model_parallel_size={pp} (the TensorRT-LLM engine spans "
                "one tensor-parallel group; pipeline-parallel actors generate with the native engine)",
            )
            e.expect(
                g.dtype is None,
                "generation.dtype",
                g.dtype,
                "null with generation.engine=trtllm (its dtype is generation.trtllm.dtype)",
            )
            e.expect(
                g.tensor_parallel_size in (None, tp),
                "generation.tensor_parallel_size",
                g.tensor_parallel_size,
                f"null or {tp} with generation.engine=trtllm (its engine spans the training TP group)",
            )
        return e

    def parallel_problems(self, world_size: int) -> Problems:
        """The parallel layout for ``world_size`` processes, and the batch sizes' divisibility
        under it (checked only when the layout and the batch sizes themselves are valid)."""
        e, p = Problems(), self.ppo
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        if world_size % (tp * pp):
            e.append(f"world size {world_size} is not divisible by tensor x pipeline parallel size {tp * pp}")
        invalid_sizes = Problems()  # reported by PPOConfig.problems
        invalid_sizes.positive_ints(p, "ppo", ("global_batch_size", "mini_batch_size", "micro_batch_size"))
        if e or invalid_sizes:
            return e
        dp = max(world_size // (tp * pp), 1)
        if p.global_batch_size % p.mini_batch_size:
            e.append(
                f"ppo.global_batch_size ({p.global_batch_size}) must be divisible by ppo.mini_batch_size "
                f"({p.mini_batch_size})"
            )
        if p.mini_batch_size % dp:
            e.append(
                f"ppo.mini_batch_size ({p.mini_batch_size}) must be divisible by the data-parallel size ({dp})"
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
        n = p.samples_per_prompt
        if isinstance(n, int) and n > 1 and not p.global_batch_size % dp and (p.global_batch_size // dp) % n:
            e.append(
                f"ppo.global_batch_size per data-parallel rank ({p.global_batch_size // dp}) must be divisible "
                f"by ppo.samples_per_prompt ({n}): each rank generates whole groups of one prompt's samples"
            )
        if isinstance(n, int) and n > 1 and not p.mini_batch_size % dp and (p.mini_batch_size // dp) % n:
            e.append(
                f"ppo.mini_batch_size per data-parallel rank ({p.mini_batch_size // dp}) must be divisible "
                f"by ppo.samples_per_prompt ({n}): each rank's minibatches hold whole groups"
            )
        return e


def validate_actor_config(cfg: ActorConfig, world_size: int = 1, vocab_size: int | None = None) -> None:
    """Check every value and cross-field constraint; raise one :class:`ConfigError` listing all problems."""
    cfg.problems(world_size, vocab_size).raise_if_any("actor config", ConfigError)
