"""The actor's entry point and composition root: PPO on a Megatron-core policy against a running
critic/reward server.

    python -m aligner.actor.run critic.url=grpc://127.0.0.1:8001      # or examples/train_actor.py
    ALIGNER_CRITIC_URL=grpc://critic:8001 torchrun --nproc_per_node 2 -m aligner.actor.run \\
        parallel.tensor_model_parallel_size=2

Every key of ``actor.yaml`` (:mod:`aligner.configs`) can be overridden on the command line; unknown
keys are errors. :func:`build_actor` puts the actor together in numbered steps, and :func:`run`
trains what it built:

1. the inputs: the config resolved against ``init_from`` and checked, the tokenizer, the training
   and validation prompts (everything that can be checked without a process group or a model);
2. the process groups;
3. the critic: its client, the compatibility check, the run token a training server requires;
4. the models: the policy (with ``init_from``'s weights), the frozen reference, LoRA adapters;
5. the checkpointer and the resume decision (a fresh start resets a trained server's critic);
6. the generation engine;
7. the prompt sampler;
8. the metrics logger, the console header and the progress bar;
9. the trainer, with the resumed state loaded.

Then :func:`run` trains, exports the policy and prints the summary.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from aligner import distributed
from aligner.actor import fingerprint
from aligner.actor.checkpointing import ActorCheckpointer, weights_fingerprint
from aligner.actor.config import ActorConfig, validate_actor_config
from aligner.actor.critic_link import checked_client
from aligner.actor.datasets import PromptSet, training_prompt_set, validation_prompt_set
from aligner.actor.export import PolicyExporter, export_policy
from aligner.actor.model_source import model_keys_named, resolve_model_config
from aligner.actor.prompts import PromptSampler
from aligner.actor.resume import check_resume, resolve_resume
from aligner.actor.rollout_workers import RolloutWorkers
from aligner.actor.trainer import PPOTrainer
from aligner.checkpoint import read_json, write_json
from aligner.config_checks import ConfigError
from aligner.cpu_memory import tune_allocator
from aligner.distributed import ParallelState
from aligner.generation.engine import GenerationEngine
from aligner.generation.native import NativeEngine
from aligner.generation.remote import worker_identity
from aligner.generation.trtllm import TrtllmEngine
from aligner.metrics import MetricsLogger, format_console, read_metrics
from aligner.models import gpt
from aligner.models.checkpoint_io import load_weights_from
from aligner.models.lora import apply_lora
from aligner.precision import precision_dtype, resolve_precision
from aligner.report import format_summary, plot_run, summarize
from aligner.rl import CRITIC_FREE_ESTIMATORS
from aligner.tasks import get_task
from aligner.tokenizers import Tokenizer, build_tokenizer, resolve_tokenizer_spec
from aligner.wire.client import RemoteCriticClient, resolve_critic_url
from aligner.wire.handle import CriticHandle
from aligner.wire.protocol import resolve_run_token

__all__ = [
    "Inputs",
    "Actor",
    "read_inputs",
    "validation_prompts",
    "build_actor",
    "run",
    "export_policy",
    "main",
]

ConfigStore.instance().store(name="actor_schema", node=ActorConfig)


# ----------------------------------------------------------------------------------------------
# 1. The inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """What step 1 read, before any process group or model exists."""

    tokenizer: Tokenizer
    url: str
    run_token: str | None
    prompts: list[str]
    train_extras: list[str] | None  # each training prompt's extra columns (JSON), or None
    train_set: PromptSet | None  # None for the built-in task (prompts without extras or lengths)
    val_prompts: list[str] = field(default_factory=list)
    val_extras: list[str] | None = None  # aligned with val_prompts
    raw_prompts: dict[str, str] | None = None  # templated prompt -> the data set's own text
    overrides: list[str] = field(default_factory=list)  # the model.* keys applied over init_from


def read_inputs(cfg: ActorConfig, model_keys: set[str] | None = None) -> Inputs:
    """Step 1. Resolves ``cfg.model`` and ``cfg.tokenizer`` in place (with ``init_from``, the
    folder decides the architecture and, with ``tokenizer: auto``, the tokenizer; ``model_keys``
    are the ``model.*`` keys named on the command line, checked against it), checks the config and
    reads the prompts. Every rank reads them; the first one says what it kept."""
    cfg.model, applied = resolve_model_config(cfg.model, cfg.init_from, model_keys or ())
    cfg.tokenizer = resolve_tokenizer_spec(cfg.tokenizer, cfg.init_from)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.init_from)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_actor_config(cfg, world_size=world, vocab_size=tokenizer.vocab_size)
    # checkpoint.resume=auto continues only a run of this config: refused before anything is read.
    check_resume(cfg, say=print if int(os.environ.get("RANK", "0")) == 0 else None)
    inputs = Inputs(
        tokenizer=tokenizer,
        url=resolve_critic_url(cfg.critic.url),
        run_token=resolve_run_token(cfg.critic.run_token_file, "critic.run_token_file"),
        prompts=[],
        train_extras=None,
        train_set=None,
        overrides=list(applied),
    )
    max_prompt = cfg.model.max_seq_len - cfg.generation.max_new_tokens
    if cfg.data.dataset is not None or cfg.data.prompt_file is not None:
        inputs.train_set = training_prompt_set(cfg.data, tokenizer, max_prompt)
        inputs.prompts, inputs.train_extras = inputs.train_set.prompts, inputs.train_set.extras
    else:
        inputs.prompts = get_task(cfg.data.task, cfg.data.num_digits).prompts(
            cfg.data.num_prompts, seed=cfg.seed
        )
    val_set = None
    if cfg.validation.interval or cfg.validation.before_train:
        inputs.val_prompts, inputs.val_extras, val_set = validation_prompts(cfg, tokenizer, inputs.train_set)
    train_set = inputs.train_set
    if int(os.environ.get("RANK", "0")) == 0 and (train_set is not None or val_set is not None):
        sets = {"train": train_set, "validation": val_set}
        for label, prompt_set in zip(("data", "validation data"), sets.values()):
            if prompt_set is not None:
                print(prompt_set.summary(label), flush=True)
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        write_json(
            os.path.join(cfg.logging.run_dir, "data_stats.json"),
            {k: x.stats if x is not None else None for k, x in sets.items()},
        )
    # With a chat template: each templated prompt's text as the data set writes it, for a reward
    # model that reads text (it must not see the policy's template).
    inputs.raw_prompts = {
        templated: raw
        for prompt_set in (train_set, val_set)
        if prompt_set is not None and prompt_set.texts is not None
        for templated, raw in zip(prompt_set.prompts, prompt_set.texts)
    } or None
    dp = max(
        world // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size), 1
    )
    if inputs.val_prompts and len(inputs.val_prompts) < dp:
        # Every data-parallel rank validates its share; an empty share would stall the others.
        raise ConfigError(
            f"validation has {len(inputs.val_prompts)} prompt(s) for {dp} data-parallel ranks: set "
            f"validation.num_prompts >= {dp} (or give validation.prompt_file more lines)"
        )
    return inputs


def validation_prompts(
    cfg: ActorConfig, tokenizer: Tokenizer, train_set: PromptSet | None
) -> tuple[list[str], list[str] | None, PromptSet | None]:
    """The fixed evaluation prompts, their extras (or None) and the prompt set they come from (or
    None): data.val_split, else validation.prompt_file, else the training data set's first
    prompts, else the built-in task drawn with validation.seed. Never depends on batch sizes."""
    v = cfg.validation
    max_prompt = cfg.model.max_seq_len - cfg.generation.max_new_tokens
    val_set = validation_prompt_set(cfg.data, v.prompt_file, v.num_prompts, tokenizer, max_prompt)
    if val_set is not None:
        return val_set.prompts, val_set.extras, val_set
    if train_set is not None:
        head = train_set.head(v.num_prompts)
        return head.prompts, head.extras, None
    return get_task(cfg.data.task, cfg.data.num_digits).prompts(v.num_prompts, seed=v.seed), None, None


# ----------------------------------------------------------------------------------------------
# 3. - 8.: the critic, the models, the engine, the sampler, the logger
# ----------------------------------------------------------------------------------------------


def connect_critic(cfg: ActorConfig, inputs: Inputs, state: ParallelState) -> RemoteCriticClient:
    """Step 3: the client, checked against the server (protocol, vocabulary, sequence length,
    tokenizer; a training server's run token)."""
    # Every rank watches for restarts: a rank whose infer reaches a restarted server (one that will
    # never reach the critic step the infer waits for) must say so, and the run rolls back on every
    # rank (after which each rank's client follows the server: CriticLink.follow).
    critic = checked_client(
        cfg, inputs.url, inputs.tokenizer, run_token=inputs.run_token, watch_restarts=True
    )
    try:
        critic_free = cfg.ppo.advantage in CRITIC_FREE_ESTIMATORS  # sends no train, save or load
        if inputs.run_token is None and not critic_free and critic.server_info().run_token_required:
            raise ConfigError(
                f"the critic server at {inputs.url} requires its run token for training, saving and loading "
                "the critic: set critic.run_token_file (or $ALIGNER_RUN_TOKEN) to the server's token"
            )
    except BaseException:
        critic.close()
        raise
    return critic


def build_models(cfg: ActorConfig, state: ParallelState) -> tuple[Any, Any | None]:
    """Step 4: the policy (``init_from``'s weights) and the frozen reference (None without a KL
    penalty), then the policy's LoRA adapters; all of it on this rank's device.

    Megatron initialises the weights on the CPU (``use_cpu_initialization``: the same initial
    weights at any layout and on any machine); each model then moves to the device once."""
    policy = gpt.build_policy(cfg.model)
    if cfg.init_from:
        load_weights_from(policy, cfg.model, cfg.init_from)
    policy.to(state.device)
    reference = None
    if cfg.ppo.init_kl_coef > 0 or cfg.ppo.adaptive_kl:
        # A second module with the initial weights (not a deepcopy: Megatron modules hold
        # process groups, which cannot be copied).
        # In the policy's compute dtype (bf16 under mixed precision): it only runs forwards.
        dtype = precision_dtype(resolve_precision(cfg.precision, state.device))
        reference = gpt.build_policy(cfg.model, params_dtype=dtype).to(state.device)
        gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy), what="reference model")
        reference.eval().requires_grad_(False)  # ppo.reference_on_cpu: the trainer offloads it
    if cfg.lora.enabled:
        # After the reference copied the base weights: the reference stays the base model, and
        # only the policy's adapters train (before the engine: it then owns merged weights).
        apply_lora(policy, cfg.lora, seed=cfg.seed)
    return policy, reference


