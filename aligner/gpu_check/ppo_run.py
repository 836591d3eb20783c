"""Section c of the check: a short PPO run of the real actor against the real critic service, and
the figures read off it.

1. the workload: a tokenizer of the model's vocabulary, mixed-length prompts, the process group;
2. the critic: a :class:`~aligner.critic.service.CriticService` built from a config as the server
   builds it (:func:`aligner.critic.config.build_config`), behind :class:`InProcessCritic`;
3. the actor: ``actor.yaml`` composed with Hydra overrides as its command line would be, built by
   :func:`aligner.actor.run.build_actor` with that critic handle; its engine and policy update are
   wrapped to be timed and measured (:class:`MeasuredEngine`, :class:`MeasuredUpdate`);
4. the steps, each in a peak-memory window, until ``steps`` or the time budget;
5. the figures (:mod:`aligner.gpu_check.figures`).

Peak memory is read per role: ``generation`` (the engine's calls), ``policy_update`` (the PPO
epochs), ``critic`` (the service's infer and train), ``refit``, and ``step`` (a whole step, which
includes the log-prob forwards of the policy and the reference that no other role covers).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aligner.gpu_check.figures import summarize
from aligner.gpu_check.handle import InProcessCritic
from aligner.gpu_check.measure import GIB, PeakMemory, sync
from aligner.gpu_check.workload import REWARD_FN, Shape, write_prompts, write_tokenizer

__all__ = [
    "PPOOptions",
    "OptionUnavailable",
    "run_ppo",
    "option_keys",
    "parse_value",
    "MeasuredEngine",
    "MeasuredUpdate",
]


class OptionUnavailable(ValueError):
    """A check option whose config key this tree does not have yet."""


@dataclass
class PPOOptions:
    """The PPO run's size and the configuration it adds to both roles'."""

    shape: Shape
    steps: int
    global_batch: int
    mini_batch: int
    micro_batch: int
    max_new_tokens: int
    prompt_min: int
    prompt_max: int
    precision: str
    """``bf16`` (bf16 compute, fp32 masters) or ``fp32``."""
    budget_s: float
    """No step starts once the steps so far took this long (the rest are reported as not done)."""
    seed: int = 1234
    recompute: str | None = None
    """``model.recompute`` of both roles (None: not set)."""
    distributed_optimizer: bool = False
    """``optim.use_distributed_optimizer=true`` on both roles."""
    actor_overrides: list[str] = field(default_factory=list)
    """More Hydra overrides of ``actor.yaml``, applied last."""
    critic_overrides: dict[str, Any] = field(default_factory=dict)
    """More critic config keys (dotted), applied last."""


# ----------------------------------------------------------------------------------------------
# The wrappers that time and measure the actor's engine and policy update
# ----------------------------------------------------------------------------------------------


class MeasuredEngine:
    """The actor's generation engine, each call timed (device work included) and its peak memory
    taken; anything else is the engine's own."""

    def __init__(self, inner: Any, peaks: PeakMemory, device: torch.device) -> None:
        self.inner, self.peaks, self.device = inner, peaks, device
        self.calls: list[dict[str, float]] = []

    def generate(self, prompts: list[list[int]], sampling: Any) -> Any:
        sync(self.device)
        t0 = time.perf_counter()
        with self.peaks.role("generation"):
            out = self.inner.generate(prompts, sampling)
            sync(self.device)
        seconds = time.perf_counter() - t0
        plen, lengths = out.prompt_lengths, out.lengths
        self.calls.append(
            {
                "seconds": seconds,
                "rows": float(lengths.numel()),
                "prompt_min": float(plen.min()),
                "prompt_max": float(plen.max()),
                "length_max": float(lengths.max()),
                "response_max": float((lengths - plen).max()),
                "tokens": float(lengths.sum()),
                "response_tokens": float((lengths - plen).sum()),
            }
        )
        return out

    def refit(self, policy: Any) -> None:
        with self.peaks.role("refit"):
            self.inner.refit(policy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MeasuredUpdate:
    """The actor's :class:`~aligner.actor.policy_update.PolicyUpdate`: its forward-and-backward
    work (``first_forward`` when the rollout reuses it, and ``train_step``) timed, per step."""

    def __init__(self, inner: Any, peaks: PeakMemory, device: torch.device) -> None:
        self.inner, self.peaks, self.device = inner, peaks, device
        self.seconds: list[float] = []
        self._open = 0.0  # first_forward's seconds, added to the step's train_step

    def _timed(self, fn, *args: Any) -> tuple[Any, float]:
        sync(self.device)
        t0 = time.perf_counter()
        with self.peaks.role("policy_update"):
            out = fn(*args)
            sync(self.device)
        return out, time.perf_counter() - t0

    def first_forward(self, *args: Any) -> Any:
        out, seconds = self._timed(self.inner.first_forward, *args)
        self._open += seconds
        return out

    def train_step(self, *args: Any) -> Any:
        out, seconds = self._timed(self.inner.train_step, *args)
        self.seconds.append(self._open + seconds)
        self._open = 0.0
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ----------------------------------------------------------------------------------------------
# The two roles' configurations
# ----------------------------------------------------------------------------------------------


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def option_keys(opts: PPOOptions) -> tuple[list[str], dict[str, Any]]:
    """The actor overrides and critic keys of ``--recompute`` and ``--distributed-optimizer``;
    OptionUnavailable when this tree's configs have no such key."""
    from aligner.actor.config import PolicyOptimConfig
    from aligner.critic.config import CriticOptimConfig
    from aligner.models.config import ModelConfig

    actor: list[str] = []
    critic: dict[str, Any] = {}
    if opts.recompute is not None:
        if "recompute" not in _fields(ModelConfig):
            raise OptionUnavailable(
                "--recompute: this tree's ModelConfig has no field 'recompute' (activation recomputation "
                "is not in this tree yet); run without --recompute"
            )
        actor.append(f"model.recompute={opts.recompute}")
        critic["model.recompute"] = parse_value(opts.recompute)
    if opts.distributed_optimizer:
        names = [c.__name__ for c in (PolicyOptimConfig, CriticOptimConfig)]
        have = ["use_distributed_optimizer" in _fields(c) for c in (PolicyOptimConfig, CriticOptimConfig)]
        if not any(have):
            raise OptionUnavailable(
                f"--distributed-optimizer: neither {' nor '.join(names)} has a field 'use_distributed_optimizer' "
                "(the sharded optimizer is not in this tree yet); run without --distributed-optimizer"
            )
        if have[0]:
            actor.append("optim.use_distributed_optimizer=true")
        if have[1]:
            critic["optim.use_distributed_optimizer"] = True
    return actor, critic


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it (``true``, ``3``, ``full``), numbers in exponent form
    included (``1e-5``, which YAML 1.1 leaves a string)."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def critic_config(opts: PPOOptions, tokenizer: Path, root: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """The critic server's configuration (a plain dict for :func:`build_config`): the policy's
    shape and tokenizer, the synthetic reward, its files under ``root``."""
    cfg: dict[str, Any] = {
        "mode": "critic",
        "tokenizer": str(tokenizer),
        "seed": opts.seed,
        "precision": opts.precision,
        "model": opts.shape.keys(),
        "server": {
            "grpc_port": 0,
            "metrics_port": None,
            "max_batch_size": max(256, opts.global_batch),
            "max_request_batch": max(1024, opts.global_batch),
        },
        "reward": {"fn": REWARD_FN},
        "log": {"dir": str(root / "log"), "tensorboard": False},
        "checkpoint": {"dir": str(root / "checkpoints")},
    }
    for key, value in {**extra, **opts.critic_overrides}.items():
        _set_dotted(cfg, key, value)
    return cfg


def actor_overrides(
    opts: PPOOptions, tokenizer: Path, prompts: Path, root: Path, extra: list[str]
) -> list[str]:
    """``actor.yaml`` overrides, as a command line would give them: the shape, the data, the batch
    sizes, no validation, no checkpoints, files under ``root``."""
    return [
        *opts.shape.overrides(),
        f"tokenizer={tokenizer}",
        f"data.prompt_file={prompts}",
        f"precision={opts.precision}",
        f"seed={opts.seed}",
        "critic.url=grpc://in-process:0",  # never dialled (the handle is passed in): named in the logs
        f"generation.max_new_tokens={opts.max_new_tokens}",
        f"ppo.num_steps={opts.steps}",
        f"ppo.global_batch_size={opts.global_batch}",
        f"ppo.mini_batch_size={opts.mini_batch}",
        f"ppo.micro_batch_size={opts.micro_batch}",
        "ppo.ppo_epochs=1",
        "validation.interval=0",
        "validation.before_train=false",
        f"checkpoint.dir={root / 'checkpoints'}",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false",
        "checkpoint.resume=none",
        f"logging.run_dir={root}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        *extra,
        *opts.actor_overrides,
    ]


def compose_actor(overrides: list[str]) -> Any:
    """``actor.yaml`` with ``overrides``, as :func:`aligner.actor.run.main` composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import aligner.actor.run  # noqa: F401 - registers the config's schema (actor_schema)

    with initialize_config_module(config_module="aligner.configs", version_base=None):
        return OmegaConf.to_object(compose("actor", overrides=overrides))


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _placement(actor: Any, service: Any, device: torch.device) -> dict[str, str]:
    """Where each model's weights are (the first parameter's device)."""
    out = {"run": str(device)}
    for name, model in (("policy", actor.policy), ("reference", actor.reference), ("critic", service.critic)):
        if model is not None:
            out[name] = str(next(model.parameters()).device)
    return out


def run_ppo(opts: PPOOptions, workdir: Path, yardsticks: dict[str, Any], report: dict[str, Any]) -> None:
    """Steps 1-5 of the module docstring; fills ``report`` as it goes (what it holds stays when a
    step fails)."""
    from aligner import distributed
    from aligner.actor.model_source import model_keys_named
    from aligner.actor.run import build_actor
    from aligner.critic.config import build_config
    from aligner.critic.service import CriticService
    from aligner.distributed import ParallelConfig
    from aligner.models.gpt import unwrap

    t_start = time.perf_counter()
    actor_extra, critic_extra = option_keys(opts)  # before anything is built
    # 1. The workload.
    tokenizer = write_tokenizer(workdir / "tokenizer", opts.shape.vocab_size)
    prompts = workdir / "prompts.jsonl"
    report["prompt_tokens"] = write_prompts(
        prompts,
        opts.global_batch * opts.steps,
        opts.shape.vocab_size,
        opts.prompt_min,
        opts.prompt_max,
        opts.seed,
    )
    state = distributed.initialize(ParallelConfig(), seed=opts.seed)
    device = state.device
    peaks = PeakMemory(device)
    service = actor = None
    try:
        # 2. The critic, as the server builds it.
        before = peaks.allocated()
        t0 = time.perf_counter()
        ccfg = critic_config(opts, tokenizer, workdir / "critic", critic_extra)
        service = CriticService(build_config(ccfg), state)
        report["critic_build_s"] = round(time.perf_counter() - t0, 2)
        critic_gib = None if before is None else round((peaks.allocated() - before) / GIB, 3)
        handle = InProcessCritic(service, peaks)

        # 3. The actor, composed as its command line would be.
        overrides = actor_overrides(opts, tokenizer, prompts, workdir / "actor", actor_extra)
        report["actor_overrides"] = overrides
        cfg = compose_actor(overrides)
        before = peaks.allocated()
        t0 = time.perf_counter()
        actor = build_actor(cfg, model_keys_named(overrides), critic=handle)
        report["actor_build_s"] = round(time.perf_counter() - t0, 2)
        actor_gib = None if before is None else round((peaks.allocated() - before) / GIB, 3)
        report["resident_gib"] = {"critic": critic_gib, "actor": actor_gib}
        report["placement"] = placement = _placement(actor, service, device)
        misplaced = {k: v for k, v in placement.items() if k != "run" and torch.device(v).type != device.type}
        if misplaced:
            raise RuntimeError(
                f"the run's device is {device}, but these models' weights are elsewhere: {misplaced}; the "
                "role that built them does not move them to the device, so a PPO run there is not a GPU run"
            )
        trainer = actor.trainer
        engine = MeasuredEngine(trainer.engine, peaks, device)
        update = MeasuredUpdate(trainer.policy_update, peaks, device)
        trainer.engine, trainer.policy_update = engine, update

        # 4. The steps, until the count or the time budget.
        rows: list[dict[str, float]] = []
        report["steps_requested"] = opts.steps
        t_loop = time.perf_counter()
        try:
            for _ in range(opts.steps):
                spent = time.perf_counter() - t_loop
                if rows and spent + rows[-1]["timers/step"] > opts.budget_s:
                    report["stopped_by_budget"] = {"budget_s": opts.budget_s, "spent_s": round(spent, 1)}
                    break
                with peaks.step():
                    metrics = trainer.step()
                rows.append({k: float(v) for k, v in metrics.items()})
                report["steps_done"] = len(rows)
            trainer.finish()
        finally:
            # 5. The figures, of the steps that ran (also when a later one failed).
            report["loop_s"] = round(time.perf_counter() - t_loop, 2)
            if rows:
                report.update(
                    summarize(
                        rows,
                        engine.calls,
                        update.seconds,
                        handle.seconds,
                        policy=unwrap(actor.policy),
                        tied=opts.shape.tie_embeddings,
                        engine=engine.inner,
                        ppo_epochs=cfg.ppo.ppo_epochs,
                        yardsticks=yardsticks,
                    )
                )
            report["memory_peak_gib"] = peaks.gib()
    finally:
        if actor is not None:
            actor.close()
        if service is not None:
            service.close()
        distributed.destroy()
        report["seconds"] = round(time.perf_counter() - t_start, 2)
