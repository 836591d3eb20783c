"""Metrics of the critic server: JSONL, TensorBoard and the log.

``<log.dir>/metrics.jsonl`` (and ``tensorboard/``) hold one row per applied train step, written
with the project's :class:`aligner.metrics.MetricsLogger` (so ``aligner.metrics.read_metrics``
reads it like the actor's): ``loss/value``, ``critic/grad_norm``, ``critic/explained_variance``,
``critic/value_clipfrac``, ``timers/critic_train_ms`` and the request statistics since the
previous row. Request statistics of intervals without training (every ``log.stats_interval_s``,
and at shutdown) go to ``<log.dir>/requests.jsonl``. Request statistics are
``server/<model>/requests``, ``.../errors``, ``.../rows``, ``.../latency_ms_mean`` and
``.../latency_ms_max``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

__all__ = ["MetricsWriter", "RequestStats"]

log = logging.getLogger("aligner.critic")


class MetricsWriter:
    """Thread-safe writer of the critic's metrics (rank 0 only)."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True) -> None:
        from aligner.metrics import MetricsLogger

        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._logger = MetricsLogger(str(self.dir), tensorboard=tensorboard)
        except Exception as e:  # tensorboard missing or broken: JSONL still works
            log.warning("TensorBoard disabled (%s: %s)", type(e).__name__, e)
            self._logger = MetricsLogger(str(self.dir), tensorboard=False)
        self._requests = open(self.dir / "requests.jsonl", "a", buffering=1)
        self._closed = False

    def train_step(self, step: int, scalars: dict[str, float | int]) -> None:
        """One row of metrics.jsonl for an applied train step."""
        with self._lock:
            if not self._closed:
                self._logger.log(int(step), scalars)

    def requests(self, critic_step: int, scalars: dict[str, float | int]) -> None:
        """One row of requests.jsonl (request statistics of an interval)."""
        if not scalars:
            return
        with self._lock:
            if not self._closed:
                row = {"time": round(time.time(), 3), "critic_step": int(critic_step), **scalars}
                self._requests.write(json.dumps(row, sort_keys=True) + "\n")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._logger.close()
                self._requests.close()


class RequestStats:
    """Counts and latencies per model since the last :meth:`snapshot` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        self.totals: dict[str, int] = {}
        self.total_seconds: dict[str, float] = {}

    def _reset(self) -> None:
        self._count: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._rows: dict[str, int] = {}
        self._lat_sum: dict[str, float] = {}
        self._lat_max: dict[str, float] = {}

    def record(self, model: str, seconds: float, ok: bool, rows: int = 0) -> None:
        with self._lock:
            self._count[model] = self._count.get(model, 0) + 1
            self.totals[model] = self.totals.get(model, 0) + 1
            self.total_seconds[model] = self.total_seconds.get(model, 0.0) + seconds
            if not ok:
                self._errors[model] = self._errors.get(model, 0) + 1
            self._rows[model] = self._rows.get(model, 0) + rows
            self._lat_sum[model] = self._lat_sum.get(model, 0.0) + seconds
            self._lat_max[model] = max(self._lat_max.get(model, 0.0), seconds)

    def lifetime(self) -> dict[str, dict[str, float]]:
        """Requests and total seconds spent in the server per model since start-up."""
        with self._lock:
            return {
                m: {"requests": n, "seconds": round(self.total_seconds.get(m, 0.0), 6)}
                for m, n in self.totals.items()
            }

    def snapshot(self) -> dict[str, float | int]:
        """The interval's statistics as metric names -> values, and start a new interval."""
        with self._lock:
            out: dict[str, float | int] = {}
            for m, n in self._count.items():
                out[f"server/{m}/requests"] = n
                out[f"server/{m}/errors"] = self._errors.get(m, 0)
                out[f"server/{m}/rows"] = self._rows.get(m, 0)
                out[f"server/{m}/latency_ms_mean"] = round(1000 * self._lat_sum[m] / n, 3)
                out[f"server/{m}/latency_ms_max"] = round(1000 * self._lat_max[m], 3)
            self._reset()
            return out
