"""The actor: PPO on a Megatron-core policy against a running critic/reward server.

    python examples/train_actor.py critic.url=grpc://127.0.0.1:8001
    ALIGNER_CRITIC_URL=grpc://critic:8001 torchrun --nproc_per_node 2 examples/train_actor.py \
        parallel.tensor_model_parallel_size=2

Every key of ``actor.yaml`` (:mod:`aligner.configs`) can be overridden on the command line; unknown keys are
errors. The config is checked, and the prompts read, before any model is built.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aligner.checkpoint import read_json, write_json  # noqa: E402
from aligner.cpu_memory import tune_allocator  # noqa: E402
from aligner.ppo.config import ActorConfig  # noqa: E402

if TYPE_CHECKING:
    from aligner.ppo.datasets import PromptSet

ConfigStore.instance().store(name="actor_schema", node=ActorConfig)


def run(cfg: ActorConfig, model_keys: set[str] | None = None) -> dict:
    """Train; ``model_keys``: the ``model.*`` keys named on the command line (checked against
    ``init_from``'s architecture, see :mod:`aligner.ppo.model_source`)."""
    import torch.distributed as dist

    from aligner import distributed
    from aligner.critic.client import RemoteCriticClient, resolve_critic_url
    from aligner.critic.protocol import resolve_run_token
    from aligner.generation.native import NativeEngine
    from aligner.metrics import MetricsLogger, format_console, read_metrics
    from aligner.models import gpt
    from aligner.ppo.checkpointing import ActorCheckpointer, weights_fingerprint
    from aligner.ppo.config import ConfigError, validate_actor_config
    from aligner.ppo.datasets import training_prompt_set
    from aligner.ppo.model_source import resolve_model_config
    from aligner.ppo.prompts import PromptSampler
    from aligner.ppo.trainer import PPOTrainer
    from aligner.report import format_summary, plot_run, summarize
    from aligner.tasks import get_task
    from aligner.tokenizers import build_tokenizer, resolve_tokenizer_spec

    # Everything that can be checked without a model is checked first. With init_from, the folder
    # decides the architecture and (tokenizer: auto) the tokenizer.
    cfg.model, applied = resolve_model_config(cfg.model, cfg.init_from, model_keys or ())
    cfg.tokenizer = resolve_tokenizer_spec(cfg.tokenizer, cfg.init_from)
    tokenizer = build_tokenizer(cfg.tokenizer)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_actor_config(cfg, world_size=world, vocab_size=tokenizer.vocab_size)
    url = resolve_critic_url(cfg.critic.url)
    run_token = resolve_run_token(cfg.critic.run_token_file, "critic.run_token_file")
    # Every rank reads the prompts (before process groups exist); the first one tells what it kept.
    first_rank = int(os.environ.get("RANK", "0")) == 0
    max_prompt = cfg.model.max_seq_len - cfg.generation.max_new_tokens
    train_set = None  # the built-in task: prompts without extras or token counts
    if cfg.data.dataset is not None or cfg.data.prompt_file is not None:
        train_set = training_prompt_set(cfg.data, tokenizer, max_prompt)
        prompts, train_extras = train_set.prompts, train_set.extras
    else:
        prompts = get_task(cfg.data.task, cfg.data.num_digits).prompts(cfg.data.num_prompts, seed=cfg.seed)
        train_extras = None
    val_prompts: list[str] = []
    val_extras: list[str] | None = None  # aligned with val_prompts: each row's extra columns (JSON)
    val_set = None
    if cfg.validation.interval or cfg.validation.before_train:
        val_prompts, val_extras, val_set = _validation_prompts(cfg, tokenizer, train_set)
    if first_rank and (train_set is not None or val_set is not None):
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
    raw_prompts = {
        templated: raw
        for prompt_set in (train_set, val_set)
        if prompt_set is not None and prompt_set.texts is not None
        for templated, raw in zip(prompt_set.prompts, prompt_set.texts)
    }
    dp = max(
        world // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size), 1
    )
    if val_prompts and len(val_prompts) < dp:
        # Every data-parallel rank validates its share; an empty share would stall the others.
        raise ConfigError(
            f"validation has {len(val_prompts)} prompt(s) for {dp} data-parallel ranks: set "
            f"validation.num_prompts >= {dp} (or give validation.prompt_file more lines)"
        )

    state = distributed.initialize(cfg.parallel, seed=cfg.seed)
    tune_allocator(state.device.type)  # keep freed activations in the heap on CPU runs
    engine = None
    try:
        log = state.is_logging_rank
        critic = RemoteCriticClient(
            url,
            timeout_s=cfg.critic.timeout_s,
            ready_timeout_s=cfg.critic.ready_timeout_s,
            wait_timeout_s=cfg.critic.wait_timeout_s,
            retries=cfg.critic.retries,
            run_token=run_token,
            # Rank 0 alone trains, saves and loads the critic: its requests are the fenced ones.
            watch_restarts=state.rank == 0,
        )
        critic.check_compatible(tokenizer.vocab_size, cfg.model.max_seq_len, tokenizer.fingerprint())
        from aligner.rl import CRITIC_FREE_ESTIMATORS

        critic_free = cfg.ppo.advantage in CRITIC_FREE_ESTIMATORS  # sends no train, save or load
        if run_token is None and not critic_free and critic.server_info().run_token_required:
            raise ConfigError(
                f"the critic server at {url} requires its run token for training, saving and loading the "
                "critic: set critic.run_token_file (or $ALIGNER_RUN_TOKEN) to the server's token"
            )

        policy = gpt.build_policy(cfg.model)
        if cfg.init_from:
            from aligner.models.checkpoint_io import load_weights_from

            load_weights_from(policy, cfg.model, cfg.init_from)
        reference = None
        if cfg.ppo.init_kl_coef > 0 or cfg.ppo.adaptive_kl:
            # A second module with the initial weights (not a deepcopy: Megatron modules hold
            # process groups, which cannot be copied).
            from aligner.precision import precision_dtype, resolve_precision

            # In the policy's compute dtype (bf16 under mixed precision): it only runs forwards.
            dtype = precision_dtype(resolve_precision(cfg.precision, state.device))
            reference = gpt.build_policy(cfg.model, params_dtype=dtype)
            gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy), what="reference model")
            reference.eval().requires_grad_(False)  # ppo.reference_on_cpu: the trainer offloads it
        if cfg.lora.enabled:
            # After the reference copied the base weights: the reference stays the base model, and
            # only the policy's adapters train (before the engine: it then owns merged weights).
            from aligner.models.lora import apply_lora

            apply_lora(policy, cfg.lora, seed=cfg.seed)
        # The initial weights' digest: a resumed run must have the same frozen reference.
        checkpointer = ActorCheckpointer(
            cfg,
            state,
            critic,
            tokenizer,
            reference_fingerprint=weights_fingerprint(reference if reference is not None else policy, state),
        )
        # Decided before anything is logged; a fresh start resets a trained server's critic.
        resume_dir = checkpointer.resolve_resume()
        if cfg.generation.engine == "trtllm":
            from aligner.generation.trtllm import TrtllmEngine

            # Group rank 0 of each tensor-parallel group owns an engine on the group's GPUs; the
            # other ranks send it their weights and receive its outputs.
            engine = TrtllmEngine(
                cfg.model,
                pad_id=tokenizer.pad_id,
                eos_id=tokenizer.eos_id,
                dp_rank=state.dp_rank,
                tensor_parallel_size=state.tp_size,
                group=state.tp_group if state.tp_size > 1 else None,
                config=cfg.generation.trtllm,
                workdir=cfg.logging.run_dir,
                tokenizer=tokenizer,
                sample_vocab_size=getattr(tokenizer, "sample_vocab_size", None),
                device=state.device,
            )
        else:
            engine = NativeEngine(
                policy,
                tokenizer,
                parallel_state=state,
                vocab_size=getattr(tokenizer, "sample_vocab_size", tokenizer.vocab_size),
                num_threads=cfg.generation.num_threads,
                decode_step=cfg.generation.decode_step,
                # Its own layout and dtype (None: the training TP, the policy's dtype); any other
                # than the training one makes the engine own a copy that each refit reshards into.
                generation_tp=cfg.generation.tensor_parallel_size,
                dtype=cfg.generation.dtype,
            )
        balance = cfg.data.balance_dp and state.dp_size > 1
        sampler = PromptSampler(
            prompts,
            cfg.ppo.global_batch_size,
            state.dp_rank,
            state.dp_size,
            cfg.seed,
            cfg.data.shuffle,
            lengths=(
                (train_set.lengths if train_set is not None else [len(tokenizer.encode(x)) for x in prompts])
                if balance
                else None
            ),
            extras=train_extras,
            samples_per_prompt=cfg.ppo.samples_per_prompt,
        )
        resume_step = -1  # a fresh start: rows of an earlier run in this run_dir are dropped
        if resume_dir is not None:
            resume_step = int(read_json(resume_dir / "actor" / "trainer_state.json")["trainer"]["step"])
        # W&B (logging.wandb): the same metrics, with the whole config as the run's config.
        run_config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True) if log else None
        logger = MetricsLogger(
            cfg.logging.run_dir,
            tensorboard=cfg.logging.tensorboard,
            enabled=log,
            resume_step=resume_step,
            wandb=cfg.logging.wandb,
            run_config=run_config,
        )
        if log:
            OmegaConf.save(OmegaConf.structured(cfg), os.path.join(cfg.logging.run_dir, "config.yaml"))
            print(
                f"actor: {state.world_size} rank(s) (TP={state.tp_size}, PP={state.pp_size}, "
                f"DP={state.dp_size}), critic at {url}, run dir {cfg.logging.run_dir}",
                flush=True,
            )
            if cfg.init_from:
                m = cfg.model
                print(
                    f"policy: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
                    f"({m.kv_heads} kv), vocab {m.vocab_size}, context {m.max_seq_len}, from {cfg.init_from}"
                    + (f" (overrides: {', '.join(applied)})" if applied else ""),
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

        bar = None
        if log and cfg.logging.progress_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.ppo.num_steps,
                initial=max(resume_step, 0),
                desc="PPO",
                dynamic_ncols=True,
                file=sys.stdout,
            )

        def on_rollback(step: int) -> None:
            """After a restarted server: the metrics and the bar continue from ``step`` (the
            redone steps' rows replace the abandoned ones, as on a resume)."""
            nonlocal logger
            logger.close()
            logger = MetricsLogger(
                cfg.logging.run_dir,
                tensorboard=cfg.logging.tensorboard,
                enabled=log,
                resume_step=step,
                wandb=cfg.logging.wandb,
                run_config=run_config,
            )
            trainer.logger = logger
            if bar is not None:
                bar.n = step
                bar.refresh()

        def on_step(step: int, m: dict) -> None:
            if not log:
                return
            if bar is not None:
                bar.set_postfix(
                    reward=f"{m['objective/scores']:.3f}",
                    kl=f"{m['objective/kl']:.3f}",
                    step_s=f"{m['timers/step']:.2f}",
                )
                bar.update(1)
            elif step % cfg.logging.log_interval == 0:
                print(format_console(step, m), flush=True)

        trainer = PPOTrainer(
            cfg,
            state,
            policy,
            reference,
            engine,
            critic,
            tokenizer,
            sampler,
            logger,
            on_step,
            checkpointer=checkpointer,
            val_prompts=val_prompts[state.dp_rank :: state.dp_size],
            val_extras=val_extras[state.dp_rank :: state.dp_size] if val_extras is not None else None,
            raw_prompts=raw_prompts or None,
            on_rollback=on_rollback,
        )
        if resume_dir is not None:
            # The checkpointer restores the policy and optimizer in place; the trainer takes back
            # the rest of its state (and refits its engine before generating again).
            trainer.load_training_state(checkpointer.load(trainer.actor_state(), resume_dir))
        t0 = time.time()
        trainer.train()
        if bar is not None:
            bar.close()
        if cfg.checkpoint.export_hf:
            _export(cfg, policy, log)
        logger.close()
        critic.close()
        summary: dict = {}
        if log:
            metrics_path = os.path.join(cfg.logging.run_dir, "metrics.jsonl")
            summary = summarize(read_metrics(metrics_path))
            summary["wall_s"] = time.time() - t0
            png = plot_run(metrics_path, os.path.join(cfg.logging.run_dir, "reward_kl.png"))
            print(format_summary(summary), flush=True)
            print(f"plot: {png}", flush=True)
        if dist.is_initialized():
            dist.barrier()
        return summary
    finally:
        close = getattr(engine, "close", None)  # an engine in processes of its own (TensorRT-LLM)
        if close is not None:
            close()
        distributed.destroy()