def build_engine(
    cfg: ActorConfig, policy: Any, tokenizer: Tokenizer, state: ParallelState, workdir: str | None = None
) -> GenerationEngine:
    """Step 6: the native KV-cache engine, or TensorRT-LLM (``generation.engine=trtllm``; its
    files under ``workdir``, default the run dir)."""
    if cfg.generation.engine == "trtllm":
        # Group rank 0 of each tensor-parallel group owns an engine on the group's GPUs; the
        # other ranks send it their weights and receive its outputs.
        return TrtllmEngine(
            cfg.model,
            pad_id=tokenizer.pad_id,
            eos_id=tokenizer.eos_id,
            dp_rank=state.dp_rank,
            tensor_parallel_size=state.tp_size,
            group=state.tp_group if state.tp_size > 1 else None,
            config=cfg.generation.trtllm,
            workdir=workdir or cfg.logging.run_dir,
            tokenizer=tokenizer,
            sample_vocab_size=getattr(tokenizer, "sample_vocab_size", None),
            device=state.device,
        )
    return NativeEngine(
        policy,
        tokenizer,
        parallel_state=state,
        vocab_size=getattr(tokenizer, "sample_vocab_size", tokenizer.vocab_size),
        num_threads=cfg.generation.num_threads,
        decode_step=cfg.generation.decode_step,
        # Its own layout and dtype (None: the training TP, the policy's dtype); any other than
        # the training one makes the engine own a copy that each refit reshards into.
        generation_tp=cfg.generation.tensor_parallel_size,
        dtype=cfg.generation.dtype,
    )


