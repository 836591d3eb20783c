"""The sentiment reward: a text classifier's positive-class score of each sample, as in trlx's and
TRL's sentiment examples.

The critic server calls it in trlx's convention (its first parameter is ``samples``), with the
classifier's folder as a constant keyword argument:

    python servers/serve_critic.py reward.python_path=[examples/sentiment] reward.fn=reward:positive_score \\
        'reward.fn_kwargs={classifier: <classifier folder>}' ...

The classifier is a ``transformers`` ``pipeline("text-classification")``, loaded once per
(folder, tokenizer, device) and kept; calls from several threads share it under a lock.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

__all__ = ["positive_score", "classify", "load_classifier"]

OUTPUTS = ("prob", "logit")


@functools.lru_cache(maxsize=8)
def load_classifier(classifier: str, tokenizer: str | None = None, device: str = "auto") -> tuple[Any, Any]:
    """The pipeline of the classifier in folder ``classifier`` (its tokenizer from ``tokenizer``,
    None: the same folder) on ``device`` ('auto': the first GPU if there is one, else the CPU),
    and the lock its callers share. Loaded once per arguments."""
    import torch
    from transformers import pipeline

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    pipe = pipeline("text-classification", model=classifier, tokenizer=tokenizer or classifier, device=device)
    return pipe, threading.Lock()


def positive_label(id2label: dict[int, str], name: str | None = None) -> str:
    """The label of the positive class: ``name`` when given (it must be one of the model's), else
    the one label containing 'POS' (POSITIVE, LABEL_POS, ...), else the second of two (LABEL_1)."""
    labels = [id2label[i] for i in sorted(id2label)]
    if name is not None:
        if name not in labels:
            raise ValueError(f"positive_label={name!r}: expected one of the classifier's labels {labels}")
        return name
    found = [label for label in labels if "POS" in label.upper()]
    if len(found) == 1:
        return found[0]
    if len(labels) == 2:
        return labels[1]
    raise ValueError(f"cannot tell the positive label among {labels}: pass positive_label")


def classify(
    texts: list[str],
    classifier: str,
    *,
    tokenizer: str | None = None,
    device: str = "auto",
    batch_size: int = 64,
    output: str = "prob",
    positive_label_name: str | None = None,
) -> list[float]:
    """The positive-class score of each text: its probability (``output='prob'``) or its logit
    (``'logit'``, what TRL's sentiment example rewards with), in batches of ``batch_size``."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}: expected one of {list(OUTPUTS)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
    if not texts:
        return []
    pipe, lock = load_classifier(classifier, tokenizer, device)
    label = positive_label(pipe.model.config.id2label, positive_label_name)
    with lock:
        results = pipe(
            list(texts),
            top_k=None,
            function_to_apply="softmax" if output == "prob" else "none",
            batch_size=batch_size,
            truncation=True,
        )
    scores = []
    for row in results:
        by_label = {r["label"]: float(r["score"]) for r in row}
        scores.append(by_label[label])
    bad = [i for i, x in enumerate(scores) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"the classifier gave non-finite scores for samples {bad[:8]}")
    return scores


def positive_score(
    samples: list[str],
    prompts: list[str],
    outputs: list[str],
    *,
    classifier: str,
    tokenizer: str | None = None,
    device: str = "auto",
    batch_size: int = 64,
    output: str = "prob",
    positive_label: str | None = None,
    score: str = "samples",
    **kwargs: Any,
) -> list[float]:
    """trlx's reward-function convention: one score per sample, the classifier's positive-class
    probability (or logit) of the whole sample (``score='samples'``: prompt and response, as trlx
    and TRL score it) or of the response alone (``'outputs'``). Other keyword arguments (the
    token ids, data-set columns) are ignored."""
    if score not in ("samples", "outputs"):
        raise ValueError(f"score={score!r}: expected 'samples' or 'outputs'")
    texts = samples if score == "samples" else outputs
    return classify(
        list(texts),
        classifier,
        tokenizer=tokenizer,
        device=device,
        batch_size=batch_size,
        output=output,
        positive_label_name=positive_label,
    )
