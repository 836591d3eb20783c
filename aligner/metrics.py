"""Run metrics: one JSONL line per step, TensorBoard scalars, histograms and text, Weights & Biases (when
configured), and a console line; and the step's timers (``timers/<part>``).

Only the logging rank constructs an enabled logger; every other rank gets a disabled one, so
who logs is decided in one place (the entry point).

Writing metrics never fails the step they describe: a write that fails (a full disk, a
permission, a dead TensorBoard writer) is dropped and counted (:class:`WriteFailures`), the first
failure logged at once and later ones at most once a minute; the next rows are tried again, and
a row cut short by a full disk costs that row alone (:class:`JsonlFile`, :func:`read_metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from aligner.config_checks import Problems

__all__ = [
    "JsonlFile",
    "MetricsLogger",
    "WriteFailures",
    "Timers",
    "WandbConfig",
    "WandbMissingError",
    "import_wandb",
    "read_metrics",
    "format_console",
]

WANDB_MODES = ("online", "offline", "disabled")
"""What ``logging.wandb.mode`` may say."""
WANDB_ID_FILE = "wandb_run_id.txt"
"""The W&B run id of a run directory (``<run_dir>/wandb_run_id.txt``): a resumed run continues it.
The actor resumes into a run directory (``resume_step`` >= 0) only when the directory is the
resumed run's own (:func:`aligner.actor.fingerprint.run_dir_continues`); else it passes -1: a new
W&B run."""
WANDB_INSTALL = "pip install 'aligner-rlhf[wandb]'"
SAMPLE_COLUMNS = ("prompt", "response", "score", "step")
"""The columns of the validation samples table (``validation/samples``) in W&B."""

# The metrics shown on the console line and progress bar, in this order.
CONSOLE_KEYS = {
    "objective/scores": "reward={:.4g}",
    "objective/kl": "kl={:.4g}",
    "policy/clipfrac": "clipfrac={:.3g}",
    "critic/vf_loss": "vf_loss={:.4g}",
    "timers/step": "{:.2f}s",
}
"""What the console line shows of a step's metrics, and how: ``step 12 reward=0.41 kl=0.031 ...``."""

log = logging.getLogger("aligner.metrics")


class WriteFailures:
    """Metric writes that failed and were dropped (a full disk, a permission): counted, the first
    logged at once, later ones at most once per ``every_s`` seconds with how many were dropped."""

    def __init__(self, where: str, logger: logging.Logger | None = None, every_s: float = 60.0) -> None:
        self.where = where
        """What is written (a folder), for the log line."""
        self.log = logger or log
        self.every_s = every_s
        self.count = 0
        """Writes dropped since start-up."""
        self._next_log = 0.0
        self._unlogged = 0
        self._lock = threading.Lock()  # a server's train and stats threads may both fail

    def __call__(self, sink: str, err: BaseException) -> None:
        """One write to ``sink`` failed with ``err``: count it, and log when it is time."""
        with self._lock:
            self.count += 1
            self._unlogged += 1
            now = time.monotonic()
            if now < self._next_log:
                return
            unlogged, self._unlogged, self._next_log = self._unlogged, 0, now + self.every_s
        self.log.warning(
            "cannot write metrics to %s in %s: %s: %s; the row is dropped and the run goes on "
            "(%d write(s) dropped since the last such line, %d since start-up; said at most every %.0f s)",
            sink,
            self.where,
            type(err).__name__,
            err,
            unlogged,
            self.count,
            self.every_s,
        )

    def guard(self, sink: str, fn: Any, *args: Any) -> bool:
        """``fn(*args)``; False (counted and logged) when it raised."""
        try:
            fn(*args)
        except Exception as e:
            self(sink, e)
            return False
        return True


