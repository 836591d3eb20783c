"""Arithmetic problems with verifiable answers, as a prompt data set: a folder with ``train.jsonl``
and ``test.jsonl`` (the actor reads it with ``data.dataset=<folder> data.val_split=test``), one row
per problem:

    {"prompt": "What is 23 + 58?", "answer": "81"}        --style question (the default)
    {"prompt": "3+4=", "answer": "7"}                      --style compact

    python examples/arithmetic/make_data.py data/arithmetic --digits 2 --num-train 5000 --num-test 500
    python examples/arithmetic/make_data.py data/sums --digits 1 --ops + --style compact \\
        --num-train 90 --num-test 10

Problems are distinct (train and test share none), drawn with a fixed seed; the answer column is
what ``reward.py`` checks each response against.
"""

from __future__ import annotations

import argparse
import itertools
import json
import operator
import os
import random

__all__ = ["make_problems", "write_data", "write_splits", "STYLES", "OPS"]

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operators a problem may use."""
STYLES = ("question", "compact")
"""'question': "What is 23 + 58?"; 'compact': "23+58=" (short prompts for tiny models)."""


def make_problems(
    n: int,
    *,
    digits: int = 2,
    ops: str = "+",
    style: str = "question",
    seed: int = 0,
    max_operand: int | None = None,
) -> list[dict]:
    """``n`` distinct problems ``a <op> b`` with ``digits``-digit operands (one digit: 0-9), or
    operands from 0 to ``max_operand`` when it is given, in an order fixed by ``seed``:
    ``{"prompt": ..., "answer": "<the result>"}``."""
    if style not in STYLES:
        raise ValueError(f"style={style!r}: expected one of {list(STYLES)}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops={ops!r}: expected one or more of {''.join(OPS)!r}")
    if max_operand is not None:
        if not isinstance(max_operand, int) or max_operand < 0:
            raise ValueError(f"max_operand={max_operand!r}: expected an integer >= 0")
        nums = range(max_operand + 1)
        what = f"operands 0-{max_operand}"
    else:
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"digits={digits!r}: expected an integer from 1 to 9")
        nums = range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)
        what = f"{digits}-digit operands"
    total = len(nums) ** 2 * len(set(ops))
    if not isinstance(n, int) or not 0 <= n <= total:
        raise ValueError(f"n={n!r}: expected 0 to {total} (the distinct problems of {what} with {ops!r})")
    rng = random.Random(seed)
    if total <= 200_000:  # small spaces: shuffle them all
        space = list(itertools.product(nums, sorted(set(ops)), nums))
        rng.shuffle(space)
        picked = space[:n]
    else:
        seen: set[tuple[int, str, int]] = set()
        picked = []
        while len(picked) < n:
            p = (rng.choice(nums), rng.choice(sorted(set(ops))), rng.choice(nums))
            if p not in seen:
                seen.add(p)
                picked.append(p)
    rows = []
    for a, op, b in picked:
        prompt = f"What is {a} {op} {b}?" if style == "question" else f"{a}{op}{b}="
        rows.append({"prompt": prompt, "answer": str(OPS[op](a, b))})
    return rows


def write_data(
    out: str,
    *,
    num_train: int,
    num_test: int,
    digits: int = 2,
    ops: str = "+",
    style: str = "question",
    seed: int = 0,
    max_operand: int | None = None,
) -> dict[str, str]:
    """``<out>/train.jsonl`` and ``<out>/test.jsonl`` (none when ``num_test`` is 0) of distinct
    problems; their paths by split."""
    rows = make_problems(
        num_train + num_test, digits=digits, ops=ops, style=style, seed=seed, max_operand=max_operand
    )
    return write_splits(out, {"test": rows[:num_test], "train": rows[num_test:]})


def write_splits(out: str, splits: dict[str, list[dict]]) -> dict[str, str]:
    """``<out>/<split>.jsonl`` for each non-empty split; their paths by split."""
    os.makedirs(out, exist_ok=True)
    paths = {}
    for split, part in splits.items():
        if not part:
            continue
        paths[split] = os.path.join(out, f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for train.jsonl and test.jsonl")
    ap.add_argument("--num-train", type=int, default=5000)
    ap.add_argument("--num-test", type=int, default=500)
    ap.add_argument("--digits", type=int, default=2, help="digits per operand (1: 0-9)")
    ap.add_argument("--max-operand", type=int, default=None, help="operands 0..N instead of --digits")
    ap.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-*'")
    ap.add_argument("--style", default="question", choices=STYLES)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    paths = write_data(
        a.out,
        num_train=a.num_train,
        num_test=a.num_test,
        digits=a.digits,
        ops=a.ops,
        style=a.style,
        seed=a.seed,
        max_operand=a.max_operand,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
