"""Run under ``torchrun --nproc_per_node 2``: the same weights at PP=1 (each rank alone) and at
PP=2 (one stage per rank); log-probs, entropies and the PPO loss's gradients through the pipeline
schedule (:class:`aligner.actor.pipeline.PipelineSchedule`) against the unpipelined ones, with and
without a tied embedding, and with a last micro-batch that needs padding.

Prints ``RESULT <json>`` from global rank 0: the largest differences found. Used by
tests/actor/test_actor_pipeline.py.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from aligner import distributed, rl
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.pipeline import PipelineSchedule, allreduce_tied_embedding_grads
from aligner.models import gpt
from aligner.models.config import ModelConfig
from aligner.models.layout import ParallelLayout, iter_megatron_tensors, load_megatron_tensors
from aligner.precision import make_optimizer


def _loss_fn(logprobs: PolicyLogprobs, tokens, old, adv, mask, start):
    def loss_fn(logits, rows):
        logp = logprobs.sequence_logprobs(logits, tokens[rows], start)
        loss, stats = rl.policy_loss(logp, old[rows], adv[rows], mask[rows], clip_eps_low=0.2)
        ent = logprobs.entropy(logits, start)
        loss = loss - 0.01 * rl.aggregate(ent, mask[rows], "token_mean")
        return loss, {"loss/policy": loss.detach(), **{f"policy/{k}": v for k, v in stats.items()}}

    return loss_fn


def _grads_by_name(model, cfg, optimizer=None) -> dict[str, torch.Tensor]:
    """Each tensor's gradient by canonical name (the optimizer's fp32 master's when given)."""
    lay = ParallelLayout.current()
    params = dict(gpt.unwrap(model).named_parameters())
    masters = {id(p): m for p, m in zip(optimizer.model_params, optimizer.master_params)} if optimizer else {}
    out = {}
    for spec, local in lay.targets(cfg, "lm"):
        key = spec.name if local == spec.name or not local.startswith("output_layer") else "tied:" + spec.name
        p = params[local]
        out[key] = masters.get(id(p), p).grad.detach().float().clone()
    return out


def case(tie: bool, bf16: bool = False) -> dict[str, float]:
    from megatron.core import parallel_state as mpu

    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, max_seq_len=16, tie_embeddings=tie
    )
    torch.manual_seed(0)  # the same data on every rank
    b, s, start, mbs = 4, 12, 3, 2
    tokens = torch.randint(0, 16, (b, s))
    old = -torch.rand(b, s - 1) * 2
    adv = torch.randn(b, s - 1)
    mask = torch.zeros(b, s - 1)
    mask[:, start:] = 1.0
    mask[1, 9:] = 0.0
    lp_ = PolicyLogprobs(temperature=0.7)

    # PP=1 on each rank alone (the world of 2 is two data-parallel ranks here).
    state = distributed.initialize(distributed.ParallelConfig(1, 1), seed=11)
    ref = gpt.build_policy(cfg)
    full = {n: t.detach().clone() for n, t in iter_megatron_tensors(ref, cfg)}
    want_lp, want_ent = lp_.no_grad(ref, tokens[:3], mbs, with_entropy=True, start=start)
    ref.train()
    loss_fn = _loss_fn(lp_, tokens, old, adv, mask, start)
    want_stats: dict[str, float] = {}
    for rows in torch.arange(b).chunk(b // mbs):
        loss, stats = loss_fn(lp_.logits(ref, tokens[rows], start), rows)
        (loss / (b // mbs)).backward()
        for k, v in stats.items():
            want_stats[k] = want_stats.get(k, 0.0) + float(v) / (b // mbs)
    want_grads = _grads_by_name(ref, cfg)
    if tie:
        want_grads["tied:embedding.word_embeddings.weight"] = want_grads["embedding.word_embeddings.weight"]
    del ref
    mpu.destroy_model_parallel()

    # PP=2: one stage per rank, the same weights.
    state = distributed.initialize(distributed.ParallelConfig(1, 2), seed=11)
    policy = gpt.build_policy(cfg)
    load_megatron_tensors(policy, cfg, full.__getitem__)
    pipe = PipelineSchedule(state, lp_)
    got_lp, got_ent = pipe.no_grad(policy, tokens[:3], mbs, with_entropy=True, start=start)
    policy.train()
    # Under bf16 the optimizer's fp32 masters collect the gradients during backward.
    opt = make_optimizer(policy, lr=1e-3, precision="bf16") if bf16 else None
    got_stats = pipe.train(policy, tokens, mbs, loss_fn, start)
    allreduce_tied_embedding_grads(policy, state, opt)
    got_grads = _grads_by_name(policy, cfg, opt)
    diffs = {
        "logprobs": float((got_lp - want_lp).abs().max()),
        "entropy": float((got_ent - want_ent).abs().max()),
        "stats": max(abs(got_stats[k] - want_stats[k]) for k in want_stats),
        "stat_keys_equal": float(sorted(got_stats) == sorted(want_stats)),
        "grads": max(float((g - want_grads[k]).abs().max()) for k, g in got_grads.items()),
        "grad_tensors": float(len(got_grads)),
        "grad_scale": max(float(g.abs().max()) for g in got_grads.values()),
    }
    if tie:
        # The two stages' copies of the tied embedding take the same (summed) gradient.
        mine = got_grads.get(
            "embedding.word_embeddings.weight", got_grads.get("tied:embedding.word_embeddings.weight")
        )
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=state.pp_group)
        diffs["tied_copies_equal"] = float(torch.equal(both[0], both[1]))
    # A stage that did not receive its gradients through the schedule would have none.
    diffs["all_grads_nonzero"] = float(all(float(g.abs().sum()) > 0 for g in got_grads.values()))
    mpu.destroy_model_parallel()
    return diffs


def freeze_case() -> dict[str, float]:
    """``optim.trainable_last_n_layers=1`` at PP=2 with a tied embedding: the model's last layer
    trains (on the last stage), every other layer and both copies of the tied embedding are
    frozen, and the tied-gradient sum is skipped on both stages alike (no lone collective)."""
    from megatron.core import parallel_state as mpu

    from aligner.actor.optimizer import freeze_all_but_last_layers

    cfg = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=16,
        max_seq_len=16,
        tie_embeddings=True,
    )
    state = distributed.initialize(distributed.ParallelConfig(1, 2), seed=11)
    policy = gpt.build_policy(cfg)
    freeze_all_but_last_layers(policy, 1, cfg.num_layers, state.pp_rank)
    lay = ParallelLayout.current()
    params = dict(gpt.unwrap(policy).named_parameters())
    trained = sorted(spec.name for spec, local in lay.targets(cfg, "lm") if params[local].requires_grad)
    allreduce_tied_embedding_grads(policy, state)  # returns on both stages: a hang would time the test out
    gathered = [None] * state.pp_size
    dist.all_gather_object(gathered, trained, group=state.pp_group)
    mpu.destroy_model_parallel()
    want = sorted(
        ["decoder.final_layernorm.weight"]
        + [n for n in _layer_names(cfg) if n.startswith("decoder.layers.3.")]
    )
    return {"freeze_ok": float(sorted(sum(gathered, [])) == want)}


def _layer_names(cfg: ModelConfig) -> list[str]:
    from aligner.models.layout import megatron_tensor_specs

    return [s.name for s in megatron_tensor_specs(cfg, "lm")]


def main() -> None:
    results = {"untied": case(False), "tied": case(True), "tied_bf16": case(True, bf16=True)}
    results["frozen"] = freeze_case()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    distributed.destroy()


if __name__ == "__main__":
    main()