def build_sampler(cfg: ActorConfig, inputs: Inputs, state: ParallelState) -> PromptSampler:
    """Step 7: the seeded order in which steps draw prompts, dealt over the data-parallel ranks
    (balanced by prompt length with ``data.balance_dp``)."""
    lengths = None
    if cfg.data.balance_dp and state.dp_size > 1:
        train_set, tok = inputs.train_set, inputs.tokenizer
        lengths = train_set.lengths if train_set is not None else [len(tok.encode(x)) for x in inputs.prompts]
    return PromptSampler(
        inputs.prompts,
        cfg.ppo.global_batch_size,
        state.dp_rank,
        state.dp_size,
        cfg.seed,
        cfg.data.shuffle,
        lengths=lengths,
        extras=inputs.train_extras,
        samples_per_prompt=cfg.ppo.samples_per_prompt,
    )


def _print_header(cfg: ActorConfig, inputs: Inputs, state: ParallelState, policy: Any) -> None:
    """Step 8, on the logging rank: the run's layout, the policy it starts from, LoRA's share."""
    print(
        f"actor: {state.world_size} rank(s) (TP={state.tp_size}, PP={state.pp_size}, "
        f"DP={state.dp_size}), critic at {inputs.url}, run dir {cfg.logging.run_dir}",
        flush=True,
    )
    if cfg.init_from:
        m = cfg.model
        print(
            f"policy: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
            f"({m.kv_heads} kv), vocab {m.vocab_size}, context {m.max_seq_len}, from {cfg.init_from}"
            + (f" (overrides: {', '.join(inputs.overrides)})" if inputs.overrides else ""),
            flush=True,
        )
    if cfg.lora.enabled:
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in policy.parameters())
        print(
            f"lora: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {', '.join(cfg.lora.targets)}: "
            f"{trained} of {total} parameters train on this rank ({100 * trained / total:.2f}%)",
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# The actor, built
# ----------------------------------------------------------------------------------------------


@dataclass
class Actor:
    """What :func:`build_actor` made; :meth:`on_step` and :meth:`on_rollback` are the trainer's
    hooks (the console and the metrics files)."""

    cfg: ActorConfig
    state: ParallelState
    inputs: Inputs
    critic: CriticHandle
    policy: Any
    reference: Any | None
    checkpointer: ActorCheckpointer
    engine: GenerationEngine
    sampler: PromptSampler
    logger: MetricsLogger | None
    run_config: dict | None
    resume_step: int = -1  # -1: a fresh start (rows of an earlier run in run_dir are dropped)
    bar: Any | None = None  # tqdm's bar, on the logging rank with logging.progress_bar
    trainer: PPOTrainer | None = None
    workers: RolloutWorkers | None = None  # rollout workers of their own (rollout.workers)

    @property
    def log(self) -> bool:
        return self.state.is_logging_rank

    def open_logger(self, resume_step: int) -> MetricsLogger:
        c = self.cfg.logging
        return MetricsLogger(
            c.run_dir,
            tensorboard=c.tensorboard,
            enabled=self.log,
            resume_step=resume_step,
            wandb=c.wandb,
            run_config=self.run_config,
        )

    def on_rollback(self, step: int) -> None:
        """After a restarted server: the metrics and the bar continue from ``step`` (the redone
        steps' rows replace the abandoned ones, as on a resume)."""
        self.logger.close()
        self.logger = self.open_logger(step)
        if self.trainer is not None:
            self.trainer.logger = self.logger
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def on_step(self, step: int, m: dict) -> None:
        if not self.log:
            return
        if self.bar is not None:
            self.bar.set_postfix(
                reward=f"{m['objective/scores']:.3f}",
                kl=f"{m['objective/kl']:.3f}",
                step_s=f"{m['timers/step']:.2f}",
            )
            self.bar.update(1)
        elif step % self.cfg.logging.log_interval == 0:
            print(format_console(step, m), flush=True)

    def close(self) -> None:
        """The rollout workers (told to stop), the engine's processes (TensorRT-LLM), the metrics
        files and the client."""
        if self.workers is not None:
            self.workers.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:  # None until step 8 opened it
            self.logger.close()
        self.critic.close()


def build_actor(
    cfg: ActorConfig, model_keys: set[str] | None = None, *, critic: CriticHandle | None = None
) -> Actor:
    """Steps 1-9 (the module's docstring). ``critic``: a handle to use instead of a client of
    ``critic.url`` (a stand-in server in tests). On an error, what was opened is closed; the
    process groups stay (:func:`run` destroys them)."""
    inputs = read_inputs(cfg, model_keys)  # 1
    state = distributed.initialize(cfg.parallel, seed=cfg.seed)  # 2
    tune_allocator(state.device.type)  # keep freed activations in the heap on CPU runs
    if critic is None:
        critic = connect_critic(cfg, inputs, state)  # 3
    engine = actor = workers = None
    try:
        policy, reference = build_models(cfg, state)  # 4
        # 5. The initial weights' digest: a resumed run must have the same frozen reference.
        checkpointer = ActorCheckpointer(
            cfg,
            state,
            critic,
            inputs.tokenizer,
            reference_fingerprint=weights_fingerprint(reference if reference is not None else policy, state),
        )
        # Decided before anything is logged; a fresh start resets a trained server's critic.
        resume_dir = resolve_resume(checkpointer)
        engine = build_engine(cfg, policy, inputs.tokenizer, state)  # 6
        if cfg.rollout.workers:  # 6b. rollout workers of their own: the trainer hosts their store
            identity = worker_identity(
                cfg.model, inputs.tokenizer, resolve_precision(cfg.precision, state.device)
            )
            workers = RolloutWorkers(cfg, identity, cfg.model, state)
        sampler = build_sampler(cfg, inputs, state)  # 7
        # 8. W&B (logging.wandb): the same metrics, with the whole config as the run's config.
        resume_step, checkpointer.run_id = -1, fingerprint.new_run_id()
        if resume_dir is not None:
            saved = read_json(resume_dir / "actor" / "trainer_state.json")
            resume_step, checkpointer.run_id = int(saved["trainer"]["step"]), saved.get("run_id")
        log = state.is_logging_rank
        run_config = fingerprint.config_dict(cfg) if log else None
        log_from = resume_step  # the run dir's rows and W&B run go on only when they are this run's
        if (
            log
            and resume_step >= 0
            and not fingerprint.run_dir_continues(cfg.logging.run_dir, checkpointer.run_id)
        ):
            log_from = -1
            print(
                f"{cfg.logging.run_dir} is not the run dir of the run resumed (run id {checkpointer.run_id}): "
                "its log starts anew there (earlier rows dropped, a new W&B run)",
                flush=True,
            )
        if log:
            fingerprint.write_run_record(
                cfg.logging.run_dir, run_config, checkpointer.run_id, resume_dir and str(resume_dir)
            )
        actor = Actor(
            cfg,
            state,
            inputs,
            critic,
            policy,
            reference,
            checkpointer,
            engine,
            sampler,
            None,
            run_config,
            resume_step,
            workers=workers,
        )
        actor.logger = actor.open_logger(log_from)
        if log:
            OmegaConf.save(OmegaConf.structured(cfg), os.path.join(cfg.logging.run_dir, "config.yaml"))
            _print_header(cfg, inputs, state, policy)
            if cfg.logging.progress_bar:
                from tqdm import tqdm

                actor.bar = tqdm(
                    total=cfg.ppo.num_steps,
                    initial=max(resume_step, 0),
                    desc="PPO",
                    dynamic_ncols=True,
                    file=sys.stdout,
                )
        # 9. The trainer; the checkpointer restores the policy and optimizer in place, and the
        # trainer takes back the rest of its state (and refits its engine before generating again).
        actor.trainer = PPOTrainer(
            cfg,
            state,
            policy,
            reference,
            engine,
            critic,
            inputs.tokenizer,
            sampler,
            actor.logger,
            actor.on_step,
            checkpointer=checkpointer,
            val_prompts=inputs.val_prompts[state.dp_rank :: state.dp_size],
            val_extras=inputs.val_extras[state.dp_rank :: state.dp_size]
            if inputs.val_extras is not None
            else None,
            raw_prompts=inputs.raw_prompts,
            on_rollback=actor.on_rollback,
            workers=workers,
        )
        if resume_dir is not None:
            actor.trainer.load_training_state(checkpointer.load(actor.trainer.actor_state(), resume_dir))
        return actor
    except BaseException:
        if actor is not None:  # the engine, the logger and its bar, the client
            actor.close()
        else:
            if workers is not None:
                workers.close()
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            critic.close()
        raise


# ----------------------------------------------------------------------------------------------
# Training, the export and the summary
# ----------------------------------------------------------------------------------------------


def run(
    cfg: ActorConfig,
    model_keys: set[str] | None = None,
    *,
    critic: CriticHandle | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Build (:func:`build_actor`), train, export (``checkpoint.export_hf``: during the run too,
    :mod:`aligner.actor.export`) and summarise; returns the summary on the logging rank (an empty
    dict elsewhere). ``overrides``: the command line, named in the exports' model cards."""
    import torch.distributed as dist

    try:
        actor = build_actor(cfg, model_keys, critic=critic)
        try:
            t0 = time.time()
            exporter = None
            if cfg.checkpoint.export_hf:
                exporter = PolicyExporter(cfg, actor.policy, log_rank=actor.log, overrides=overrides)
                actor.checkpointer.exporter = exporter
            actor.trainer.train()
            if actor.bar is not None:
                actor.bar.close()
                actor.bar = None
            if exporter is not None:
                exporter.at_end(actor.trainer.step_count)
        finally:
            actor.close()
        summary: dict = {}
        if actor.log:
            metrics_path = os.path.join(cfg.logging.run_dir, "metrics.jsonl")
            summary = summarize(read_metrics(metrics_path))
            summary["wall_s"] = time.time() - t0
            png = plot_run(metrics_path, os.path.join(cfg.logging.run_dir, "reward_kl.png"))
            print(format_summary(summary), flush=True)
            print(f"plot: {png}" if png else "plot: skipped (needs matplotlib: the plot extra)", flush=True)
        if dist.is_initialized():
            dist.barrier()
        return summary
    finally:
        distributed.destroy()


@hydra.main(config_path="pkg://aligner.configs", config_name="actor", version_base=None)
def main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg: ActorConfig = OmegaConf.to_object(dcfg)
    overrides = list(HydraConfig.get().overrides.task)
    run(cfg, model_keys_named(overrides), overrides=overrides)


if __name__ == "__main__":
    main()
