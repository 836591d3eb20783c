"""Reward functions of the critic server: a function named by import path
(``aligner.tasks.digits:sort_reward``), loaded as a :class:`RewardFn`, which reads the function's
signature once to decide how it is called: this project's form ``fn(prompts, responses, **kwargs)``,
or trlx's ``fn(samples, prompts, outputs, **kwargs)`` (its first parameter named ``samples``:
prompt + response strings). Keyword arguments go only to a function that accepts them (by name, or
``**kwargs``): ``prompt_ids``, ``response_ids``, each of the request's extra data-set columns as a
list over the batch (critic_infer's ``extras``), and the constant ``reward.fn_kwargs``. A failure on
one request's samples is that request's alone (:func:`score_requests`).

The other reward source, a reward model, is :mod:`aligner.critic.reward_model`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aligner.critic.errors import RequestRewardError
from aligner.wire.protocol import neutralize

__all__ = [
    "RewardFn",
    "load_reward_fn",
    "reward_fn_problem",
    "split_samples",
    "RewardFunctionError",
    "RewardArgumentError",
    "call_reward_fn",
    "score_requests",
    "parse_extras",
]

KNOWN_KWARGS = ("prompt_ids", "response_ids")
"""Keyword arguments every call offers (a function gets those it accepts): each sample's prompt and
response token ids (the policy's tokenizer; the response up to its end-of-sequence)."""

_FORMS = (
    "fn(prompts, responses, **kwargs) -> list[float] (the prompts and the responses, lists of "
    "strings), or trlx's fn(samples, prompts, outputs, **kwargs) (the first parameter named "
    "'samples': prompt + response strings); keyword arguments prompt_ids, response_ids, each extra "
    "data-set column (a list over the batch) and reward.fn_kwargs go to a function that accepts them "
    "by name or **kwargs"
)


def _import_path(python_path: Sequence[str]) -> None:
    """Put ``python_path`` (in order) and the working directory at the front of ``sys.path``."""
    for folder in [os.getcwd(), *reversed([str(Path(p).resolve()) for p in python_path])]:
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    importlib.invalidate_caches()  # a module written since the last import is found


def _resolve(path: str, python_path: Sequence[str] = ()) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("expected 'package.module:function'")
    missing = [p for p in python_path if not Path(p).is_dir()]
    if missing:
        raise ValueError(f"reward.python_path names folders that do not exist: {missing}")
    _import_path(python_path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while importing it
        where = f"reward.python_path={list(python_path)} and the working directory {os.getcwd()}"
        raise ValueError(
            f"cannot import module {module_name!r} ({type(e).__name__}: {e}; searched {where} "
            "before the installed packages)"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a callable")
    return obj


class RewardFn:
    """A reward function and how to call it, decided once from its signature.

    The convention: trlx's when the first parameter is named ``samples`` (the batch is
    ``samples``, ``prompts``, ``outputs``), this project's otherwise (``prompts``,
    ``responses``). The batch goes positionally into the function's positional parameters (all
    of them with ``*args``), the rest by name where the function takes that name (or
    ``**kwargs``); ``samples`` (trlx) or ``prompts`` and ``responses`` (ours) must be taken. Then,
    where accepted: ``prompt_ids`` and ``response_ids``, ``fn_kwargs``, and each extra column of
    the request (a list over the batch, None where a row lacks it). A column whose name is
    already taken by one of those is not passed. A required parameter left over must be a
    column of the request (else :class:`RewardArgumentError`).

    Args:
        fn: the callable.
        name: how messages name it (its ``module:function`` path).
        fn_kwargs: constant keyword arguments for every call (``reward.fn_kwargs``).

    Raises:
        ValueError: the signature cannot take a batch, or does not accept a ``fn_kwargs`` key; the
            message names the function, its signature and the accepted forms.
    """

    def __init__(self, fn: Callable[..., Any], name: str, fn_kwargs: dict[str, Any] | None = None) -> None:
        self.fn, self.name = fn, name
        self.fn_kwargs = dict(fn_kwargs or {})
        try:
            sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none: take them as (*args, **kwargs)
            sig = None
        self.signature = f"{getattr(fn, '__name__', type(fn).__name__)}{sig if sig is not None else '(...)'}"
        params = list(sig.parameters.values()) if sig is not None else []
        P = inspect.Parameter
        self.convention = "trlx" if params and params[0].name == "samples" else "aligner"
        batch = ("samples", "prompts", "outputs") if self.convention == "trlx" else ("prompts", "responses")
        needed = 1 if self.convention == "trlx" else 2
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        var_positional = sig is None or any(p.kind == P.VAR_POSITIONAL for p in params)
        self.var_keyword = sig is None or any(p.kind == P.VAR_KEYWORD for p in params)
        slots = len(batch) if var_positional else len(positional)
        self._positional = list(batch[: min(slots, len(batch))])
        taken_params = {p.name for p in positional[: len(self._positional)]}
        self._named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        self._named -= taken_params
        self._by_keyword = [n for n in batch[len(self._positional) :] if self.accepts(n)]
        given = len(self._positional) + sum(
            1 for n in batch[len(self._positional) : needed] if self.accepts(n)
        )
        if given < needed:
            raise ValueError(
                f"reward function {name!r} with signature {self.signature} cannot take a batch: expected {_FORMS}"
            )
        self._taken = set(batch) | taken_params | set(KNOWN_KWARGS) | set(self.fn_kwargs)
        for key in self.fn_kwargs:
            if key in batch or key in KNOWN_KWARGS or key in taken_params:
                raise ValueError(
                    f"reward.fn_kwargs key {key!r}: the reward function {name!r} gets {key!r} from the "
                    "batch; choose another name"
                )
            if not self.accepts(key):
                raise ValueError(
                    f"reward.fn_kwargs key {key!r} is not a parameter of reward function {name!r} "
                    f"(signature {self.signature}, no **kwargs)"
                )
        covered = set(self._by_keyword) | set(self.fn_kwargs) | {k for k in KNOWN_KWARGS if self.accepts(k)}
        self.required_columns: list[str] = []
        """Required parameters that only a column of the request's extras can fill."""
        for p in params:
            if (
                p.name in taken_params
                or p.default is not P.empty
                or p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
            ):
                continue
            if p.name in covered:
                continue
            if p.kind == P.POSITIONAL_ONLY:
                raise ValueError(
                    f"reward function {name!r} with signature {self.signature}: its positional-only "
                    f"parameter {p.name!r} cannot be given; expected {_FORMS}"
                )
            self.required_columns.append(p.name)

    def accepts(self, name: str) -> bool:
        """Whether ``name`` can be given as a keyword argument."""
        return self.var_keyword or name in self._named

    def missing_columns(self, columns: Sequence[str]) -> list[str]:
        """Required parameters that neither the call nor ``columns`` fill."""
        return [c for c in self.required_columns if c not in columns]

    def argument_error(self, columns: Sequence[str]) -> RewardArgumentError | None:
        """The error of a request whose extras have only ``columns``, when a required parameter
        is left without a value; None when every one has one."""
        missing = self.missing_columns(columns)
        if not missing:
            return None
        return RewardArgumentError(
            self.name,
            f"its required parameter {missing[0]!r} (signature {self.signature}) is neither a batch "
            f"argument, {' nor '.join(KNOWN_KWARGS)}, a reward.fn_kwargs key, nor a column of the "
            f"request's extras (columns: {list(columns) or 'none'})",
        )

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        extras: list[dict[str, Any]] | None = None,
    ) -> Any:
        """Call the function on one batch (``extras``: each sample's extra columns, or None).

        Raises:
            RewardArgumentError: a required parameter that no column of ``extras`` fills.
        """
        columns = _columns(extras)
        error = self.argument_error(columns)
        if error is not None:
            raise error
        if self.convention == "trlx":
            values = {
                "samples": [p + r for p, r in zip(prompts, responses)],
                "prompts": prompts,
                "outputs": responses,
            }
        else:
            values = {"prompts": prompts, "responses": responses}
        args = [values[n] for n in self._positional]
        kwargs: dict[str, Any] = {n: values[n] for n in self._by_keyword}
        for key, value in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
            if self.accepts(key):
                kwargs[key] = value
        kwargs.update(self.fn_kwargs)
        rows = extras or [{} for _ in prompts]
        for c in columns:
            if c not in self._taken and self.accepts(c):
                kwargs[c] = [row.get(c) for row in rows]
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RewardFn({self.name!r}, {self.convention}, {self.signature})"


def _columns(extras: list[dict[str, Any]] | None) -> list[str]:
    """The columns of ``extras``, in the order they first appear."""
    seen: dict[str, None] = {}
    for row in extras or ():
        seen.update(dict.fromkeys(row))
    return list(seen)


def reward_fn_problem(
    path: str, python_path: Sequence[str] = (), fn_kwargs: dict[str, Any] | None = None
) -> str | None:
    """Why ``path`` cannot be used as a reward function (it does not import, is no callable, or its
    signature cannot take a batch), or None when it can."""
    try:
        RewardFn(_resolve(path, python_path), path, fn_kwargs)
    except ValueError as e:
        return str(e)
    return None


def load_reward_fn(
    path: str, fn_kwargs: dict[str, Any] | None = None, python_path: Sequence[str] = ()
) -> RewardFn:
    """The reward function named by ``'module:function'`` (``python_path`` and the working
    directory searched first); ValueError naming the path otherwise."""
    try:
        return RewardFn(_resolve(path, python_path), path, fn_kwargs)
    except ValueError as e:
        raise ValueError(f"reward.fn={path!r}: {e}") from None


def split_samples(tokens, lengths, prompt_lengths, eos_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cut each sample into prompt ids and response ids (stopping at the first end-of-sequence).

    Args:
        tokens: ``[b, s]`` ints; lengths, prompt_lengths: ``[b]``.

    Returns:
        (prompt_ids, response_ids), lists of ``b`` lists.
    """
    prompts, responses = [], []
    for row, n, p in zip(tokens.tolist(), lengths.tolist(), prompt_lengths.tolist()):
        prompts.append(row[:p])
        resp = row[p:n]
        if eos_id in resp:
            resp = resp[: resp.index(eos_id)]
        responses.append(resp)
    return prompts, responses


class RewardFunctionError(RequestRewardError):
    """The reward function failed on one request's samples: it raised, or answered the wrong
    number of scores or one that is not a finite number. The message names the function and,
    when one sample is to blame, its index in the request (``sample``)."""

    def __init__(self, fn_name: str, detail: str, sample: int | None = None) -> None:
        # The function's own words may echo the samples (a request's text): neutralized and cut.
        detail = neutralize(detail, 1000)
        self.fn_name, self.detail, self.sample = fn_name, detail, sample
        where = "on the request's samples" if sample is None else f"on sample {sample} of the request"
        super().__init__(f"reward function {fn_name!r} failed {where}: {detail}")


class RewardArgumentError(RewardFunctionError):
    """The request cannot give the reward function a required parameter (no column of its extras
    fills it): the whole request's fault, no sample's."""


def _as_reward_fn(fn: Callable[..., Any], name: str) -> RewardFn:
    return fn if isinstance(fn, RewardFn) else RewardFn(fn, name)


def parse_extras(extras: Sequence[str] | None, b: int) -> list[dict[str, Any]]:
    """Each sample's extra columns from critic_infer's ``extras`` (validated JSON objects); ``b``
    empty rows when the request carries none."""
    if extras is None:
        return [{} for _ in range(b)]
    return [json.loads(x) for x in extras]


def call_reward_fn(
    fn: Callable[..., Sequence[float]],
    name: str,
    tokenizer,
    tokens,
    lengths,
    prompt_lengths,
    extras: list[dict[str, Any]] | None = None,
) -> np.ndarray:
    """Decode the samples and score them with ``fn`` (named ``name`` in messages; a plain callable
    is wrapped in a :class:`RewardFn`).

    Args:
        tokens: ``[b, s]`` ints; lengths, prompt_lengths: ``[b]``.
        extras: each sample's extra data-set columns, or None.

    Returns:
        ``[b]`` float64 scores, every one finite.

    Raises:
        RewardFunctionError: ``fn`` raised, or answered other than ``b`` finite numbers (with the
            sample's index when one is to blame); RewardArgumentError: a required parameter no
            column fills.
    """
    fn = _as_reward_fn(fn, name)
    prompt_ids, response_ids = split_samples(tokens, lengths, prompt_lengths, tokenizer.eos_id)
    prompts = [tokenizer.decode(ids) for ids in prompt_ids]
    responses = [tokenizer.decode(ids) for ids in response_ids]
    try:
        answer = list(fn(prompts, responses, prompt_ids, response_ids, extras))
    except RewardArgumentError:
        raise
    except Exception as e:  # the function's own error, whatever it is, is the message
        raise RewardFunctionError(name, f"{type(e).__name__}: {e}") from e
    if len(answer) != len(prompts):
        raise RewardFunctionError(name, f"it returned {len(answer)} scores for {len(prompts)} samples")
    scores = np.zeros(len(answer), dtype=np.float64)
    for i, x in enumerate(answer):
        try:
            scores[i] = float(x)
        except (TypeError, ValueError):
            raise RewardFunctionError(name, f"its score {x!r} is not a number", sample=i) from None
        if not np.isfinite(scores[i]):
            raise RewardFunctionError(name, f"its score is {scores[i]}, not a finite number", sample=i)
    return scores


def score_requests(
    fn: Callable[..., Sequence[float]], name: str, tokenizer, requests: list[tuple[Any, ...]]
) -> list[np.ndarray | RewardFunctionError]:
    """Score the samples of several requests (merged into one execution) so that one request's
    failure never touches another's scores.

    One call scores them all (when they carry the same extra columns, so that each sample gets
    the arguments it gets alone); when it fails, each request is scored alone, and in a request
    that fails alone each sample, to name the one to blame. Every request thus gets what an
    unmerged call would give it: its ``[b_i]`` float64 scores, or its
    :class:`RewardFunctionError`.

    Args:
        requests: ``(tokens [b_i, s], lengths [b_i], prompt_lengths [b_i])`` per request, all of
            the same ``s``, optionally with a fourth item: the samples' extra columns (a list of
            ``b_i`` dicts, or None).
    """
    fn = _as_reward_fn(fn, name)
    parts = [(*r[:3], r[3] if len(r) > 3 else None) for r in requests]
    out: list[np.ndarray | RewardFunctionError | None] = [None] * len(parts)
    for i, (_, _, _, extras) in enumerate(parts):
        out[i] = fn.argument_error(_columns(extras))  # a request that cannot call it fails alone
    todo = [i for i, o in enumerate(out) if o is None]
    same_columns = len({tuple(sorted(_columns(parts[i][3]))) for i in todo}) == 1
    if len(todo) > 1 and same_columns:
        try:
            merged = call_reward_fn(
                fn,
                name,
                tokenizer,
                *(np.concatenate([parts[i][k] for i in todo]) for k in range(3)),
                [row for i in todo for row in (parts[i][3] or [{}] * len(parts[i][1]))],
            )
        except RewardFunctionError:
            pass
        else:
            ends = np.cumsum([len(parts[i][1]) for i in todo])
            for i, scores in zip(todo, np.split(merged, ends[:-1])):
                out[i] = scores
            return out  # type: ignore[return-value]
    for i in todo:
        tokens, lengths, prompt_lengths, extras = parts[i]
        try:
            out[i] = call_reward_fn(fn, name, tokenizer, tokens, lengths, prompt_lengths, extras)
        except RewardFunctionError as e:
            out[i] = (
                e
                if e.sample is not None or isinstance(e, RewardArgumentError)
                else _blame_one(fn, name, tokenizer, tokens, lengths, prompt_lengths, extras, e)
            )
    return out  # type: ignore[return-value]


def _blame_one(fn, name: str, tokenizer, tokens, lengths, prompt_lengths, extras, err: RewardFunctionError):
    """``err`` (what the request's call answered) with the index of the first sample that fails
    alone; ``err`` itself when none does."""
    if len(lengths) == 1:
        return RewardFunctionError(name, err.detail, sample=0)
    for i in range(len(lengths)):
        try:
            call_reward_fn(
                fn,
                name,
                tokenizer,
                tokens[i : i + 1],
                lengths[i : i + 1],
                prompt_lengths[i : i + 1],
                None if extras is None else extras[i : i + 1],
            )
        except RewardFunctionError:
            return RewardFunctionError(name, err.detail, sample=i)
    return err
