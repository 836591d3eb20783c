"""The actor's PPO loop against a remote critic, one step at a time.

Each step reads as the algorithm (DESIGN.md, "one PPO step"):

1. draw a batch of prompts and generate responses;
2. send them to the critic (values and rewards) without waiting, and meanwhile compute the
   policy's and the reference's log-probs;
3. KL-shaped rewards, GAE, whitened advantages;
4. send the critic its training batch for this step id, without waiting;
5. PPO epochs of clipped-surrogate updates over shuffled minibatches;
6. refit the generation engine and log the step.

All numbers come from :mod:`aligner.rl`; this file only moves tensors between them.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner import precision as mp
from aligner import rl
from aligner.distributed import ParallelState
from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.models import gpt
from aligner.ppo.config import ActorConfig

log = logging.getLogger(__name__)

__all__ = ["Rollout", "PromptSampler", "PPOTrainer", "make_optimizer", "lr_lambda"]


@dataclass
class Rollout:
    """This data-parallel rank's experience for one step (``b`` prompts, padded length ``s``)."""

    tokens: torch.Tensor
    """[b, s] int64 prompt + response, right-padded."""
    lengths: torch.Tensor
    """[b] int64."""
    prompt_lengths: torch.Tensor
    """[b] int64."""
    mask: torch.Tensor
    """[b, s-1] float32 response mask."""
    old_logprobs: torch.Tensor
    """[b, s-1] float32 policy log-probs from the training forward before any update."""
    values: torch.Tensor
    """[b, s-1] float32 critic values at rollout time."""
    advantages: torch.Tensor
    """[b, s-1] float32 (whitened when configured)."""
    returns: torch.Tensor
    """[b, s-1] float32 value targets."""
    start: int = 0
    """First position whose logits any loss term reads (:func:`aligner.rl.loss_start`)."""


