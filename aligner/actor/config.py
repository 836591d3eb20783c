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
from aligner.actor.ppo_config import PPOConfig
from aligner.config_checks import ConfigError, Problems
from aligner.distributed import ParallelConfig
from aligner.generation.config import GenerationConfig
from aligner.generation.remote import RolloutConfig
from aligner.metrics import WandbConfig
from aligner.models.config import FORWARD_MODES, ConversionError, ModelConfig
from aligner.models.lora import LoraConfig
from aligner.models.model_files import parse_size
from aligner.optim import OptimConfig
from aligner.wire.tls import ClientTLS

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

    lr: float = 1e-6
    """Peak learning rate (1e-6: full fine-tuning of a 0.5-8B model, as verl and OpenRLHF default)."""
    min_lr: float = 1e-6
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
    tls: ClientTLS = field(default_factory=ClientTLS)
    """For a ``grpcs://`` url (a server with server.tls on): the CA its certificate chains to
    (``ca_file``; null: the system's roots) and, where it requires client certificates, this
    client's (``cert_file``, ``key_file``). Must stay unset for a grpc:// or http:// url."""

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
        e += self.tls.problems(f"{prefix}.tls")
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
    histogram_interval: int = 10
    """Histograms of the scores, advantages, returns, values and response lengths (over every
    data-parallel rank) to TensorBoard and W&B every N steps; 0: none (docs/metrics.md)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for ``perf/mfu``; None: a known GPU's dense bf16 peak when the
    run computes in bf16 (else no MFU; never on a CPU unless given here)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases as a third sink (off by default): the same metrics at the same steps, the
    validation samples as a table, this config as the run's config; a resume continues the run."""

    def problems(self, prefix: str = "logging") -> Problems:
        """The W&B settings' problems (a missing wandb package among them, when it is on), and a
        negative histogram interval or a peak that is not positive."""
        e = self.wandb.problems(f"{prefix}.wandb")
        e.expect(
            isinstance(self.histogram_interval, int) and self.histogram_interval >= 0,
            f"{prefix}.histogram_interval",
            self.histogram_interval,
            "an integer >= 0 (0: no histograms)",
        )
        e.expect(
            self.peak_tflops is None or (isinstance(self.peak_tflops, int | float) and self.peak_tflops > 0),
            f"{prefix}.peak_tflops",
            self.peak_tflops,
            "a positive number of TFLOP/s per device, or null",
        )
        return e


