"""Run metrics: one JSONL line per step, TensorBoard scalars and text, and a console line; and
the step's timers (``timers/<part>``).

Only the logging rank constructs an enabled logger; every other rank gets a disabled one, so
who logs is decided in one place (the entry point).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["MetricsLogger", "Timers", "read_metrics", "format_console"]

# The metrics shown on the console line and progress bar, in this order.
CONSOLE_KEYS = ("objective/scores", "objective/kl", "policy/clipfrac", "loss/value", "timers/step")


class Timers:
    """Wall-clock seconds of the named parts of one step, as the metrics ``timers/<name>``.

    ``timed = Timers()``, then ``with timed("generate"): ...`` around each part; a name timed
    twice adds up (a part may be spread over the step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        """``timers/<name>`` -> seconds, in the order the parts first ran."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        key = f"timers/{name}"
        self.seconds.setdefault(key, 0.0)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] += time.perf_counter() - t


class MetricsLogger:
    """``resume_step``: the run continues after this step (a resume): rows of later steps, written
    before the run stopped, are dropped from the JSONL files and from TensorBoard's view, so the
    curves of a resumed run read as one run."""

    def __init__(
        self,
        run_dir: str | None,
        *,
        tensorboard: bool = True,
        enabled: bool = True,
        resume_step: int | None = None,
        print_fn: Any = print,
    ) -> None:
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self.print_fn = print_fn
        self._jsonl = None
        self._samples = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        jsonl = os.path.join(run_dir, "metrics.jsonl")
        samples = os.path.join(run_dir, "val_samples.jsonl")
        if resume_step is not None:
            for path in (jsonl, samples):
                _truncate_after(path, resume_step)
        self._jsonl = open(jsonl, "a", buffering=1)
        self._samples = open(samples, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}, allow_nan=True) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A small table of prompts, responses and scores: console, ``val_samples.jsonl`` and
        TensorBoard text (``val/samples``)."""
        if not self.enabled or not rows:
            return
        for r in rows:
            self._samples.write(json.dumps({"step": step, **r}) + "\n")
        table = format_samples(rows)
        self.text(step, "val/samples", table)
        if self.print_fn is not None:
            self.print_fn(f"validation samples at step {step}:\n{table}")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def _truncate_after(path: str, step: int) -> None:
    """Keep only the JSONL rows of ``path`` whose step is <= ``step`` (rewritten atomically)."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def format_samples(rows: list[dict[str, Any]]) -> str:
    """Markdown table of prompt | response | score (TensorBoard renders it; readable as text)."""

    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| prompt | response | score |", "|---|---|---|"]
    out += [f"| {cell(r['prompt'])} | {cell(r['response'])} | {r['score']:.3f} |" for r in rows]
    return "\n".join(out)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file (the newest row wins for a repeated step)."""
    rows: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def format_console(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for k in CONSOLE_KEYS:
        if k in metrics:
            parts.append(f"{k.split('/')[-1]}={metrics[k]:.4g}")
    return " ".join(parts)
