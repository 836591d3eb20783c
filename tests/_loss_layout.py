"""What tests/actor/test_loss_layout.py shares with its worker processes: a fixed rollout (rows of
very different response lengths), the PPO update of one step on it in any layout (micro-batch
size, TP, PP, DP), and what that update did (gradients, weights, statistics) in canonical,
layout-free form.

The worker (``tests/workers/loss_layout.py``, two processes under torchrun over gloo) runs
several layouts in one process group, tearing Megatron's parallel state down between them (as
``tests/_layout_workers.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Rows of the fixed rollout and its padded length.
ROWS, SEQ = 8, 20
#: Prompt and total lengths: responses of 1 to 16 tokens, so that micro-batches hold very
#: different token counts.
PROMPTS = [3, 2, 4, 3, 2, 5, 3, 2]
LENGTHS = [20, 4, 19, 6, 17, 7, 20, 3]
SEED = 11
#: A packed micro-batch's token budget: 1 to 4 of the rows (the longest, 20 tokens, alone or
#: with a short one).
BUDGET = 24


def model_cfg():
    """A two-layer GPT (vocabulary 16, no padding at TP 1 or 2: divisible by 8 x TP), untied."""
    from aligner.models.config import ModelConfig

    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=16,
        max_seq_len=24,
        make_vocab_size_divisible_by=8,
    )


def canonical_weights(cfg) -> dict[str, torch.Tensor]:
    """Full tensors every rank makes alike (N(0, 0.2^2) weights, norms around 1)."""
    from aligner.models.layout import megatron_tensor_specs

    out = {}
    for i, spec in enumerate(megatron_tensor_specs(cfg, "lm")):
        g = torch.Generator().manual_seed(SEED * 1000 + i)
        t = torch.randn(spec.shape, generator=g)
        out[spec.name] = 1.0 + 0.1 * t if "norm" in spec.name else 0.2 * t
    return out


def tokens_and_mask() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [8, 20], lengths [8], prompt_lengths [8], mask [8, 19])`` of the fixed rollout."""
    from aligner import rl

    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(1, 16, (ROWS, SEQ), generator=g)
    lengths, prompts = torch.tensor(LENGTHS), torch.tensor(PROMPTS)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return tokens, lengths, prompts, rl.response_mask(lengths, prompts, SEQ)


def rollout_inputs(old_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fixed rollout's tensors: ``old_logprobs`` (the initial policy's, given) moved by a
    fixed noise, so that the first ratios spread around 1 and some are clipped, and fixed
    advantages. Row 5's loss mask is empty (a response overlong filtering left out), so that
    micro-batches also hold different numbers of sequences that count."""
    tokens, lengths, prompts, mask = tokens_and_mask()
    mask[5] = 0.0
    g = torch.Generator().manual_seed(SEED + 1)
    noise = 0.15 * torch.randn(ROWS, SEQ - 1, generator=g)
    advantages = torch.randn(ROWS, SEQ - 1, generator=g) * mask
    return {
        "tokens": tokens,
        "lengths": lengths,
        "prompt_lengths": prompts,
        "mask": mask,
        "old_logprobs": (old_logprobs + noise) * mask,
        "advantages": advantages,
    }


def rollout_of(inputs: dict[str, torch.Tensor], rows: slice | None = None):
    """A :class:`~aligner.actor.rollout.Rollout` of ``rows`` of ``inputs`` (all by default);
    ``start`` from these rows' mask, as the trainer takes it from its rank's."""
    from aligner import rl
    from aligner.actor.rollout import Rollout

    x = {k: v[rows] if rows is not None else v for k, v in inputs.items()}
    zeros = torch.zeros_like(x["mask"])
    return Rollout(
        x["tokens"],
        x["lengths"],
        x["prompt_lengths"],
        x["mask"],
        x["old_logprobs"],
        zeros,
        x["advantages"],
        zeros,
        rl.loss_start(x["mask"]),
        x.get("behaviour_logprobs"),
    )


@dataclass
class Layout:
    """One way to run the update: sizes and the loss aggregation."""

    micro: int = 8
    tp: int = 1
    pp: int = 1
    dp: int = 1
    agg: str = "token_mean"
    mini: int = ROWS
    epochs: int = 2
    entropy_coef: float = 0.01
    reuse: bool = False
    forward: str = "megatron"
    max_tokens: int | None = None
    tis_cap: float | None = None

    def __str__(self) -> str:
        packed = f" packed {self.max_tokens}" if self.max_tokens else ""
        return f"micro {self.micro}{packed} TP {self.tp} PP {self.pp} DP {self.dp} {self.agg} {self.forward}"


@dataclass
class Result:
    """What one update did: the gradients each optimizer step applied (canonical names, full
    tensors, after the data-parallel sum and before the step), the weights after the update, the
    per-minibatch and step statistics."""

    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    minibatch_stats: list[dict[str, float]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)


def actor_cfg(lay: Layout):
    from aligner.actor.config import ActorConfig

    cfg = ActorConfig()
    cfg.model = model_cfg()
    p = cfg.ppo
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = ROWS, lay.mini, lay.micro
    p.ppo_epochs, p.loss_agg, p.entropy_coef = lay.epochs, lay.agg, lay.entropy_coef
    p.clip_eps, p.reuse_rollout_forward = 0.2, lay.reuse
    p.max_tokens_per_micro_batch = lay.max_tokens
    p.tis_cap = lay.tis_cap
    cfg.optim.grad_clip = None  # the gradients themselves are compared: none scaled
    cfg.seed = SEED
    return cfg


def full_grads(model, cfg) -> dict[str, torch.Tensor]:
    """Every canonical tensor's gradient, gathered over TP and broadcast over PP (collective)."""
    import torch.distributed as dist

    from aligner.models import gpt
    from aligner.models.layout import ParallelLayout, megatron_tensor_specs

    lay = ParallelLayout.current()
    params = dict(gpt.unwrap(model).named_parameters())
    mine = {s.name: n for s, n in lay.targets(cfg, "lm") if lay.owner(s, cfg) == lay.pp_rank}
    out = {}
    for spec in megatron_tensor_specs(cfg, "lm"):
        owner = lay.owner(spec, cfg)
        if owner == lay.pp_rank:
            p = params[mine[spec.name]]
            full = lay.gather(p.grad if p.grad is not None else torch.zeros_like(p), spec, cfg)
        else:
            full = torch.empty(spec.shape)
        if lay.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, group=lay.pp_group, group_src=owner)
        out[spec.name] = full.detach().clone()
    return out


