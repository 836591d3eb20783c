"""A verifiable reward for arithmetic: the last integer of each response against the row's
``answer`` column.

The critic server calls it in trlx's convention (its first parameter is ``samples``); the data
set's ``answer`` column arrives as the keyword argument ``answer``, a list over the batch:

    python servers/serve_critic.py reward.python_path=[examples/arithmetic] reward.fn=reward:reward_fn ...
    python servers/serve_critic.py ... 'reward.fn_kwargs={format_reward: 0.1}'     # and a format reward

A response scores 1.0 when its last integer equals the answer, ``format_reward`` (0.0 unless set)
when it holds an integer that is wrong, and 0.0 when it holds none.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["reward_fn", "last_integer", "score"]

# An integer with thousands separators (1,234) or without (-7, 81).
_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` ("... so 3 + 4 = 7." -> 7; "1,234" -> 1234; "-5" -> -5),
    or None when there is none."""
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def _answer(value: Any, where: str = "answer") -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(str(value).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"{where}={value!r}: expected an integer (the answer column)") from None


def score(output: str, answer: Any, format_reward: float = 0.0) -> float:
    """1.0 when the last integer of ``output`` is ``answer``; ``format_reward`` when it is another
    integer; 0.0 when ``output`` has no integer."""
    got = last_integer(output)
    if got is None:
        return 0.0
    return 1.0 if got == _answer(answer) else float(format_reward)


def reward_fn(
    samples: list[str],
    prompts: list[str],
    outputs: list[str],
    answer: list[Any],
    format_reward: float = 0.0,
    **kwargs: Any,
) -> list[float]:
    """trlx's convention: one reward per sample, :func:`score` of each output against its row's
    answer. Other keyword arguments (token ids, other columns) are ignored."""
    if len(answer) != len(outputs):
        raise ValueError(
            f"answer has {len(answer)} values for {len(outputs)} outputs: expected one per output"
        )
    expected = [_answer(a, f"answer[{i}]") for i, a in enumerate(answer)]
    return [score(text, want, format_reward) for text, want in zip(outputs, expected)]
