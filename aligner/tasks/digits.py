"""Digit-sequence tasks: copy, reverse and sort a sequence of digits.

A prompt is ``"<digits>:"`` (e.g. ``"3141:"``) and the expected response is the transformed
digits followed by end-of-sequence (``"1134"`` for sort). The reward is the fraction of
positions that match the target, with a response of the wrong length counted against its
longer side, so it lies in [0, 1] and rewards partial progress (a dense signal a tiny random
policy can climb).

Reward functions follow trlx's ``reward_fn`` convention: decoded prompts and responses (and
the token ids) in, one float per sample out. The server names them by import path, e.g.
``aligner.tasks.digits:sort_reward``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "DigitTask",
    "TASKS",
    "get_task",
    "match_score",
    "copy_reward",
    "reverse_reward",
    "sort_reward",
]


def match_score(response: str, target: str) -> float:
    """Fraction of the positions of the longer of (response, target) where both agree."""
    n = max(len(response), len(target))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, target)) / n


def _split_prompt(prompt: str) -> str:
    digits, sep, _ = prompt.partition(":")
    if not sep:
        raise ValueError(f"prompt {prompt!r} has no ':' separator: expected '<digits>:'")
    return digits


def _transform(kind: str, digits: str) -> str:
    if kind == "copy":
        return digits
    if kind == "reverse":
        return digits[::-1]
    if kind == "sort":
        return "".join(sorted(digits))
    raise ValueError(f"task {kind!r}: expected one of {sorted(TASKS)}")


def _reward_fn(kind: str) -> Callable[..., list[float]]:
    def reward(
        prompts: Sequence[str], responses: Sequence[str], prompt_ids=None, response_ids=None, **_: object
    ) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [match_score(r, _transform(kind, _split_prompt(p))) for p, r in zip(prompts, responses)]

    reward.__name__ = f"{kind}_reward"
    reward.__doc__ = f"Reward for the {kind} task: fraction of positions matching the target, in [0, 1]."
    return reward


copy_reward = _reward_fn("copy")
reverse_reward = _reward_fn("reverse")
sort_reward = _reward_fn("sort")


@dataclass(frozen=True)
class DigitTask:
    """A digit task: its prompts, its reward and the score of a uniformly random response."""

    name: str
    num_digits: int = 4

    @property
    def reward_fn_path(self) -> str:
        return f"aligner.tasks.digits:{self.name}_reward"

    def reward(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return _reward_fn(self.name)(prompts, responses)

    def target(self, prompt: str) -> str:
        return _transform(self.name, _split_prompt(prompt))

    def prompts(self, n: int, seed: int) -> list[str]:
        """``n`` prompts drawn with their own RNG (independent of torch's global state)."""
        rng = random.Random(seed)
        return ["".join(rng.choice("0123456789") for _ in range(self.num_digits)) + ":" for _ in range(n)]

    @property
    def chance(self) -> float:
        """Expected score of a response of the right length with uniformly random digits."""
        return 0.1

    @property
    def max_response_tokens(self) -> int:
        return self.num_digits + 1  # digits + end-of-sequence


TASKS = ("copy", "reverse", "sort")


def get_task(name: str, num_digits: int = 4) -> DigitTask:
    if name not in TASKS:
        raise ValueError(f"task={name!r}: expected one of {list(TASKS)}")
    if not isinstance(num_digits, int) or num_digits < 1:
        raise ValueError(f"num_digits={num_digits!r}: expected a positive integer")
    return DigitTask(name, num_digits)
