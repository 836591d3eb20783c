"""The policy's optimizer: which weights train, AdamW with fp32 masters under bf16 (sharded over
the data-parallel ranks with ``optim.use_distributed_optimizer``), and the learning-rate schedule
(linear warmup, then cosine decay), including where a resumed run puts the schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from aligner.actor.config import ActorConfig
from aligner.distributed import ParallelState
from aligner.models import gpt
from aligner.models.lora import is_lora_name, lora_config_of
from aligner.precision import Optimizer, make_optimizer

__all__ = ["freeze_all_but_last_layers", "lr_lambda", "make_policy_optimizer", "set_schedule_position"]

Schedule = torch.optim.lr_scheduler.LambdaLR


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` optimizer steps."""

    def f(i: int) -> float:
        if warmup > 0 and i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_policy_optimizer(
    model: torch.nn.Module, cfg: ActorConfig, precision: str = "fp32", state: ParallelState | None = None
) -> tuple[Optimizer, Schedule]:
    """AdamW (fp32 master weights when ``precision`` is bf16: the model is cast to bf16 in
    place and its fp32 values become the masters) and the warmup + cosine LR schedule. Only
    trainable parameters (``requires_grad``) are in it and get masters: with LoRA, the adapters.

    With ``optim.use_distributed_optimizer`` and more than one data-parallel rank the masters
    and moments are sharded over ``state.dp_group`` (:class:`aligner.precision.ShardedAdamW`;
    the same updates, bit for bit). ``state``: this rank's place; None: Megatron's, as
    :func:`aligner.distributed.initialize` set it up (read only for that option)."""
    o, p = cfg.optim, cfg.ppo
    dp_group = None
    if o.use_distributed_optimizer:
        device = next(model.parameters()).device
        state = state or ParallelState.from_megatron(device)
        if state is not None and state.dp_size > 1:
            dp_group = state.dp_group
    # Given the module, an fp32 model is cast to bf16 in place (frozen weights too) and the
    # trained weights' fp32 values become the masters, unrounded.
    opt = make_optimizer(model, **o.adamw(), precision=precision, dp_group=dp_group)
    # The policy's optimizer steps: none in the critic warm-up's steps.
    total = (
        max(p.num_steps - p.critic_warmup_steps, 1)
        * p.ppo_epochs
        * (p.global_batch_size // p.mini_batch_size)
    )
    sched = Schedule(opt, lr_lambda(o.warmup_steps, total, o.min_lr / o.lr))
    return opt, sched


def set_schedule_position(scheduler: Schedule, optimizer: torch.optim.Optimizer, last: int) -> None:
    """Continue ``scheduler`` after ``last`` optimizer steps, under its own (this run's) settings:
    the learning rate is the schedule's at that position, not the one a checkpoint saved."""
    scheduler.last_epoch = last
    scheduler._step_count = last + 1
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(last)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def freeze_all_but_last_layers(
    model: torch.nn.Module, n: int | None, num_layers: int | None = None, pp_rank: int = 0
) -> None:
    """Train only the model's last ``n`` transformer layers plus the final norm and LM head (all
    when None). ``num_layers``: the whole model's, for a pipeline stage that holds some of them
    (its layers are numbered from its stage's offset, ``pp_rank`` times the layers it holds);
    default the layers this module holds.
    An LM head tied to the embedding is frozen with it, on every stage that holds a copy.

    With LoRA (:func:`aligner.models.lora.apply_lora`) the base weights stay frozen, the final
    norm and LM head included: only the adapters of the last ``n`` layers train."""
    if n is None:
        return
    m = gpt.unwrap(model)
    local = len(m.decoder.layers)
    total = num_layers if num_layers is not None else local
    offset = pp_rank * local if total != local else 0
    tied = bool(getattr(m, "share_embeddings_and_output_weights", False))
    lora = lora_config_of(m) is not None
    for name, param in m.named_parameters():
        if lora and not is_lora_name(name):
            continue  # a frozen base weight
        keep = name.startswith("decoder.final_layernorm") or (name.startswith("output_layer") and not tied)
        if name.startswith("decoder.layers."):
            keep = offset + int(name.split(".")[2]) >= total - n
        param.requires_grad_(keep)
