"""The critic/reward service: the model, its optimiser, the reward source, and the rules of
the protocol (validation, exactly-once training, save/load), independent of PyTriton.

One lock serialises every operation, so inference and training never race, and an infer is
computed only while the server holds the critic step it names (``after_step``: it waits for the
train of that step, :mod:`aligner.critic.ordering`). Who may change the state is checked
before the lock is taken (the run token), and against which state under it (fencing: a train or
save that expects another critic step than the one held is refused), in the order of
docs/design.md, "Wire protocol"; a refused request changes nothing. :class:`CriticService` composes
one collaborator per concern, built from the configuration with the models, the optimiser and the
reward sources by :func:`aligner.critic.build.build_parts`:

- :class:`~aligner.critic.exactly_once.AppliedSteps`: each step id applied once and in order,
  and the kept results that answer repeats;
- :class:`~aligner.critic.ordering.StepGate`: each infer computed with the critic step it asks for;
- :class:`~aligner.critic.value_update.ValueUpdate`: the forward and the value update, with the
  infer forward a train may reuse;
- :class:`~aligner.critic.peers.PeerLink`: the operations rank 0 broadcasts to the other ranks
  (and the heartbeat that keeps idle peers within the collective timeout);
- :class:`~aligner.critic.replicas.Replicas`: under data parallelism, each replica's rows of an
  infer and the values gathered back on rank 0 (a train splits its rows in the update itself);
- :class:`~aligner.critic.checkpointing.CriticCheckpoints`: save, prune, read and apply, with the
  shard exchange between ranks, and the rules that keep every step a request did not name (a
  save is labelled with the critic step held; pruning never removes a later step the server did
  not roll back from; leftovers of killed saves are cleaned at start-up).

Metrics and logs describe what happened; they never change it: a metrics writer that fails (a
full disk) after a train is counted and logged (rate-limited), and the applied step's result is
returned all the same. A load (or a fresh start) rewinds them: the steps redone replace the rows
of the abandoned ones, as in the actor's.

Reward-only mode (``mode: reward_only``, for critic-free actors): no critic, no optimizer and no
checkpoints are built; ``critic_infer`` answers the rewards with values of zeros ``[b, s-1]`` (the
wire stays what clients expect), ``critic_train``, ``critic_save`` and ``critic_load`` are refused
with a :class:`~aligner.wire.protocol.ProtocolError` naming the mode, and ``server_info`` says
``critic: false``.

Tensor and data parallelism. Rank 0 owns PyTriton and calls the public methods; every other
rank (the TP peers of rank 0 and the ranks of the other replicas) calls
:meth:`CriticService.serve_peers`, which runs what rank 0 broadcasts until it calls
:meth:`CriticService.close`. The rules (run token, exactly once, fencing) are checked on rank 0
alone, before anything is broadcast, so they hold for every replica at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aligner import faults
from aligner.critic.build import build_parts
from aligner.critic.checkpointing import LoadedCheckpoint
from aligner.critic.config import CriticServerConfig
from aligner.critic.errors import (
    CriticServiceError,
    RequestRewardError,
    ServiceClosedError,
    reward_only_refusal,
)
from aligner.critic.exactly_once import AppliedSteps
from aligner.critic.info import service_info
from aligner.critic.metrics import MetricsWriter, RequestStats
from aligner.critic.ordering import StepGate, other_instances
from aligner.critic.peers import Op
from aligner.critic.reward_fn import parse_extras, score_requests
from aligner.critic.reward_model import RewardTextError
from aligner.distributed import ParallelState
from aligner.metrics import WriteFailures
from aligner.wire.protocol import (
    INFER,
    LOAD,
    PROTOCOL_VERSION,
    SAVE,
    TEXT_INPUTS,
    TRAIN,
    FencedError,
    InferRequest,
    InferResponse,
    ProtocolError,
    ServerInfo,
    TrainRequest,
    TrainResult,
    check_run_token,
    critic_step_after_load,
    resolve_run_token,
    validate_expected_step,
    validate_infer,
    validate_run_token,
    validate_step,
    validate_train,
)

__all__ = ["CriticService", "start_state"]

log = logging.getLogger("aligner.critic")


class CriticService:
    """Critic (trained) + reward source (frozen), with the server's rules.

    Call :meth:`infer`, :meth:`train`, :meth:`save`, :meth:`load` and :meth:`info` on rank 0;
    peers call :meth:`serve_peers` and return when rank 0 calls :meth:`close`.
    """

    def __init__(
        self, cfg: CriticServerConfig, state: ParallelState, *, metrics: MetricsWriter | None = None
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.dp_rank, self.dp_size = state.dp_rank, state.dp_size
        self.is_rank0 = state.rank == 0
        self.device = state.device
        self.metrics = metrics
        self.metric_failures = WriteFailures(f"log.dir={cfg.log.dir}", log)
        """Calls of ``metrics`` that raised (counted and logged, never passed on)."""
        self.request_stats = RequestStats()
        self._lock = threading.Lock()
        self._closed = False
        self.applied = AppliedSteps()
        self.order = StepGate(self._lock, cfg.server.infer_wait_s)
        """critic_infer's wait for the critic step it asks for (rank 0)."""
        self.started_at = time.time()
        self.capacity: Callable[[], dict[str, Any]] | None = None
        """Set by the server that binds this service to Triton: its queue bound and memory budget
        (``server_info``'s ``extra.capacity``)."""
        self.instance_id = uuid.uuid4().hex
        """Made once per process start: a client that finds another one talks to another server."""
        # Checked at start-up by the config (a bad file is a config error naming the key).
        self.run_token = resolve_run_token(cfg.server.run_token_file, "server.run_token_file")
        # Collective: every rank builds its part (its TP shards; the rank layout).
        parts = build_parts(cfg, state, self._lock)
        self.reward_only = parts.reward_only
        """No critic: the server scores responses and nothing else (``mode: reward_only``)."""
        self.tokenizer = parts.tokenizer
        self.reward_fn = parts.reward_fn
        self.reward_model, self.rm_cfg = parts.reward_model, parts.rm_cfg
        self.reward_tokens = parts.reward_tokens
        """The reward model's own tokenizer when it reads text (None: it reads the critic's ids)."""
        self.init_source, self.model_cfg = parts.init_source, parts.model_cfg
        self.precision = parts.precision
        self.critic, self.optimizer = parts.critic, parts.optimizer
        self.model_forward = parts.model_forward
        self.update = parts.update
        self.limits = parts.limits
        self.peers, self.replicas = parts.peers, parts.replicas
        self.checkpoints = parts.checkpoints
        """The critic's checkpoints (None in reward-only mode: there is nothing to save)."""
        if self.is_rank0 and self.checkpoints is not None:
            self.checkpoints.clean_leftovers()  # of saves killed before this start

    @property
    def required_inputs(self) -> dict[str, str]:
        """critic_infer's optional inputs a request must carry -> why (``extras`` is not among
        them: a request without it counts as no columns)."""
        if self.reward_tokens is None:
            return {}
        why = (
            f"this server's reward model reads text with its own tokenizer ({self.reward_tokens.spec!r}, "
            "not the policy's), so the actor sends each sample's prompt and response text"
        )
        return dict.fromkeys(TEXT_INPUTS, why)

    @property
    def infer_inputs(self) -> list[str]:
        """critic_infer's optional inputs this server reads (``server_info``'s ``infer_inputs``)."""
        names = ["extras"] if self.reward_fn is not None else []
        return names + list(self.required_inputs)

    # -- State the collaborators keep

    @property
    def critic_step(self) -> int:
        """The critic step held: the last applied train step, or the step last loaded; -1 before either."""
        return self.applied.last

    @property
    def last_saved_step(self) -> int:
        """The step last saved or loaded; -1 before either (and always in reward-only mode)."""
        return -1 if self.checkpoints is None else self.checkpoints.last_saved

    @property
    def reuse_infer_forward(self) -> bool:
        """Whether a train takes the last infer forward of its tokens as its first pass."""
        return self.update.reuse_infer_forward

    @property
    def reused_forwards(self) -> int:
        """How many train steps took the kept infer forward as their first pass."""
        return self.update.reused_forwards

    # -- Public API (rank 0)

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceClosedError()

    def info(self) -> ServerInfo:
        """What clients check before they send anything (:func:`~aligner.critic.info.service_info`)."""
        return service_info(self)

    def infer(
        self,
        tokens: Any,
        lengths: Any,
        prompt_lengths: Any,
        after_step: Any = None,
        *,
        prompt_texts: Any = None,
        response_texts: Any = None,
        extras: Any = None,
        instance_id: Any = None,
    ) -> InferResponse:
        """Values and rewards of one batch (validated here).

        Args:
            tokens: ``[b, s]`` int64; lengths, prompt_lengths: ``[b]`` or ``[b, 1]`` int64.
            after_step: the critic step the values must come from (an int, or int64 ``[b, 1]``),
                waited for (:mod:`aligner.critic.ordering`); None: any.
            prompt_texts, response_texts: ``b`` strings each (needed when the reward model reads
                text: :attr:`required_inputs`); extras: ``b`` JSON objects (the samples' extra
                data-set columns for the reward function), or None. instance_id: the caller's
                server instance (another one refuses the request); None: any.

        Returns:
            values ``[b, s-1]`` float32 and rewards ``[b]`` float32.

        Raises:
            RequestRewardError: the reward function (or the reward tokenizer) failed on these samples.
            StepWaitError, ProtocolError: the critic step asked did not come in time, or is past.
        """
        req = validate_infer(
            tokens,
            lengths,
            prompt_lengths,
            self.limits,
            prompt_text=prompt_texts,
            response_text=response_texts,
            extras=extras,
            after_step=after_step,
            instance_id=instance_id,
            require=self.required_inputs,
        )
        out = self.infer_many([req])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def infer_many(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Score several *validated* requests (e.g. merged by Triton's batcher), each with the
        critic step it asks for (``after_step``, waited for: :mod:`aligner.critic.ordering`) and
        in a forward of its own, its rows split across the data-parallel replicas (a reward model
        that reads text gets a second one of its own tokenizer's ids): a forward rounds a row by
        where it sits in the batch, so a request's values are the same bits however Triton
        merged it. The reward function runs once over the requests of one padded length.

        A request whose samples the reward function (or the reward tokenizer) fails on gets its
        :class:`~aligner.critic.errors.RequestRewardError` in its place, one whose critic step did
        not come or is past, or that names another server instance (checked first), its error
        (:mod:`aligner.critic.ordering`); the others what an unmerged call gives
        (:func:`~aligner.critic.reward_fn.score_requests`). Each request's optional inputs are its
        own: one without ``extras`` gives the reward function no columns.
        """
        out: list[InferResponse | Exception | None] = list(other_instances(requests, self.instance_id))
        # The reward model's own ids, tokenized before the lock (a failing request fails alone).
        rm_inputs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self.reward_tokens is not None:
            for i, r in [(i, r) for i, r in enumerate(requests) if out[i] is None]:
                missing = [n for n in TEXT_INPUTS if n not in r.texts()]
                if missing:  # validated requests carry them; an in-process caller may not
                    raise ProtocolError(
                        INFER, missing[0], self.required_inputs[missing[0]], "a request without it"
                    )
                try:
                    rm_inputs[i] = self.reward_tokens.encode(r.prompt_texts, r.response_texts)
                except RewardTextError as e:
                    log.warning("critic_infer: %s", e)
                    out[i] = e
        computed: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

        def forward(i: int) -> None:  # under the lock, while the critic step asked is held
            r = requests[i]
            self.peers.broadcast(Op.INFER, r.tokens, r.lengths)
            values, scores = self.replicas.forward(r.tokens, r.lengths)  # [b, s-1], [b] or None
            if i in rm_inputs:
                self.peers.broadcast(Op.SCORE, *rm_inputs[i])
                scores = self.replicas.score(*rm_inputs[i])
            computed[i] = (values, scores)

        with self._lock:
            self._check_open()
            asked = {i: r.after_step for i, r in enumerate(requests) if out[i] is None}
            refused = self.order.serve(asked, lambda: self.critic_step, forward, lambda: self._closed)
            faults.SERVER.hit("infer", self.critic_step)
            self.peers.touch()
        for i, e in refused.items():
            log.warning("critic_infer: %s", e)
            out[i] = e
        by_len: dict[int, list[int]] = {}
        for i in sorted(computed):
            by_len.setdefault(requests[i].tokens.shape[1], []).append(i)
        # The reward function needs no model: run it outside the lock, so a slow one does not
        # hold up training.
        for idx in by_len.values():
            parts = []
            for r in (requests[i] for i in idx):
                extras = None if r.extras is None else parse_extras(r.extras, len(r.lengths))
                parts.append((r.tokens, r.lengths, r.prompt_lengths, extras))
            fn_scores: list = [None] * len(idx)
            if self.reward_fn is not None:
                fn_scores = score_requests(self.reward_fn, self.cfg.reward.fn, self.tokenizer, parts)
            for i, fn_score in zip(idx, fn_scores):
                if isinstance(fn_score, RequestRewardError):
                    log.warning("critic_infer: %s", fn_score)
                    out[i] = fn_score
                else:
                    values, rm = computed[i]
                    out[i] = InferResponse(values, self._combine_rewards(fn_score, rm, len(values)))
        return out  # type: ignore[return-value]

    def train(
        self,
        tokens: Any,
        lengths: Any,
        returns: Any,
        old_values: Any,
        mask: Any,
        step: Any,
        expected_step: Any = None,
        *,
        run_token: Any = None,
    ) -> TrainResult:
        """Apply one critic update for ``step``, exactly once (:mod:`aligner.critic.exactly_once`).

        Checked in order (docs/design.md, "Wire protocol"): the contract; the run token; a
        repeated step id whose result is kept gets that result and changes nothing, whatever
        ``expected_step`` says; fencing: ``expected_step`` must be the critic step held (None:
        an in-process caller, not fenced); the in-order rule: a step older than the last applied
        one whose result is no longer kept is rejected. Shapes: tokens ``[b, s]``; lengths
        ``[b]``; returns, old_values, mask ``[b, s-1]``.

        Raises:
            ProtocolError, UnauthorizedError, FencedError: with nothing applied (a ProtocolError
            naming the mode in reward-only mode).
        """
        self._check_has_critic(TRAIN)
        req = validate_train(tokens, lengths, returns, old_values, mask, step, expected_step, self.limits)
        self._check_token(TRAIN, run_token)
        with self._lock:
            self._check_open()
            earlier = self.applied.kept(req.step)
            if earlier is not None:
                log.info("train step %d repeated: returning its earlier result, nothing applied", req.step)
                return earlier
            self._check_fence(TRAIN, req.step, req.expected_step)
            self.applied.check_new(req.step)
            b, s = req.tokens.shape
            self.peers.broadcast(
                Op.TRAIN, req.tokens, req.lengths, req.returns, req.old_values, req.mask, step=req.step
            )
            t0 = time.perf_counter()
            result = self.update.train_step(req)
            result = dataclasses.replace(result, train_ms=round(1000 * (time.perf_counter() - t0), 3))
            self.applied.record(req.step, result)
            self.order.moved()  # the infers that wait for this step
            self.peers.touch()
            elapsed = time.perf_counter() - t0
        log.info(
            "train step %d: loss %.5f grad_norm %.4f explained_variance %.3f (%.0f ms, %d rows)",
            result.applied_step,
            result.loss,
            result.grad_norm,
            result.explained_variance,
            1000 * elapsed,
            b,
        )
        scalars = {
            **result.metrics(),
            "critic/vf_explained_var": result.explained_variance,
        }
        self._write_metrics("train_step", req.step, lambda: {**scalars, **self.request_stats.snapshot()})
        return result

    def save(self, step: Any, expected_step: Any = None, *, run_token: Any = None) -> Path:
        """Write critic weights, optimiser, RNG and bookkeeping to ``<dir>/step_XXXXXXXX/critic/``,
        if the server holds critic step ``expected_step`` (None: an in-process caller, not
        fenced) and ``step`` is the critic step it holds (the weights written are that step's:
        :meth:`~aligner.critic.checkpointing.CriticCheckpoints.check_save`).

        Raises:
            ProtocolError, UnauthorizedError, FencedError: with nothing written.
        """
        self._check_has_critic(SAVE)
        step = validate_step(SAVE, step)
        expected = None if expected_step is None else validate_expected_step(SAVE, expected_step)
        self._check_token(SAVE, run_token)
        with self._lock:
            self._check_open()
            self._check_fence(SAVE, step, expected)
            self.checkpoints.check_save(step, self.critic_step)
            return self._save_locked(step)

    def load(self, step: Any, *, run_token: Any = None) -> None:
        """Restore the critic, optimiser, RNG and bookkeeping saved at ``step`` (resume); the
        server then holds critic step ``step`` (:func:`~aligner.wire.protocol.critic_step_after_load`).

        Raises:
            ProtocolError, UnauthorizedError, CriticServiceError: with nothing changed.
        """
        self._check_has_critic(LOAD)
        step = validate_step(LOAD, step)
        self._check_token(LOAD, run_token)
        with self._lock:
            self._check_open()
            loaded = self.checkpoints.read(step)  # raises before anything changes
            self.peers.broadcast(Op.LOAD, step=step)
            self._apply(loaded)
            self.order.moved()  # waiting infers look again: theirs may be the step loaded, or past
            self.peers.touch()
        log.info("loaded critic checkpoint step %d (critic step %d)", step, self.critic_step)

    def _check_has_critic(self, model: str) -> None:
        """Refuse a request that needs the critic in reward-only mode, naming the mode."""
        if self.reward_only:
            raise reward_only_refusal(model)

    def _check_token(self, model: str, run_token: Any) -> None:
        """The run token check of a mutating request: what came on the wire (a str or the BYTES
        input, empty for none) must be the server's token, if it has one. None: a caller that
        holds this service in-process (the server itself, tests), which needs none."""
        if run_token is not None:
            check_run_token(model, self.run_token, validate_run_token(model, run_token))

    def _check_fence(self, model: str, step: int, expected_step: int | None) -> None:
        """Refuse a request that expects another critic step than the one held (under the lock)."""
        if expected_step is not None and expected_step != self.critic_step:
            raise FencedError(model, step, expected_step, self.critic_step)

    def latest_checkpoint(self) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.latest()

    def close(self, *, save: bool = False) -> Path | None:
        """Finish the in-flight operation, optionally save the last applied step, release peers.

        Later calls of the public methods raise :class:`~aligner.critic.errors.ServiceClosedError`."""
        saved = None
        with self._lock:
            if self._closed:
                return None
            if save and self.critic_step >= 0 and self.last_saved_step != self.critic_step:
                try:
                    saved = self._save_locked(self.critic_step)
                except Exception:
                    log.exception("saving the critic at shutdown failed")
            self._closed = True
            self.order.moved()  # waiting infers leave (ServiceClosedError: their clients retry)
            self.peers.stop()
        self.flush_stats()
        return saved

    def flush_stats(self) -> None:
        """Write the request statistics of the last interval (called periodically by the server)."""
        self._write_metrics("requests", self.critic_step, self.request_stats.snapshot)

    def _write_metrics(self, method: str, step: int, scalars: Any) -> None:
        """``metrics.<method>(step, scalars())``. A failure (a full disk, a permission) is counted
        and logged, at most once a minute, and never raised: what the metrics describe happened."""
        if self.metrics is not None:
            self.metric_failures.guard(method, lambda: getattr(self.metrics, method)(step, scalars()))

    def _save_locked(self, step: int) -> Path:
        self.peers.broadcast(Op.SAVE, step=step)
        bookkeeping = {
            "critic_step": self.critic_step,
            "protocol_version": PROTOCOL_VERSION,
            "tokenizer": self.cfg.tokenizer,
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "init_source": self.init_source,
            "precision": self.precision,
            "results": self.applied.to_json(),
        }
        return self.checkpoints.save(step, bookkeeping)

    def _apply(self, loaded: LoadedCheckpoint) -> None:
        """Apply a checked checkpoint on this rank, with the bookkeeping it carries. The critic
        step held becomes the checkpoint's step: the initial critic (step 0, saved before any
        train) included."""
        self.update.drop_kept()  # computed with the weights being replaced
        meta = self.checkpoints.apply(loaded)
        self.applied.restore(critic_step_after_load(int(meta["step"])), meta["results"])
        self.rewind_metrics(self.critic_step)

    def rewind_metrics(self, step: int) -> None:
        """Metrics continue after ``step`` (-1: a fresh start; rank 0, never raises)."""
        if self.metrics is not None:
            self.metric_failures.guard("rewind", lambda: self.metrics.rewind(step))

    # -- Peers (every rank but 0)

    def serve_peers(self) -> None:
        """Run the operations rank 0 broadcasts until it closes the service (ranks > 0 only)."""
        assert not self.is_rank0
        for r in self.peers.operations():
            if r.op == Op.INFER:
                self.replicas.forward(*r.arrays)
            elif r.op == Op.SCORE:
                self.replicas.score(*r.arrays)
            elif r.op == Op.TRAIN:
                try:
                    self.applied.record(r.step, self.update.train_step(TrainRequest(*r.arrays, r.step)))
                except CriticServiceError as e:  # rank 0 fails the same way and reports it
                    log.warning("rank %d: %s", self.state.rank, e)
            elif r.op == Op.SAVE:
                self.checkpoints.send_shards()
            elif r.op == Op.LOAD:
                self._apply(self.checkpoints.receive())

    # -- Rewards

    def _combine_rewards(
        self, fn_scores: np.ndarray | None, rm_scores: np.ndarray | None, b: int
    ) -> np.ndarray:
        """Reward function (scaled) + standardised reward-model score, per sample: [b] float32."""
        r = self.cfg.reward
        total = np.zeros(b, dtype=np.float64)
        if fn_scores is not None:
            total += r.fn_scale * fn_scores
        if rm_scores is not None:
            total += (rm_scores.astype(np.float64) - r.model_mean) / r.model_std
        return total.astype(np.float32)


def start_state(service: CriticService, cfg: CriticServerConfig) -> None:
    """Where the critic starts (rank 0; peers follow the load): with ``checkpoint.resume=auto``
    the newest complete critic checkpoint, so a restarted server comes back with its last saved
    critic; then, with nothing applied yet, the initial critic is saved as step 0
    (``checkpoint.save_initial``). A reward-only server holds no critic: nothing to load or save."""
    if service.reward_only:
        log.info("mode=reward_only: no critic to resume or to save as step 0")
        return
    if cfg.checkpoint.resume == "auto":
        latest = service.latest_checkpoint()
        if latest is not None:
            service.load(latest)
        else:
            log.info(
                "checkpoint.resume=auto: no complete critic checkpoint under %s; starting fresh",
                cfg.checkpoint.dir,
            )
    if service.critic_step < 0:  # a fresh start: an earlier run's rows in log.dir are not this run's
        service.rewind_metrics(-1)
    if cfg.checkpoint.save_initial and service.critic_step < 0:
        service.save(0)
