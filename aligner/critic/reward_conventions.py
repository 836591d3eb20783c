"""The calling conventions of reward functions written for other frameworks, recognised by the
NAMES of a function's parameters (never by their position), and what each one is given.

=============  ====================================================  ==============================
convention     signature (as that framework writes it)               the server gives
=============  ====================================================  ==============================
``aligner``    ``fn(prompts, responses, **kwargs)``                  prompts, responses
``trlx``       ``fn(samples, prompts, outputs, **kwargs)``           samples = prompt + response
``trl``        ``fn(completions, **kwargs)``, ``fn(prompts,          completions = responses,
               completions, **kwargs)``                              completion_ids = response ids
``openrlhf``   ``reward_func(queries, prompts, labels)``             queries = prompt + response,
                                                                     labels = each sample's label
``verl``       ``compute_score(data_source, solution_str,            once per sample: solution_str =
               ground_truth, extra_info=None)``                      the response
``verl_batch`` ``compute_score(data_sources, solution_strs,          the same, as lists
               ground_truths, extra_infos, **kwargs)``
=============  ====================================================  ==============================

A convention is picked by its marker parameter (``responses``; ``samples`` or ``outputs``;
``completions``; ``queries``; ``solution_str``; ``solution_strs``); ``prompts`` is everyone's. A
function with no marker, or with the markers of two conventions, is refused when it is loaded.

The batch conventions (all but ``verl``) also get, where they accept them (by name or
``**kwargs``): ``prompt_ids``, ``response_ids``, each extra data-set column of the request as a list
over the batch, and ``reward.fn_kwargs``. verl's functions get ``reward.fn_kwargs`` (verl's
``reward_kwargs``) and only the columns they name as parameters.

Labels (OpenRLHF's ``labels``, verl's ``ground_truth``): each sample's value of the extras column
``reward.label_column`` when it is set, else of the first of :data:`LABEL_COLUMNS` the sample has; a
dotted name reads a key of a dict column (verl's data sets: ``reward_model.ground_truth``). verl's
``data_source`` is the sample's ``data_source`` column, else ``reward.fn_kwargs.data_source``, else
None; its ``extra_info`` is a dict of the sample's other columns (a dict column ``extra_info``
merged in, as verl's data sets carry it).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Binding",
    "Convention",
    "CONVENTIONS",
    "LABEL_COLUMNS",
    "FORMS",
    "detect_convention",
    "label_of",
    "extra_info_of",
    "reward_options_problems",
]

LABEL_COLUMNS = ("label", "labels", "ground_truth", "answer", "reward_model.ground_truth")
"""Where a sample's label is looked for (in this order) when ``reward.label_column`` is null."""


@dataclass(frozen=True)
class Convention:
    """One framework's way of writing a reward function."""

    name: str
    markers: tuple[str, ...]
    """Parameter names that select it (any one of them)."""
    batch: tuple[str, ...]
    """The values the server makes from the batch, passed by these names."""
    label: str | None = None
    """The batch value that is each sample's label (from the extras), if any."""
    per_sample: bool = False
    """Called once per sample (verl), the server doing the batching."""
    ids: tuple[str, ...] = ("prompt_ids", "response_ids")
    """Token-id keyword arguments offered."""
    columns_by_kwargs: bool = True
    """Extra columns go to ``**kwargs`` too (else only to parameters that name them)."""
    form: str = ""