def build_update(lay: Layout, state, weights: dict[str, torch.Tensor], result: Result):
    """The policy (``weights`` in this rank's layout) and its :class:`PolicyUpdate`; every
    optimizer step records its gradients into ``result``."""
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.actor.pipeline import PipelineSchedule
    from aligner.actor.policy_update import PolicyUpdate
    from aligner.models import forward, gpt
    from aligner.models.layout import load_megatron_tensors
    from aligner.precision import make_optimizer

    cfg = actor_cfg(lay)
    model = gpt.build_policy(cfg.model)
    load_megatron_tensors(model, cfg.model, weights.__getitem__)
    if lay.forward != "megatron":
        forward.set_forward(model, lay.forward, state.tp_size)
    opt = make_optimizer(model, lr=2e-3, precision="fp32")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    measure = opt.clip_grad_norm  # called once per optimizer step, after the data-parallel sum

    def recorded(*args, **kwargs):
        result.grads.append(full_grads(model, cfg.model))
        return measure(*args, **kwargs)

    opt.clip_grad_norm = recorded
    local = cfg.model.padded_vocab_size(state.tp_size) // state.tp_size
    logprobs = PolicyLogprobs(
        temperature=0.7,
        group=state.tp_group if state.tp_size > 1 else None,
        vocab_start=state.tp_rank * local,
    )
    pipeline = PipelineSchedule(state, logprobs) if state.pp_size > 1 else None
    update = PolicyUpdate(model, opt, sched, logprobs, pipeline, cfg, state)
    return model, update


def run_update(
    lay: Layout, state, weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]
) -> Result:
    """One step's PPO update of the fixed rollout (this data-parallel rank's rows of it)."""
    from aligner.models.layout import iter_megatron_tensors

    result = Result()
    model, update = build_update(lay, state, weights, result)
    per_rank = ROWS // state.dp_size
    rollout = rollout_of(inputs, slice(state.dp_rank * per_rank, (state.dp_rank + 1) * per_rank))
    orders = update.epoch_orders(1, per_rank)
    result.stats = update.train_step(rollout, orders, [])
    result.minibatch_stats = update.minibatch_stats
    result.weights = {k: v.clone() for k, v in iter_megatron_tensors(model, model_cfg())}
    return result


