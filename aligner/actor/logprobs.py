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
- the rollout's no-grad forwards run in micro-batches: of fixed row counts, or packed
  (:mod:`aligner.models.packing`: rows laid end to end without their padding, in micro-batches
  of consecutive rows under a token budget, ``ppo.max_tokens_per_micro_batch``). The packed
  methods give the padded ``[b, s-1]`` layout back, 0 past each row's last transition.

Shapes: ``b`` batch, ``s`` padded length, ``v`` vocabulary (this rank's shard), ``T`` packed
tokens (``T'`` those at or past ``start`` in their row).
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
from aligner.models.packing import PackedRows, pack, plan_micro_batches
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

    # -- packed rows ----------------------------------------------------------------------------

    def packed_logits(self, model: torch.nn.Module, rows: PackedRows, start: int = 0) -> torch.Tensor:
        """The model's masked logits ``[1, T', v]`` of packed ``rows`` at the positions at or
        past ``start`` in their row (``rows.positions_from(start)``; all ``T`` for 0)."""
        return self.masked(forward.policy_logits_packed(model, rows, start))

    def packed_sequence_logprobs(
        self, logits: torch.Tensor, rows: PackedRows, s: int, start: int = 0
    ) -> torch.Tensor:
        """``logits [1, T', v]`` of :meth:`packed_logits` -> the rows' log-probs ``[n, s-1]`` in
        the padded layout of :meth:`sequence_logprobs`: 0 before ``start`` and past each row's
        last transition."""
        at = rows.positions_from(start)
        targets = rows.next_tokens()
        targets = targets if at is None else targets[:, at]  # [1, T']
        lp = rl.gather_logprobs(
            logits, targets, self.temperature, group=self.group, vocab_start=self.vocab_start
        )
        if self.pad_from is not None:  # as sequence_logprobs: a never-sampled target reads 0
            lp = lp.masked_fill(targets >= self.actions, 0.0)
        return rows.unpack_shifted(lp, s, start=start)

    def packed_entropy(self, logits: torch.Tensor, rows: PackedRows, s: int, start: int = 0) -> torch.Tensor:
        """``logits [1, T', v]`` of :meth:`packed_logits` -> entropy ``[n, s-1]`` of the sampling
        distribution at each transition (padded layout; 0 before ``start`` and past each row's
        last transition)."""
        ent = rl.entropy_from_logits(logits, self.temperature, group=self.group)
        return rows.unpack_shifted(ent, s, start=start)

    def no_grad(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        micro_batch_size: int,
        *,
        with_entropy: bool = False,
        start: int = 0,
        lengths: torch.Tensor | None = None,
        max_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[b, s-1]`` (and entropy ``[b, s-1]``) of ``tokens [b, s]`` from the
        training forward in eval mode (dropout off: these are the "old" log-probs of the PPO
        ratio), in micro-batches, without gradient; 0 before ``start``.

        Given the rows' ``lengths [b]``, each micro-batch runs only up to its longest row (right
        padding is never attended to by a real position, so the real positions' values are the
        same up to float rounding: the matrix shapes differ) and reads 0 after it: rows sorted
        by length, as each data-parallel rank's balanced share of prompts is, then cost what
        their tokens cost rather than the batch's longest. Given ``lengths`` and ``max_tokens``
        too, the rows run packed (:mod:`aligner.models.packing`), in micro-batches of
        consecutive rows of at most ``max_tokens`` real tokens (``micro_batch_size`` unused),
        0 past each row's last transition."""
        if max_tokens is not None and lengths is not None:
            return self._no_grad_packed(model, tokens, lengths, max_tokens, with_entropy, start)
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

    def _no_grad_packed(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        max_tokens: int,
        with_entropy: bool,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`no_grad` over packed micro-batches of at most ``max_tokens`` real tokens."""
        host = lengths.detach().to("cpu", torch.int64)  # one read: plans and packs read the CPU copy
        s = tokens.shape[1]
        was_training = model.training
        model.eval()
        out_lp, out_ent = [], []
        try:
            with torch.no_grad():
                for part in plan_micro_batches(host, max_tokens):
                    rows = pack(tokens[part.to(tokens.device)], host[part])
                    logits = self.packed_logits(model, rows, start)
                    out_lp.append(self.packed_sequence_logprobs(logits, rows, s, start))
                    if with_entropy:
                        out_ent.append(self.packed_entropy(logits, rows, s, start))
        finally:
            model.train(was_training)
        return torch.cat(out_lp), (torch.cat(out_ent) if with_entropy else None)
