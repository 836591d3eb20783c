"""IMDB review openings as a prompt file, as trlx's and TRL's sentiment examples make them: the
first few tokens of each review (a random length from --min-tokens to --max-tokens, TRL's
LengthSampler) become a prompt the policy continues.

    python examples/sentiment/prepare_imdb.py data/imdb_prompts.jsonl --tokenizer models/gpt2
    python examples/sentiment/prepare_imdb.py data/imdb_test.jsonl --split test --limit 256

writes one ``{"prompt": ...}`` line per review (``--with-label`` adds IMDB's ``label``, 1 =
positive, which then reaches the reward function as a column). ``--dataset`` is a hub name (the
default, ``imdb``, needs the network once; ``datasets`` caches it), a folder written by
``save_to_disk``, or a local .jsonl/.json/.csv/.parquet file with a ``text`` column. With
``--tokenizer`` (a HF tokenizer folder: the policy's) lengths count that tokenizer's tokens;
without, whitespace-separated words.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Any

__all__ = ["review_opening", "load_reviews", "prepare"]

_TAG = re.compile(r"<br\s*/?>|<[^>]{0,20}>")


def clean(text: str) -> str:
    """A review without its HTML line breaks and tags, on one line."""
    return " ".join(_TAG.sub(" ", text).split())


def review_opening(text: str, n: int, tokenizer: Any = None) -> str:
    """The first ``n`` tokens of ``text`` (cleaned): ``tokenizer``'s tokens when given (decoded
    back to text), else whitespace-separated words."""
    if n < 1:
        raise ValueError(f"n={n}: expected at least one token")
    text = clean(text)
    if tokenizer is None:
        return " ".join(text.split()[:n])
    ids = tokenizer.encode(text, add_special_tokens=False)[:n]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def load_reviews(dataset: str, split: str, text_column: str = "text") -> Any:
    """The ``split`` of ``dataset`` (a hub name, a ``save_to_disk`` folder or a data file) as a
    ``datasets.Dataset`` with a ``text_column``."""
    try:
        import datasets
    except ImportError as err:
        raise SystemExit("prepare_imdb.py needs the datasets package: pip install datasets") from err
    formats = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    suffix = os.path.splitext(dataset)[1].lower()
    if os.path.isdir(dataset):
        loaded = datasets.load_from_disk(dataset)
        ds = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    elif os.path.isfile(dataset) and suffix in formats:
        ds = datasets.load_dataset(formats[suffix], data_files={split: dataset}, split=split)
    else:
        ds = datasets.load_dataset(dataset, split=split)
    if text_column not in ds.column_names:
        raise ValueError(
            f"{dataset} ({split}) has no column {text_column!r}: its columns are {ds.column_names}"
        )
    return ds


def prepare(
    out: str,
    *,
    dataset: str = "imdb",
    split: str = "train",
    min_tokens: int = 2,
    max_tokens: int = 8,
    tokenizer: str | None = None,
    limit: int | None = None,
    with_label: bool = False,
    seed: int = 0,
) -> int:
    """Write the prompt file ``out`` from the reviews of ``dataset``; the number of prompts."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"min_tokens={min_tokens}, max_tokens={max_tokens}: expected 1 <= min <= max")
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    ds = load_reviews(dataset, split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    n = 0
    with open(out, "w") as f:
        for row in ds:
            prompt = review_opening(row["text"], rng.randint(min_tokens, max_tokens), tok)
            if not prompt:
                continue
            line: dict[str, Any] = {"prompt": prompt}
            if with_label and "label" in row:
                line["label"] = int(row["label"])
            f.write(json.dumps(line) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the prompt file (JSONL) to write")
    ap.add_argument("--dataset", default="imdb", help="hub name, save_to_disk folder or data file")
    ap.add_argument("--split", default="train")
    ap.add_argument("--min-tokens", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder to count tokens with")
    ap.add_argument("--limit", type=int, default=None, help="use the first N reviews only")
    ap.add_argument("--with-label", action="store_true", help="keep IMDB's label column")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = prepare(
        a.out,
        dataset=a.dataset,
        split=a.split,
        min_tokens=a.min_tokens,
        max_tokens=a.max_tokens,
        tokenizer=a.tokenizer,
        limit=a.limit,
        with_label=a.with_label,
        seed=a.seed,
    )
    print(f"{n} prompts written to {a.out}")


if __name__ == "__main__":
    main()