@dataclass
class ActorCheckpointConfig:
    """Checkpoints of the run under ``<dir>/step_XXXXXXXX/actor/`` (the critic server writes
    ``.../critic/`` beside it when it shares the folder), and resuming from them."""

    dir: str | None = None
    """Root of the run's checkpoints; None = <logging.run_dir>/checkpoints."""
    save_interval: int = 100
    """Save every N steps (0 = only at the end)."""
    save_at_end: bool = True
    """Save after the last step."""
    keep_last: int = 3
    """Actor checkpoints kept (older ones are removed once a newer one is complete); 0 keeps all."""
    keep_best: bool = True
    """When validation reaches a new best validation/scores, save that step and keep it as 'best'
    (never pruned; <dir>/best links to it)."""
    resume: str = "auto"
    """'auto': continue from the newest step both roles completed (fresh if none), only when it was
    made with this config (``aligner.actor.fingerprint``); 'force': the same, whatever its config;
    'none': start fresh; or a checkpoint folder (<dir>/step_XXXXXXXX) to continue from."""
    export_hf: str | None = None
    """At the end, export the policy as a Hugging Face folder here (None = no export)."""
    export_arch: str | None = None
    """HF architecture of the export (default: the one recorded when the policy was imported, else llama)."""
    export_interval: int = 0
    """Also export every N steps, to <export_hf>-step_XXXXXXXX (0 = off; needs export_hf)."""
    export_keep_last: int = 0
    """Step exports kept (the newest; older <export_hf>-step_XXXXXXXX folders are removed once a newer
    one is written); 0 keeps all. The best and final exports are never removed."""
    export_best: bool = False
    """Also export each new best validation/scores step to <export_hf>-best, replacing the previous best's
    (needs export_hf, keep_best and validation.interval > 0)."""
    export_dtype: str = "bf16"
    """dtype of the exported weights: 'bf16', 'fp16' or 'fp32'."""
    export_max_shard_size: str | None = "5GB"
    """Largest weight file of an export ('5GB', '500MB', bytes), as HF's shards with
    model.safetensors.index.json; None = one model.safetensors."""

    def problems(self, prefix: str = "checkpoint", validation_interval: int | None = None) -> Problems:
        e = Problems()
        e.non_negative_ints(
            self, prefix, ("save_interval", "keep_last", "export_interval", "export_keep_last")
        )
        e.expect(
            self.export_dtype in ("bf16", "fp16", "fp32"),
            f"{prefix}.export_dtype",
            self.export_dtype,
            "'bf16', 'fp16' or 'fp32'",
        )
        try:
            parse_size(self.export_max_shard_size)
        except ConversionError:
            e.expect(
                False,
                f"{prefix}.export_max_shard_size",
                self.export_max_shard_size,
                "a size such as '5GB', '500MB', '2GiB', a number of bytes, or null (one file)",
            )
        if not self.export_hf:
            for key in ("export_interval", "export_best"):
                if getattr(self, key):
                    e.append(
                        f"{prefix}.{key}={getattr(self, key)!r} needs {prefix}.export_hf: the exports are "
                        f"written beside it (<export_hf>-step_XXXXXXXX, <export_hf>-best)"
                    )
        if self.export_best and not self.keep_best:
            e.append(
                f"{prefix}.export_best=true needs {prefix}.keep_best=true (it exports the step keep_best keeps)"
            )
        if self.export_best and validation_interval == 0:
            e.append(
                f"{prefix}.export_best=true needs validation.interval > 0 (the best step is the best validation/scores)"
            )
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

    interval: int = 50
    """Validate every N steps (0 = never)."""
    before_train: bool = True
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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers of their own (``aligner-rollout``) and the staleness bound."""
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
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        e += self.served_problems(vocab_size, tp, pp)
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
        e += self.data.problems(self.generation.max_new_tokens, self.model.max_seq_len, "data")
        e += self.checkpoint.problems("checkpoint", validation_interval=self.validation.interval)
        e += self.critic.problems("critic")
        e += self.validation.problems("validation")
        e += self.logging.problems("logging")
        e += self.rollout_problems()
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

    def served_problems(self, vocab_size: int | None, tp: int = 1, pp: int = 1) -> Problems:
        """What generating from this policy needs (the actor's and a rollout worker's): the model
        at TP ``tp`` x PP ``pp``, the generation settings and the precision against a tokenizer of
        ``vocab_size`` ids."""
        e = self.generation.problems("generation", vocab_size or self.model.vocab_size)
        e.expect(
            self.precision in ("auto", "bf16", "fp32"),
            "precision",
            self.precision,
            "'auto', 'bf16' or 'fp32'",
        )
        if vocab_size is not None and self.model.vocab_size < vocab_size:
            # A larger embedding than the tokenizer (Qwen2's padded vocabularies) is fine: the ids
            # beyond the tokenizer are never sampled nor scored.
            e.append(
                f"model.vocab_size={self.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({vocab_size}); set model.vocab_size >= {vocab_size}"
            )
        e += [f"model: {m}" for m in self.model.problems(tp, pp)]
        return e

    def rollout_problems(self) -> Problems:
        """``rollout.*`` and what rollout workers need of the rest: in this version, the native
        engine in the training dtype or TensorRT-LLM (not with partial rollouts: no token
        boundary to swap at), at the workers' own layout (``rollout.tensor_parallel_size``, not
        ``generation.tensor_parallel_size``), one generation round per step;
        a staleness bound above 0 needs the truncated importance weight (``ppo.tis_cap``)."""
        e = self.rollout.problems("rollout")
        if self.rollout.workers < 1:
            e.expect(
                self.rollout.max_staleness == 0,
                "rollout.max_staleness",
                self.rollout.max_staleness,
                "0 without rollout workers (set rollout.workers >= 1)",
            )
            return e
        need = {
            "generation.tensor_parallel_size": (self.generation.tensor_parallel_size, None, "null"),
            "generation.dtype": (self.generation.dtype, None, "null (the policy's dtype)"),
            "ppo.dynamic_sampling": (self.ppo.dynamic_sampling, False, "false with rollout workers"),
        }
        for key, (value, want, expected) in need.items():
            e.expect(value == want, key, value, expected)
        e.expect(
            not self.rollout.partial or self.generation.engine == "native",
            "rollout.partial",
            self.rollout.partial,
            f"false with generation.engine={self.generation.engine!r} (partial rollouts swap versions "
            "between the native engine's decode steps)",
        )
        e.expect(
            self.rollout.max_staleness == 0 or self.ppo.tis_cap is not None,
            "ppo.tis_cap",
            self.ppo.tis_cap,
            f"a cap (e.g. 2.0) with rollout.max_staleness={self.rollout.max_staleness}: the update weights "
            "each token by its proximal/behaviour probability ratio, truncated there (decoupled PPO)",
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
