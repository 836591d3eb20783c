"""The critic server's entry point: binds :class:`~aligner.critic.service.CriticService` to
PyTriton and runs its lifecycle.

    python -m aligner.critic.server                                  # READY grpc://127.0.0.1:8001
    aligner-serve-critic server.grpc_port=9001 reward.fn=aligner.tasks.digits:copy_reward
    torchrun --nproc_per_node 2 -m aligner.critic.server parallel.tensor_model_parallel_size=2
    torchrun --nproc_per_node 4 -m aligner.critic.server parallel.tensor_model_parallel_size=2 \
        parallel.data_parallel_size=2

Configuration: ``critic.yaml`` of :mod:`aligner.configs` (package data, so an installed package
finds it), backed by :class:`~aligner.critic.config.CriticServerConfig`: overrides go on the
command line, and unknown keys and ill-typed values are errors that name the key. Hydra writes
nothing into the working directory (no outputs/ folder, no .hydra/, no log file); the server's
own logs and metrics go to ``log.dir``. ``servers/serve_critic.py`` forwards here.

Errors. PyTriton 0.7 turns an exception raised by an inference callable into a Triton error
for *every* request of that execution, and the server stays up (checked in
``tests/critic/test_critic_server.py``). Triton itself rejects a wrong dtype, rank, fixed
dimension or an over-long critic_infer batch per request, before the dynamic batcher merges
anything. What is left, value checks and the sizes of ``limits`` (checked before anything is
decoded or parsed), is done per request inside the callables, which take PyTriton's raw request
list (no ``@batch``) for exactly this reason: a lone bad request gets its own
:class:`~aligner.wire.protocol.ProtocolError`. When the batcher has merged a bad critic_infer
request with good ones, PyTriton cannot fail just one of them; nothing is run, and every request
of that execution gets one :class:`~aligner.wire.protocol.BatchPeerError`, marked
:data:`~aligner.wire.protocol.BATCH_PEER_MARK`, which says how many requests broke the contract
and which fields, and nothing any of them sent; it tells
:class:`~aligner.wire.client.RemoteCriticClient` (whose requests were validated before sending)
to retry. A request the reward function fails on is no such case: the others run as they would
alone, and the failing one gets its message in its ``error`` output (alone in its execution, as
its error). Training, save and load are never batched, so their errors are their own; their run
token and fencing are the service's checks.

Every error leaves a callable as the server composed it (:func:`~aligner.critic.errors.for_the_wire`):
its mark chosen by its type, the rest neutralized (no line breaks, no other mark), no chained
exception (whose text Triton would show), and an exception the server did not mean to raise
wrapped in a CriticServiceError naming its type. So the only mark in the text a client reads is
the one the server chose, at the start of its message.

Optional inputs. critic_infer's ``prompt_text``, ``response_text`` and ``extras`` are bound
with ``optional=True``: a request may leave them out, and ``server_info``'s ``infer_inputs``
names those this server needs (:attr:`~aligner.critic.service.CriticService.infer_inputs`).
Triton's dynamic batcher was seen to keep requests with different sets of inputs in separate
executions (``tests/critic/test_reward_inputs.py`` sends such requests together); if it merges them,
the callable still reads each request's own inputs, a request without ``extras`` gives the
reward function no columns, and one without texts the server needs is refused as any invalid
request of a merged execution is.

Ordering. critic_infer's ``after_step`` names the critic step its values must come from; the
callable waits for it (``server.infer_wait_s``) on a condition of the service's lock, which it
releases meanwhile, so critic_train, on a thread of its own, applies the step it waits for
(:mod:`aligner.critic.ordering`). Triton queues the next critic_infer requests meanwhile. A
request naming another server ``instance_id`` is refused first, fenced, and never waits.

Batching is shown, not assumed. ``critic_infer`` is bound with Triton's dynamic batcher
(``server.max_queue_delay_us``, ``server.preferred_batch_size``; ``server.dynamic_batching=false``
binds it without one, so that every request runs alone), and every execution records how many
requests it answered: ``server_info``'s ``batching`` (a histogram since start-up) and the
``server/critic_infer/requests_per_execution_*`` metrics (:mod:`aligner.critic.metrics`).

Replicas. With ``parallel.data_parallel_size`` > 1 this one front end serves TP x DP ranks: the
rows of each execution are split across the replicas, and each training step's gradients are
summed over them (:mod:`aligner.critic.replicas`). A rank that hangs, or a collective that fails,
ends the server (exit 1, nothing saved) for its supervisor to restart (:mod:`aligner.critic.liveness`).

Modes. ``mode: critic`` (the default) serves the critic and the reward source; ``mode:
reward_only`` serves the reward source alone, for critic-free actors: the same five models, with
critic_infer's values all zeros, critic_train, critic_save and critic_load refused naming the
mode, and ``server_info``'s ``critic`` false (:class:`~aligner.critic.service.CriticService`).

Lifecycle. :func:`run_server` checks ``$ALIGNER_SERVER_FAULT_AT`` (:mod:`aligner.faults`),
builds the service, loads the newest critic checkpoint with ``checkpoint.resume=auto``, requires
a run token when it serves beyond loopback or with HTTP on (making ``<log.dir>/run_token`` if none
was set) and drops ``$ALIGNER_RUN_TOKEN`` from its environment (:mod:`aligner.critic.security`),
prepares the environment PyTriton needs (``LD_LIBRARY_PATH`` to the interpreter's libdir, a
project-local cache), starts Triton on the configured (or free) ports (HTTP only when
``server.http_port`` is set; ``http=0`` in the PORTS line when off), prints ``PORTS ...`` and then
``READY grpc://host:port`` once every model is loaded and ``/v2/health/ready`` answers, and serves
until SIGTERM/SIGINT. Shutdown finishes the in-flight operation, saves the last applied step if
``checkpoint.save_on_sigterm``, stops Triton and returns 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from aligner import faults
from aligner.config_checks import ConfigError
from aligner.configs import CONFIG_PATH
from aligner.cpu_memory import tune_allocator
from aligner.critic.budget import MemoryBudget, request_bytes, work_factors
from aligner.critic.config import CriticServerConfig, build_config
from aligner.critic.errors import (
    PYTRITON_MISSING,
    CriticServiceError,
    PyTritonMissingError,
    for_the_wire,
    pytriton_missing,
)
from aligner.critic.host import (
    PortInUseError,
    check_ports_free,
    connectable_host,
    parallel_model_cleanup,
    prepare_environment,
    remove_stale_workspaces,
    setup_logging,
)
from aligner.critic.liveness import end_server, fatal_collective
from aligner.critic.metrics import MetricsWriter
from aligner.critic.security import (
    RefusalLog,
    TokenFileError,
    drop_token_env,
    hide_admin_token,
    info_for,
    server_run_token,
)
from aligner.critic.service import CriticService, start_state
from aligner.critic.tls import http_options, own_ready_url, pytriton_http_port
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.wire.protocol import (
    FENCED_MARK,
    INFER,
    INFO,
    LOAD,
    MODEL_NAMES,
    MODELS,
    OPTIONAL_INFER_INPUTS,
    SAVE,
    TRAIN,
    BatchPeerError,
    InferRequest,
    OtherInstanceError,
    ProtocolError,
    infer_error_wire,
    validate_infer,
    wire_text,
)
from aligner.wire.readiness import wait_ready

__all__ = ["CriticTritonServer", "run_server", "main"]

log = logging.getLogger("aligner.critic")


def _bytes_array(blob: bytes) -> np.ndarray:
    return np.array([blob], dtype=np.bytes_)


def _optional(request: Any, name: str) -> Any:
    """An optional input of one request (PyTriton's Request or a dict), or None when it was left out."""
    return request[name] if name in request.keys() else None


def _row_mark(error: Exception) -> str:
    """The mark of a failed request's ``error`` rows in a merged execution: the fenced one for a
    request that named another server instance, none for the others (errors of their own)."""
    return FENCED_MARK if isinstance(error, OtherInstanceError) else ""


class CriticTritonServer:
    """The five Triton models of the protocol, backed by one :class:`CriticService` (rank 0)."""

    def __init__(self, service: CriticService, cfg: CriticServerConfig, workspace_root: Path) -> None:
        self.service = service
        self.cfg = cfg
        s = cfg.server
        bind = s.host if s.host != "0.0.0.0" else "127.0.0.1"
        # None: HTTP off (the default; security.token_required_reason).
        self.http_port = None if s.http_port is None else s.http_port or free_port(bind)
        self.grpc_port = s.grpc_port or free_port(bind)
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.metrics_port = None
        if s.metrics_port is not None:
            self.metrics_port = s.metrics_port or free_port()
            while self.metrics_port in (self.http_port, self.grpc_port):
                self.metrics_port = free_port()
        self.pytriton_http_port = pytriton_http_port(s.tls, (self.grpc_port, self.metrics_port))  # TLS only
        self.host = s.host
        self.input_limits = cfg.limits.input_limits()
        """How large critic_infer's text inputs may be (``limits``), checked per request."""
        self.workspace_root = workspace_root
        self.triton = None
        self.refusals = RefusalLog(log)
        """Refused requests, one line per kind per minute (security.RefusalLog)."""
        self.budget = MemoryBudget(
            s.memory_budget_gb, work_factors(None if service.reward_only else service.model_cfg)
        )
        service.capacity = lambda: {
            "max_queue_size": s.max_queue_size if s.dynamic_batching else None,
            "max_batch_size": s.max_batch_size,
            **self.budget.stats(),
        }

    @property
    def grpc_url(self) -> str:
        return f"{self.cfg.server.tls.scheme}://{connectable_host(self.host)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """Empty when HTTP is off."""
        return "" if self.http_port is None else f"http://{connectable_host(self.host)}:{self.http_port}"

    # ------------------------------------------------------------------------------------------
    # Inference callables: each takes PyTriton's list of requests and returns one dict per request.
    # ------------------------------------------------------------------------------------------

    def _timed(self, model: str, fn, requests) -> list[dict[str, np.ndarray]]:
        """Run ``fn`` on one execution's ``requests`` and record it (time, rows, how many
        requests Triton merged into it)."""
        t0 = time.perf_counter()
        ok = False
        rows = 0
        nbytes = request_bytes(requests)  # once, for the budget's check and its clean-up
        try:
            if model != INFO:  # never refused: probes and readiness checks ask it
                self.budget.admit(model, nbytes)  # over the memory budget: nothing run
            out = fn(requests)
            ok = True
            rows = sum(int(next(iter(o.values())).shape[0]) for o in out) if model == INFER else len(out)
            return out
        except Exception as e:
            if fatal_collective(e):  # the ranks no longer agree: the main loop ends the server
                self.service.peers.fail(f"{model}: a collective between the server's ranks failed: {e}")
            if isinstance(e, (ProtocolError, CriticServiceError)):
                self.refusals.refused(model, e)  # expected: throttled, no traceback
            else:
                log.exception("%s failed", model)
            # No chained exception: Triton would show its text, which the server did not compose.
            raise for_the_wire(e, model) from None
        finally:
            self.budget.done(nbytes, failed=not ok)  # free heap memory back to the OS
            self.service.request_stats.record(model, time.perf_counter() - t0, ok, rows, len(requests))

    def infer_fn(self, requests) -> list[dict[str, np.ndarray]]:
        return self._timed(INFER, self._infer, requests)

    def _infer(self, requests) -> list[dict[str, np.ndarray]]:
        parsed: list[InferRequest] = []
        errors: list[tuple[int, ProtocolError]] = []
        require = self.service.required_inputs
        for i, r in enumerate(requests):
            try:
                parsed.append(
                    validate_infer(
                        r["tokens"],
                        r["lengths"],
                        r["prompt_lengths"],
                        self.service.limits,
                        # Each request's own optional inputs: Triton may merge requests that carry
                        # different sets of them (an absent one is not in that request's dict).
                        **{name: _optional(r, name) for name in OPTIONAL_INFER_INPUTS},
                        after_step=_optional(r, "after_step"),  # left out: any critic step
                        instance_id=_optional(r, "instance_id"),  # left out: any server instance
                        require=require,
                        input_limits=self.input_limits,
                    )
                )
            except ProtocolError as e:
                errors.append((i, e))
            except Exception as e:  # a request the checks could not read fails alone, as a bad one
                log.warning("critic_infer: request %d of %d unreadable: %r", i, len(requests), e)
                got = f"a request the checks could not read ({type(e).__name__})"
                errors.append((i, ProtocolError(INFER, "tokens", "a well-formed request", got)))
        if errors:
            if len(requests) == 1:
                raise errors[0][1]
            # One error for the whole execution (PyTriton cannot fail one request of a batch),
            # holding only what the server chose: counts and field names. The valid requests
            # retry; a bad one gets its own error when it runs alone.
            raise BatchPeerError(INFER, [(i, e.field) for i, e in errors], len(requests))
        # Each request once the critic step it asks for is held (aligner.critic.ordering).
        results = self.service.infer_many(parsed)
        if len(results) == 1 and isinstance(results[0], Exception):
            raise results[0]  # alone in its execution: its own Triton error
        # Merged: a request the reward function failed on, or whose critic step did not come or
        # is past, gets its message in its `error` output (PyTriton can fail only a whole
        # execution), the others their values and rewards; one for another server instance its
        # fenced refusal, marked (its own message: the client raises CriticRestartedError).
        return [
            infer_error_wire(wire_text(str(r) or type(r).__name__, _row_mark(r)), p.tokens.shape[0])
            if isinstance(r, Exception)
            else r.to_wire()
            for r, p in zip(results, parsed)
        ]

    def train_fn(self, requests) -> list[dict[str, np.ndarray]]:
        def run(reqs):
            out = []
            for r in reqs:
                res = self.service.train(
                    r["tokens"],
                    r["lengths"],
                    r["returns"],
                    r["old_values"],
                    r["mask"],
                    r["step"],
                    r["expected_step"],
                    run_token=r["run_token"],
                )
                out.append(res.to_wire())
            return out

        return self._timed(TRAIN, run, requests)

    def save_fn(self, requests) -> list[dict[str, np.ndarray]]:
        def run(reqs):
            out = []
            for r in reqs:
                self.service.save(r["step"], r["expected_step"], run_token=r["run_token"])
                out.append({"ok": np.ones((1, 1), dtype=np.int64)})
            return out

        return self._timed(SAVE, run, requests)

    def load_fn(self, requests) -> list[dict[str, np.ndarray]]:
        def run(reqs):
            out = []
            for r in reqs:
                self.service.load(r["step"], run_token=r["run_token"])
                out.append({"ok": np.ones((1, 1), dtype=np.int64)})
            return out

        return self._timed(LOAD, run, requests)

    def info_fn(self, requests) -> list[dict[str, np.ndarray]]:
        def run(reqs):
            # The full info to a caller that sends the run token (or when the server has none),
            # the public part to one that sends none (the probe, readiness checks).
            required = self.service.run_token
            return [
                {
                    "info": _bytes_array(
                        info_for(self.service.info(), required, _optional(r, "run_token")).to_json()
                    )
                }
                for r in reqs
            ]

        return self._timed(INFO, run, requests)

    # ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start Triton, bind the models and wait until all of them are ready."""
        try:
            from pytriton.model_config import DynamicBatcher, ModelConfig, QueuePolicy, Tensor
            from pytriton.triton import Triton, TritonConfig
        except ImportError as e:
            raise PyTritonMissingError(f"{PYTRITON_MISSING} ({e})") from None

        s = self.cfg.server
        check_ports_free(
            s.host,
            {"http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port},
        )
        log_dir = Path(self.cfg.log.dir).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        triton_cfg = TritonConfig(
            **http_options(s.host, self.http_port, self.pytriton_http_port, s.tls),  # and gRPC's TLS
            grpc_address=s.host,
            grpc_port=self.grpc_port,
            allow_metrics=self.metrics_port is not None,
            metrics_address=s.host if self.metrics_port is not None else None,
            metrics_port=self.metrics_port,
            exit_timeout_secs=s.exit_timeout_s,
            log_verbose=0,
            grpc_infer_allocation_pool_size=0,  # no request buffers kept (aligner.critic.budget)
            log_file=log_dir / "triton.log",
        )
        root = self.workspace_root
        # PyTriton puts Unix sockets in the workspace (e.g. critic_infer_0_0-server.sock); their
        # paths must fit in 107 bytes, so a deep workspace root falls back to a short one.
        if len(str(root)) > 60:
            import tempfile

            short = Path(tempfile.gettempdir()) / f"aligner-critic-{os.getuid()}"
            log.warning("PyTriton workspace root %s is too deep for Unix socket paths; using %s", root, short)
            root = short
            root.mkdir(parents=True, exist_ok=True)
        remove_stale_workspaces(root)
        workspace = root / f"critic-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.triton = Triton(config=triton_cfg, workspace=workspace)

        def tensors(specs) -> list[Any]:
            # An optional input may be left out of a request; Triton passes the request on
            # without it, and the dynamic batcher may merge it with requests that carry it
            # (the callable reads each request's own, see _infer).
            return [Tensor(name=t.name, dtype=t.dtype, shape=t.shape, optional=t.optional) for t in specs]

        fns = {
            INFER: self.infer_fn,
            TRAIN: self.train_fn,
            SAVE: self.save_fn,
            LOAD: self.load_fn,
            INFO: self.info_fn,
        }
        for name, spec in MODELS.items():
            if spec.batched:
                # Without a dynamic batcher Triton still takes [b, ...] inputs but runs every
                # request alone, and its queue has no bound (Triton has no queue policy then).
                batcher = (
                    DynamicBatcher(
                        max_queue_delay_microseconds=s.max_queue_delay_us,
                        preferred_batch_size=list(s.preferred_batch_size) or None,
                        # Full: Triton refuses the next request itself (aligner.critic.budget).
                        default_queue_policy=QueuePolicy(max_queue_size=s.max_queue_size),
                    )
                    if s.dynamic_batching
                    else None
                )
                mc = ModelConfig(batching=True, max_batch_size=s.max_batch_size, batcher=batcher)
            else:
                mc = ModelConfig(batching=False)
            self.triton.bind(
                model_name=name,
                infer_func=fns[name],
                inputs=tensors(spec.inputs),
                outputs=tensors(spec.outputs),
                config=mc,
                strict=True,
            )
        self.triton.run()
        hide_admin_token(os.getpid())  # Triton has read its arguments: off its command line
        wait_ready(own_ready_url(self.grpc_url, self.pytriton_http_port), timeout_s=120.0, models=MODEL_NAMES)

    def is_alive(self) -> bool:
        return self.triton is not None and self.triton.is_alive()

    def stop(self) -> None:
        """Stop Triton and clean PyTriton's workspace (its model proxies torn down concurrently)."""
        if self.triton is not None:
            parallel_model_cleanup(self.triton)
            self.triton.stop()
            self.triton = None


def run_server(cfg: CriticServerConfig) -> int:
    """Run the critic server until SIGTERM/SIGINT; returns the process exit code.

    Under torchrun, rank 0 serves and ranks > 0 follow it (see :mod:`aligner.critic.peers`):
    the TP peers of its replica and, with ``parallel.data_parallel_size`` > 1, the ranks of the
    other replicas (:mod:`aligner.critic.replicas`).
    """
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    stop = threading.Event()
    rank = int(os.environ.get("RANK", "0"))

    def _on_signal(signum, _frame):
        if rank == 0:
            log.info("received %s: finishing in-flight work and shutting down", signal.Signals(signum).name)
            stop.set()
        # Peers wait for rank 0's stop message: leaving now would hang its final save.

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    setup_logging(cfg.log.level, cfg.log.dir, rank)
    missing = pytriton_missing()
    if missing:
        print(f"critic server: {missing}", file=sys.stderr, flush=True)
        return 2
    try:
        faults.SERVER.parse(os.environ.get(faults.SERVER.env))
    except ValueError as e:
        print(f"critic server: {e}", file=sys.stderr, flush=True)
        return 2

    p = cfg.parallel
    problem = p.world_size_problem(int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        print(f"critic server: {problem}", file=sys.stderr, flush=True)
        return 2
    state = initialize(
        ParallelConfig(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            backend=p.backend,
            timeout_s=p.timeout_s,
        ),
        seed=cfg.seed,
    )
    log.info("CPU allocator: %s", tune_allocator(state.device.type))
    metrics = None
    server = None
    service = None
    try:
        if state.rank == 0:
            metrics = MetricsWriter(cfg.log.dir, tensorboard=cfg.log.tensorboard)
        service = CriticService(cfg, state, metrics=metrics)
        if state.rank == 0:
            start_state(service, cfg)
        drop_token_env()  # read: Triton and its backend stubs, started below, never hold it
        if state.rank != 0:
            service.serve_peers()
            return 0

        # Beyond loopback or with HTTP on, a token is required: made in log.dir if none was set.
        try:
            service.run_token = server_run_token(cfg, service.run_token)
        except TokenFileError as e:
            print(f"critic server: {e}", file=sys.stderr, flush=True)
            return 2
        workspace_root = prepare_environment(cfg.server.workspace_root)
        server = CriticTritonServer(service, cfg, workspace_root)
        try:
            server.start()
        except (PortInUseError, PyTritonMissingError) as e:
            print(f"critic server: {e}", file=sys.stderr, flush=True)
            server = None
            return 2
        log.info(
            "critic server ready: grpc %s, http %s, metrics %s",
            server.grpc_url,
            server.http_url or "off",
            server.metrics_port,
        )
        print(
            f"PORTS http={server.http_port or 0} grpc={server.grpc_port} metrics={server.metrics_port or 0} "
            f"pid={os.getpid()}",
            flush=True,
        )
        print(f"READY {server.grpc_url}", flush=True)
        next_stats = time.monotonic() + cfg.log.stats_interval_s
        while not stop.wait(0.25):
            if service.peers.lost:  # a hung rank or a failed collective: restart from the checkpoint
                end_server(service.peers.lost_reason)
            if not server.is_alive():
                log.error("Triton stopped unexpectedly; exiting")
                service.close(save=cfg.checkpoint.save_on_sigterm)
                return 1
            if time.monotonic() >= next_stats:
                service.flush_stats()
                next_stats = time.monotonic() + cfg.log.stats_interval_s
        saved = service.close(save=cfg.checkpoint.save_on_sigterm)
        if saved is not None:
            log.info("saved on shutdown: %s", saved)
        server.stop()
        server = None
        log.info("critic server stopped")
        return 0
    finally:
        if service is not None and state.rank == 0:
            service.close(save=False)  # releases TP peers if something above failed
        if server is not None:
            server.stop()
        if metrics is not None:
            metrics.close()
        destroy()


# The structured schema critic.yaml names in its defaults list (registered on import, as Hydra
# composes the config before main runs).
ConfigStore.instance().store(name="critic_schema", node=CriticServerConfig)


@hydra.main(config_path=CONFIG_PATH, config_name="critic", version_base=None)
def main(cfg: DictConfig) -> None:
    """``python -m aligner.critic.server [overrides]``, the ``aligner-serve-critic`` script: check
    the configuration (exit 2 naming every bad key), then serve until SIGTERM/SIGINT."""
    # One thread per process unless told otherwise (run_server sizes torch's pool by it; Triton's
    # backend processes inherit it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    missing = pytriton_missing()
    if missing:  # before the configuration: without the server extra nothing else can help
        print(f"critic server: {missing}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        checked = build_config(cfg)
    except ConfigError as e:
        print(f"critic server: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(run_server(checked))


if __name__ == "__main__":
    main()
