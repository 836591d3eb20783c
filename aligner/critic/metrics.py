"""Metrics of the critic server: JSONL, TensorBoard and the log.

``<log.dir>/metrics.jsonl`` (and ``tensorboard/``) hold one row per applied train step, written
with the project's :class:`aligner.metrics.MetricsLogger` (so ``aligner.metrics.read_metrics``
reads it like the actor's): ``critic/vf_loss``, ``critic/grad_norm``, ``critic/vf_explained_var``,
``critic/vf_clipfrac``, ``timers/critic_train_ms`` and the request statistics since the
previous row. Request statistics of intervals without training (every ``log.stats_interval_s``,
and at shutdown) go to ``<log.dir>/requests.jsonl``. Request statistics are
``server/<model>/requests`` (requests answered), ``.../executions`` (calls of the model's
callable: Triton's dynamic batcher may merge several requests into one), ``.../errors``
(failed executions), ``.../rows``, ``.../requests_per_execution_mean`` and ``..._max``,
``.../latency_ms_mean`` and ``.../latency_ms_max`` (per execution).

Writing metrics never fails a request nor stops the server: a row that cannot be written (a full
disk, a permission) is dropped and counted (:attr:`MetricsWriter.dropped`, ``server_info``'s
``extra.metrics_dropped``), the first failure logged at once and later ones at most once a
minute (:class:`aligner.metrics.WriteFailures`); the next rows are tried again.

Merging is shown, not assumed: :meth:`RequestStats.batching` keeps, since start-up, how many
executions merged how many requests (``server_info``'s ``batching``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from aligner.metrics import JsonlFile, MetricsLogger, WriteFailures

__all__ = ["MetricsWriter", "RequestStats"]

log = logging.getLogger("aligner.critic")


class MetricsWriter:
    """Thread-safe writer of the critic's metrics (rank 0 only). No method raises for a file that
    cannot be written: the row is dropped and counted (:attr:`dropped`)."""

    def __init__(self, log_dir: str | Path, tensorboard: bool = True) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._tensorboard = tensorboard
        try:
            self._logger = MetricsLogger(str(self.dir), tensorboard=tensorboard)
        except Exception as e:  # tensorboard missing or broken: JSONL still works
            log.warning("TensorBoard disabled (%s: %s)", type(e).__name__, e)
            self._tensorboard = False
            self._logger = MetricsLogger(str(self.dir), tensorboard=False)
        # One count and one rate limit for every file of the folder.
        self.failures: WriteFailures = self._logger.failures
        self.failures.log = log
        self._requests = JsonlFile(self.dir / "requests.jsonl")
        self._closed = False

    @property
    def dropped(self) -> int:
        """Metric writes that failed and were dropped since start-up."""
        return self.failures.count

    def train_step(self, step: int, scalars: dict[str, float | int]) -> None:
        """One row of metrics.jsonl for an applied train step."""
        with self._lock:
            if not self._closed:
                self.failures.guard("metrics.jsonl", self._logger.log, int(step), scalars)

    def rewind(self, step: int) -> None:
        """The critic continues after ``step`` (a checkpoint was loaded; -1: a fresh start): rows
        of later train steps are dropped from metrics.jsonl and TensorBoard's view, so the steps
        that are redone replace them, as the actor's metrics do on a resume or a rollback."""
        with self._lock:
            if self._closed:
                return
            self.failures.guard("metrics.jsonl", self._logger.close)
            try:
                self._logger = MetricsLogger(str(self.dir), tensorboard=self._tensorboard, resume_step=step)
            except Exception as e:  # a full disk, a permission: keep writing where possible
                self.failures("metrics.jsonl", e)
                self._logger = MetricsLogger(str(self.dir), tensorboard=False)
            self._logger.failures = self.failures

    def requests(self, critic_step: int, scalars: dict[str, float | int]) -> None:
        """One row of requests.jsonl (request statistics of an interval)."""
        if not scalars:
            return
        with self._lock:
            if not self._closed:
                row = {"time": round(time.time(), 3), "critic_step": int(critic_step), **scalars}
                self.failures.guard(
                    "requests.jsonl", self._requests.write, json.dumps(row, sort_keys=True) + "\n"
                )

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._logger.close()
                self.failures.guard("requests.jsonl", self._requests.close)