class PromptSampler:
    """Epochs over a fixed prompt list in a seeded order; each step takes ``global_batch``
    prompts and this rank keeps its contiguous share. Its position is a small dict (resume)."""

    def __init__(
        self,
        prompts: list[str],
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if len(prompts) < global_batch:
            raise ValueError(f"{len(prompts)} prompts is fewer than ppo.global_batch_size ({global_batch})")
        self.prompts, self.global_batch = prompts, global_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[str]:
        if self.index + self.global_batch > len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        ids = self._order[self.index : self.index + self.global_batch]
        self.index += self.global_batch
        per = self.global_batch // self.dp_size
        return [self.prompts[i] for i in ids[self.dp_rank * per : (self.dp_rank + 1) * per]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.epoch, self.index = int(d["epoch"]), int(d["index"])
        self._order = self._permutation(self.epoch)


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` optimizer steps."""

    def f(i: int) -> float:
        if warmup > 0 and i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(
    model: torch.nn.Module, cfg: ActorConfig, precision: str = "fp32"
) -> tuple[mp.MixedPrecisionAdamW, Any]:
    """AdamW (fp32 master weights when ``precision`` is bf16: the model is cast to bf16 in
    place and its fp32 values become the masters) and the warmup + cosine LR schedule."""
    o, p = cfg.optim, cfg.ppo
    # Given the module, an fp32 model is cast to bf16 in place (frozen weights too) and the
    # trained weights' fp32 values become the masters, unrounded.
    opt = mp.make_optimizer(
        model,
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
        precision=precision,
    )
    total = p.num_steps * p.ppo_epochs * (p.global_batch_size // p.mini_batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o.warmup_steps, total, o.min_lr / o.lr))
    return opt, sched


def freeze_all_but_last_layers(model: torch.nn.Module, n: int | None) -> None:
    """Train only the last ``n`` transformer layers plus the final norm and LM head."""
    if n is None:
        return
    m = gpt.unwrap(model)
    num_layers = len(m.decoder.layers)
    for name, param in m.named_parameters():
        keep = name.startswith("decoder.final_layernorm") or name.startswith("output_layer")
        if name.startswith("decoder.layers."):
            keep = int(name.split(".")[2]) >= num_layers - n
        param.requires_grad_(keep)


class PPOTrainer:
    """Owns the policy, the reference, the engine and the critic connection for one run."""

    def __init__(
        self,
        cfg: ActorConfig,
        state: ParallelState,
        policy: torch.nn.Module,
        reference: torch.nn.Module | None,
        engine: GenerationEngine,
        critic: Any,
        tokenizer: Any,
        sampler: PromptSampler,
        logger: Any,
        on_step: Callable[[int, dict], None] | None = None,
        *,
        checkpointer: Any = None,
        val_prompts: list[str] | None = None,
    ) -> None:
        """``checkpointer``: an :class:`aligner.ppo.checkpointing.ActorCheckpointer` (saves at the
        configured interval and at the end); ``val_prompts``: this data-parallel rank's share of
        the fixed evaluation prompts (validation is off without them)."""
        self.cfg, self.state = cfg, state
        self.policy, self.reference, self.engine = policy, reference, engine
        self.critic, self.tokenizer, self.sampler, self.logger = critic, tokenizer, sampler, logger
        self.on_step = on_step
        self.checkpointer = checkpointer
        self.val_prompts = list(val_prompts) if val_prompts else []
        freeze_all_but_last_layers(policy, cfg.optim.trainable_last_n_layers)
        self.precision = mp.resolve_precision(cfg.precision, state.device)
        self.optimizer, self.scheduler = make_optimizer(policy, cfg, self.precision)
        # After the optimizer: it casts the policy to its compute dtype.
        self.model_forward = gpt.set_forwards(
            {"policy": policy, "reference": reference},
            cfg.model_forward,
            state.tp_size,
            log if state.is_logging_rank else None,
        )
        self.engine.refit(policy)  # the engine serves the policy in its training dtype
        p = cfg.ppo
        # The first PPO pass's forward doubles as the rollout log-prob forward when that pass is
        # one forward over the whole batch with the same weights, and the forward ignores
        # train/eval mode (the fused path: no dropout).
        per_rank = p.global_batch_size // state.dp_size
        self.reuse_rollout_forward = bool(
            p.reuse_rollout_forward
            and p.ppo_epochs >= 1
            and p.mini_batch_size // state.dp_size == per_rank
            and p.micro_batch_size == per_rank
            and getattr(policy, "aligner_fused", None) is not None
        )
        if state.is_logging_rank:
            log.info(
                "rollout log-probs: %s",
                "the first PPO forward's" if self.reuse_rollout_forward else "a separate no-grad forward",
            )
        self.kl_ctl = (
            rl.AdaptiveKLController(p.init_kl_coef, p.kl_target, p.kl_horizon)
            if p.adaptive_kl
            else rl.FixedKLController(p.init_kl_coef)
        )
        self.score_moments = rl.RunningMoments()
        self.step_count = 0
        self._pending_train: Future | None = None
        self._completed_train: dict[str, Any] | None = None  # its result, not yet reported
        self._tp_group = state.tp_group if state.tp_size > 1 else None
        self._dp_group = state.dp_group if state.dp_size > 1 else None
        padded = cfg.model.padded_vocab_size(state.tp_size)
        self._vocab_local = padded // state.tp_size
        self._vocab_start = state.tp_rank * self._vocab_local
        # Logit columns the engine never samples (Megatron's vocabulary padding for TP, and a
        # tokenizer's pad id kept out of the action space) must not enter the training softmax
        # either, or training log-probs would differ from generation's.
        actions = min(getattr(tokenizer, "sample_vocab_size", cfg.model.vocab_size), cfg.model.vocab_size)
        self._actions = actions
        self._pad_from = (
            max(0, min(self._vocab_local, actions - self._vocab_start)) if padded > actions else None
        )
        self.sampling = SamplingParams(
            max_new_tokens=cfg.generation.max_new_tokens,
            temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k,
            top_p=cfg.generation.top_p,
            stop_strings=tuple(cfg.generation.stop_strings),
        )

    # -- the loop ----------------------------------------------------------------------------

    def train(self, num_steps: int | None = None) -> None:
        end = num_steps if num_steps is not None else self.cfg.ppo.num_steps
        v = self.cfg.validation
        if v.before_train and self.val_prompts and self.step_count == 0:
            self.logger.log(0, self.validate(0))
        while self.step_count < end:
            metrics = self.step()
            if self.on_step is not None:
                self.on_step(self.step_count, metrics)
            if self.checkpointer is not None:
                self.checkpointer.after_step(self, metrics, last=self.step_count >= end)
        self.finish()

    def wait_critic(self) -> None:
        """Wait for the critic's pending training request; its result is reported with the next
        step's metrics (``loss/value`` is the critic's loss on the previous step's batch)."""
        if self._pending_train is not None:
            self._completed_train = self._pending_train.result()
            self._pending_train = None

    def finish(self) -> None:
        """Wait for the critic's last training request."""
        self.wait_critic()

    # -- state for checkpoints ---------------------------------------------------------------

    def training_state(self) -> dict[str, Any]:
        """Everything besides weights and optimizer moments that the next step depends on, as
        JSON (call after :meth:`wait_critic`)."""
        if self._pending_train is not None:
            raise RuntimeError("training_state() while a critic training request is in flight")
        return {
            "step": self.step_count,
            "kl_ctl": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "sampler": self.sampler.state_dict(),
            "scheduler_last_epoch": int(self.scheduler.last_epoch),
            "last_critic_train": self._completed_train,
        }

    def load_training_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`training_state`. The learning-rate schedule continues from the saved
        position under *this* run's settings (a changed LR or step budget takes effect)."""
        self.step_count = int(d["step"])
        self.kl_ctl.load_state_dict(d["kl_ctl"])
        self.score_moments.load_state_dict(d["score_moments"])
        self.sampler.load_state_dict(d["sampler"])
        last = int(d["scheduler_last_epoch"])
        self.scheduler.last_epoch = last
        self.scheduler._step_count = last + 1
        for group, base, fn in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas
        ):
            group["lr"] = base * fn(last)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self._completed_train = d.get("last_critic_train")
        self._pending_train = None

    def step(self) -> dict[str, float]:
        cfg, p = self.cfg, self.cfg.ppo
        timers: dict[str, float] = {}
        t_step = time.perf_counter()
        step_id = self.step_count + 1

        # 1. Draw prompts and generate responses.
        waited = self._wait_before_generating()
        t = time.perf_counter()
        prompts = self.sampler.next_batch()
        encoded = [self.tokenizer.encode(x) for x in prompts]
        sampling = SamplingParams(**{**self.sampling.__dict__, "seed": cfg.seed * 100_003 + step_id})
        gen = self.engine.generate(encoded, sampling)
        tokens, lengths, prompt_lengths = gen.tokens, gen.lengths, gen.prompt_lengths
        mask = rl.response_mask(lengths, prompt_lengths, tokens.shape[1])
        start = rl.loss_start(mask)
        timers["timers/generate"] = time.perf_counter() - t

        # 2. Values and scores from the server, overlapped with the log-prob forwards.
        t = time.perf_counter()
        critic_future = self._critic_infer(tokens, lengths, prompt_lengths)
        orders = self._epoch_orders(step_id, tokens.shape[0])
        beta = self.kl_ctl.value
        ref_logprobs = None
        if self.reference is not None and beta > 0:
            ref_logprobs, _ = self._logprobs(self.reference, tokens, start=start)
        first = None
        if self.reuse_rollout_forward:
            first, old_logprobs, entropy = self._first_forward(tokens, orders[0], start)
        else:
            old_logprobs, entropy = self._logprobs(self.policy, tokens, with_entropy=True, start=start)
        if ref_logprobs is None:
            ref_logprobs = old_logprobs
        timers["timers/logprobs"] = time.perf_counter() - t
        t = time.perf_counter()
        values, scores = self._critic_result(critic_future, tokens.shape)
        self.wait_critic()  # last step's critic update, normally long done
        last_train, self._completed_train = self._completed_train, None
        timers["timers/critic_wait"] = time.perf_counter() - t + waited

        # 3. KL-shaped rewards, GAE and whitened advantages.
        raw_scores = scores
        scores = rl.apply_missing_eos_penalty(scores, gen.ended, p.missing_eos_penalty)
        scores = rl.clip_scores(scores, p.score_clip)
        if p.normalize_scores:
            self.score_moments.update(scores, group=self._dp_group)
            scores = self.score_moments.normalize(scores)
        kl = rl.kl_penalty(old_logprobs, ref_logprobs, p.kl_estimator) * mask
        rewards, non_score = rl.shaped_rewards(scores, kl, mask, beta)
        advantages, returns = rl.compute_gae(rewards, values, mask, p.gamma, p.lam, p.value_lam)
        if p.whiten_advantages:
            advantages = rl.global_whiten(advantages, mask, shift_mean=True, group=self._dp_group)

        # 4. The critic's training batch for this step id; the server trains while we do.
        self._pending_train = self._critic_train(tokens, lengths, returns, values, mask, step_id)

        # 5. PPO epochs over shuffled minibatches.
        t = time.perf_counter()
        rollout = Rollout(
            tokens, lengths, prompt_lengths, mask, old_logprobs, values, advantages, returns, start
        )
        handoff = [first] if first is not None else []
        del first  # the first minibatch step holds the only reference: freed once it is done
        train_stats = self._update_policy(rollout, orders, handoff)
        timers["timers/train"] = time.perf_counter() - t

        # 6. Refit the engine from the updated policy, and log.
        self.engine.refit(self.policy)
        self.kl_ctl.update(float(self._global_mean(kl.sum(1), None)), p.global_batch_size)
        self.step_count = step_id
        timers["timers/step"] = time.perf_counter() - t_step
        metrics = self._metrics(
            gen,
            mask,
            raw_scores,
            kl,
            non_score,
            entropy,
            old_logprobs,
            values,
            returns,
            train_stats,
            last_train,
            beta,
            timers,
        )
        v = cfg.validation
        if self.val_prompts and v.interval and step_id % v.interval == 0:
            metrics.update(self.validate(step_id))
        self.logger.log(step_id, metrics)
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Greedy responses to the fixed evaluation prompts, scored by the server: ``val/scores``,
        ``val/kl`` (summed over the response, policy vs reference), ``val/response_length``; a
        samples table goes to the logger. Changes no training state and draws no randomness."""
        t = time.perf_counter()
        self._wait_before_generating()
        encoded = [self.tokenizer.encode(x) for x in self.val_prompts]
        params = SamplingParams(**{**self.sampling.__dict__, "greedy": True, "seed": 0})
        gen = self.engine.generate(encoded, params)
        tokens, lengths, prompt_lengths = gen.tokens, gen.lengths, gen.prompt_lengths
        mask = rl.response_mask(lengths, prompt_lengths, tokens.shape[1])
        future = self._critic_infer(tokens, lengths, prompt_lengths)
        start = rl.loss_start(mask)
        logprobs, _ = self._logprobs(self.policy, tokens, start=start)
        if self.reference is not None:
            ref_logprobs, _ = self._logprobs(self.reference, tokens, start=start)
            kl = ((logprobs - ref_logprobs) * mask).sum(1)
        else:
            kl = torch.zeros(tokens.shape[0])
        _, scores = self._critic_result(future, tokens.shape)
        resp_len = (lengths - prompt_lengths).float()
        rows = []
        for i in range(min(self.cfg.validation.num_samples, tokens.shape[0])):
            pl, ln = int(prompt_lengths[i]), int(lengths[i])
            rows.append(
                {
                    "prompt": self.val_prompts[i],
                    "response": self.tokenizer.decode(tokens[i, pl:ln].tolist()),
                    "score": float(scores[i]),
                }
            )
        if hasattr(self.logger, "samples"):
            self.logger.samples(step, rows)
        return {
            "val/scores": float(self._global_mean(scores, None)),  # means over every DP rank's prompts
            "val/kl": float(self._global_mean(kl, None)),
            "val/response_length": float(self._global_mean(resp_len, None)),
            "timers/validation": time.perf_counter() - t,
        }

    # -- pieces ----------------------------------------------------------------------------

    def _wait_before_generating(self) -> float:
        """Generation on more threads than training takes the cores the server's pending critic
        update runs on (two busy processes on one core stall every parallel region of the
        generation): let that update finish first. Returns the seconds waited."""
        n = self.cfg.generation.num_threads
        if n is None or n <= torch.get_num_threads() or self._pending_train is None:
            return 0.0
        t = time.perf_counter()
        self.wait_critic()
        return time.perf_counter() - t

    def _logprobs(
        self, model: torch.nn.Module, tokens: torch.Tensor, with_entropy: bool = False, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training-forward log-probs [b, s-1] (and entropy [b, s-1]), in micro-batches, no grad;
        0 before position ``start``."""
        was_training = model.training
        model.eval()  # dropout off: these are the "old" log-probs of the ratio
        out_lp, out_ent = [], []
        mb = self.cfg.ppo.micro_batch_size
        with torch.no_grad():
            for i in range(0, tokens.shape[0], mb):
                logits = self._masked_logits(gpt.policy_logits(model, tokens[i : i + mb], start))
                out_lp.append(self._sequence_logprobs(logits, tokens[i : i + mb], start))
                if with_entropy:
                    out_ent.append(self._entropy(logits, start))
        model.train(was_training)
        return torch.cat(out_lp), (torch.cat(out_ent) if with_entropy else None)

    def _sequence_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """logits [b, s - start, v] (masked; positions ``start..s-1``), tokens [b, s] -> [b, s-1];
        0 before ``start`` and where the target is padding (a never-sampled id whose log-prob is
        -inf; those positions are outside every mask)."""
        lp = rl.sequence_logprobs(
            logits,
            tokens[:, start:],
            self.cfg.generation.temperature,
            group=self._tp_group,
            vocab_start=self._vocab_start,
        )
        if start:
            lp = F.pad(lp, (start, 0))
        if self._pad_from is None:
            return lp
        return lp.masked_fill(tokens[:, 1:] >= self._actions, 0.0)

    def _entropy(self, logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        """logits [b, s - start, v] (positions ``start..s-1``) -> entropy [b, s-1] of the
        sampling distribution at the positions that predict a next token; 0 before ``start``."""
        ent = rl.entropy_from_logits(logits[:, :-1], self.cfg.generation.temperature, group=self._tp_group)
        return F.pad(ent, (start, 0)) if start else ent

    def _masked_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self._pad_from is None:
            return logits
        # A shard with no action column at all gets a large finite negative instead of -inf, so
        # its local max and sums stay finite (its exp terms vanish in the global normaliser).
        fill = float("-inf") if self._pad_from > 0 else -1e30
        return logits.index_fill(-1, torch.arange(self._pad_from, logits.shape[-1]), fill)

    def _epoch_orders(self, step_id: int, b: int) -> list[torch.Tensor]:
        """Each PPO epoch's row order: the same on every rank of a TP group (seeded by step and
        DP rank)."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + step_id * 31 + self.state.dp_rank)
        return [torch.randperm(b, generator=gen) for _ in range(self.cfg.ppo.ppo_epochs)]

    def _first_forward(self, tokens: torch.Tensor, order: torch.Tensor, start: int = 0):
        """The first PPO pass's forward (one minibatch of one micro-batch: every row, in the
        first epoch's order), with gradients. Returns ``(logits, logprobs)`` for that pass and,
        detached and back in row order, the rollout's log-probs and entropy."""
        self.policy.train()
        rows = tokens[order]
        logits = self._masked_logits(gpt.policy_logits(self.policy, rows, start))
        logp = self._sequence_logprobs(logits, rows, start)
        old_logprobs = torch.empty_like(logp, requires_grad=False)
        old_logprobs[order] = logp.detach()
        with torch.no_grad():
            ent = self._entropy(logits.detach(), start)
        entropy = torch.empty_like(ent)
        entropy[order] = ent
        return (logits, logp), old_logprobs, entropy

    def _update_policy(self, r: Rollout, orders: list[torch.Tensor], handoff: list) -> dict[str, float]:
        """PPO epochs over ``orders`` (one row permutation per epoch); ``handoff``: empty, or the
        first pass's ``(logits, logprobs)`` from :meth:`_first_forward` (taken out of the list,
        so that nothing keeps them once the first minibatch is done)."""
        first = handoff.pop() if handoff else None
        p = self.cfg.ppo
        b = r.tokens.shape[0]
        per_rank_mini = p.mini_batch_size // self.state.dp_size
        n_micro = per_rank_mini // p.micro_batch_size
        sums: dict[str, float] = {}
        count = 0
        self.policy.train()
        for order in orders:
            for start in range(0, b, per_rank_mini):
                idx = order[start : start + per_rank_mini]
                stats = self._minibatch_step(r, idx, n_micro, first)
                first = None
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _minibatch_step(self, r: Rollout, idx: torch.Tensor, n_micro: int, first=None) -> dict[str, float]:
        p = self.cfg.ppo
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, float] = {}
        for micro in idx.chunk(n_micro):
            tokens, mask = r.tokens[micro], r.mask[micro]
            if first is not None:  # this pass's forward was run for the rollout log-probs
                (logits, logp), first = first, None
            else:
                logits = self._masked_logits(gpt.policy_logits(self.policy, tokens, r.start))
                logp = self._sequence_logprobs(logits, tokens, r.start)
            loss, stats = rl.policy_loss(
                logp,
                r.old_logprobs[micro],
                r.advantages[micro],
                mask,
                clip_eps_low=p.clip_eps,
                clip_eps_high=p.clip_eps_high,
                dual_clip=p.dual_clip,
                agg=p.loss_agg,
            )
            if p.entropy_coef > 0:
                ent = self._entropy(logits, r.start)
                loss = loss - p.entropy_coef * rl.aggregate(ent, mask, p.loss_agg)
            (loss / n_micro).backward()
            acc["loss/policy"] = acc.get("loss/policy", 0.0) + float(loss.detach()) / n_micro
            for k, v in stats.items():
                acc[f"policy/{k}"] = acc.get(f"policy/{k}", 0.0) + float(v) / n_micro
        self.optimizer.allreduce_grads(self._dp_group, self.state.dp_size)  # fp32 master grads
        acc["policy/grad_norm"] = self.optimizer.clip_grad_norm(
            self.cfg.optim.grad_clip, self._tp_group, self.state.tp_size, self.state.tp_rank
        )
        self.optimizer.step()  # skipped (and counted in grad_norm as inf/nan) on a non-finite norm
        self.scheduler.step()
        return acc

    # -- the critic, seen from the actor's ranks ------------------------------------------------
    # One rank per TP group talks to the server for its data-parallel rows and broadcasts
    # the answer; training requests are gathered to global rank 0 and sent once per step.

    def _is_tp_src(self) -> bool:
        return self.state.tp_rank == 0

    def _critic_infer(self, tokens, lengths, prompt_lengths) -> Future | None:
        if not self._is_tp_src():
            return None
        return self.critic.infer(tokens, lengths, prompt_lengths)

    def _critic_result(self, future: Future | None, shape) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = shape
        if future is not None:
            values_np, rewards_np = future.result()
            values = torch.as_tensor(values_np, dtype=torch.float32).reshape(b, s - 1)
            scores = torch.as_tensor(rewards_np, dtype=torch.float32).reshape(b)
        else:
            values, scores = torch.empty(b, s - 1), torch.empty(b)
        if self.state.tp_size > 1:
            from megatron.core import parallel_state as mpu

            src = mpu.get_tensor_model_parallel_src_rank()
            dist.broadcast(values, src, group=self.state.tp_group)
            dist.broadcast(scores, src, group=self.state.tp_group)
        return values, scores

    def _critic_train(self, tokens, lengths, returns, values, mask, step_id: int) -> Future | None:
        if self.state.dp_size > 1:
            tokens, lengths, returns, values, mask = self._gather_dp(tokens, lengths, returns, values, mask)
        if self.state.rank != 0:
            return None
        return self.critic.train(tokens, lengths, returns, values, mask, step_id)

    def _gather_dp(self, tokens, lengths, returns, values, mask):
        """Concatenate every DP rank's rows (padded to a common length) on all ranks."""
        s = torch.tensor([tokens.shape[1]])
        dist.all_reduce(s, op=dist.ReduceOp.MAX, group=self.state.dp_group)
        s = int(s)
        pad = s - tokens.shape[1]
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad), value=self.tokenizer.pad_id)
            returns, values, mask = (torch.nn.functional.pad(x, (0, pad)) for x in (returns, values, mask))
        out = []
        for x in (tokens, lengths, returns, values, mask):
            parts = [torch.empty_like(x) for _ in range(self.state.dp_size)]
            dist.all_gather(parts, x.contiguous(), group=self.state.dp_group)
            out.append(torch.cat(parts))
        return out

    # -- metrics -----------------------------------------------------------------------------

    def _global_mean(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        m = torch.ones_like(x) if mask is None else mask
        return rl.global_masked_mean(x, m, group=self._dp_group)

    def _metrics(
        self,
        gen,
        mask,
        scores,
        kl,
        non_score,
        entropy,
        old_logprobs,
        values,
        returns,
        train_stats,
        last_train,
        beta,
        timers,
    ) -> dict[str, float]:
        row = lambda x: self._global_mean(x, None)  # noqa: E731 - per-sample means over all DP rows
        resp_len = (gen.lengths - gen.prompt_lengths).float()
        diff = (gen.logprobs - old_logprobs).abs() * mask
        gen_mismatch = diff.max()
        n_tokens = resp_len.sum()
        if self._dp_group is not None:
            dist.all_reduce(gen_mismatch, op=dist.ReduceOp.MAX, group=self._dp_group)
            dist.all_reduce(n_tokens, group=self._dp_group)
        m = {
            "objective/scores": float(row(scores)),
            "objective/kl": float(row(kl.sum(1))),
            "objective/non_score_reward": float(row(non_score.sum(1))),
            "objective/entropy": float(self._global_mean(entropy, mask)),
            "objective/kl_coef": float(beta),
            "critic/explained_variance": float(rl.explained_variance(values, returns, mask)),
            "rollout/response_length": float(row(resp_len)),
            "rollout/ended_fraction": float(row(gen.ended.float())),
            "rollout/logprob_mismatch_max": float(gen_mismatch),
            "rollout/logprob_mismatch_mean": float(self._global_mean(diff, mask)),
            "lr": float(self.scheduler.get_last_lr()[0]),
            **train_stats,
            **timers,
        }
        m["throughput/tokens_per_s"] = float(n_tokens) / max(timers["timers/generate"], 1e-9)
        if last_train is not None:
            m["loss/value"] = float(last_train["loss"])
            m["critic/grad_norm"] = float(last_train["grad_norm"])
        return m
