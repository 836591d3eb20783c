"""The actor's log-probabilities and entropies, from its models' logits over this rank's
vocabulary shard.

The arithmetic is :mod:`aligner.rl.logprobs` (vocab-parallel under tensor parallelism: each
TP rank holds the logit columns ``[vocab_start, vocab_start + v)`` and only ``[b, s]``
quantities are reduced over the TP group). What this module adds is what the actor's models and
tokenizer make of it:

- the logit columns the engine never samples (Megatron's vocabulary padding for TP, and a
  tokenizer's pad id kept out of the action space) are masked out of the training softmax, or
  training log-probs would differ from generation's;
- positions before the first one any loss reads (``start``, :func:`aligner.rl.loss_start`) are
  not computed, and read as 0;
- the rollout's no-grad forwards run in micro-batches.

Shapes: ``b`` batch, ``s`` padded length, ``v`` vocabulary (this rank's shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from aligner import rl
from aligner.actor.config import ActorConfig
from aligner.distributed import ParallelState
from aligner.models import forward
from aligner.tokenizers import Tokenizer

__all__ = ["PolicyLogprobs"]


@dataclass(frozen=True)
class PolicyLogprobs:
    """Log-probs and entropies of the sampling distribution, from this rank's logit columns."""

    temperature: float
    """The sampling temperature: logits are divided by it as the sampler divides them."""
    group: Any = None
    """The tensor-parallel group the vocabulary is sharded over; None at TP=1."""
    vocab_start: int = 0
    """First vocabulary id of this rank's logit columns."""
    pad_from: int | None = None
    """First of this rank's logit columns that is no action (every later one is none either);
    None when every column of the padded vocabulary is an action."""
    actions: int | None = None
    """Token ids at or above this are never sampled (set whenever ``pad_from`` is)."""

    @classmethod
    def for_actor(cls, cfg: ActorConfig, state: ParallelState, tokenizer: Tokenizer) -> PolicyLogprobs:
        """This rank's shard of the policy's vocabulary, and the tokenizer's action space."""
        padded = cfg.model.padded_vocab_size(state.tp_size)
        local = padded // state.tp_size
        start = state.tp_rank * local
        actions = min(tokenizer.sample_vocab_size, cfg.model.vocab_size)
        return cls(
            temperature=cfg.generation.temperature,
            group=state.tp_group if state.tp_size > 1 else None,
            vocab_start=start,
            pad_from=max(0, min(local, actions - start)) if padded > actions else None,
            actions=actions,
        )

    def logits(self, model: torch.nn.Module, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The model's masked logits ``[b, s - start, v]`` for ``tokens [b, s]`` (positions
        ``start..s-1``), with gradients when enabled."""
        return self.masked(forward.policy_logits(model, tokens, start))

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., v]`` logits with the columns that are no action set to -inf."""
        if self.pad_from is None:
            return logits
        # A shard with no action column at all gets a large finite negative instead of -inf, so
        # its local max and sums stay finite (its exp terms vanish in the global normaliser).
        fill = float("-inf") if self.pad_from > 0 else -1e30
        columns = torch.arange(self.pad_from, logits.shape[-1], device=logits.device)
        return logits.index_fill(-1, columns, fill)

    def sequence_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """logits ``[b, s - start, v]`` (masked; positions ``start..s-1``), tokens ``[b, s]`` ->
        ``[b, s-1]``; 0 before ``start`` and where the target is padding (a never-sampled id
        whose log-prob is -inf; those positions are outside every mask)."""
        lp = rl.sequence_logprobs(
            logits, tokens[:, start:], self.temperature, group=self.group, vocab_start=self.vocab_start
        )
        if start:
            lp = F.pad(lp, (start, 0))
        if self.pad_from is None:
            return lp
        return lp.masked_fill(tokens[:, 1:] >= self.actions, 0.0)

    def entropy(self, logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        """logits ``[b, s - start, v]`` (positions ``start..s-1``) -> entropy ``[b, s-1]`` of the
        sampling distribution at the positions that predict a next token; 0 before ``start``."""
        ent = rl.entropy_from_logits(logits[:, :-1], self.temperature, group=self.group)
        return F.pad(ent, (start, 0)) if start else ent

    def no_grad(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        micro_batch_size: int,
        *,
        with_entropy: bool = False,
        start: int = 0,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[b, s-1]`` (and entropy ``[b, s-1]``) of ``tokens [b, s]`` from the
        training forward in eval mode (dropout off: these are the "old" log-probs of the PPO
        ratio), in micro-batches, without gradient; 0 before ``start``.

        Given the rows' ``lengths [b]``, each micro-batch runs only up to its longest row (right
        padding is never attended to by a real position, so the real positions' values are the
        same up to float rounding: the matrix shapes differ) and reads 0 after it: rows sorted by length, as each data-parallel rank's balanced
        share of prompts is, then cost what their tokens cost rather than the batch's longest."""
        was_training = model.training
        model.eval()
        out_lp, out_ent = [], []
        s = tokens.shape[1]
        with torch.no_grad():
            for i in range(0, tokens.shape[0], micro_batch_size):
                rows = tokens[i : i + micro_batch_size]
                if lengths is not None:
                    n = max(int(lengths[i : i + micro_batch_size].max()), start + 1)
                    rows = rows[:, :n]
                logits = self.logits(model, rows, start)
                lp = self.sequence_logprobs(logits, rows, start)
                out_lp.append(F.pad(lp, (0, s - rows.shape[1])))
                if with_entropy:
                    out_ent.append(F.pad(self.entropy(logits, start), (0, s - rows.shape[1])))
        model.train(was_training)
        return torch.cat(out_lp), (torch.cat(out_ent) if with_entropy else None)