class RequestStats:
    """Counts and latencies per model since the last :meth:`snapshot`, and since start-up
    (thread-safe). One :meth:`record` per execution of a model's callable, which may have
    answered several requests that Triton merged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        self.totals: dict[str, int] = {}
        """Requests answered per model since start-up."""
        self.total_executions: dict[str, int] = {}
        """Executions per model since start-up."""
        self.total_seconds: dict[str, float] = {}
        """Seconds spent in executions per model since start-up."""
        self.total_rows: dict[str, int] = {}
        """Rows answered per model since start-up."""
        self.merged: dict[str, dict[int, int]] = {}
        """Per model, since start-up: requests in one execution -> how many executions had that many."""

    def _reset(self) -> None:
        self._executions: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._rows: dict[str, int] = {}
        self._merged_max: dict[str, int] = {}
        self._lat_sum: dict[str, float] = {}
        self._lat_max: dict[str, float] = {}

    def record(self, model: str, seconds: float, ok: bool, rows: int = 0, requests: int = 1) -> None:
        """One execution of ``model`` that took ``seconds``, answered ``requests`` requests (more
        than one when Triton merged them) with ``rows`` rows in all, or failed (``ok`` False)."""

        def add(d: dict, key, n) -> None:
            d[key] = d.get(key, 0) + n

        with self._lock:
            add(self._executions, model, 1)
            add(self._requests, model, requests)
            add(self.totals, model, requests)
            add(self.total_executions, model, 1)
            add(self.total_seconds, model, seconds)
            add(self.total_rows, model, rows)
            add(self.merged.setdefault(model, {}), requests, 1)
            if not ok:
                add(self._errors, model, 1)
            add(self._rows, model, rows)
            self._merged_max[model] = max(self._merged_max.get(model, 0), requests)
            add(self._lat_sum, model, seconds)
            self._lat_max[model] = max(self._lat_max.get(model, 0.0), seconds)

    def lifetime(self) -> dict[str, dict[str, float]]:
        """Requests, executions and total seconds spent in executions per model since start-up."""
        with self._lock:
            return {
                m: {
                    "requests": n,
                    "executions": self.total_executions.get(m, 0),
                    "seconds": round(self.total_seconds.get(m, 0.0), 6),
                }
                for m, n in self.totals.items()
            }

    def batching(self, model: str) -> dict[str, object]:
        """How the executions of ``model`` merged requests since start-up: ``executions``,
        ``requests``, ``rows``, ``requests_per_execution_mean`` and ``_max``, and
        ``requests_per_execution``, a histogram (requests in one execution, as a string -> how
        many executions had that many)."""
        with self._lock:
            hist = dict(sorted(self.merged.get(model, {}).items()))
            executions = self.total_executions.get(model, 0)
            requests = self.totals.get(model, 0)
            return {
                "executions": executions,
                "requests": requests,
                "rows": self.total_rows.get(model, 0),
                "requests_per_execution_mean": round(requests / executions, 4) if executions else 0.0,
                "requests_per_execution_max": max(hist, default=0),
                "requests_per_execution": {str(k): v for k, v in hist.items()},
            }

    def snapshot(self) -> dict[str, float | int]:
        """The interval's statistics as metric names -> values, and start a new interval."""
        with self._lock:
            out: dict[str, float | int] = {}
            for m, n in self._executions.items():
                out[f"server/{m}/requests"] = self._requests.get(m, 0)
                out[f"server/{m}/executions"] = n
                out[f"server/{m}/errors"] = self._errors.get(m, 0)
                out[f"server/{m}/rows"] = self._rows.get(m, 0)
                out[f"server/{m}/requests_per_execution_mean"] = round(self._requests.get(m, 0) / n, 4)
                out[f"server/{m}/requests_per_execution_max"] = self._merged_max.get(m, 0)
                out[f"server/{m}/latency_ms_mean"] = round(1000 * self._lat_sum[m] / n, 3)
                out[f"server/{m}/latency_ms_max"] = round(1000 * self._lat_max[m], 3)
            self._reset()
            return out