CONVENTIONS = (
    Convention("aligner", ("responses",), ("prompts", "responses"), form="fn(prompts, responses, **kwargs)"),
    Convention(
        "trlx",
        ("samples", "outputs"),
        ("samples", "prompts", "outputs"),
        form="trlx's fn(samples, prompts, outputs, **kwargs) (samples: prompt + response strings)",
    ),
    Convention(
        "trl",
        ("completions",),
        ("prompts", "completions"),
        ids=("prompt_ids", "response_ids", "completion_ids"),
        form="TRL's fn(completions, **kwargs) or fn(prompts, completions, **kwargs)",
    ),
    Convention(
        "openrlhf",
        ("queries",),
        ("queries", "prompts", "labels"),
        label="labels",
        form="OpenRLHF's reward_func(queries, prompts, labels) (queries: prompt + response strings)",
    ),
    Convention(
        "verl",
        ("solution_str",),
        ("data_source", "solution_str", "ground_truth", "extra_info"),
        label="ground_truth",
        per_sample=True,
        ids=(),
        columns_by_kwargs=False,
        form="verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info=None)",
    ),
    Convention(
        "verl_batch",
        ("solution_strs",),
        ("data_sources", "solution_strs", "ground_truths", "extra_infos"),
        label="ground_truths",
        ids=(),
        columns_by_kwargs=False,
        form="verl's batched compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)",
    ),
)

FORMS = (
    "one of: "
    + "; ".join(c.form for c in CONVENTIONS)
    + " -- recognised by parameter names ("
    + ", ".join(f"{'/'.join(c.markers)}: {c.name}" for c in CONVENTIONS)
    + "); a batch function returns a list of floats, verl's a float or a dict with a 'score'; "
    "prompt_ids, response_ids, each extra data-set column (a list over the batch) and reward.fn_kwargs "
    "go to a batch function that accepts them by name or **kwargs"
)
"""The accepted forms, for messages."""


def detect_convention(names: list[str], fn_name: str, signature: str) -> Convention:
    """The one convention whose marker is among ``names`` (the function's named parameters).

    Raises:
        ValueError: none or several match; the message names the function, its signature, the
            parameters seen and the conventions it could be.
    """
    found = [c for c in CONVENTIONS if set(c.markers) & set(names)]
    if len(found) == 1:
        return found[0]
    seen = f"parameters seen: {names or 'none'}"
    if found:
        could = ", ".join(f"{c.name} (parameter {sorted(set(c.markers) & set(names))[0]!r})" for c in found)
        raise ValueError(
            f"reward function {fn_name!r} with signature {signature} is ambiguous: it could be "
            f"{could}; rename the parameters so that only one convention's names appear ({seen}); "
            f"expected {FORMS}"
        )
    could_be = [c.name for c in CONVENTIONS if set(c.batch) & set(names)]
    hint = (
        f"; its parameters could be those of {', '.join(could_be)}, but no marker names the response"
        if could_be
        else ""
    )
    raise ValueError(
        f"reward function {fn_name!r} with signature {signature} cannot take a batch: its "
        f"parameters match none of the conventions ({seen}{hint}); expected {FORMS}"
    )


_MISSING = object()


def _lookup(row: dict[str, Any], column: str) -> Any:
    """``row[column]``, or for a dotted name absent as such, the key inside a dict column."""
    if column in row:
        return row[column]
    head, dot, rest = column.partition(".")
    if dot and isinstance(row.get(head), dict) and rest in row[head]:
        return row[head][rest]
    return _MISSING


def label_of(row: dict[str, Any], label_column: str | None) -> tuple[str | None, Any]:
    """``(column, value)`` of a sample's label (``label_column``, else the first of
    :data:`LABEL_COLUMNS` present); ``(None, None)`` when it has none."""
    for column in (label_column,) if label_column else LABEL_COLUMNS:
        value = _lookup(row, column)
        if value is not _MISSING:
            return column, value
    return None, None


def label_sources(label_column: str | None) -> str:
    """Where labels are looked for, for messages."""
    if label_column:
        return f"the column reward.label_column={label_column!r}"
    return f"the first of the columns {list(LABEL_COLUMNS)} (or set reward.label_column)"


def extra_info_of(row: dict[str, Any], label_column: str | None) -> dict[str, Any]:
    """verl's ``extra_info`` for a sample: its columns but ``data_source`` and the label's, with
    the keys of a dict column ``extra_info`` merged in."""
    used, _ = label_of(row, label_column)
    skip = {"data_source", "extra_info", (used or "").partition(".")[0]}
    info = {k: v for k, v in row.items() if k not in skip}
    if isinstance(row.get("extra_info"), dict):
        info.update(row["extra_info"])
    elif "extra_info" in row:
        info["extra_info"] = row["extra_info"]
    return info


