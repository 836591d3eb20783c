"""A verifiable reward for GSM8K-style maths: the response's final number against the data set's
answer.

GSM8K (``openai/gsm8k``, configuration ``main``) has two columns: ``question`` and ``answer``,
the worked solution ending in ``#### <number>`` (``"... so she makes 9 * 2 = $18.\\n#### 18"``).
The actor sends the ``answer`` column with each prompt (``data.extra_columns=[answer]``); the
server calls :func:`gsm8k_reward` with it as the keyword argument ``answer``, a list over the
batch (this project's convention, ``fn(prompts, responses, **kwargs)``):

    aligner-serve-critic reward.fn=aligner.tasks.gsm8k:gsm8k_reward ...
    aligner-serve-critic ... +reward.fn_kwargs.format_reward=0.1 +reward.fn_kwargs.strict=true

A response's answer is the first number after its last ``####`` (the format the prompt asks
for, as verl's GSM8K reward reads it), else, unless ``strict``, the last number it writes. Numbers
compare by value: ``1,234``, ``$18``, ``18.00`` and ``-3`` read as 1234, 18, 18 and -3. A
response scores 1.0 when its answer equals the reference, ``format_reward`` (0.0 unless set)
when it gives another number, and 0.0 when it gives none. The presets
``+recipe=gsm8k_ppo_qwen2.5_0.5b`` and ``+recipe=grpo_lora_qwen2.5_1.5b`` use it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["extract_answer", "reference_answer", "score", "gsm8k_reward"]

# A number: thousands separators (1,234) or none (-7, 81), an optional decimal part (3.5; the
# full stop that ends a sentence is no decimal part).
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_MARK = "####"


def _value(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def extract_answer(text: str, strict: bool = False) -> Decimal | None:
    """The number a response gives as its answer: the first number after its last ``####``,
    else (unless ``strict``) the last number in it; None when there is none.

    >>> extract_answer("3 + 4 = 7, so #### 7")
    Decimal('7')
    >>> extract_answer("She pays $1,234.50 in total.")
    Decimal('1234.50')
    """
    _, mark, tail = text.rpartition(_MARK)
    if mark:
        found = _NUMBER.search(tail)
        if found:
            return _value(found.group())
    if strict:
        return None
    found = _NUMBER.findall(text)
    return _value(found[-1]) if found else None


def reference_answer(answer: Any, where: str = "answer") -> Decimal:
    """The reference number of a data set's answer: the number after the last ``####`` of a GSM8K
    solution, or the value itself (``72``, ``"72"``, ``"1,234"``).

    Raises:
        ValueError: naming ``where`` when no number can be read."""
    if isinstance(answer, bool):
        raise ValueError(f"{where}={answer!r}: expected a number or a solution ending in '#### <number>'")
    if isinstance(answer, (int, float)):
        return Decimal(str(answer))
    text = str(answer)
    _, mark, tail = text.rpartition(_MARK)
    candidate = (tail if mark else text).strip().replace("$", "")
    found = _NUMBER.fullmatch(candidate) or (_NUMBER.match(candidate) if mark else None)
    if found is None:
        raise ValueError(f"{where}={answer!r}: expected a number or a solution ending in '#### <number>'")
    try:
        return _value(found.group())
    except InvalidOperation:  # pragma: no cover - the pattern reads only numbers
        raise ValueError(f"{where}={answer!r}: not a number") from None


def score(response: str, answer: Any, format_reward: float = 0.0, strict: bool = False) -> float:
    """1.0 when the response's answer (:func:`extract_answer`) equals the reference
    (:func:`reference_answer`), ``format_reward`` when it is another number, 0.0 when none."""
    return _score(extract_answer(response, strict=strict), reference_answer(answer), format_reward)


def _score(got: Decimal | None, want: Decimal, format_reward: float) -> float:
    if got is None:
        return 0.0
    return 1.0 if got == want else float(format_reward)


def gsm8k_reward(
    prompts: Sequence[str],
    responses: Sequence[str],
    answer: Sequence[Any],
    format_reward: float = 0.0,
    strict: bool = False,
    **kwargs: Any,
) -> list[float]:
    """This project's convention: one reward per response, :func:`score` of each against its
    row's ``answer`` column. Other keyword arguments (token ids, other columns) are ignored."""
    if len(answer) != len(responses):
        raise ValueError(
            f"answer has {len(answer)} values for {len(responses)} responses: expected one per response"
        )
    wants = [reference_answer(a, f"answer[{i}]") for i, a in enumerate(answer)]
    return [
        _score(extract_answer(text, strict=strict), want, format_reward)
        for text, want in zip(responses, wants)
    ]
