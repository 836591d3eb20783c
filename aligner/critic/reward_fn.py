"""Reward functions of the critic server: a function named by import path
(``aligner.tasks.digits:sort_reward``), loaded as a :class:`RewardFn`, which reads the NAMES of the
function's parameters once to decide how it is called (:mod:`aligner.critic.reward_conventions`):
this project's ``fn(prompts, responses, **kwargs)``, trlx's ``fn(samples, prompts, outputs,
**kwargs)``, TRL's ``fn(completions, **kwargs)``, OpenRLHF's ``reward_func(queries, prompts,
labels)``, or verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` (or its batched form). A signature that matches none, or several, is refused when
it is loaded, naming the parameters seen and the conventions it could be. Keyword arguments go only to
a function that accepts them (by name, or ``**kwargs``): ``prompt_ids``, ``response_ids``, each of the
request's extra data-set columns as a list over the batch (critic_infer's ``extras``), and the
constant ``reward.fn_kwargs``.

verl's per-sample functions are batched by the server: called over the batch in order in the
caller's thread (``reward.workers=1``), or on a pool of ``reward.workers`` threads. ``async def``
functions are awaited, per-sample ones up to ``reward.concurrency`` at a time. Every call honours
``reward.timeout_s`` (a timed-out thread cannot be stopped: it is left to finish, unwaited). A
failure on one request's samples (the function raised, timed out, or answered a bad score) is that
request's alone, and names the function and the sample (:func:`score_requests`).

The other reward source, a reward model, is :mod:`aligner.critic.reward_model`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import numpy as np

from aligner.critic.errors import RequestRewardError
from aligner.critic.reward_conventions import FORMS, Binding
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
"""Keyword arguments every batch call offers (a function gets those it accepts): each sample's
prompt and response token ids (the policy's tokenizer; the response up to its end-of-sequence)."""

_FORMS = FORMS


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


class _TimedOut(Exception):
    """A call ran past ``reward.timeout_s``."""


class _Failed:
    """One per-sample call's failure (kept in the outcome list in place of its score)."""

    def __init__(self, detail: str, *, timed_out: bool = False, argument: bool = False) -> None:
        self.detail, self.timed_out, self.argument = detail, timed_out, argument


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


def _run_coro(coro: Any) -> Any:
    """Run ``coro`` to its end from synchronous code (on a thread of its own when this thread
    already runs an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


async def _awaited(x: Any) -> Any:
    return await x


class RewardFn(Binding):
    """A reward function and how to call it: its :class:`~aligner.critic.reward_conventions.Binding`
    (the convention, decided once from its parameters' names), and how calls run.

    Args:
        fn: the callable (``async def`` ones are awaited).
        name: how messages name it (its ``module:function`` path).
        fn_kwargs: constant keyword arguments for every call (``reward.fn_kwargs``); for verl,
            ``data_source`` is the default of samples without a ``data_source`` column.
        workers: threads that call a per-sample function (1: in order, in the caller's thread,
            unless ``timeout_s`` is set: a call is timed on a thread of its own).
        concurrency: per-sample ``async`` calls in flight at once.
        timeout_s: the longest one call (a batch's, or a sample's) may take; None: no limit.
        label_column: the extras column of each sample's label (OpenRLHF's labels, verl's
            ground_truth); None: the first of :data:`~aligner.critic.reward_conventions.LABEL_COLUMNS`.

    Raises:
        ValueError: no convention, or several, match the parameters; or a ``fn_kwargs`` key the
            function does not accept; the message names the function, its signature, the
            parameters seen and the accepted forms.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        fn_kwargs: dict[str, Any] | None = None,
        *,
        workers: int = 1,
        concurrency: int = 8,
        timeout_s: float | None = None,
        label_column: str | None = None,
    ) -> None:
        super().__init__(fn, name, fn_kwargs, label_column)
        self.workers, self.concurrency, self.timeout_s = workers, concurrency, timeout_s
        self.is_async = _is_async(fn)
        self.calls = self.failures = self.timeouts = 0
        """Calls made (one per batch, or per sample), and how many raised or timed out."""
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def argument_error(self, columns: Sequence[str]) -> RewardArgumentError | None:
        """The error of a request whose extras have only ``columns``, when a required parameter
        (or the label it needs) is left without a value; None when every one has one."""
        problem = self.argument_problem(columns)
        return None if problem is None else RewardArgumentError(self.name, problem)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        extras: list[dict[str, Any]] | None = None,
    ) -> Any:
        """Call the function on one batch (``extras``: each sample's extra columns, or None): its
        answer (a per-sample function's: the list of its answers).

        Raises:
            RewardArgumentError: a required parameter (or label) that no column of ``extras``
                fills; RewardFunctionError: a call timed out, or a per-sample call failed (naming
                the sample); whatever a batch function raised.
        """
        out = self.outcomes(prompts, responses, prompt_ids, response_ids, extras)
        for i, o in enumerate(out if self.per_sample else ()):
            if isinstance(o, _Failed):
                raise _error(self.name, o, i)
        return out

    def outcomes(self, prompts, responses, prompt_ids, response_ids, extras=None) -> Any:
        """The batch function's answer, or a per-sample function's list of answers, each one a
        :class:`_Failed` where that call failed (see :meth:`__call__`)."""
        columns = _columns(extras)
        error = self.argument_error(columns)
        if error is not None:
            raise error
        rows = extras or [{} for _ in prompts]
        values, unlabelled = self.values(prompts, responses, prompt_ids, response_ids, rows)
        missing = unlabelled if self.needs_label else []
        no_label = [
            _Failed(self.label_problem(f"its columns: {list(rows[i]) or 'none'}"), argument=True)
            for i in missing
        ]
        if not self.per_sample:
            if missing:
                raise _error(self.name, no_label[0], missing[0])
            return self._call_batch(*self.call_args(values, rows, columns))
        skip, unlabelled_set = set(missing), set(unlabelled)
        todo = [i for i in range(len(prompts)) if i not in skip]
        calls = [self.call_args(values, rows, columns, i, no_label=i in unlabelled_set) for i in todo]
        done = dict(zip(todo, self._call_each(calls)))
        done.update(zip(missing, no_label))
        return [done[i] for i in range(len(prompts))]

    def _count(self, key: str) -> None:
        with self._lock:
            setattr(self, key, getattr(self, key) + 1)

    def stats(self) -> dict[str, int]:
        """Calls made, and how many failed (raised) or timed out, since it was loaded."""
        with self._lock:
            return {"calls": self.calls, "failures": self.failures, "timeouts": self.timeouts}

    def _timeout_detail(self) -> str:
        return f"it timed out after {self.timeout_s:g} s (reward.timeout_s)"

    def _pool(self) -> ThreadPoolExecutor:
        """The threads of per-sample calls without a time limit."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="reward-fn")
            return self._executor

    @staticmethod
    def _on_thread(call: Callable[[], Any]) -> Future:
        """Start ``call`` on a daemon thread of its own (so its time is its own, and a call that
        hangs past its timeout is left behind without holding up the process's exit)."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as e:  # handed to the waiter
                    future.set_exception(e)

        threading.Thread(target=run, name="reward-fn-timed", daemon=True).start()
        return future

    async def _timed(self, awaitable: Any) -> Any:
        """``awaitable``'s result; :class:`_TimedOut` past ``timeout_s`` (a TimeoutError the
        function raises itself is its own failure, not a timeout)."""
        if self.timeout_s is None:
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            raise _TimedOut
        return task.result()

    def _call_batch(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        self._count("calls")
        try:
            if self.is_async:
                return _run_coro(self._timed(self.fn(*args, **kwargs)))
            if self.timeout_s is None:
                answer = self.fn(*args, **kwargs)
            else:
                future = self._on_thread(functools.partial(self.fn, *args, **kwargs))
                if not wait_futures([future], self.timeout_s).done:
                    raise _TimedOut
                answer = future.result()
            return _run_coro(self._timed(answer)) if inspect.isawaitable(answer) else answer
        except _TimedOut:
            self._count("timeouts")
            raise RewardFunctionError(self.name, self._timeout_detail(), timed_out=True) from None
        except Exception:
            self._count("failures")
            raise

    def _one_sync(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """One per-sample call on this thread; its failure as a :class:`_Failed`."""
        self._count("calls")
        try:
            answer = self.fn(*args, **kwargs)
            return asyncio.run(_awaited(answer)) if inspect.isawaitable(answer) else answer
        except Exception as e:
            self._count("failures")
            return _Failed(f"{type(e).__name__}: {e}")

    def _call_each(self, calls: list[tuple[list[Any], dict[str, Any]]]) -> list[Any]:
        if not calls:
            return []
        if not self.is_async and self.workers == 1 and self.timeout_s is None:
            return [self._one_sync(a, k) for a, k in calls]
        return _run_coro(self._each_async(calls) if self.is_async else self._each_threads(calls))

    async def _each_async(self, calls) -> list[Any]:
        limit = asyncio.Semaphore(self.concurrency)

        async def one(args, kwargs):
            async with limit:
                self._count("calls")
                try:
                    return await self._timed(self.fn(*args, **kwargs))
                except _TimedOut:
                    self._count("timeouts")
                    return _Failed(self._timeout_detail(), timed_out=True)
                except Exception as e:
                    self._count("failures")
                    return _Failed(f"{type(e).__name__}: {e}")

        return list(await asyncio.gather(*(one(a, k) for a, k in calls)))

    async def _each_threads(self, calls) -> list[Any]:
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(self.workers)  # reward.workers threads at a time

        async def one(args, kwargs):
            async with limit:
                call = functools.partial(self._one_sync, args, kwargs)
                if self.timeout_s is None:
                    return await loop.run_in_executor(self._pool(), call)
                try:
                    return await self._timed(asyncio.wrap_future(self._on_thread(call)))
                except _TimedOut:
                    self._count("timeouts")
                    return _Failed(self._timeout_detail(), timed_out=True)

        return list(await asyncio.gather(*(one(a, k) for a, k in calls)))

    def __repr__(self) -> str:
        return f"RewardFn({self.name!r}, {self.convention}, {self.signature})"


def _error(name: str, failed: _Failed, sample: int | None) -> RewardFunctionError:
    cls = RewardArgumentError if failed.argument else RewardFunctionError
    return cls(name, failed.detail, sample=sample, timed_out=failed.timed_out)


def _columns(extras: list[dict[str, Any]] | None) -> list[str]:
    """The columns of ``extras``, in the order they first appear."""
    seen: dict[str, None] = {}
    for row in extras or ():
        seen.update(dict.fromkeys(row))
    return list(seen)


def reward_fn_problem(
    path: str, python_path: Sequence[str] = (), fn_kwargs: dict[str, Any] | None = None, **options: Any
) -> str | None:
    """Why ``path`` cannot be used as a reward function (it does not import, is no callable, or its
    parameters match no convention, or several), or None when it can. ``options``: those of
    :class:`RewardFn` (workers, concurrency, timeout_s, label_column)."""
    try:
        RewardFn(_resolve(path, python_path), path, fn_kwargs, **options)
    except ValueError as e:
        return str(e)
    return None


def load_reward_fn(
    path: str, fn_kwargs: dict[str, Any] | None = None, python_path: Sequence[str] = (), **options: Any
) -> RewardFn:
    """The reward function named by ``'module:function'`` (``python_path`` and the working
    directory searched first); ValueError naming the path otherwise. ``options``: those of
    :class:`RewardFn` (workers, concurrency, timeout_s, label_column: ``RewardConfig.fn_options()``)."""
    try:
        return RewardFn(_resolve(path, python_path), path, fn_kwargs, **options)
    except ValueError as e:
        raise ValueError(f"reward.fn={path!r}: {e}") from None


def split_samples(tokens, lengths, prompt_lengths, eos_id) -> tuple[list[list[int]], list[list[int]]]:
    """Cut each sample into prompt ids and response ids (stopping at the first end-of-sequence).

    Args:
        tokens: ``[b, s]`` ints; lengths, prompt_lengths: ``[b]``; eos_id: an id, or several (a
            tokenizer's ``stop_ids``): a response stops at the first of them.

    Returns: (prompt_ids, response_ids), lists of ``b`` lists."""
    stops, prompts, responses = {eos_id} if isinstance(eos_id, int) else set(eos_id), [], []
    for row, n, p in zip(tokens.tolist(), lengths.tolist(), prompt_lengths.tolist()):
        prompts.append(row[:p])
        resp = row[p:n]
        responses.append(resp[: next((j for j, t in enumerate(resp) if t in stops), len(resp))])
    return prompts, responses


class RewardFunctionError(RequestRewardError):
    """The reward function failed on one request's samples: it raised, or answered the wrong
    number of scores or one that is not a finite number. The message names the function and,
    when one sample is to blame, its index in the request (``sample``)."""

    def __init__(self, fn_name: str, detail: str, sample: int | None = None, timed_out: bool = False) -> None:
        # The function's own words may echo the samples (a request's text): neutralized and cut.
        detail = neutralize(detail, 1000)
        self.fn_name, self.detail, self.sample, self.timed_out = fn_name, detail, sample, timed_out
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


def _decode(tokenizer, tokens, lengths, prompt_lengths):
    """``(prompts, responses, prompt_ids, response_ids)`` of the samples."""
    stops = getattr(tokenizer, "stop_ids", tokenizer.eos_id)  # a response ends at the first
    prompt_ids, response_ids = split_samples(tokens, lengths, prompt_lengths, stops)
    return (
        [tokenizer.decode(ids) for ids in prompt_ids],
        [tokenizer.decode(ids) for ids in response_ids],
        prompt_ids,
        response_ids,
    )


def _score(name: str, x: Any, i: int) -> float:
    """One answer as a finite float (a dict's ``'score'``, as verl's functions answer)."""
    if isinstance(x, dict):
        if "score" not in x:
            raise RewardFunctionError(
                name, f"it answered a dict without a 'score' key: {sorted(x)}", sample=i
            )
        x = x["score"]
    try:
        score = float(x)
    except (TypeError, ValueError):
        raise RewardFunctionError(name, f"its score {x!r} is not a number", sample=i) from None
    if not np.isfinite(score):
        raise RewardFunctionError(name, f"its score is {score}, not a finite number", sample=i)
    return score


def _scores(name: str, answer: Any, b: int) -> np.ndarray:
    """A batch's answer (a sequence of numbers or dicts with a 'score', or OpenRLHF's dict with
    'rewards') as ``[b]`` finite float64 scores; per-sample failures raise naming the sample."""
    if isinstance(answer, dict) and "rewards" in answer:
        answer = answer["rewards"]
    try:
        answer = list(answer)
    except TypeError:
        raise RewardFunctionError(
            name, f"it returned a {type(answer).__name__}, not a list of scores"
        ) from None
    if len(answer) != b:
        raise RewardFunctionError(name, f"it returned {len(answer)} scores for {b} samples")
    for i, x in enumerate(answer):
        if isinstance(x, _Failed):
            raise _error(name, x, i)
    return np.array([_score(name, x, i) for i, x in enumerate(answer)], dtype=np.float64).reshape(b)


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
        RewardFunctionError: ``fn`` raised or timed out, or answered other than ``b`` finite numbers
            (with the sample's index when one is to blame); RewardArgumentError: a required
            parameter no column fills.
    """
    fn = _as_reward_fn(fn, name)
    decoded = _decode(tokenizer, tokens, lengths, prompt_lengths)
    try:
        answer = fn.outcomes(*decoded, extras)
    except RewardFunctionError:
        raise
    except Exception as e:  # the function's own error, whatever it is, is the message
        raise RewardFunctionError(name, f"{type(e).__name__}: {e}") from e
    return _scores(name, answer, len(decoded[0]))


def score_requests(
    fn: Callable[..., Sequence[float]], name: str, tokenizer, requests: list[tuple[Any, ...]]
) -> list[np.ndarray | RewardFunctionError]:
    """Score the samples of several requests (merged into one execution) so that one request's
    failure never touches another's scores.

    A batch function is called once for them all (when they carry the same extra columns, so that
    each sample gets the arguments it gets alone); when it fails, each request is scored alone,
    and in a request that fails alone (not by a timeout) each sample, to name the one to blame. A
    per-sample function (verl's) is called once per sample of them all, and a request fails on its
    first failing sample. Every request thus gets what an unmerged call would give it: its
    ``[b_i]`` float64 scores, or its :class:`RewardFunctionError`.

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
    if fn.per_sample and todo:
        decoded = [_decode(tokenizer, *parts[i][:3]) for i in todo]
        rows = [parts[i][3] or [{} for _ in parts[i][1]] for i in todo]
        merged = [sum((list(d[k]) for d in decoded), []) for k in range(4)]
        answers = fn.outcomes(*merged, [row for r in rows for row in r])
        start = 0
        for i, d in zip(todo, decoded):
            try:
                out[i] = _scores(name, answers[start : start + len(d[0])], len(d[0]))
            except RewardFunctionError as e:
                out[i] = e
            start += len(d[0])
        return out  # type: ignore[return-value]
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
                if e.sample is not None or e.timed_out or isinstance(e, RewardArgumentError)
                else _blame_one(fn, name, tokenizer, tokens, lengths, prompt_lengths, extras, e)
            )
    return out  # type: ignore[return-value]


def _blame_one(fn, name: str, tokenizer, tokens, lengths, prompt_lengths, extras, err: RewardFunctionError):
    """``err`` (what the request's call answered) with the index of the first sample that fails
    alone; ``err`` itself when none does (or one times out: the request's error stands)."""
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
        except RewardFunctionError as e:
            return err if e.timed_out else RewardFunctionError(name, err.detail, sample=i)
    return err
