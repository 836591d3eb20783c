"""Shared by the actor's one-process part tests (tests/actor/test_actor_*.py): the parallel
state of a single rank on the CPU."""

from __future__ import annotations

import torch

from aligner.distributed import ParallelState

ONE_RANK = ParallelState(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"), None, None, None)


def tiny_run_config():
    """An :class:`ActorConfig` sized for the packaged tiny model on a digit task, as in-process
    tests build their runs: the packaged defaults are a real model's (lr 1e-6, 512-token
    responses), these are the settings the tests were measured with (lr 1e-3 decaying to 1e-4,
    two PPO epochs, KL 0.02, 8-token responses, batches of 64 in minibatches and micro-batches of
    32, 100 steps, no periodic save or validation)."""
    from aligner.actor.config import ActorConfig

    cfg = ActorConfig()
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps = 1e-3, 1e-4, 5
    cfg.generation.max_new_tokens = 8
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 100, 64, 32, 32
    p.ppo_epochs, p.init_kl_coef = 2, 0.02
    cfg.checkpoint.save_interval = 0
    cfg.validation.interval, cfg.validation.before_train = 0, False
    return cfg
