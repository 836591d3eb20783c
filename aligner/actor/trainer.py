"""The actor's PPO loop against a remote critic, one step at a time.

Each step reads as the steps of docs/design.md, "Roles and data flow":

1. refit the generation engine from the current policy;
2. generate responses for a batch of prompts;
3. send them to ``critic_infer`` (values and scores) without waiting;
4. meanwhile, the policy's and the reference's log-probs;
5. KL-shaped per-token rewards -> advantages (``ppo.advantage``: GAE, whitened; or critic-free
   GRPO, RLOO, REINFORCE++);
6. send ``critic_train`` this step's batch, without waiting for it (not in critic-free runs);
7. PPO epochs x minibatches of clipped-surrogate updates (:mod:`aligner.actor.policy_update`;
   not during the critic warm-up);
8. every N steps: validation on fixed prompts, and checkpoints of both roles at the same step.

With rollout workers of their own (``rollout.workers``, :mod:`aligner.actor.rollout_workers`),
step 1 pushes the policy's version to them and asks for every step it may generate (up to
``rollout.max_staleness`` ahead), and step 2 takes this step's batch from them; at k >= 1 the push
(and the asks it allows) runs on through steps 2-4 and 7's backward (``rollout.overlap_push``),
waited for right before the first optimizer step.

Algorithms (``ppo.*``, :class:`~aligner.actor.config.PPOConfig`):

- ``samples_per_prompt = n``: each step draws ``global_batch_size / n`` prompts, each a group of
  ``n`` adjacent rows on one data-parallel rank; the engine samples every row from its own
  random stream, so a group's copies draw different responses. PPO's minibatch orders permute
  whole groups.
- Critic-free estimators (``grpo``, ``rloo``, ``reinforce_pp``): the scores come from
  ``critic_infer`` as before; its values are not used (a reward-only server answers zeros) and
  no ``critic_train`` is sent. GRPO and RLOO compare each sample's sequence reward (its score
  plus its KL penalty, ``-beta * sum_t kl_t``) with its group's; REINFORCE++ takes token-level
  returns of the KL-shaped rewards, whitened over the global batch.
- Overlong handling (DAPO): ``overlong_filtering`` takes responses that never ended out of the
  loss mask; ``overlong_buffer`` adds the soft overlong penalty to the score, beside
  ``missing_eos_penalty``.
- ``critic_warmup_steps``: the first steps send the critic its training batch as usual but leave
  the policy, its LR schedule and the KL controller as they are.
- ``dynamic_sampling`` (DAPO; GRPO and RLOO): step 2 becomes rounds of generating and scoring,
  each keeping the groups whose scores differ, until the batch is full (at most
  ``max_generation_rounds``); step 3's scores are then those rounds'.

All numbers come from :mod:`aligner.rl`; this file only moves tensors between the pieces, each
in a module of its own: the prompts (:mod:`aligner.actor.prompts`), the critic as the actor's
ranks see it (:mod:`aligner.actor.critic_link`), log-probs over this rank's vocabulary shard
(:mod:`aligner.actor.logprobs`), step 5's rewards and advantages (:mod:`aligner.actor.shaping`),
the optimizer and its schedule (:mod:`aligner.actor.optimizer`),
the rollout and the step's record (:mod:`aligner.actor.rollout`), the policy update
(:mod:`aligner.actor.policy_update`), checkpoints (:mod:`aligner.actor.checkpointing`) and the
step they resume from (:mod:`aligner.actor.resume`), the frozen reference and where its weights
live (:mod:`aligner.actor.reference`).

A restarted critic server (:class:`~aligner.wire.handle.CriticRestartedError`) is met in
:meth:`PPOTrainer.train`: per ``critic.on_restart`` it rolls both roles back to the newest step
both checkpointed and redoes the steps after it (at most ``critic.max_restarts`` times), or stops.

Shapes: ``b`` this data-parallel rank's samples (its prompts times ``samples_per_prompt``), ``s``
padded length, ``v`` vocabulary shard.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from aligner import faults, rl
from aligner.actor.checkpointing import ActorCheckpointer, ActorState
from aligner.actor.config import ActorConfig
from aligner.actor.critic_link import CriticLink, prompt_texts, sample_texts
from aligner.actor.logprobs import PolicyLogprobs
from aligner.actor.optimizer import freeze_all_but_last_layers, make_policy_optimizer, set_schedule_position
from aligner.actor.pipeline import PipelineSchedule
from aligner.actor.policy_update import PolicyUpdate
from aligner.actor.ppo_config import estimator_line
from aligner.actor.prompts import PromptSampler
from aligner.actor.reference import ReferenceModel
from aligner.actor.resume import check_restart, rollback_dir, rolled_back
from aligner.actor.rollout import GroupFilter, Rollout, StepRecord, fill_by_rounds, global_mean
from aligner.actor.rollout_workers import RolloutWorkers
from aligner.actor.shaping import shape_and_estimate
from aligner.actor.step_report import StepReport, worker_metrics
from aligner.actor.validation import validate
from aligner.distributed import ParallelState
from aligner.generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from aligner.metrics import MetricsLogger, Timers
from aligner.models import forward
from aligner.precision import resolve_precision
from aligner.tokenizers import Tokenizer
from aligner.wire.handle import CriticHandle, CriticRestartedError
from aligner.wire.protocol import TrainResult

log = logging.getLogger(__name__)

__all__ = ["PPOTrainer"]


class PPOTrainer:
    """Owns the policy, the reference, the engine and the critic connection for one run."""

    def __init__(
        self,
        cfg: ActorConfig,
        state: ParallelState,
        policy: torch.nn.Module,
        reference: torch.nn.Module | None,
        engine: GenerationEngine,
        critic: CriticHandle,
        tokenizer: Tokenizer,
        sampler: PromptSampler,
        logger: MetricsLogger,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        *,
        checkpointer: ActorCheckpointer | None = None,
        val_prompts: list[str] | None = None,
        val_extras: list[str] | None = None,
        raw_prompts: dict[str, str] | None = None,
        on_rollback: Callable[[int], None] | None = None,
        workers: RolloutWorkers | None = None,
    ) -> None:
        """``checkpointer`` saves at the configured interval and at the end, and rolls back
        after a server restart; ``val_prompts``: this data-parallel rank's share of the fixed
        evaluation prompts (validation is off without them), ``val_extras`` their data-set rows'
        extra columns (JSON objects, for the reward function); ``on_rollback(step)``: called
        after a rollback to ``step`` (the entry point rewinds its metrics and progress bar);
        ``workers``: rollout workers of their own that generate the steps' batches (the engine
        then serves validation only)."""
        self.cfg, self.state = cfg, state
        self.policy, self.engine = policy, engine
        self.critic = CriticLink(critic, state, tokenizer.pad_id)
        self.tokenizer, self.sampler, self.logger = tokenizer, sampler, logger
        self.on_step = on_step
        self.on_rollback = on_rollback
        self.checkpointer = checkpointer
        self.workers = workers
        if workers is not None:  # with rollout.score_on_workers, the asks carry the prompts' texts
            workers.prompt_texts = lambda ps, ts: prompt_texts(
                self.raw_prompts, ps, [tokenizer.decode(t, skip_special=True) for t in ts]
            )
        self.val_prompts = list(val_prompts) if val_prompts else []
        self.val_extras = list(val_extras) if val_extras is not None else None
        self.raw_prompts = raw_prompts
        """Templated prompt -> the prompt as the data set writes it (with a chat template): what
        a reward model reading text gets as the prompt (None: the decoded prompt tokens)."""
        if self.val_extras is not None and len(self.val_extras) != len(self.val_prompts):
            raise ValueError(f"val_extras: {len(self.val_extras)} rows for {len(self.val_prompts)} prompts")
        freeze_all_but_last_layers(
            policy, cfg.optim.trainable_last_n_layers, cfg.model.num_layers, state.pp_rank
        )
        self.precision = resolve_precision(cfg.precision, state.device)
        self.optimizer, self.scheduler = make_policy_optimizer(policy, cfg, self.precision, state)
        # After the optimizer: it casts the policy to its compute dtype, the dtype the engine
        # serves it in (the first step refits the engine).
        self.model_forward = forward.set_forwards(
            {"policy": policy, "reference": reference},
            cfg.model_forward,
            state.tp_size,
            log if state.is_logging_rank else None,
        )
        # After the forwards are set (they read the parameters at each call): with
        # ppo.reference_on_cpu on an accelerator, the reference's weights leave it here.
        self.reference = (
            ReferenceModel(
                reference, state.device, offload=cfg.ppo.reference_on_cpu and state.device.type != "cpu"
            )
            if reference is not None
            else None
        )
        self._engine_stale = True
        self.logprobs = PolicyLogprobs.for_actor(cfg, state, tokenizer)
        # Under pipeline parallelism every forward and backward runs through Megatron's schedule.
        self.pipeline = PipelineSchedule(state, self.logprobs) if state.pp_size > 1 else None
        # 7. The policy update; its first forward may double as the rollout's log-prob forward.
        self.policy_update = PolicyUpdate(
            policy, self.optimizer, self.scheduler, self.logprobs, self.pipeline, cfg, state
        )
        self.reuse_rollout_forward = self.policy_update.reuse_rollout_forward
        p = cfg.ppo
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
        self.critic_free = p.advantage in rl.CRITIC_FREE_ESTIMATORS
        """No critic in this run (``ppo.advantage``): its values are not used, nor is it trained."""
        if self.critic_free and hasattr(critic, "watch_restarts"):
            # The server holds nothing this run depends on: a restarted one is simply reconnected.
            critic.watch_restarts = False
        server_critic = self.critic.check_mode(p.advantage)  # 'gae' refuses a reward-only server
        if state.is_logging_rank:
            print(estimator_line(p, self.critic_free, server_critic), flush=True)
        if workers is not None and not self.critic_free:  # workers that score ask for values too
            workers.critic_step = self.critic.infer_step
        self.step_count = 0
        self.restarts = 0
        """Server restarts this run rolled back from."""
        self._current = 0  # the step being run, or saved: where a restart is found
        self._dp_group = state.dp_group if state.dp_size > 1 else None
        self.report = StepReport(cfg, state, policy, self.precision)
        """The episode counter, histograms, memory and MFU of each step."""

    # -- the loop ----------------------------------------------------------------------------

    def train(self, num_steps: int | None = None) -> None:
        """Steps until ``num_steps`` (default ``ppo.num_steps``), then wait for the last critic
        update. A restarted server met on the way is handled per ``critic.on_restart``."""
        end = num_steps if num_steps is not None else self.cfg.ppo.num_steps
        v = self.cfg.validation
        while True:
            try:
                if v.before_train and self.val_prompts and self.step_count == 0:
                    self.logger.log(0, self.validate(0))
                while self.step_count < end:
                    metrics = self.step()
                    if self.on_step is not None:
                        self.on_step(self.step_count, metrics)
                    # 8. (continued) Checkpoints of both roles at this step, when due.
                    if self.checkpointer is not None:
                        last = self.step_count >= end
                        self.checkpointer.after_step(self.step_count, metrics, self.actor_state, last=last)
                self.finish()
                return
            except CriticRestartedError as e:
                self._roll_back(e)

    def _roll_back(self, error: CriticRestartedError) -> None:
        """After a restarted server: per ``critic.on_restart``, stop naming the server's critic
        step and the actor's, or roll both roles back to the newest step both checkpointed (the
        server loads its half; this process reloads its own in place, as a resume at start-up
        does) so that the steps after it are redone. On every rank."""
        c, reached = self.cfg.critic, max(self._current, self.step_count)
        self.critic.drop()  # the update in flight (if any) failed with the server it was sent to
        if c.on_restart != "fail" and self.checkpointer is not None:
            self.restarts += 1  # this restart counts against critic.max_restarts
        ckpt, url = self.checkpointer, self.critic.critic.url
        check_restart(error, c, ckpt, url, reached=reached, completed=self.step_count, restarts=self.restarts)
        try:
            step_dir, held_now, instance = rollback_dir(self.checkpointer, error)
            self.load_training_state(self.checkpointer.load(self.actor_state(), step_dir))
            self.critic.follow(instance)  # every rank's client: this server, its restart handled
        except CriticRestartedError as again:  # restarted again meanwhile: counted, and retried
            self._roll_back(again)
            return
        to = self.step_count
        msg = rolled_back(
            error, held_now, to=to, reached=reached, restarts=self.restarts, max_restarts=c.max_restarts
        )
        log.warning("%s", msg)
        if self.state.is_logging_rank:
            print(msg, flush=True)
        if self.on_rollback is not None:
            self.on_rollback(to)

    def step(self) -> dict[str, float]:
        try:
            return self._step()
        finally:  # a step that failed leaves no push reading the weights (a roll-back loads them)
            if self.workers is not None:
                self.workers.abandon_push()

    def _step(self) -> dict[str, float]:
        cfg, p = self.cfg, self.cfg.ppo
        step_id = self._current = self.step_count + 1
        timed = Timers()
        self.report.start()
        with timed("step"):
            # 1. Refit the generation engine from the current policy.
            with timed("refit"):
                if self.workers is None:
                    refit = self._refit_engine()
                else:  # push this version (at k >= 1 on a thread, waited for in step 7), then ask for
                    # every step it may generate (rollout.max_staleness; sent after the push)
                    refit = self.workers.push(self.step_count, self.policy)
                    self.workers.ask_through(step_id + self.workers.k, self._draw)

            # 2. Generate responses for a batch of prompts.
            with timed("critic_wait"):
                self._wait_before_generating()
            # Critic warm-up: the critic trains on this step's rollout, the policy stays as it is.
            warmup = self.step_count < p.critic_warmup_steps
            with timed("generate"):
                sampling = self._sampling(step_id)
                scored, sampled = None, {}
                if p.dynamic_sampling:  # rounds of generation and scoring until the groups fill the batch
                    gen, scored, sampled = self._dynamic_rollout(step_id, sampling)
                elif self.workers is not None:  # generated by a worker, from version step_id - 1 - k
                    arrived = self.workers.take(step_id)
                    prompts, extras, gen = arrived.prompts, arrived.extras, arrived.gen
                    scored = arrived.scored()  # the worker's scores (rollout.score_on_workers), or None
                else:
                    # Each prompt samples_per_prompt times in a row (a group, whole on this rank).
                    prompts, extras = self.sampler.next_rows(p.samples_per_prompt)
                    gen = self._generate(prompts, sampling)
                tokens = gen.tokens
                mask = rl.response_mask(gen.lengths, gen.prompt_lengths, tokens.shape[1])
                start = rl.loss_start(mask)

            with timed("logprobs"):
                # 3. Values and scores from critic_infer, without waiting (dynamic sampling has them)...
                critic_future = None
                if scored is None:
                    inputs = self._reward_inputs(gen, extras, prompts)
                    critic_future = self.critic.infer(
                        tokens, gen.lengths, gen.prompt_lengths, step_id, **inputs
                    )
                # 4. ...while the reference's and the policy's log-probs are computed.
                orders = self.policy_update.epoch_orders(step_id, tokens.shape[0])
                beta = self.kl_ctl.value
                with_reference = self.reference is not None and beta > 0
                first, ref_logprobs = None, None
                if self.reuse_rollout_forward and not warmup:
                    # The reference first: the policy's forward keeps its graph for the update.
                    if with_reference:
                        ref_logprobs = self._reference_logprobs(gen, start)
                    first, old_logprobs, entropy = self.policy_update.first_forward(tokens, orders[0], start)
                else:
                    if with_reference:
                        self.reference.prefetch()  # an offloaded reference's copy runs under this forward
                    old_logprobs, entropy = self._no_grad(self.policy, gen, with_entropy=True, start=start)
                    if with_reference:
                        ref_logprobs = self._reference_logprobs(gen, start)
                if ref_logprobs is None:
                    ref_logprobs = old_logprobs
            with timed("critic_wait"):
                values, raw_scores = (
                    scored if scored is not None else self.critic.result(critic_future, tokens.shape)
                )
                self.critic.wait()  # last step's critic update, normally long done
                last_train = self.critic.take_completed()

            # 5. KL-shaped per-token rewards -> advantages (GAE and whitening, or critic-free).
            shaped = shape_and_estimate(
                p,
                max_new_tokens=cfg.generation.max_new_tokens,
                raw_scores=raw_scores,
                values=values,
                ended=gen.ended,
                response_lengths=gen.response_lengths,
                mask=mask,
                old_logprobs=old_logprobs,
                ref_logprobs=ref_logprobs,
                beta=beta,
                score_moments=self.score_moments,
                group=self._dp_group,
            )
            kl, loss_mask, advantages, returns = (
                shaped.kl,
                shaped.loss_mask,
                shaped.advantages,
                shaped.returns,
            )

            # 6. The critic's training batch for this step id; the server trains while we do.
            faults.ACTOR.hit("mid_step", step_id)  # the crash tests' kill: generated, nothing sent yet
            if not self.critic_free:
                self.critic.train(tokens, gen.lengths, returns, values, mask, step_id)

            # 7. PPO epochs x minibatches of clipped-surrogate updates.
            with timed("train"):
                rollout = Rollout(
                    tokens,
                    gen.lengths,
                    gen.prompt_lengths,
                    loss_mask,
                    old_logprobs,
                    values,
                    advantages,
                    returns,
                    start,
                    gen.logprobs if p.tis_cap is not None else None,
                )
                handoff = [first] if first is not None else []
                del first  # the first minibatch step holds the only reference: freed once it is done
                # The push in flight (rollout.overlap_push) has read the weights before the first
                # optimizer step writes them. During the critic warm-up: no optimizer step, no
                # schedule step, no KL update.
                join = self.workers.join_push if self.workers is not None else None
                policy_stats = {} if warmup else self.policy_update.train_step(rollout, orders, handoff, join)
                if join is not None:
                    join()  # (waited for already, unless nothing was trained)
            if not warmup:
                self._engine_stale = True  # the policy changed: the next step refits the engine
                self.kl_ctl.update(float(global_mean(kl.sum(1), None, self._dp_group)), p.global_batch_size)
            self.step_count = step_id

        record = StepRecord(
            gen=gen,
            mask=mask,
            scores=raw_scores,
            kl=kl,
            non_score=shaped.non_score,
            entropy=entropy,
            old_logprobs=old_logprobs,
            values=values,
            returns=returns,
            kl_coef=beta,
            lr=self.scheduler.get_last_lr()[0],
            policy_stats=policy_stats,
            critic_stats=last_train,
            timers={**timed.seconds, **(self.reference.take_seconds() if self.reference else {})},
            critic_free=self.critic_free,
            loss_mask=loss_mask if p.overlong_filtering else None,
            advantages=advantages,
        )
        metrics, hists = self.report.summarize(
            record,
            step_id,
            trained=not warmup,
            rollout_forward=not (self.reuse_rollout_forward and not warmup),
            reference_forward=with_reference,
        )
        metrics.update(sampled)
        if p.samples_per_prompt > 1:  # how much a prompt's samples differ (what a group estimator sees)
            spread = rl.group_score_std(shaped.scores, p.samples_per_prompt).reshape(1)
            metrics["rollout/group_score_std"] = float(global_mean(spread, None, self._dp_group))
        if p.critic_warmup_steps:
            metrics["ppo/critic_warmup"] = float(warmup)
        if self.workers is not None:  # staleness, the worker's time, the push, the trainer's wait
            metrics.update(worker_metrics(self.workers, arrived, step_id, timed.seconds))
        elif hasattr(self.engine, "last_refit"):  # what this step's refit moved into the engine, on this rank
            metrics["refit/mbytes"] = float(refit.bytes) / 1e6 if refit is not None else 0.0
        # 8. Validation every N steps (the checkpoints follow the step: see train()).
        v = cfg.validation
        if self.val_prompts and v.interval and step_id % v.interval == 0:
            metrics.update(self.validate(step_id))
        self.logger.log(step_id, metrics)
        self.logger.histograms(step_id, hists)
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Greedy responses to the fixed evaluation prompts, scored by the server
        (:func:`aligner.actor.validation.validate`)."""
        return validate(self, step)

    def finish(self) -> None:
        """Wait for the critic's last training request."""
        self.critic.wait()

    # -- state for checkpoints ---------------------------------------------------------------

    def actor_state(self) -> ActorState:
        """What a checkpoint of this step holds, once the critic's pending update has finished
        (both roles are saved at the same step) and, with rollout workers, once every batch
        asked for has arrived."""
        self._current = self.step_count
        self.critic.wait()
        training, rollouts = self.training_state(), None
        if self.workers is not None:
            training["rollout_workers"], rollouts = self.workers.pending()
        return ActorState(self.step_count, self.policy, self.optimizer, self.precision, training, rollouts)

    def training_state(self) -> dict[str, Any]:
        """Everything besides weights and optimizer moments that the next step depends on, as
        JSON (once no critic training request is in flight)."""
        if self.critic.pending is not None:
            raise RuntimeError("training_state() while a critic training request is in flight")
        return {
            "step": self.step_count,
            "kl_ctl": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "sampler": self.sampler.state_dict(),
            "scheduler_last_epoch": int(self.scheduler.last_epoch),
            "last_critic_train": None if self.critic.completed is None else self.critic.completed.to_dict(),
            **self.report.state_dict(),
        }

    def load_training_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`training_state`, after the checkpointer has loaded the weights and
        optimizer of :meth:`actor_state`. The learning-rate schedule continues from the saved
        position under *this* run's settings (a changed LR or step budget takes effect)."""
        self.step_count = int(d["step"])
        self.report.load_state_dict(d, self.step_count)
        self.kl_ctl.load_state_dict(d["kl_ctl"])
        self.score_moments.load_state_dict(d["score_moments"])
        self.sampler.load_state_dict(d["sampler"])
        set_schedule_position(self.scheduler, self.optimizer, int(d["scheduler_last_epoch"]))
        last = d.get("last_critic_train")
        self.critic.completed = None if last is None else TrainResult.from_dict(last)
        self.critic.pending = None
        self._engine_stale = True  # the policy's weights were replaced
        if self.workers is not None:  # the batches the checkpoint had asked for come back
            self.workers.restore(d.get("rollout_workers"), d.get("rollout_tensors"), self.step_count)

    # -- pieces ----------------------------------------------------------------------------

    def _no_grad(
        self, model: torch.nn.Module, gen: GenerationOutput, *, with_entropy: bool = False, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model``'s log-probs (and entropy) ``[b, s-1]`` of the generated rows, without
        gradient, in micro-batches: through the pipeline schedule under PP (one sequence length
        per call), else each micro-batch cut to its longest row, or packed under the token
        budget (``ppo.max_tokens_per_micro_batch``)."""
        p = self.cfg.ppo
        if self.pipeline is not None:
            return self.pipeline.no_grad(
                model, gen.tokens, p.micro_batch_size, with_entropy=with_entropy, start=start
            )
        return self.logprobs.no_grad(
            model,
            gen.tokens,
            p.micro_batch_size,
            with_entropy=with_entropy,
            start=start,
            lengths=gen.lengths,
            max_tokens=p.max_tokens_per_micro_batch,
        )

    def _reference_logprobs(self, gen: GenerationOutput, start: int) -> torch.Tensor:
        """The frozen reference's log-probs ``[b, s-1]`` of the generated rows (an offloaded
        reference's weights visit the device for this forward)."""
        with self.reference.on_device() as reference:
            return self._no_grad(reference, gen, start=start)[0]

    def _refit_engine(self) -> Any:
        """Give the engine the policy's current weights, once after each change (collective: an
        engine in a layout of its own streams them from every rank). Returns the engine's
        account of that refit (``last_refit``: seconds, bytes), or None when there was none."""
        if not self._engine_stale:
            return None
        self.engine.refit(self.policy)
        self._engine_stale = False
        return getattr(self.engine, "last_refit", None)

    def _wait_before_generating(self) -> None:
        """Generation on more threads than training takes the cores the server's pending critic
        update runs on (two busy processes on one core stall every parallel region of the
        generation): let that update finish first."""
        n = self.cfg.generation.num_threads
        if n is not None and n > torch.get_num_threads():
            self.critic.wait()

    def _draw(self, step_id: int) -> tuple[list[str], list[str] | None, list[list[int]], SamplingParams]:
        """Step ``step_id``'s prompts, extras, prompt tokens and sampling, as :meth:`step` draws
        them in process (for a rollout worker, up to ``rollout.max_staleness`` steps ahead)."""
        prompts, extras = self.sampler.next_rows(self.cfg.ppo.samples_per_prompt)
        return prompts, extras, [self.tokenizer.encode(x) for x in prompts], self._sampling(step_id)

    def _sampling(self, step_id: int) -> SamplingParams:
        """Step ``step_id``'s sampling parameters: its own seed, the same wherever it generates."""
        return self.cfg.generation.sampling(seed=self.cfg.seed * 100_003 + step_id)

    def _generate(self, prompts: list[str], sampling: SamplingParams) -> GenerationOutput:
        return self.engine.generate([self.tokenizer.encode(x) for x in prompts], sampling)

    def _reward_inputs(
        self, gen: GenerationOutput, extras: list[str] | None, prompts: list[str]
    ) -> dict[str, Any]:
        """What ``critic_infer`` carries beside the tokens, on the ranks that send it: the rows'
        extra data-set columns, and the samples' texts when the server's reward model reads text
        with a tokenizer of its own (the prompt as the data set writes it when a chat template
        rendered it, so that the reward model never sees the policy's template)."""
        if self.state.tp_rank != 0 or self.state.pp_rank != 0:
            return {}
        out: dict[str, Any] = {"extras": extras}
        if self.critic.needs_texts:
            # The response text ends where generation stopped it: any of the engine's stop ids.
            tok = self.tokenizer
            stops = getattr(self.engine, "stop_ids", None) or getattr(tok, "stop_ids", (tok.eos_id,))
            stops = (*stops, *self.cfg.generation.stop_token_ids)
            decoded, out["response_texts"] = sample_texts(
                self.tokenizer, gen.tokens, gen.lengths, gen.prompt_lengths, stops
            )
            out["prompt_texts"] = prompt_texts(self.raw_prompts, prompts, decoded)
        return out

    def _dynamic_rollout(
        self, step_id: int, sampling: SamplingParams
    ) -> tuple[GenerationOutput, tuple[torch.Tensor, torch.Tensor], dict[str, float]]:
        """DAPO's dynamic sampling (:func:`~aligner.actor.rollout.fill_by_rounds`): rounds of
        drawing a step's prompts, generating and scoring them (``critic_infer``, waited for).
        Returns the batch, its ``(values, scores)``, and the rounds' metrics."""
        p = self.cfg.ppo

        def one_round(n: int) -> tuple[GenerationOutput, torch.Tensor, torch.Tensor]:
            prompts, extras = self.sampler.next_rows(p.samples_per_prompt)
            # Another seed for every round: the same prompts may come again.
            seed = sampling.seed if n == 1 else sampling.seed * 1_000_003 + n
            gen = self._generate(prompts, dataclasses.replace(sampling, seed=seed))
            inputs = self._reward_inputs(gen, extras, prompts)
            future = self.critic.infer(gen.tokens, gen.lengths, gen.prompt_lengths, step_id, **inputs)
            return gen, *self.critic.result(future, gen.tokens.shape)

        fill = GroupFilter(
            p.global_batch_size // self.state.dp_size, p.samples_per_prompt, self.tokenizer.pad_id
        )
        gen, values, scores, stats = fill_by_rounds(fill, one_round, p.max_generation_rounds, self.state)
        return gen, (values, scores), stats
