"""Validation: greedy responses to the fixed evaluation prompts, scored by the server, with the
policy's KL to the reference (the trainer's step 8). ``trainer``: the
:class:`~aligner.actor.trainer.PPOTrainer` whose engine, critic link and models it uses."""

from __future__ import annotations

from typing import Any

import torch

from aligner import rl
from aligner.actor.rollout import global_mean
from aligner.generation.engine import GenerationOutput
from aligner.metrics import Timers

__all__ = ["sample_rows", "validate"]


def validate(trainer: Any, step: int) -> dict[str, float]:
    """Greedy responses to the fixed evaluation prompts, scored by the server: ``validation/scores``,
    ``validation/kl`` (summed over the response, policy vs reference), ``validation/response_length``; a
    samples table goes to the logger. Changes no training state and draws no randomness."""
    timed = Timers()
    with timed("validation"):
        trainer._refit_engine()
        trainer._wait_before_generating()
        gen = trainer._generate(trainer.val_prompts, trainer.cfg.generation.sampling(greedy=True, seed=0))
        tokens = gen.tokens
        mask = rl.response_mask(gen.lengths, gen.prompt_lengths, tokens.shape[1])
        inputs = trainer._reward_inputs(gen, trainer.val_extras, trainer.val_prompts)
        future = trainer.critic.infer(tokens, gen.lengths, gen.prompt_lengths, step, **inputs)
        start = rl.loss_start(mask)
        if trainer.reference is not None:
            trainer.reference.prefetch()  # an offloaded reference's copy runs under the policy's forward
        logprobs, _ = trainer._no_grad(trainer.policy, gen, start=start)
        if trainer.reference is not None:
            kl = ((logprobs - trainer._reference_logprobs(gen, start)) * mask).sum(1)
        else:
            kl = torch.zeros(tokens.shape[0], device=tokens.device)
        _, scores = trainer.critic.result(future, tokens.shape)
        trainer.logger.samples(step, sample_rows(trainer, gen, scores))
        metrics = {  # means over every data-parallel rank's prompts
            key: float(global_mean(x, None, trainer._dp_group))
            for key, x in (
                ("validation/scores", scores),
                ("validation/kl", kl),
                ("validation/response_length", gen.response_lengths.float()),
            )
        }
    if trainer.reference is not None:
        trainer.reference.take_seconds()  # inside timers/validation: the step's own copy is reported alone
    return {**metrics, **timed.seconds}


def sample_rows(trainer: Any, gen: GenerationOutput, scores: torch.Tensor) -> list[dict[str, Any]]:
    """The first ``validation.num_samples`` prompts, responses and scores, for the samples table."""
    rows = []
    for i in range(min(trainer.cfg.validation.num_samples, gen.tokens.shape[0])):
        pl, ln = int(gen.prompt_lengths[i]), int(gen.lengths[i])
        response = trainer.tokenizer.decode(gen.tokens[i, pl:ln].tolist())
        rows.append({"prompt": trainer.val_prompts[i], "response": response, "score": float(scores[i])})
    return rows
