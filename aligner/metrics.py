"""Run metrics: one JSONL line per step, TensorBoard scalars and text, and a console line.

Only the logging rank constructs an enabled logger; every other rank gets a disabled one, so
who logs is decided in one place (the entry point).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

__all__ = ["MetricsLogger", "read_metrics", "format_console"]

# The metrics shown on the console line and progress bar, in this order.
CONSOLE_KEYS = ("objective/scores", "objective/kl", "policy/clipfrac", "loss/value", "timers/step")


class MetricsLogger:
    def __init__(self, run_dir: str | None, *, tensorboard: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

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

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


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
