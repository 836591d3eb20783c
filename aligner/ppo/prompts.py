"""The actor's prompts: reading a prompt file, and the seeded order in which steps draw them.

Each step takes ``ppo.global_batch_size`` prompts from epochs over a fixed list, reshuffled per
epoch with the run's seed; the position is part of a checkpoint, so a resumed run draws the
prompts the uninterrupted run would have. Every data-parallel rank keeps its share of the step's
prompts: a contiguous slice, or, given the prompts' token counts (``data.balance_dp``), a share
dealt so that every rank gets the same mix of lengths: the step's prompts sorted longest first
and dealt in a snake order (0, 1, ..., n-1, n-1, ..., 0, ...): the simplest form of the
sequence-length balancing that verl (a Karmarkar-Karp partition) does across its ranks. The slowest rank sets every step's pace, and a rank that drew the long
prompts generates, scores and trains on more tokens than the others.
"""

from __future__ import annotations

import json
import random

from aligner.models.config import ConfigError
from aligner.tokenizers import Tokenizer

__all__ = ["PromptSampler", "load_prompts"]


class PromptSampler:
    """Epochs over a fixed prompt list in a seeded order; each step takes ``global_batch``
    prompts and this rank keeps its share: contiguous, or balanced by ``lengths`` (each
    prompt's token count) when given. Its position is a small dict (resume)."""

    def __init__(
        self,
        prompts: list[str],
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        lengths: list[int] | None = None,
    ) -> None:
        if len(prompts) < global_batch:
            raise ValueError(f"{len(prompts)} prompts is fewer than ppo.global_batch_size ({global_batch})")
        if lengths is not None and len(lengths) != len(prompts):
            raise ValueError(f"lengths: {len(lengths)} token counts for {len(prompts)} prompts")
        self.lengths = lengths
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
        return [self.prompts[i] for i in self.share(ids)]

    def share(self, ids: list[int]) -> list[int]:
        """This rank's prompt ids of a step's ``ids``: a contiguous slice, or (with ``lengths``)
        every ``dp_size``-th id of the step sorted longest first, in snake order."""
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
    """Read a JSONL prompt file, checking every line; errors name the line and the problem."""
    prompts: list[str] = []
    errors: list[str] = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as ex:
                errors.append(f"{path}:{i}: not valid JSON ({ex.msg})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                errors.append(
                    f'{path}:{i}: expected an object with a non-empty string "prompt", got {line.strip()[:80]}'
                )
                continue
            try:
                n = len(tokenizer.encode(obj["prompt"]))
            except ValueError as ex:
                errors.append(f"{path}:{i}: {ex}")
                continue
            if n > max_prompt_tokens:
                errors.append(
                    f"{path}:{i}: prompt has {n} tokens, more than the {max_prompt_tokens} that fit "
                    "(model.max_seq_len - generation.max_new_tokens)"
                )
                continue
            prompts.append(obj["prompt"])
            if len(errors) >= 20:
                break
    if errors:
        raise ConfigError("bad prompt file:\n  " + "\n  ".join(errors))
    if not prompts:
        raise ConfigError(
            f'data.prompt_file={path!r} holds no prompts: expected JSONL lines like {{"prompt": "..."}}'
        )
    return prompts
