"""Configuration of the critic/reward server: one dataclass per component.

These back ``aligner/configs/critic.yaml`` as Hydra structured configs (so an unknown key or a value
of the wrong type is an error naming the key), and :func:`build_config` runs the cross-field
checks once at start-up, reporting every problem together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from aligner.config_checks import ConfigError, Problems
from aligner.critic.budget import ServerCapacity
from aligner.critic.config_limits import LimitsConfig
from aligner.critic.config_parallel import ParallelSection
from aligner.critic.reward_conventions import reward_options_problems
from aligner.critic.reward_fn import reward_fn_problem
from aligner.critic.reward_model import checkpoint_folder_problem, tokenizer_folder
from aligner.critic.tls import ServerTLSConfig
from aligner.models.config import FORWARD_MODES, ModelConfig
from aligner.optim import OptimConfig
from aligner.tokenizers import build_tokenizer
from aligner.wire.protocol import resolve_run_token

__all__ = [
    "ServerConfig",
    "ParallelSection",
    "CriticOptimConfig",
    "RewardConfig",
    "InitConfig",
    "CriticCheckpointConfig",
    "LogConfig",
    "LimitsConfig",
    "CriticServerConfig",
    "build_config",
    "LOSS_AGGREGATIONS",
    "INIT_SOURCES",
    "PRECISION_CHOICES",
    "RESUME_MODES",
    "SERVER_MODES",
]

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
INIT_SOURCES = ("auto", "reward", "policy", "fresh")
PRECISION_CHOICES = ("auto", "bf16", "fp32")
RESUME_MODES = ("none", "auto")
SERVER_MODES = ("critic", "reward_only")
"""What ``mode`` may say: a server with a critic, or one that only scores."""


@dataclass
class ServerConfig(ServerCapacity):
    """The Triton endpoints, the critic_infer batcher, and the work taken on (:class:`ServerCapacity`)."""

    host: str = "127.0.0.1"
    """Address HTTP, gRPC and metrics bind to; 0.0.0.0 to serve other machines (e.g. a k8s Service)."""
    http_port: int | None = None
    """HTTP/REST port; null (default): HTTP off (the actor speaks gRPC; the bundled Triton 2.51's
    JSON parser crashes on deeply nested bodies), 0: a free one (PORTS line). On, it requires a
    run token (README.md, "What the server trusts")."""
    grpc_port: int = 8001
    """gRPC port; 0 picks a free one (the READY line names it)."""
    metrics_port: int | None = 0
    """Prometheus metrics port; 0 picks a free one, null disables metrics."""
    max_batch_size: int = 256
    """Most rows in one critic_infer request, and in one execution after dynamic batching."""
    max_queue_delay_us: int = 0
    """How long the dynamic batcher waits for more critic_infer requests to merge (microseconds)."""
    dynamic_batching: bool = True
    """Whether Triton may merge concurrent critic_infer requests into one execution; false runs
    each request alone (what merging buys is then measurable: ``server_info``'s ``batching``)."""
    preferred_batch_size: list[int] = field(default_factory=list)
    """Batch sizes the dynamic batcher aims for (empty: as large as possible)."""
    max_request_batch: int = 1024
    """Most rows in one critic_train request (never merged by Triton)."""
    exit_timeout_s: int = 3
    """How long Triton waits for open connections/in-flight requests when stopping."""
    infer_wait_s: float = 600.0
    """How long a critic_infer waits for the critic step it names (``after_step``): the train of
    that step may still be running or on its way (a step at real size takes minutes). Then the
    request fails with an error naming both steps (docs/design.md, "Wire protocol")."""
    workspace_root: str | None = None
    """Where PyTriton's workspace (~22 MB of Triton binaries per start) goes; null: .cache/pytriton."""
    run_token_file: str | None = None
    """A file that holds the run token (its text, surrounding whitespace stripped); null: the
    token is ``$ALIGNER_RUN_TOKEN``, or there is none. With a token, critic_train, critic_save and
    critic_load are refused without it. With none, a server beyond loopback or with HTTP on
    makes one in ``<log.dir>/run_token`` (mode 0600, reused on restart; :mod:`.security`)."""
    allow_no_token: bool = False
    """true: serve beyond loopback or with HTTP on without a run token (isolated networks only;
    anyone who reaches the server may then train, save and load; warned at start-up)."""
    tls: ServerTLSConfig = field(default_factory=ServerTLSConfig)
    """TLS on the gRPC endpoint (off by default; :mod:`aligner.critic.tls`)."""


@dataclass
class CriticOptimConfig(OptimConfig):
    """The critic's Adam optimiser (the settings both roles share) and its value loss."""

    lr: float = 1e-5
    """Adam learning rate."""
    value_clip_eps: float | None = 0.2
    """Clip range of the clipped value loss around the rollout values; null for the plain loss."""
    loss_agg: str = "token_mean"
    """'token_mean' or 'seq_mean_token_mean' (see aligner.rl.aggregate)."""
    epochs: int = 1
    """Passes over each critic_train batch."""
    num_minibatches: int = 1
    """Optimizer steps per pass: the batch is shuffled and cut into this many minibatches."""
    reuse_infer_forward: bool = True
    """With one minibatch and a dropout-free forward (``model_forward`` fused or compiled), the
    values of a ``critic_infer`` request are computed with gradients and kept: a
    ``critic_train`` of the same tokens that follows uses that forward as its first pass
    instead of recomputing it (one critic forward fewer per PPO step; the returned values are
    the training forward's, so the first pass's value clipping is exactly inactive). Any
    other request, a load or a train step drops what is kept. The kept activations are one
    training forward's worth of memory."""

    def problems(self, prefix: str = "optim") -> Problems:
        p = super().problems(prefix)
        v = self.value_clip_eps
        p.expect(v is None or v > 0, f"{prefix}.value_clip_eps", v, "> 0, or null for the unclipped loss")
        p.expect(
            self.loss_agg in LOSS_AGGREGATIONS,
            f"{prefix}.loss_agg",
            self.loss_agg,
            f"one of {list(LOSS_AGGREGATIONS)}",
        )
        p.expect(self.epochs >= 1, f"{prefix}.epochs", self.epochs, ">= 1")
        p.expect(self.num_minibatches >= 1, f"{prefix}.num_minibatches", self.num_minibatches, ">= 1")
        return p


@dataclass
class RewardConfig:
    """Where the per-sample reward comes from: a Python function, a reward model, or both (summed)."""

    fn: str | None = None
    """Reward function 'module:function', its convention told by its parameters' names: ours
    fn(prompts, responses, **kwargs), trlx's fn(samples, prompts, outputs, **kwargs), TRL's
    fn(completions, **kwargs), OpenRLHF's reward_func(queries, prompts, labels), or verl's per-sample
    compute_score(data_source, solution_str, ground_truth, extra_info=None)
    (aligner.critic.reward_conventions); async def ones are awaited."""
    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    """Constant keyword arguments of every call of fn (e.g. a classifier's path; the function
    caches what it loads)."""
    python_path: list[str] = field(default_factory=list)
    """Folders put at the front of sys.path (in this order) before fn is imported; the server's
    working directory always goes there too, so reward.fn=my_reward:score works from the folder
    that holds my_reward.py, without PYTHONPATH."""
    label_column: str | None = None
    """The extras column of each sample's label (OpenRLHF's labels, verl's ground_truth; 'a.b': key
    b of a dict column a); null: the first of label, labels, ground_truth, answer,
    reward_model.ground_truth that the sample has."""
    workers: int = 1
    """Threads that call a per-sample (verl) function over a batch; 1: in order, in the caller's thread."""
    concurrency: int = 8
    """A per-sample async def function's calls in flight at once."""
    timeout_s: float | None = None
    """The longest one call of fn (a batch's, or a sample's) may take before it fails that
    request naming the sample; null: no limit. A timed-out sync call's thread finishes unwaited."""
    model_path: str | None = None
    """Reward model: this project's checkpoint folder (meta.json + model.safetensors, e.g. from aligner-convert)."""
    hf_path: str | None = None
    """Reward model: a HF sequence-classification folder, imported with aligner.models.hf.import_hf."""
    tokenizer: str | None = None
    """The reward model's tokenizer (a HF tokenizer folder, or 'char...'); null: the tokenizer
    files of hf_path when it has some, else the policy's. When it is not the policy's tokenizer
    (another fingerprint) the reward model reads text: actors send prompt_text and response_text,
    which the server tokenizes with it (special tokens added), cut from the left to the reward
    model's max_seq_len; the critic keeps the policy's ids."""
    chat_template: bool = False
    """With a reward model that reads text: format each sample as a user turn (the prompt) and an
    assistant turn (the response) with the reward tokenizer's chat template before tokenizing."""
    fn_scale: float = 1.0
    """Multiplies the reward function's score."""
    model_mean: float = 0.0
    """Subtracted from the reward model's score (reward standardisation, as NeMo-Aligner)."""
    model_std: float = 1.0
    """Divides the reward model's score after the mean is subtracted."""

    def fn_options(self) -> dict[str, Any]:
        """How fn is called: the keyword options of aligner.critic.reward_fn.load_reward_fn."""
        keys = ("workers", "concurrency", "timeout_s", "label_column")
        return {k: getattr(self, k) for k in keys}

    @property
    def has_model(self) -> bool:
        return bool(self.model_path or self.hf_path)

    @property
    def tokenizer_spec(self) -> str | None:
        """The reward model's own tokenizer, when it names one (``tokenizer``, else the tokenizer
        files of ``hf_path``); None: the policy's."""
        if not self.has_model:
            return None
        if self.tokenizer:
            return self.tokenizer
        return tokenizer_folder(self.hf_path)


@dataclass
class InitConfig:
    """Where the critic's weights start."""

    source: str = "auto"
    """'auto' (the reward model if any and it reads the policy's token ids, else policy_path if
    set, else fresh), 'reward', 'policy' or 'fresh'."""
    policy_path: str | None = None
    """A policy: this project's checkpoint folder (meta.json + model.safetensors) or a HF causal-LM
    folder (config.json + safetensors). Its trunk is copied, the value head is fresh, and the
    critic takes its architecture (model.* are then ignored)."""


@dataclass
class CriticCheckpointConfig:
    """Critic checkpoints: <dir>/step_XXXXXXXX/critic/ (safetensors + JSON)."""

    dir: str = "runs/critic/checkpoints"
    """Root the server writes under; clients name only a step, never a path."""
    keep_last: int = 3
    """Critic checkpoints kept (older critic sub-directories are removed); 0 keeps all."""
    save_on_sigterm: bool = True
    """On SIGTERM/SIGINT, save the last applied step (if not saved yet) before exiting."""
    resume: str = "none"
    """'auto': at start-up, load the newest complete critic checkpoint under dir, if there is
    one (a restarted server comes back with its last saved critic); 'none': start from init.
    true and false are read as auto and none."""
    save_initial: bool = True
    """When starting fresh, save the initial critic as step 0 (never pruned): an actor that starts
    a fresh run (or resumes one that has no common checkpoint yet) resets the critic to it instead
    of needing a new server."""

    def __post_init__(self) -> None:
        # The boolean of earlier versions; from the command line it may come as text.
        if isinstance(self.resume, bool) or str(self.resume).lower() in ("true", "false"):
            self.resume = "auto" if str(self.resume).lower() == "true" else "none"


@dataclass
class LogConfig:
    """Metrics and logs."""

    dir: str = "runs/critic"
    """metrics.jsonl, TensorBoard events and server.log go here."""
    tensorboard: bool = True
    """Also write TensorBoard scalars."""
    stats_interval_s: float = 30.0
    """How often request counts and latencies are written (also at every train step)."""
    level: str = "INFO"
    """Python logging level."""


@dataclass
class CriticServerConfig:
    """Everything the critic/reward server needs (``aligner/configs/critic.yaml``)."""

    mode: str = "critic"
    """'critic': a critic trained by the actor's critic_train beside the reward source (for
    ppo.advantage=gae); 'reward_only': the reward source alone, for critic-free actors
    (ppo.advantage grpo, rloo, reinforce_pp): no critic and no optimizer are built, critic_infer
    answers the rewards with values of zeros, critic_train, critic_save and critic_load are
    refused naming the mode, and server_info says critic: false."""
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=14, max_seq_len=64))
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    init: InitConfig = field(default_factory=InitConfig)
    checkpoint: CriticCheckpointConfig = field(default_factory=CriticCheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tokenizer: str = "char"
    """'char', 'char:<alphabet>' or a HF tokenizer folder."""
    seed: int = 1234
    """Seed for weight initialisation and minibatch shuffling."""
    precision: str = "auto"
    """'bf16' (bf16 weights and compute; fp32 master weights, gradients and Adam state), 'fp32', or 'auto' (bf16 where the GPU or CPU computes it natively: AVX512-BF16/AMX)."""
    model_forward: str = "auto"
    """How the critic and reward model forwards run: 'fused' (``aligner.models.fused``: Megatron's arithmetic in fewer ops on the same parameters), 'compiled' (fused under torch.compile, TP=1), 'megatron' (the modules' own forward), or 'auto' (fused where the architecture allows it, else megatron)."""
    max_tokens_per_micro_batch: int | None = None
    """Packed sequences (``aligner.models.packing``, docs/design.md "Packed sequences"): each
    replica runs critic inference, reward-model scoring and critic training over its rows packed
    without padding, in micro-batches of consecutive rows of at most this many real tokens (a
    longer row alone), training gradients accumulated over them: the same values, scores and
    steps to float round-off, the cost of the real tokens rather than rows x the longest row,
    and memory bounded by the budget. Values past a row's length are 0 (nothing reads them). The
    infer forward is kept for critic_train (``optim.reuse_infer_forward``) only when a replica's
    rows fit one micro-batch. null: every replica's rows in one padded forward (no bound on memory)."""

    def problems(self) -> Problems:
        """Every cross-field problem, as messages that name the key (empty when consistent)."""
        e = Problems()
        e.expect(self.mode in SERVER_MODES, "mode", self.mode, f"one of {list(SERVER_MODES)}")
        if self.mode == "reward_only":
            i = self.init
            e.expect(
                i.source == "auto",
                "init.source",
                i.source,
                "'auto' with mode=reward_only (there is no critic to initialise)",
            )
            e.expect(
                i.policy_path is None,
                "init.policy_path",
                i.policy_path,
                "null with mode=reward_only (there is no critic to initialise)",
            )
        s = self.server
        for key in ("http_port", "grpc_port"):
            v = getattr(s, key)
            if (v is not None or key == "grpc_port") and (not isinstance(v, int) or not 0 <= v < 65536):
                e.append(f"server.{key}={v!r}: expected a port in [0, 65535] (0 picks a free one)")
        if s.metrics_port is not None and not 0 <= s.metrics_port < 65536:
            e.append(
                f"server.metrics_port={s.metrics_port!r}: expected a port in [0, 65535], or null to disable"
            )
        nonzero = [p for p in (s.http_port, s.grpc_port, s.metrics_port) if p]
        if len(nonzero) != len(set(nonzero)):
            e.append(
                f"server ports http={s.http_port}, grpc={s.grpc_port}, metrics={s.metrics_port}: "
                "expected distinct ports (or 0 to pick free ones)"
            )
        if s.max_batch_size < 1:
            e.append(f"server.max_batch_size={s.max_batch_size}: expected >= 1")
        if s.max_request_batch < 1:
            e.append(f"server.max_request_batch={s.max_request_batch}: expected >= 1")
        if s.max_queue_delay_us < 0:
            e.append(f"server.max_queue_delay_us={s.max_queue_delay_us}: expected >= 0")
        bad_pref = [p for p in s.preferred_batch_size if not 1 <= p <= s.max_batch_size]
        if bad_pref:
            e.append(
                f"server.preferred_batch_size={list(s.preferred_batch_size)}: every size must be in "
                f"[1, server.max_batch_size={s.max_batch_size}]"
            )
        if s.exit_timeout_s < 0:
            e.append(f"server.exit_timeout_s={s.exit_timeout_s}: expected >= 0")
        if not s.infer_wait_s > 0:
            e.append(f"server.infer_wait_s={s.infer_wait_s}: expected > 0 (seconds)")
        e += s.capacity_problems()
        if s.run_token_file:
            try:
                resolve_run_token(s.run_token_file, "server.run_token_file")
            except ValueError as exc:  # names the key and the file, never the token
                e.append(str(exc))
        e += s.tls.problems(s.http_port)

        p = self.parallel
        e += p.problems()
        if p.tensor_model_parallel_size >= 1 and p.pipeline_model_parallel_size >= 1:
            e += [
                f"model.{m}"
                for m in self.model.problems(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
            ]

        o = self.optim
        e += o.problems("optim")
        if 1 <= o.num_minibatches and o.num_minibatches > s.max_request_batch:
            e.append(
                f"optim.num_minibatches={o.num_minibatches} exceeds server.max_request_batch="
                f"{s.max_request_batch}: a train request could never fill every minibatch"
            )

        r = self.reward
        if not (r.fn or r.model_path or r.hf_path):
            e.append(
                "reward: no reward source: set reward.fn='module:function' and/or reward.model_path "
                "or reward.hf_path (none is set by default; the CPU demo's is +server_recipe=demo)"
            )
        if r.model_path and r.hf_path:
            e.append(f"reward.model_path={r.model_path!r} and reward.hf_path={r.hf_path!r}: set only one")
        options = reward_options_problems(r.workers, r.concurrency, r.timeout_s, r.label_column)
        e += options
        if r.fn:
            fn_options = r.fn_options() if not options else {}
            problem = reward_fn_problem(r.fn, list(r.python_path), dict(r.fn_kwargs), **fn_options)
            if problem:
                e.append(f"reward.fn={r.fn!r}: {problem}")
        elif r.fn_kwargs:
            e.append(f"reward.fn_kwargs={dict(r.fn_kwargs)}: set without reward.fn")
        for key in ("model_path", "hf_path"):
            path = getattr(r, key)
            problem = checkpoint_folder_problem(path, hf=key == "hf_path") if path else None
            if problem:
                e.append(f"reward.{key}={path!r}: {problem}")
        if not r.model_std > 0:
            e.append(f"reward.model_std={r.model_std}: expected > 0")

        i = self.init
        if i.source not in INIT_SOURCES:
            e.append(f"init.source={i.source!r}: expected one of {list(INIT_SOURCES)}")
        if i.source == "reward" and not r.has_model:
            e.append("init.source='reward' needs a reward model: set reward.model_path or reward.hf_path")
        if i.source == "policy" and not i.policy_path:
            e.append("init.source='policy' needs init.policy_path")
        problem = checkpoint_folder_problem(i.policy_path, hf=None) if i.policy_path else None
        if problem:
            e.append(f"init.policy_path={i.policy_path!r}: {problem}")

        if self.precision not in PRECISION_CHOICES:
            e.append(f"precision={self.precision!r}: expected one of {list(PRECISION_CHOICES)}")
        if self.model_forward not in FORWARD_MODES:
            e.append(f"model_forward={self.model_forward!r}: expected one of {list(FORWARD_MODES)}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            e.append(f"max_tokens_per_micro_batch={budget!r}: expected an integer >= 1, or null (no packing)")

        c = self.checkpoint
        if c.keep_last < 0:
            e.append(f"checkpoint.keep_last={c.keep_last}: expected >= 0 (0 keeps all)")
        if not c.dir:
            e.append("checkpoint.dir is empty: expected a directory")
        if c.resume not in RESUME_MODES:
            e.append(f"checkpoint.resume={c.resume!r}: expected one of {list(RESUME_MODES)} (or true/false)")

        e += self.limits.problems("limits")
        if self.log.stats_interval_s <= 0:
            e.append(f"log.stats_interval_s={self.log.stats_interval_s}: expected > 0")
        if self.log.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            e.append(f"log.level={self.log.level!r}: expected DEBUG, INFO, WARNING or ERROR")

        tok = None
        try:
            tok = build_tokenizer(self.tokenizer)
        except Exception as exc:  # the tokenizer reports what was wrong
            e.append(f"tokenizer={self.tokenizer!r}: {exc}")
        else:
            i = self.init
            borrowed = i.source in ("reward", "policy") or (
                i.source == "auto" and (r.has_model or bool(i.policy_path))
            )  # the critic takes the architecture of the model it starts from (checked when built)
            if not borrowed and self.mode != "reward_only" and self.model.vocab_size < tok.vocab_size:
                e.append(
                    f"model.vocab_size={self.model.vocab_size} is smaller than the tokenizer's vocabulary "
                    f"({tok.vocab_size} for tokenizer={self.tokenizer!r}): expected >= {tok.vocab_size}"
                )
        e += self._reward_tokenizer_problems(tok)
        return e

    def _reward_tokenizer_problems(self, policy_tokenizer: Any) -> list[str]:
        """``reward.tokenizer`` and ``reward.chat_template``: a tokenizer that loads, for a reward
        model, with a chat template where one is asked for."""
        r = self.reward
        e: list[str] = []
        if r.tokenizer and not r.has_model:
            e.append(
                f"reward.tokenizer={r.tokenizer!r}: set without a reward model (reward.model_path or reward.hf_path)"
            )
            return e
        spec = r.tokenizer_spec
        reward_tokenizer = None
        if spec:
            try:
                reward_tokenizer = build_tokenizer(spec)
            except Exception as exc:  # the tokenizer reports what was wrong
                key = "reward.tokenizer" if r.tokenizer else "reward.hf_path"
                e.append(f"{key}={spec!r}: cannot load the reward model's tokenizer: {exc}")
                return e
        if r.chat_template:
            reads_text = (
                reward_tokenizer is not None
                and policy_tokenizer is not None
                and reward_tokenizer.fingerprint() != policy_tokenizer.fingerprint()
            )
            if not reads_text:
                e.append(
                    "reward.chat_template=true: only a reward model that reads text uses it (its tokenizer, "
                    "reward.tokenizer or the tokenizer files of reward.hf_path, differing from "
                    f"tokenizer={self.tokenizer!r}); set reward.chat_template=false"
                )
            elif not getattr(getattr(reward_tokenizer, "hf", None), "chat_template", None):
                e.append(
                    f"reward.chat_template=true: the reward tokenizer {spec!r} has no chat template "
                    "(its tokenizer_config.json sets no chat_template); set reward.chat_template=false"
                )
        return e

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _section(cls: type, data: Any, prefix: str, errors: list[str]) -> Any:
    if data is None:
        return CriticServerConfig().model if cls is ModelConfig else cls()
    if not isinstance(data, dict):
        errors.append(f"{prefix}: expected a mapping, got {data!r}")
        return cls()
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    for k in unknown:
        errors.append(f"{prefix}.{k}: unknown key; expected one of {sorted(known)}")
    kwargs = {k: v for k, v in data.items() if k in known}
    for f in dataclasses.fields(cls):  # a nested section (server.tls): a dataclass of its own
        if dataclasses.is_dataclass(f.default_factory) and isinstance(kwargs.get(f.name), dict):
            kwargs[f.name] = _section(f.default_factory, kwargs[f.name], f"{prefix}.{f.name}", errors)
    if cls is ModelConfig:
        try:
            return ModelConfig(**kwargs)
        except ConfigError as exc:
            errors += [f"model.{line.strip()}" for line in str(exc).splitlines()[1:]]
            # Keep going with the defaults so the other sections are still checked.
            return ModelConfig(vocab_size=14)
    return cls(**kwargs)


def build_config(data: Any) -> CriticServerConfig:
    """A checked :class:`CriticServerConfig` from a Hydra ``DictConfig``, a plain dict or itself.

    Raises:
        ConfigError: listing every problem (unknown keys, bad values, inconsistent fields).
    """
    if isinstance(data, CriticServerConfig):
        cfg, errors = data, []
    else:
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(data, DictConfig):
                data = OmegaConf.to_container(data, resolve=True)
        except ImportError:  # plain dicts need no omegaconf
            pass
        data = dict(data or {})
        data.pop("hydra", None)
        errors: list[str] = []
        sections = {
            "server": ServerConfig,
            "model": ModelConfig,
            "parallel": ParallelSection,
            "optim": CriticOptimConfig,
            "reward": RewardConfig,
            "init": InitConfig,
            "checkpoint": CriticCheckpointConfig,
            "log": LogConfig,
            "limits": LimitsConfig,
        }
        scalars = ("mode", "tokenizer", "seed", "precision", "model_forward", "max_tokens_per_micro_batch")
        known_top = set(sections) | set(scalars)
        for k in sorted(set(data) - known_top):
            errors.append(f"{k}: unknown key; expected one of {sorted(known_top)}")
        kwargs = {name: _section(cls, data.get(name), name, errors) for name, cls in sections.items()}
        for k in scalars:
            if k in data:
                kwargs[k] = data[k]
        cfg = CriticServerConfig(**kwargs)
    Problems(errors + cfg.problems()).raise_if_any("critic server config", ConfigError)
    return cfg
