"""The ``ppo`` section of the actor's configuration: batch sizes, KL control, advantage
estimation and the losses (re-exported by :mod:`aligner.actor.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aligner.config_checks import Problems
from aligner.rl import ESTIMATORS, GROUP_ESTIMATORS

__all__ = ["PPOConfig", "estimator_line"]


@dataclass
class PPOConfig:
    """The PPO algorithm: batch sizes, KL control, advantage estimation and the losses.

    Which estimator when (``advantage``): ``gae`` with a critic server, the default (dense
    per-token credit from a learned value; costs a critic's forward and update per step);
    ``grpo`` with ``samples_per_prompt`` of 4-16 and a reward-only server, for verifiable
    rewards (math, code: scores of 0/1 that a group's samples compare well); ``rloo`` the same
    without GRPO's per-group scaling (unbiased); ``reinforce_pp`` critic-free at any
    ``samples_per_prompt``, one sample per prompt included (token-level returns of the KL-shaped
    rewards against the batch's mean)."""

    num_steps: int = 500
    """PPO steps (rollout + update) to run."""
    global_batch_size: int = 256
    """Samples (responses) per step, over all data-parallel ranks: each step draws
    global_batch_size / samples_per_prompt prompts."""
    mini_batch_size: int = 64
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank (gradient accumulation below the minibatch)."""
    max_tokens_per_micro_batch: int | None = None
    """Packed sequences (``aligner.models.packing``): the policy's and the reference's forwards
    (the PPO update, the rollout's and the reference's log-probs, validation's) run over each
    rank's rows packed without padding, in micro-batches of consecutive rows of at most this
    many real tokens (a longer row alone) instead of micro_batch_size rows: the same loss,
    gradients and log-probs to float round-off (the loss is the global minibatch's whatever the
    cut), at the cost of the real tokens rather than rows x the longest row, and memory bounded
    by the budget. null: micro-batches of micro_batch_size rows. Under pipeline parallelism the
    micro-batches keep micro_batch_size rows (Megatron's schedule sends activations of one fixed
    shape between the stages). Packed, the rollout's log-probs take a forward of their own
    (reuse_rollout_forward needs the update's first pass to be one micro-batch of every row)."""
    samples_per_prompt: int = 1
    """Responses drawn for each prompt of a step, a group on one data-parallel rank with distinct
    sampling streams: 1 for PPO with a critic; 4-16 for 'grpo' and 'rloo' (which need >= 2: they
    compare a prompt's samples with each other)."""
    advantage: str = "gae"
    """The advantage estimator: 'gae' (the critic's values, PPO's default), or critic-free
    'grpo', 'rloo', 'reinforce_pp' (no critic values used, no critic_train sent: run the server
    with mode=reward_only). When to use which: the class docstring."""
    grpo_std_norm: bool = True
    """'grpo': divide each group's centred scores by the group's standard deviation; false is
    Dr. GRPO (no division, which would favour prompts whose samples barely differ)."""
    overlong_filtering: bool = False
    """Leave responses cut at generation.max_new_tokens without end-of-sequence out of the policy
    loss (DAPO; they still count in the score metrics): for long responses whose truncation says
    little about their quality. Only ended responses are then learned from: when those are mostly
    poor, the policy can learn never to end (``rollout/overlong_filtered`` shows it)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: responses longer than generation.max_new_tokens minus this
    many tokens get a score penalty growing linearly to overlong_penalty at the limit, so that the
    policy learns to finish before it is cut off (0 = off)."""
    overlong_penalty: float = 1.0
    """The soft overlong punishment's largest penalty (subtracted from the score at the limit)."""
    critic_warmup_steps: int = 0
    """The first N steps train only the critic on fresh rollouts, while the policy, its LR schedule
    and the KL controller stay as they are: for a fresh critic (a new value head) whose values
    would otherwise steer the first policy updates with noise. 'gae' only."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling ('grpo', 'rloo'): drop the groups whose scores are all equal (their
    advantages are 0: nothing to learn) and generate more prompts until every rank's batch is
    full again, for tasks where many prompts are always or never solved."""
    max_generation_rounds: int = 4
    """Dynamic sampling: the most generation rounds of one step; a batch still short after them is
    filled up with dropped groups."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    reuse_rollout_forward: bool = True
    """With one minibatch of one micro-batch per rank and a dropout-free forward
    (``model_forward`` fused or compiled), the rollout's log-probs come from the first PPO
    pass's own forward (its output, detached) instead of a separate no-grad forward of the same
    weights on the same tokens: one policy forward fewer per step, and the first ratio is
    exactly 1."""
    clip_eps: float = 0.2
    """Policy ratio clip (lower side, and upper side unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (DAPO's clip-higher); None = clip_eps."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss for negative advantages (Ye et al. 2020)."""
    tis_cap: float | None = None
    """Truncated importance sampling (verl's ``tis_imp_ratio_cap``): each token's policy loss is
    weighted by ``min(pi_train / pi_engine, tis_cap)`` of the training forward's log-probs
    against the generation engine's, correcting for the gap between the two (another kernel or
    precision, TensorRT-LLM's especially); e.g. 2.0. None: no weight."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    loss_agg: str = "token_mean"
    """'token_mean' or 'seq_mean_token_mean'."""
    init_kl_coef: float = 0.001
    """Initial beta of the per-token KL penalty (0 skips the reference model)."""
    adaptive_kl: bool = False
    """Use Ziegler et al.'s adaptive controller instead of a fixed beta."""
    kl_target: float = 6.0
    """Target KL of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon of the adaptive controller."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward: 'k1', 'abs' or 'k3'."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda for the advantages."""
    value_lam: float | None = None
    """GAE lambda for the value targets (None = lam)."""
    whiten_advantages: bool = True
    """Whiten advantages over the global batch."""
    score_clip: float | None = None
    """Clip scores to [-c, c] before shaping (None = off)."""
    normalize_scores: bool = False
    """Normalise scores with running mean/std across steps."""
    missing_eos_penalty: float | None = None
    """Added to the score of responses that never emitted end-of-sequence (None = off)."""
    reference_on_cpu: bool = False
    """Keep the frozen reference model's weights on the CPU between its forwards; each forward
    (one per step for the rollout's KL, one per validation) copies them to the policy's device
    and drops that copy afterwards. What it saves: the reference's weights on the accelerator
    during generation and the PPO updates, where memory peaks (the peak becomes the larger of
    training's and the reference forward's, not their sum). What it costs: one host-to-device
    copy of the reference per forward (its parameter bytes, e.g. 2 GB for a 1B-parameter bf16
    model, some 0.1 s over PCIe 4 at pinned-memory speed) and its device memory again while that
    forward runs. No effect when the policy itself is on the CPU."""

    def problems(self, prefix: str = "ppo", max_new_tokens: int | None = None) -> Problems:
        """Each value on its own (the batch sizes' divisibility depends on the data-parallel
        size: :meth:`ActorConfig.problems`), and ``overlong_buffer`` against ``max_new_tokens``
        (``generation.max_new_tokens``) when given."""
        e = Problems()
        e.positive_ints(
            self,
            prefix,
            (
                "num_steps",
                "global_batch_size",
                "mini_batch_size",
                "micro_batch_size",
                "ppo_epochs",
                "samples_per_prompt",
            ),
        )
        e += self._estimator_problems(prefix, max_new_tokens)
        budget = self.max_tokens_per_micro_batch
        e.expect(
            budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1),
            f"{prefix}.max_tokens_per_micro_batch",
            budget,
            "an integer >= 1, or null (no packing)",
        )
        e.expect(0 < self.clip_eps < 1, f"{prefix}.clip_eps", self.clip_eps, "a value in (0, 1)")
        high, dual, vlam = self.clip_eps_high, self.dual_clip, self.value_lam
        e.expect(high is None or high > 0, f"{prefix}.clip_eps_high", high, "> 0 or null")
        e.expect(dual is None or dual > 1, f"{prefix}.dual_clip", dual, "a constant > 1 or null")
        e.expect(self.tis_cap is None or self.tis_cap >= 1, f"{prefix}.tis_cap", self.tis_cap, ">= 1 or null")
        e.expect(
            self.loss_agg in ("token_mean", "seq_mean_token_mean"),
            f"{prefix}.loss_agg",
            self.loss_agg,
            "'token_mean' or 'seq_mean_token_mean'",
        )
        e.expect(
            self.kl_estimator in ("k1", "abs", "k3"),
            f"{prefix}.kl_estimator",
            self.kl_estimator,
            "'k1', 'abs' or 'k3'",
        )
        e.expect(self.init_kl_coef >= 0, f"{prefix}.init_kl_coef", self.init_kl_coef, ">= 0")
        for name in ("gamma", "lam"):
            e.expect(
                0 <= getattr(self, name) <= 1, f"{prefix}.{name}", getattr(self, name), "a value in [0, 1]"
            )
        e.expect(vlam is None or 0 <= vlam <= 1, f"{prefix}.value_lam", vlam, "a value in [0, 1] or null")
        return e

    def _estimator_problems(self, prefix: str, max_new_tokens: int | None) -> Problems:
        """The advantage estimator, its groups, the overlong settings and the critic warm-up."""
        e = Problems()
        n, adv = self.samples_per_prompt, self.advantage
        e.expect(adv in ESTIMATORS, f"{prefix}.advantage", adv, f"one of {list(ESTIMATORS)}")
        valid_n = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        if valid_n and adv in GROUP_ESTIMATORS:
            e.expect(
                n >= 2,
                f"{prefix}.samples_per_prompt",
                n,
                f">= 2 with {prefix}.advantage={adv!r} (it compares the samples of one prompt)",
            )
        if valid_n:
            for name in ("global_batch_size",):  # minibatches per rank: ActorConfig.parallel_problems
                v = getattr(self, name)
                if isinstance(v, int) and v >= 1 and v % n:
                    e.append(
                        f"{prefix}.{name}={v}: expected a multiple of {prefix}.samples_per_prompt={n} "
                        "(whole groups of one prompt's samples)"
                    )
        e.non_negative_ints(self, prefix, ("critic_warmup_steps", "overlong_buffer"))
        e.positive_ints(self, prefix, ("max_generation_rounds",))
        if self.dynamic_sampling:
            e.expect(
                adv in GROUP_ESTIMATORS,
                f"{prefix}.dynamic_sampling",
                self.dynamic_sampling,
                f"false with {prefix}.advantage={adv!r} (it drops groups of equal scores: "
                f"{' or '.join(repr(a) for a in GROUP_ESTIMATORS)} only)",
            )
        w = self.critic_warmup_steps
        if isinstance(w, int) and w > 0:
            e.expect(
                adv == "gae",
                f"{prefix}.critic_warmup_steps",
                w,
                f"0 with {prefix}.advantage={adv!r} (only 'gae' has a critic to warm up)",
            )
        b = self.overlong_buffer
        if max_new_tokens is not None and isinstance(b, int) and b > 0:
            e.expect(
                b <= max_new_tokens,
                f"{prefix}.overlong_buffer",
                b,
                f"at most generation.max_new_tokens={max_new_tokens} (0 turns the penalty off)",
            )
        pen = self.overlong_penalty
        e.expect(
            isinstance(pen, (int, float)) and math.isfinite(pen) and pen >= 0,
            f"{prefix}.overlong_penalty",
            pen,
            "a finite number >= 0",
        )
        return e


def estimator_line(p: PPOConfig, critic_free: bool, server_critic: bool) -> str:
    """The console line that says which advantage estimator a run uses (``server_critic``: the
    server holds a critic)."""
    what = {
        "gae": f"gae (the critic's values, lambda {p.lam}{', whitened' if p.whiten_advantages else ''})",
        "grpo": f"grpo ({'std-normalised' if p.grpo_std_norm else 'not std-normalised: Dr. GRPO'})",
        "rloo": "rloo (leave-one-out baseline)",
        "reinforce_pp": f"reinforce_pp (returns-to-go, gamma {p.gamma}, whitened over the batch)",
    }[p.advantage]
    line = f"ppo: advantage estimator {what}, {p.samples_per_prompt} sample(s) per prompt"
    if critic_free:
        line += "; critic-free: no critic values used, no critic_train sent"
        if server_critic:
            line += " (this server holds a critic it will not use: start it with mode=reward_only)"
    elif p.critic_warmup_steps:
        line += f"; critic warm-up: the policy waits for the first {p.critic_warmup_steps} step(s)"
    return line