class JsonlFile:
    """An append-only JSONL file written a whole row per call with ``os.write``: no buffer keeps a
    failed row to write later, and a row after one that failed (perhaps half written, on a full
    disk) starts on a new line, so the cut row alone is lost (:func:`read_metrics` skips it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._torn = False

    def write(self, text: str) -> None:
        """Append ``text`` (whole lines). Raises OSError when it could not all be written."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        view = memoryview((("\n" if self._torn else "") + text).encode())
        self._torn = True  # until every byte is written
        while view:
            view = view[os.write(self._fd, view) :]
        self._torn = False

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class Timers:
    """Wall-clock seconds of the named parts of one step, as the metrics ``timers/<name>``.

    ``timed = Timers()``, then ``with timed("generate"): ...`` around each part; a name timed
    twice adds up (a part may be spread over the step). Where CUDA is in use, each part starts
    and ends with a device synchronisation: kernels are queued asynchronously, and without it a
    part's time would be what the host took to queue them, and the next part's would include
    them (the phases would not add up to the step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        """``timers/<name>`` -> seconds, in the order the parts first ran."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        key = f"timers/{name}"
        self.seconds.setdefault(key, 0.0)
        _synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self.seconds[key] += time.perf_counter() - t


def _synchronize() -> None:
    """Wait for the current CUDA device's queued work, where CUDA has been initialised (never
    initialising it, nor importing torch: a CPU run pays nothing)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class WandbConfig:
    """Weights & Biases: a third sink beside metrics.jsonl and TensorBoard, with the same metric
    names at the same (PPO) steps, the validation samples as a table, and the run's config."""

    enabled: bool = False
    """Log to W&B (needs the wandb package: ``pip install 'aligner-rlhf[wandb]'``)."""
    project: str = "aligner"
    """The W&B project."""
    entity: str | None = None
    """The W&B entity (user or team); None: W&B's default for the logged-in user."""
    run_name: str | None = None
    """The run's display name; None: the name of the run directory."""
    mode: str = "online"
    """'online' (sync as it runs), 'offline' (write under ``dir``; ``wandb sync`` uploads it later)
    or 'disabled' (no W&B at all; the package is not needed)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    dir: str | None = None
    """Where W&B writes its files (a ``wandb/`` folder inside); None: the run directory."""

    def problems(self, prefix: str = "logging.wandb") -> Problems:
        """The values that cannot work, and a missing wandb package when W&B is on."""
        e = Problems()
        e.expect(self.mode in WANDB_MODES, f"{prefix}.mode", self.mode, f"one of {list(WANDB_MODES)}")
        e.expect(
            isinstance(self.project, str) and bool(self.project.strip()),
            f"{prefix}.project",
            self.project,
            "a non-empty project name",
        )
        tags = list(self.tags) if isinstance(self.tags, list | tuple) else None
        e.expect(
            tags is not None and all(isinstance(t, str) and t for t in tags),
            f"{prefix}.tags",
            self.tags,
            "a list of non-empty strings",
        )
        if self.active:
            try:
                import_wandb()
            except WandbMissingError:
                e.append(
                    f"{prefix}.enabled=True: the wandb package is not installed ({WANDB_INSTALL}); "
                    f"or set {prefix}.enabled=false"
                )
        return e

    @property
    def active(self) -> bool:
        """Whether a run is logged to W&B (enabled, and a mode other than 'disabled')."""
        return bool(self.enabled) and self.mode != "disabled"


class WandbMissingError(ImportError):
    """W&B logging was asked for and the wandb package is not installed."""


def import_wandb() -> Any:
    """The ``wandb`` module, imported on first use; a :class:`WandbMissingError` naming the
    install command when it is not installed."""
    try:
        import wandb
    except ImportError as err:
        raise WandbMissingError(
            f"logging.wandb.enabled=true needs the wandb package, which is not installed: {WANDB_INSTALL} "
            f"(or set logging.wandb.enabled=false) [{type(err).__name__}: {err}]"
        ) from err
    return wandb


class MetricsLogger:
    """``resume_step``: the run continues after this step (a resume): rows of later steps, written
    before the run stopped, are dropped from the JSONL files and from TensorBoard's view, so the
    curves of a resumed run read as one run. ``-1`` is a fresh start in a run directory that may
    hold an earlier run's rows (dropped, and a new W&B run); None appends to what is there.

    ``wandb`` (a :class:`WandbConfig`) adds Weights & Biases with ``run_config`` (a plain dict, the
    run's whole config) as the W&B config. The W&B run id is kept in ``<run_dir>/wandb_run_id.txt``:
    a resume continues the same W&B run. W&B takes only increasing steps, so rows of steps it has
    already been sent (the steps a resume or a rollback redoes) go to the JSONL files and
    TensorBoard only, which the console says once."""

    def __init__(
        self,
        run_dir: str | None,
        *,
        tensorboard: bool = True,
        enabled: bool = True,
        resume_step: int | None = None,
        print_fn: Any = print,
        wandb: WandbConfig | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self.print_fn = print_fn
        self.failures = WriteFailures(str(run_dir))
        """Writes that failed and were dropped (``failures.count``)."""
        self._jsonl: JsonlFile | None = None
        self._samples: JsonlFile | None = None
        self._tb = None
        self._tb_dir: str | None = None
        self._tb_broken = False
        self._wandb: _WandbSink | None = None
        if not self.enabled:
            return
        if wandb is not None and wandb.active:
            import_wandb()  # not installed: a WandbMissingError naming the install command
            wandb.problems().raise_if_any("W&B logging config")
        os.makedirs(run_dir, exist_ok=True)
        jsonl = os.path.join(run_dir, "metrics.jsonl")
        samples = os.path.join(run_dir, "val_samples.jsonl")
        if wandb is not None and wandb.active:
            # Before the JSONL rows are truncated: their last step is the last step W&B was sent
            # (every row goes to the JSONL file first).
            logged = max(_last_step(jsonl), _last_step(samples))
            self._wandb = _WandbSink(wandb, run_dir, run_config, resume_step, logged, print_fn)
        if resume_step is not None:
            for path in (jsonl, samples):
                _truncate_after(path, resume_step)
        self._jsonl = JsonlFile(jsonl)
        self._samples = JsonlFile(samples)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb_dir = os.path.join(run_dir, "tensorboard")
            self._tb = SummaryWriter(log_dir=self._tb_dir, purge_step=purge)

    @property
    def dropped(self) -> int:
        """Metric writes that failed and were dropped since start-up."""
        return self.failures.count

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One row of ``metrics`` at ``step`` to every sink. Never raises for a sink that cannot
        be written (:class:`WriteFailures`)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        row = json.dumps({"step": step, "time": time.time(), **clean}, allow_nan=True) + "\n"
        self.failures.guard("metrics.jsonl", self._jsonl.write, row)

        def scalars(tb: Any) -> None:
            for k, v in clean.items():
                if math.isfinite(v):
                    tb.add_scalar(k, v, step)

        self._to_tensorboard(scalars)
        if self._wandb is not None:
            self.failures.guard("W&B", self._wandb.log, step, clean)

    def _to_tensorboard(self, write: Any) -> None:
        """``write(summary_writer)``; after a failure (its writer thread dies with the error) the
        next call opens a new event file first, so TensorBoard resumes when the disk has room."""
        if self._tb_broken and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            old, self._tb = self._tb, None
            with suppress(Exception):
                old.close()
            try:
                self._tb = SummaryWriter(log_dir=self._tb_dir)
                self._tb_broken = False
            except Exception as e:
                self.failures("tensorboard", e)
                return
        if self._tb is not None and not self.failures.guard("tensorboard", write, self._tb):
            self._tb_broken = True

    def histograms(self, step: int, hists: dict[str, Any]) -> None:
        """Histograms (:class:`aligner.histograms.Histogram`, by name) at ``step``: TensorBoard
        and W&B only (metrics.jsonl keeps the scalars ``<name>/mean``, ``/max``, ``/min``)."""
        if not self.enabled or not hists:
            return

        def write(tb: Any) -> None:
            for name, h in hists.items():
                h.to_tensorboard(tb, name, step)

        self._to_tensorboard(write)
        if self._wandb is not None:
            self.failures.guard("W&B", self._wandb.histograms, step, hists)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self._to_tensorboard(lambda tb: tb.add_text(tag, text, step))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A small table of prompts, responses and scores: console, ``val_samples.jsonl`` and
        TensorBoard text (``validation/samples``)."""
        if not self.enabled or not rows:
            return
        text = "".join(json.dumps({"step": step, **r}) + "\n" for r in rows)
        self.failures.guard("val_samples.jsonl", self._samples.write, text)
        table = format_samples(rows)
        self.text(step, "validation/samples", table)
        if self._wandb is not None:
            self.failures.guard("W&B", self._wandb.samples, step, rows)
        if self.print_fn is not None:
            self.print_fn(f"validation samples at step {step}:\n{table}")

    def close(self) -> None:
        """Close every sink (a sink that fails to flush is counted and logged, never raised)."""
        for name in ("_jsonl", "_samples", "_tb", "_wandb"):
            sink = getattr(self, name)
            if sink is not None:
                setattr(self, name, None)
                if name == "_tb":
                    self.failures.guard("tensorboard", sink.flush)
                self.failures.guard(name.lstrip("_"), sink.close)


class _WandbSink:
    """One W&B run of a run directory, continued by id across resumes and rollbacks; sends only
    steps above every step it was sent before (``logged``: the last step of the JSONL rows before
    a resume truncated them)."""

    def __init__(
        self,
        cfg: WandbConfig,
        run_dir: str,
        run_config: dict[str, Any] | None,
        resume_step: int | None,
        logged: int,
        print_fn: Any,
    ) -> None:
        wandb = import_wandb()
        self.print_fn = print_fn
        id_path = os.path.join(run_dir, WANDB_ID_FILE)
        run_id = None
        if resume_step != -1 and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        # Steps <= floor are in the W&B run already; a new W&B run has none.
        self.floor = logged if run_id is not None else -1
        if run_id is None:
            run_id = _new_run_id()
            tmp = f"{id_path}.tmp"
            with open(tmp, "w") as f:
                f.write(run_id + "\n")
            os.replace(tmp, id_path)
        wandb_dir = cfg.dir or run_dir
        os.makedirs(wandb_dir, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name or os.path.basename(os.path.abspath(run_dir)),
            mode=cfg.mode,
            tags=list(cfg.tags) or None,
            dir=wandb_dir,
            id=run_id,
            resume="allow",
        )
        if run_config:
            # A resume may change some values (the learning rate, the step budget): the newest win.
            self.run.config.update(run_config, allow_val_change=True)
        # An online run resumed by W&B knows its own last step (starting_step is the next one).
        self.floor = max(self.floor, int(getattr(self.run, "starting_step", 0) or 0) - 1)
        self.last = self.floor
        self._warned = False
        self._table = wandb.Table
        self._wandb = wandb

    def _accept(self, step: int) -> bool:
        """Whether W&B takes a row of ``step``: above every earlier run's step, and not below this
        run's last (rows of one step may come in several calls)."""
        if step > self.floor and step >= self.last:
            self.last = step
            return True
        if not self._warned and self.print_fn is not None:
            self._warned = True
            self.print_fn(
                f"W&B: run {self.run.id} already has step {max(self.last, self.floor)}; rows of steps up "
                "to it (redone after a resume or rollback) go to metrics.jsonl and TensorBoard only "
                "(W&B takes steps in increasing order)"
            )
        return False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._accept(step):
            self.run.log(metrics, step=step)

    def histograms(self, step: int, hists: dict[str, Any]) -> None:
        if self._accept(step):
            self.run.log({name: h.to_wandb(self._wandb) for name, h in hists.items()}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self._accept(step):
            data = [[str(r["prompt"]), str(r["response"]), float(r["score"]), int(step)] for r in rows]
            self.run.log(
                {"validation/samples": self._table(columns=list(SAMPLE_COLUMNS), data=data)}, step=step
            )

    def close(self) -> None:
        self.run.finish()


def _new_run_id() -> str:
    """A W&B run id of the kind W&B draws itself: 8 lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _last_step(path: str) -> int:
    """The largest step of the JSONL rows of ``path`` (-1 when there is none)."""
    last = -1
    if not os.path.isfile(path):
        return last
    with open(path) as f:
        for line in f:
            try:
                last = max(last, int(json.loads(line).get("step", -1)))
            except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
                continue
    return last


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
                try:
                    row = json.loads(line)
                    rows[int(row["step"])] = row
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a row cut short by a full disk or a crash
    return [rows[k] for k in sorted(rows)]


def format_console(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for k, fmt in CONSOLE_KEYS.items():
        if k in metrics:
            parts.append(fmt.format(metrics[k]))
    return " ".join(parts)