def reward_options_problems(
    workers: Any, concurrency: Any, timeout_s: Any, label_column: Any, prefix: str = "reward"
) -> list[str]:
    """What is wrong with the reward function's call options (``reward.workers``, ``concurrency``,
    ``timeout_s``, ``label_column``), one message each naming the field, its value and what is
    expected."""
    e = []
    for key, value in (("workers", workers), ("concurrency", concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            e.append(f"{prefix}.{key}={value!r}: expected a positive integer (>= 1)")
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        e.append(
            f"{prefix}.timeout_s={timeout_s!r}: expected a positive number of seconds, or null for no limit"
        )
    if label_column is not None and (not isinstance(label_column, str) or not label_column.strip()):
        e.append(
            f"{prefix}.label_column={label_column!r}: expected a column name of the extras, or null "
            f"for the first of {list(LABEL_COLUMNS)}"
        )
    return e


class Binding:
    """How a reward function is called, decided once from its parameters' names.

    The convention is the one whose marker parameter the function names. The batch's values go
    by keyword to the parameters of their names (or ``**kwargs``); positional-only parameters get
    them in order. Then, for batch conventions, where accepted: ``prompt_ids`` and
    ``response_ids`` (TRL: ``completion_ids`` too), ``fn_kwargs``, and each extra column of the
    request (a list over the batch, None where a row lacks it); a column whose name is already
    taken by one of those is not passed. verl's functions get ``fn_kwargs`` and the columns they
    name. A required parameter left over must be a column of the request.

    Raises:
        ValueError: no convention, or several, match the parameters; a positional-only parameter
            that cannot be given; a ``fn_kwargs`` key the function does not accept or that names a
            batch value.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        fn_kwargs: dict[str, Any] | None = None,
        label_column: str | None = None,
    ) -> None:
        self.fn, self.name, self.label_column = fn, name, label_column
        self.fn_kwargs = dict(fn_kwargs or {})
        try:
            sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        self.signature = f"{getattr(fn, '__name__', type(fn).__name__)}{sig if sig is not None else '(...)'}"
        params = list(sig.parameters.values()) if sig is not None else []
        P = inspect.Parameter
        conv = detect_convention(
            [p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)], name, self.signature
        )
        self.conv, self.convention, self.per_sample = conv, conv.name, conv.per_sample
        offered = (*conv.batch, *conv.ids)
        self.var_keyword = any(p.kind == P.VAR_KEYWORD for p in params)
        self._named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        self._positional: list[str] = []
        for k, p in enumerate(params):
            if p.kind != P.POSITIONAL_ONLY:
                break
            if p.name in offered and len(self._positional) == k:
                self._positional.append(p.name)
            elif p.default is P.empty:
                raise ValueError(
                    f"reward function {name!r} with signature {self.signature}: its positional-only "
                    f"parameter {p.name!r} cannot be given; expected {FORMS}"
                )
        self._keyword = [n for n in offered if n not in self._positional and self.accepts(n)]
        by_name = {p.name: p for p in params}
        label = conv.label
        self.needs_label = bool(label) and label in by_name and by_name[label].default is P.empty
        """The function names the label parameter without a default: every sample needs a label."""
        verl = conv.name.startswith("verl")
        self._default_source = self.fn_kwargs.pop("data_source", None) if verl else None
        for key in self.fn_kwargs:
            if key in offered or key in self._positional:
                raise ValueError(
                    f"reward.fn_kwargs key {key!r}: the reward function {name!r} gets {key!r} from the "
                    "batch; choose another name"
                )
            if not self.accepts(key):
                raise ValueError(
                    f"reward.fn_kwargs key {key!r} is not a parameter of reward function {name!r} "
                    f"(signature {self.signature}, no **kwargs)"
                )
        self._taken = set(offered) | set(self._positional) | set(self.fn_kwargs)
        self._column_params = {n for n in self._named if n not in self._taken}
        """Named parameters that a column fills (verl's functions get no other column)."""
        self.required_columns: list[str] = [
            p.name
            for p in params
            if p.default is P.empty
            and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
            and p.name not in self._taken
        ]
        """Required parameters that only a column of the request's extras can fill."""

    def accepts(self, name: str) -> bool:
        """Whether ``name`` can be given as a keyword argument."""
        return self.var_keyword or name in self._named

    def missing_columns(self, columns: Sequence[str]) -> list[str]:
        """Required parameters that neither the call nor ``columns`` fill."""
        return [c for c in self.required_columns if c not in columns]

    def argument_problem(self, columns: Sequence[str]) -> str | None:
        """Why a request whose extras have only ``columns`` cannot call the function (a required
        parameter, or the label it needs, is left without a value); None when it can."""
        missing = self.missing_columns(columns)
        if missing:
            return (
                f"its required parameter {missing[0]!r} (signature {self.signature}) is neither a batch "
                f"argument, {' nor '.join(self.conv.ids) or 'an id list'}, a reward.fn_kwargs key, nor a "
                f"column of the request's extras (columns: {list(columns) or 'none'})"
            )
        sources = (self.label_column,) if self.label_column else LABEL_COLUMNS
        if self.needs_label and not any(s.partition(".")[0] in columns for s in sources):
            return self.label_problem(f"the request's columns: {list(columns) or 'none'}")
        return None

    def label_problem(self, seen: str) -> str:
        """The message of a missing label (``seen``: the columns there were)."""
        return (
            f"its parameter {self.conv.label!r} ({self.conv.name} convention, signature "
            f"{self.signature}) needs each sample's label, from {label_sources(self.label_column)}; {seen}"
        )

    def values(self, prompts, responses, prompt_ids, response_ids, rows) -> tuple[dict[str, Any], list[int]]:
        """The batch's values by name (lists over the batch), and the samples without a label
        (their label is None in the batch's list; a sample's own call leaves it to the default)."""
        joined = [p + r for p, r in zip(prompts, responses)]
        values: dict[str, Any] = {
            "prompts": prompts,
            "responses": responses,
            "samples": joined,
            "outputs": responses,
            "completions": responses,
            "queries": joined,
            "solution_str": responses,
            "solution_strs": responses,
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "completion_ids": response_ids,
        }
        if self.conv.name.startswith("verl"):
            sources = [row.get("data_source", self._default_source) for row in rows]
            infos = [extra_info_of(row, self.label_column) for row in rows]
            values.update(data_source=sources, data_sources=sources, extra_info=infos, extra_infos=infos)
        missing: list[int] = []
        if self.conv.label:
            found = [label_of(row, self.label_column) for row in rows]
            if self.needs_label or any(col is not None for col, _ in found):
                values[self.conv.label] = [v for _, v in found]
            missing = [i for i, (col, _) in enumerate(found) if col is None]
        return values, missing

    def call_args(self, values: dict[str, Any], rows, columns, i: int | None = None, no_label: bool = False):
        """``(args, kwargs)`` of one call: the batch's (``i`` None) or sample ``i``'s (without
        its label parameter when ``no_label``)."""
        pick = (lambda v: v) if i is None else (lambda v: v[i])
        args = [pick(values[n]) for n in self._positional]
        skip = self.conv.label if no_label else None
        kwargs = {n: pick(values[n]) for n in self._keyword if n in values and n != skip}
        kwargs.update(self.fn_kwargs)
        for c in columns:
            if c in self._taken:
                continue
            if c in self._column_params or (self.conv.columns_by_kwargs and self.var_keyword):
                kwargs[c] = [row.get(c) for row in rows] if i is None else rows[i].get(c)
        return args, kwargs
