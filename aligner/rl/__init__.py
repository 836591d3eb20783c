"""The RL maths both roles share, as pure functions: masked statistics, log-probs, KL and
rewards, advantages, losses.

Everything here takes plain tensors and floats and returns tensors: no configs, no global
state. Collectives appear only in functions that take an explicit ``group`` argument (a
``torch.distributed`` process group, or ``None`` meaning "no reduction", in which case the
function is exactly its single-process counterpart).

The topics live in their own modules (:mod:`~aligner.rl.stats`, :mod:`~aligner.rl.logprobs`,
:mod:`~aligner.rl.rewards`, :mod:`~aligner.rl.advantages`, :mod:`~aligner.rl.losses`); every
public name is importable from ``aligner.rl`` itself. The actor's trainer and the critic
service both import this package; it imports neither (nor configs, nor process set-up).

Shape notation used in the docstrings: ``b`` batch, ``s`` padded sequence length, ``v``
vocabulary (the local shard under tensor parallelism).

Tensor conventions (fixed for the project)
------------------------------------------
A sample is prompt + response tokens, right-padded to ``s``. Per-token arrays (log-probs,
reference log-probs, values, rewards, advantages, returns, mask) have length ``s-1``:
element ``t`` describes the transition that emits token ``t+1`` (the log-prob of token
``t+1`` given tokens ``0..t``; the value of the state ``0..t``). The response mask is 1 for
``t`` in ``[prompt_len-1, length-1)`` and 0 elsewhere. A sample's score is added at its last
response transition (``length-2``); every response transition gets ``-beta * kl_t``.

All arithmetic is float32 (inputs are cast with ``.float()``, since logits are often bf16).
Masks may be bool or float; they are treated as 0/1 weights.

References
----------
- [PPO] Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation".
- [Ziegler] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
  (per-token KL penalty, adaptive KL controller).
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case Study on
  TL;DR Summarization" (masked whitening, score at the EOS token, missing-EOS penalty,
  value clipping, approxkl statistic, running reward normalisation).
- [KL-blog] J. Schulman 2020, "Approximating KL Divergence" (k1 / k3 estimators).
- [Dual-clip] Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning" (dual-clip PPO).
- [DAPO] Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
  (decoupled, asymmetric "clip-higher" range; overlong filtering and soft overlong punishment;
  dynamic sampling).
- [VAPO] Yue et al. 2025, "VAPO" / NeMo-RL (separate GAE lambda for the value targets).
- [Megatron] Shoeybi et al. 2019, "Megatron-LM" (vocab-parallel softmax / cross entropy).
- [GRPO] Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models" (group relative policy optimisation: advantages within a prompt's group).
- [Dr-GRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (GRPO without the division by the group's standard deviation).
- [RLOO] Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs" (REINFORCE with a leave-one-out baseline).
- [REINFORCE++] Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
  Language Models" (token-level KL-shaped returns, global batch baseline and whitening).
- [TIS] Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (truncated importance sampling between the sampling engine's and the trainer's
  log-probs).
- [Decoupled] Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
  for Language Reasoning" (decoupled PPO: the clipped ratio against a proximal policy, an
  importance weight against the behaviour policy).
- [Chan] Chan, Golub, LeVeque 1979, "Updating Formulae and a Pairwise Algorithm for
  Computing Sample Variances" (parallel merge of running moments).
"""

from aligner.rl.advantages import (
    CRITIC_FREE_ESTIMATORS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_gae,
    group_score_std,
    grpo_advantages,
    reinforce_pp_advantages,
    returns_to_go,
    rloo_advantages,
)
from aligner.rl.logprobs import (
    entropy_from_logits,
    gather_logprobs,
    sequence_logprobs,
)
from aligner.rl.losses import (
    AGG_MODES,
    aggregate,
    explained_variance,
    loss_normaliser,
    policy_loss,
    policy_stat_sums,
    policy_stats_from_sums,
    value_loss,
)
from aligner.rl.rewards import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    apply_missing_eos_penalty,
    clip_scores,
    kl_penalty,
    overlong_filter,
    overlong_penalty,
    shaped_rewards,
)
from aligner.rl.stats import (
    LOG_RATIO_CLAMP,
    all_reduce_max,
    all_reduce_sum,
    global_masked_mean,
    global_masked_var,
    global_whiten,
    loss_start,
    masked_mean,
    masked_sum,
    masked_var,
    response_mask,
    safe_div,
    whiten,
)

__all__ = [
    "AGG_MODES",
    "CRITIC_FREE_ESTIMATORS",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "RunningMoments",
    "aggregate",
    "all_reduce_max",
    "all_reduce_sum",
    "apply_missing_eos_penalty",
    "clip_scores",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "gather_logprobs",
    "group_score_std",
    "grpo_advantages",
    "global_masked_mean",
    "global_masked_var",
    "global_whiten",
    "kl_penalty",
    "loss_normaliser",
    "loss_start",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "overlong_filter",
    "overlong_penalty",
    "policy_loss",
    "policy_stat_sums",
    "policy_stats_from_sums",
    "reinforce_pp_advantages",
    "response_mask",
    "returns_to_go",
    "rloo_advantages",
    "safe_div",
    "sequence_logprobs",
    "shaped_rewards",
    "value_loss",
    "whiten",
]