def _validation_prompts(
    cfg: ActorConfig, tokenizer, train_set: PromptSet | None
) -> tuple[list[str], list[str] | None, PromptSet | None]:
    """The fixed evaluation prompts, their extras (or None) and the prompt set they come from (or
    None): data.val_split, else validation.prompt_file, else the training data set's first
    prompts, else the built-in task drawn with validation.seed. Never depends on batch sizes."""
    from aligner.ppo.datasets import validation_prompt_set
    from aligner.tasks import get_task

    v = cfg.validation
    max_prompt = cfg.model.max_seq_len - cfg.generation.max_new_tokens
    val_set = validation_prompt_set(cfg.data, v.prompt_file, v.num_prompts, tokenizer, max_prompt)
    if val_set is not None:
        return val_set.prompts, val_set.extras, val_set
    if train_set is not None:
        head = train_set.head(v.num_prompts)
        return head.prompts, head.extras, None
    return get_task(cfg.data.task, cfg.data.num_digits).prompts(v.num_prompts, seed=v.seed), None, None


def _export(cfg: ActorConfig, policy, log: bool) -> None:
    """The final policy as a Hugging Face folder (tokenizer files copied when it is a HF one)."""
    from aligner.models.hf import export_hf

    arch = cfg.checkpoint.export_arch
    if arch is None and cfg.init_from:
        meta = os.path.join(cfg.init_from, "meta.json")
        hf_conf = os.path.join(cfg.init_from, "config.json")
        if os.path.isfile(meta):
            arch = read_json(meta).get("hf_architecture")
        elif os.path.isfile(hf_conf):
            arch = (read_json(hf_conf).get("architectures") or [None])[0]
    tok_dir = cfg.tokenizer if os.path.isdir(cfg.tokenizer) else None
    if arch is None:
        from aligner.models.hf_config import default_architecture

        arch = default_architecture(cfg.model)  # Qwen3 for q/k norms, GPT-2 for learned positions, ...
    out = export_hf(policy, cfg.model, cfg.checkpoint.export_hf, arch, tokenizer_dir=tok_dir, overwrite=True)
    if log:
        print(f"exported the policy as a Hugging Face folder: {out}", flush=True)
    if cfg.lora.enabled:
        from aligner.models.lora import export_peft_adapter

        # The merged model is the folder itself; the adapters alone apply to the base model.
        peft_dir = export_peft_adapter(
            policy,
            os.path.join(out, "peft_adapter"),
            arch or "llama",
            base_model=cfg.init_from,
            overwrite=True,
        )
        if log:
            print(f"exported the LoRA adapters (peft format, for the base model): {peft_dir}", flush=True)


@hydra.main(config_path="pkg://aligner.configs", config_name="actor", version_base=None)
def main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from aligner.ppo.model_source import model_keys_named

    cfg: ActorConfig = OmegaConf.to_object(dcfg)
    run(cfg, model_keys_named(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
