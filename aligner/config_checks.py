"""Checking a configuration: every problem is collected, each naming its key, the value and what
was expected, and all of them are reported in one error.

The actor's config, the critic server's config, the shared optimizer settings and the engine's
sampling parameters all check themselves this way: a ``problems()`` that returns a
:class:`Problems`, and one :meth:`Problems.raise_if_any` where the checks end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError", "Problems"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names every offending field."""


class Problems(list[str]):
    """The problems found so far, one message each (a plain list of strings otherwise)."""

    def expect(self, ok: bool, key: str, value: Any, expected: str) -> None:
        """Record ``key=value: expected <expected>`` unless ``ok``."""
        if not ok:
            self.append(f"{key}={value!r}: expected {expected}")

    def existing_file(self, key: str, path: str, expected: str = "an existing file") -> None:
        """``path`` (the value of ``key``) must name a file that exists."""
        self.expect(os.path.isfile(path), key, path, expected)

    def positive_ints(self, obj: Any, prefix: str, names: Iterable[str]) -> None:
        """Each ``obj.<name>`` must be an integer >= 1 (a bool is not an integer here)."""
        for n in names:
            v = getattr(obj, n)
            self.expect(_is_int(v) and v >= 1, f"{prefix}.{n}", v, "a positive integer")

    def non_negative_ints(self, obj: Any, prefix: str, names: Iterable[str]) -> None:
        """Each ``obj.<name>`` must be an integer >= 0."""
        for n in names:
            v = getattr(obj, n)
            self.expect(_is_int(v) and v >= 0, f"{prefix}.{n}", v, "an integer >= 0")

    def raise_if_any(self, what: str, error: type[Exception] = ValueError) -> None:
        """Raise ``error`` listing every problem, one per line, under ``invalid <what>``."""
        if self:
            raise error(f"invalid {what} ({len(self)} problem(s)):\n  " + "\n  ".join(self))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
