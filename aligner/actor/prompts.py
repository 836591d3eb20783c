"""The actor's prompts: the seeded order in which steps draw them (reading them:
:mod:`aligner.actor.datasets`).

Each step takes ``ppo.global_batch_size / ppo.samples_per_prompt`` prompts from epochs over a
fixed list, reshuffled per epoch with the run's seed; the position (in prompts) is part of a
checkpoint, so a resumed run draws the prompts the uninterrupted run would have. With
``samples_per_prompt = n > 1`` each drawn prompt becomes a group of ``n`` adjacent copies on one
data-parallel rank (whole groups are dealt, never split), which the engine samples with distinct
random streams (one per row) and the group estimators compare (:mod:`aligner.rl.advantages`:
groups are contiguous blocks of ``n`` rows). Every data-parallel rank keeps its share of the step's
prompts: a contiguous slice, or, given the prompts' token counts (``data.balance_dp``), a share
dealt so that every rank gets the same mix of lengths: the step's prompts sorted longest first
and dealt in a snake order (0, 1, ..., n-1, n-1, ..., 0, ...): the simplest form of the
sequence-length balancing that verl (a Karmarkar-Karp partition) does across its ranks. The slowest rank sets every step's pace, and a rank that drew the long
prompts generates, scores and trains on more tokens than the others. Each prompt's extras (its
row's other columns, a JSON string for the reward function) go wherever the prompt goes, copied
with it.
"""

from __future__ import annotations

import random

from aligner.actor.datasets import load_prompt_set
from aligner.tokenizers import Tokenizer

__all__ = ["PromptSampler", "load_prompts"]


class PromptSampler:
    """Epochs over a fixed prompt list in a seeded order; each step takes ``global_batch /
    samples_per_prompt`` prompts (``global_batch`` counts samples) and this rank keeps its share:
    contiguous, or balanced by ``lengths`` (each prompt's token count) when given; each prompt
    then comes ``samples_per_prompt`` times in a row. ``extras`` (one JSON string per prompt, or
    None) travel with the prompts (:meth:`next_rows`). Its position is a small dict (resume)."""

    def __init__(
        self,
        prompts: list[str],
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        lengths: list[int] | None = None,
        extras: list[str] | None = None,
        samples_per_prompt: int = 1,
    ) -> None:
        """``samples_per_prompt``: the default of :meth:`next_rows` (``ppo.samples_per_prompt``)."""
        self.samples_per_prompt = samples_per_prompt
        per_step = global_batch // max(samples_per_prompt, 1)
        if len(prompts) < per_step:
            groups = (
                f" / ppo.samples_per_prompt ({samples_per_prompt}) prompts" if samples_per_prompt > 1 else ""
            )
            raise ValueError(
                f"{len(prompts)} prompts is fewer than ppo.global_batch_size ({global_batch}){groups}"
            )
        if lengths is not None and len(lengths) != len(prompts):
            raise ValueError(f"lengths: {len(lengths)} token counts for {len(prompts)} prompts")
        if extras is not None and len(extras) != len(prompts):
            raise ValueError(f"extras: {len(extras)} extras for {len(prompts)} prompts")
        self.lengths, self.extras = lengths, extras
        self.prompts, self.global_batch = prompts, global_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_ids(self, samples_per_prompt: int | None = None) -> list[int]:
        """This rank's prompt ids of the next step, each ``samples_per_prompt`` times in a row
        (advancing the position by the step's prompts)."""
        n = self.samples_per_prompt if samples_per_prompt is None else samples_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or self.global_batch % (n * self.dp_size):
            raise ValueError(
                f"samples_per_prompt={n!r}: expected an integer >= 1 that divides the {self.global_batch} "
                f"samples of a step into whole groups on each of the {self.dp_size} data-parallel rank(s)"
            )
        count = self.global_batch // n
        if count > len(self._order):
            raise ValueError(f"{len(self._order)} prompts is fewer than the {count} prompts of a step")
        if self.index + count > len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        ids = self._order[self.index : self.index + count]
        self.index += count
        return [i for i in self.share(ids) for _ in range(n)]

    def next_batch(self, samples_per_prompt: int | None = None) -> list[str]:
        """This rank's prompts of the next step (each ``samples_per_prompt`` times in a row;
        default: the constructor's)."""
        return [self.prompts[i] for i in self._next_ids(samples_per_prompt)]

    def next_rows(self, samples_per_prompt: int | None = None) -> tuple[list[str], list[str] | None]:
        """This rank's prompts of the next step and their extras, in the same order (None when
        the sampler has none); draws the same prompts as :meth:`next_batch` would. Each prompt
        (and its extras) comes ``samples_per_prompt`` times in a row (default: the
        constructor's), a group that stays whole on this rank."""
        ids = self._next_ids(samples_per_prompt)
        extras = None if self.extras is None else [self.extras[i] for i in ids]
        return [self.prompts[i] for i in ids], extras

    def share(self, ids: list[int]) -> list[int]:
        """This rank's prompt ids of a step's ``ids`` (distinct prompts: groups are made after
        dealing, so they are never split): a contiguous slice, or (with ``lengths``) every
        ``dp_size``-th id of the step sorted longest first, in snake order."""
        n, r = self.dp_size, self.dp_rank
        if self.lengths is None or n == 1:
            per = len(ids) // n
            return ids[r * per : (r + 1) * per]
        ranked = sorted(ids, key=lambda i: -self.lengths[i])  # stable: ties keep the drawn order
        return [i for k, i in enumerate(ranked) if (k % n if (k // n) % 2 == 0 else n - 1 - k % n) == r]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.epoch, self.index = int(d["epoch"]), int(d["index"])
        self._order = self._permutation(self.epoch)


def load_prompts(path: str, tokenizer: Tokenizer, max_prompt_tokens: int) -> list[str]:
    """The prompts of a JSONL prompt file (``{"prompt": ...}`` lines): errors name the line and
    the problem; prompts longer than ``max_prompt_tokens`` are dropped (an error when all are).
    :func:`aligner.actor.datasets.load_prompt_set` reads it, and tells what it kept."""
    return load_prompt_set(path, tokenizer, max_prompt_tokens, key="data.prompt_file", jsonl=True).prompts