def initial_logprobs(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The initial policy's log-probs ``[8, 19]`` of the fixed rows (TP=1, one process's model)."""
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.models import gpt
    from aligner.models.layout import load_megatron_tensors

    cfg = model_cfg()
    model = gpt.build_policy(cfg)
    load_megatron_tensors(model, cfg, weights.__getitem__)
    tokens, _, _, _ = tokens_and_mask()
    lp, _ = PolicyLogprobs(temperature=0.7).no_grad(model, tokens, ROWS)
    return lp


def old_style_grads(
    weights, inputs, micro: int, agg: str, entropy_coef: float = 0.01
) -> dict[str, torch.Tensor]:
    """The first minibatch's gradient as the update took it before the global normaliser: each
    micro-batch's own mean loss, divided by the number of micro-batches (in row order; TP=1)."""
    from aligner import rl
    from aligner.actor.logprobs import PolicyLogprobs
    from aligner.models import gpt
    from aligner.models.layout import load_megatron_tensors

    cfg = model_cfg()
    model = gpt.build_policy(cfg)
    load_megatron_tensors(model, cfg, weights.__getitem__)
    model.train()
    lp_ = PolicyLogprobs(temperature=0.7)
    r = rollout_of(inputs)
    chunks = torch.arange(ROWS).split(micro)
    for rows in chunks:
        logits = lp_.logits(model, r.tokens[rows], r.start)
        logp = lp_.sequence_logprobs(logits, r.tokens[rows], r.start)
        mask = r.mask[rows]
        loss, _ = rl.policy_loss(logp, r.old_logprobs[rows], r.advantages[rows], mask, 0.2, agg=agg)
        loss = loss - entropy_coef * rl.aggregate(lp_.entropy(logits, r.start), mask, agg)
        (loss / len(chunks)).backward()
    return full_grads(model, cfg)


def differences(got: Result, want: Result) -> dict[str, float]:
    """The largest differences of ``got`` from ``want``: gradients relative to the largest
    gradient element, weights (absolute), statistics (relative to the larger of 1 and the
    value)."""
    scale = max(float(g.abs().max()) for step in want.grads for g in step.values())
    out = {
        "steps": float(len(got.grads) == len(want.grads)),
        "grads": max(
            float((a[k] - b[k]).abs().max()) / scale for a, b in zip(got.grads, want.grads) for k in b
        ),
        "weights": max(float((got.weights[k] - v).abs().max()) for k, v in want.weights.items()),
        "stat_keys": float(
            got.stats.keys() == want.stats.keys()
            and all(a.keys() == b.keys() for a, b in zip(got.minibatch_stats, want.minibatch_stats))
        ),
    }
    pairs = list(zip(got.minibatch_stats, want.minibatch_stats)) + [(got.stats, want.stats)]
    out["stats"] = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in pairs for k in b if k in a)
    return out


# ----------------------------------------------------------------------------------------------
# The two-process worker
# ----------------------------------------------------------------------------------------------


def _layout(tp: int, pp: int):
    from megatron.core import parallel_state as mpu

    from aligner import distributed

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return distributed.initialize(
        distributed.ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, backend="gloo", timeout_s=120.0
        ),
        seed=SEED,
    )


def alone(state):
    """``state`` as if this rank were its own data-parallel world (DP=1 on each rank of a DP=2
    layout: every rank computes the one-process reference itself)."""
    import dataclasses

    return dataclasses.replace(state, dp_rank=0, dp_size=1, dp_group=None)


def layout_report() -> dict[str, dict[str, float]] | None:
    """Under ``torchrun --nproc_per_node 2`` (``tests/workers/loss_layout.py``): each layout
    (DP=2 with micro-batches 2 and 4, TP=2 and PP=2 with micro-batch 2; and packed
    micro-batches of at most :data:`BUDGET` tokens at DP=2 and TP=2 (the fused forward), and at
    PP=2 where they keep their row count) against the one-process reference (micro-batch 8, DP=1, computed on
    each rank) on the same weights and rollout, for both loss aggregations. Returns the
    differences (:func:`differences`) on global rank 0, None elsewhere."""
    import warnings

    import torch.distributed as dist

    from aligner import distributed

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    weights = canonical_weights(model_cfg())
    report: dict[str, dict[str, float]] = {}
    try:
        state = _layout(1, 1)  # two data-parallel ranks
        inputs = rollout_inputs(initial_logprobs(weights))
        for agg in ("token_mean", "seq_mean_token_mean"):
            state = _layout(1, 1)
            ref = run_update(Layout(micro=8, agg=agg), alone(state), weights, inputs)
            for lay in (
                Layout(micro=2, dp=2, agg=agg),
                Layout(micro=4, dp=2, agg=agg),
                Layout(micro=4, dp=2, agg=agg, max_tokens=BUDGET),
            ):
                report[str(lay)] = differences(run_update(lay, state, weights, inputs), ref)
            for tp, pp in ((2, 1), (1, 2)):
                state = _layout(tp, pp)
                for budget in (None, BUDGET):
                    fused = budget is not None and pp == 1  # the fused forward's packed path at TP=2
                    lay = Layout(
                        micro=2,
                        tp=tp,
                        pp=pp,
                        agg=agg,
                        max_tokens=budget,
                        forward="fused" if fused else "megatron",
                    )
                    report[str(lay)] = differences(run_update(lay, state, weights, inputs), ref)
        rank = dist.get_rank()
        distributed.barrier()
    finally:
        distributed.destroy()
    return report if rank == 0 else None
