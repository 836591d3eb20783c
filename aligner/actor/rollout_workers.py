"""The trainer's side of rollout workers of their own (``rollout.workers`` >= 1; docs/design.md,
"Rollout workers"): it pushes each policy version to every worker, asks them for each step's
batch ahead of time within the staleness bound, and takes the batches back in step order.

The schedule is fixed by ``k = rollout.max_staleness``: step ``s`` is generated from policy
version ``max(0, s - 1 - k)`` (the policy after that many updates), and asked for as soon as that
version is pushed. A trainer of ``d`` data-parallel ranks asks for each step's ``d`` shares (each
rank's own prompts, sampled from that rank's random streams) of workers ``((s - 1) d + r) % n +
1``; its rank 0 alone talks to the workers, and hands each rank its share. So step ``t`` trains on rollouts of version
``t - 1 - k`` in the same order in every run: the run is deterministic, and k = 0 is the
synchronous algorithm generated elsewhere. The prompts and sampling seeds of each step are the
ones the in-process run draws for it (the sampler simply runs k steps ahead). At k >= 1 the push
may run on a thread of its own while the step reads the weights (:meth:`RolloutWorkers.join_push`).

A checkpoint holds the batches asked for but not yet trained on (they were generated from
versions a resumed run no longer has): :meth:`RolloutWorkers.pending` waits for them and returns
them, :meth:`RolloutWorkers.restore` puts them back (and, after a roll-back, first receives and
drops whatever the abandoned continuation still had in flight, so that nothing is used twice).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner.actor.push_overlap import PushInFlight
from aligner.actor.worker_membership import RolloutWorkerError, WorkerMembership, differences
from aligner.distributed import ParallelState, all_gather_json, comm_device, on_rank0, recv_json, send_json
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.remote import (
    OUTPUT_FIELDS,
    JoinRequests,
    RolloutLinks,
    decode_output,
    encode_output,
    encode_prompts,
    mark_epoch,
    sampling_to,
)
from aligner.generation.weight_push import PushReport, WeightPusher
from aligner.models.layout import iter_megatron_tensors
from aligner.peer_group import recv_message, send_message

log = logging.getLogger(__name__)

__all__ = ["Arrived", "Draw", "RolloutWorkerError", "RolloutWorkers"]


Draw = Callable[[int], tuple[list[str], list[str] | None, list[list[int]], SamplingParams]]
"""Step -> its prompts, their extras, their tokens and its sampling parameters."""


@dataclass
class Arrived:
    """One step's batch, back from its worker."""

    step: int
    version: int
    worker: int
    prompts: list[str]
    extras: list[str] | None
    gen: GenerationOutput
    generate_s: float
    idle_s: float
    scores: list[float] | None = None
    """The worker's scores of the rows (``rollout.score_on_workers``), else None."""
    score_s: float = 0.0

    def scored(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(values, scores)`` as a reward-only server answers them (values of zeros ``[b, s-1]``,
        scores ``[b]``, float32, on the rows' device) when the worker scored the rows, else None."""
        if self.scores is None:
            return None
        b, s = self.gen.tokens.shape
        dev = self.gen.tokens.device
        return torch.zeros(b, s - 1, device=dev), torch.tensor(self.scores, dtype=torch.float32, device=dev)


def _announce_and_push(
    pusher: WeightPusher,
    commands: Any,
    ranks: list[int],
    version: int,
    stream: Iterator[tuple[str, torch.Tensor]],
) -> PushReport:
    """Tell the workers at channel ``ranks`` that ``version`` follows, then push it (serial, or on
    the overlapped push's thread with the channels it was started with)."""
    for g in ranks:
        send_message(commands, g, {"op": "weights", "version": version})
    return pusher.push(version, stream)


class RolloutWorkers(WorkerMembership):
    """The trainer's end, on every rank: rank 0 holds the channels, the push and the shares asked
    for and arrived; every rank its own prompts of the steps asked for. Every method is called on
    every rank (the outcome of rank 0's part reaches all of them)."""

    def __init__(self, cfg: Any, identity: dict[str, Any], policy_cfg: Any, state: ParallelState) -> None:
        r = cfg.rollout
        self.n, self.k, self.timeout_s = r.workers, r.max_staleness, r.timeout_s
        self.rcfg, self.on_loss, self.identity = r, r.on_worker_loss, identity
        self.joins: JoinRequests | None = None
        """On rank 0: workers asking to join the run under way (in place of ones it lost)."""
        self.alive = list(range(1, self.n + 1))
        """On rank 0: the workers still in the run, in the order of their ranks in the channels."""
        self.policy_cfg, self.device = policy_cfg, state.device
        self.dp, self.rank, self.lead = state.dp_size, state.dp_rank, state.rank == 0
        self.world = state.world_size
        self.dp_of = all_gather_json(state.dp_rank) if self.world > 1 else [0]
        """Each global rank's data-parallel rank (the ranks of one replica share its batch)."""
        self.streams = state.tp_size * state.pp_size > 1 and state.dp_rank == 0
        """This rank takes part in rank 0's weight stream (gathered over its TP and PP groups)."""
        self.asked: dict[tuple[int, int], tuple[int, int]] = {}
        """On rank 0: (step, rank) -> (version, worker), asked for and not yet arrived."""
        self.scoring = r.score_on_workers
        """The workers score their batches (``rollout.score_on_workers``)."""
        self.prompt_texts: Callable[[list[str], list[list[int]]], list[str]] | None = None
        """With ``scoring``: the rows' prompt texts as the trainer sends them to the server (set
        by the trainer: its prompts and their tokens -> texts)."""
        self.requests: dict[tuple[int, int], tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        """On rank 0: (step, rank) -> what was asked (to ask another worker if its own is lost)."""
        self.arrived: dict[tuple[int, int], tuple[GenerationOutput, dict[str, Any]]] = {}
        """On rank 0: (step, rank) -> the share and its worker's record, not yet handed out."""
        self.drawn: dict[int, tuple[list[str], list[str] | None]] = {}
        """Step -> this rank's prompts and extras, asked for and not yet taken."""
        self.submitted = 0
        """The last step asked for."""
        self.pushed: int | None = None
        """The last version pushed (or being pushed)."""
        self.overlap = r.overlap_push and self.k >= 1 and state.tp_size * state.pp_size == 1
        """Push on a thread of rank 0's while the step goes on (``rollout.overlap_push``), when the
        step's batch was asked for from an older version (k >= 1, after the first step), and rank
        0's weight stream is its own parameters (under TP or PP its gathers are collectives on the
        groups the step's forwards use)."""
        self.in_flight: int | None = None
        """On every rank: the version of an overlapped push not yet waited for (:meth:`join_push`)."""
        self._flight: PushInFlight | None = None
        """On rank 0: that push (its thread, then its outcome), until :meth:`join_push` takes it."""
        self._side_stream: Any = None  # on a GPU: the overlapped pushes' one CUDA stream
        self.step_push: PushReport | None = None
        """This step's push, once it has finished; :attr:`push_wait_s`: how long the step waited for
        it at :meth:`join_push` (None: a serial push, waited for whole)."""
        self.push_wait_s: float | None = None
        self._closing, self._threads = False, []
        self._inbox: queue.Queue = queue.Queue()
        self.links, self.retired = None, []
        if self.lead:
            print(
                f"rollout: waiting for {self.n} worker(s) at {r.address} (rollout.timeout_s={r.timeout_s:g})",
                flush=True,
            )
        on_rank0(lambda: self._join(r, identity), carried=(RolloutWorkerError,))
        if self.lead:
            print(f"rollout: {self.n} worker(s) joined; max_staleness {self.k}", flush=True)

    def _join(self, r: Any, identity: dict[str, Any]) -> None:
        backend = r.weights_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.backend = backend
        try:
            self._use(RolloutLinks(r, 0, backend))
        except RuntimeError as e:
            raise RolloutWorkerError(str(e)) from e
        for w in self.alive:
            meta, _ = recv_message(self.links.rollouts, w)
            if meta.get("op") == "error":  # it could not start (e.g. reach the server it scores with)
                self.close()
                raise RolloutWorkerError(f"rollout worker {w} could not start: {meta.get('message')}")
            differ = differences(identity, meta)
            if meta.get("op") != "hello" or differ:
                self.close()
                raise RolloutWorkerError(
                    f"rollout worker {w} serves something else than this trainer's policy: "
                    f"{'; '.join(differ)}; give it the trainer's model, tokenizer and precision overrides"
                )
        self._listen_all()

    def _use(self, links: RolloutLinks) -> None:
        """Talk to the workers over ``links`` from now on (the push too); a worker that starts
        from now on asks to join (:meth:`_admit`)."""
        self.links = links
        self.pusher = WeightPusher(links.weights, src=0, bucket_bytes=self.rcfg.bucket_mb << 20)
        mark_epoch(links.store, links.epoch)
        self.joins = self.joins or JoinRequests(links.store)

    def worker_of(self, step: int, rank: int = 0) -> int:
        """The worker asked for ``rank``'s share of ``step`` (of those still in the run)."""
        return self.alive[((step - 1) * self.dp + rank) % len(self.alive)]

    def version_of(self, step: int) -> int:
        """The policy version step ``step`` is generated from."""
        return max(0, step - 1 - self.k)

    # -- the step -------------------------------------------------------------------------------

    def push(self, version: int, policy: torch.nn.Module) -> PushReport | None:
        """Push ``version`` (the policy after that many updates) to every worker, once: from rank
        0 (the data-parallel replicas hold the same weights), the ranks of its replica streaming
        their shards with it. Overlapped (:attr:`overlap`): started on rank 0's thread and None
        returned; :meth:`join_push` waits for it (before anything writes the weights). First,
        workers that asked to join are admitted (:meth:`_admit`)."""
        self.join_push()  # the one before (normally long waited for)
        self.step_push, self.push_wait_s = None, None
        if self.on_loss == "continue" and on_rank0(self._admit, carried=(RolloutWorkerError,)):
            self.pushed = None  # the newcomers and the others (who forgot theirs) take it again
        if self.pushed == version:
            return None
        if self.overlap and self.submitted > version:  # this step's batch is asked for already
            on_rank0(lambda: self._start(version, policy), carried=(RolloutWorkerError,))
            self.pushed = self.in_flight = version
            return None
        stream = iter_megatron_tensors(policy, self.policy_cfg) if self.lead or self.streams else None

        def push() -> dict[str, Any]:
            try:
                return dataclasses.asdict(self._push(version, stream))
            finally:
                for _ in stream:  # a push that failed midway: the replica's collectives end together
                    pass

        if not self.lead and self.streams:
            for _ in stream:
                pass
        report = on_rank0(push, carried=(RolloutWorkerError,))
        self.pushed = version
        self.step_push = PushReport(**report)
        return self.step_push

    def _push(self, version: int, stream: Iterator[tuple[str, torch.Tensor]]) -> PushReport:
        self._poll()  # a worker already gone is left out of the push
        ranks = [self._rank(w) for w in self.alive]
        with self._reaching(f"the push of version {version}"):
            report = _announce_and_push(self.pusher, self.links.commands, ranks, version, stream)
        return self._accepted(report)

    @staticmethod
    def _accepted(report: PushReport) -> PushReport:
        if report.refused:
            raise RolloutWorkerError(
                f"{report.refused} rollout worker(s) refused version {report.version} (their logs say why); "
                "nothing was swapped"
            )
        return report

    def _start(self, version: int, policy: torch.nn.Module) -> None:
        """On rank 0: announce ``version`` and push it, then send the asks queued meanwhile, on a
        thread of its own. Until it is done, that thread alone uses the ``commands`` channel (a
        send waits for a worker to take it: after the batch it is generating) and ``weights``;
        this one the ``rollouts`` (its inbox)."""
        self._finish()  # an abandoned push's error (a step that failed meanwhile) is met here
        self._poll()  # a worker already gone is left out of the push (here: it may regroup)
        if self.pusher.device.type == "cuda" and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.pusher.device)
        stream = iter_megatron_tensors(policy, self.policy_cfg)  # rank 0's own parameters: no collective
        pusher, commands, ranks = self.pusher, self.links.commands, [self._rank(w) for w in self.alive]
        push = functools.partial(_announce_and_push, pusher, commands, ranks, version, stream)
        send = lambda item: send_message(commands, *item[2:])  # noqa: E731 - an ask queued meanwhile
        self._flight = PushInFlight(push, version, pusher.device, self._side_stream, f"push-{version}", send)

    def _finish(self, take: bool = False) -> dict[str, Any] | None:
        """On rank 0: wait for the overlapped push (None: none), then its report (forgotten with
        ``take``), or its error raised as the serial push raises it."""
        flight = self._flight
        if flight is None:
            return None
        if take:
            self._flight = None
        with self._reaching(f"the push of version {flight.version}"):
            report = self._accepted(flight.wait())
        unsent = flight.unsent()  # an ask whose send failed, and those after it: asked again here
        for key, *_ in unsent:
            del self.asked[key]
        for key, version, *_ in unsent:
            self._send_ask(key, version)
        return dataclasses.asdict(report)

    def join_push(self) -> PushReport | None:
        """Wait for the overlapped push in flight, on every rank (its error raised on every rank);
        its report, also kept as :attr:`step_push`. Nothing in flight: nothing happens."""
        if self.in_flight is None:
            return None
        t0 = time.perf_counter()
        try:
            done = on_rank0(functools.partial(self._finish, take=True), carried=(RolloutWorkerError,))
        finally:
            self.in_flight = None
        self.step_push = None if done is None else PushReport(**done)
        self.push_wait_s = time.perf_counter() - t0
        return self.step_push

    def abandon_push(self) -> None:
        """A step that failed: wait for the push in flight (rank 0's thread; nothing collective),
        raising nothing; a failure of it is raised by whatever next waits for it on rank 0 (the
        next push, a roll-back's reset, a lost worker's regroup)."""
        self.in_flight = None
        if self._flight is not None:
            self._flight.settle()

    def ask_through(self, last_step: int, draw: Draw) -> None:
        """Ask for every step up to ``last_step`` whose version has been pushed: each rank draws
        its share's prompts, rank 0 asks the workers for all of them."""
        while self.submitted < last_step and self.version_of(self.submitted + 1) == self.pushed:
            s = self.submitted + 1
            prompts, extras, tokens, sampling = draw(s)
            self.drawn[s] = (prompts, extras)
            mine: dict[str, Any] = {"tokens": tokens}
            if self.scoring:  # what the server reads beside the tokens travels with the ask
                mine |= {"prompt_texts": self.prompt_texts(prompts, tokens), "extras": extras}
            shares = self._by_replica(all_gather_json(mine) if self.world > 1 else [mine])
            on_rank0(functools.partial(self._ask, s, shares, sampling), carried=(RolloutWorkerError,))
            self.submitted = s

    def _by_replica(self, per_rank: list[Any]) -> list[Any]:
        """One entry per data-parallel rank (its first global rank's) of a list over global ranks."""
        out: dict[int, Any] = {}
        for g, x in enumerate(per_rank):
            out.setdefault(self.dp_of[g], x)
        return [out[r] for r in range(self.dp)]

    def _ask(self, s: int, shares: list[dict[str, Any]], sampling: SamplingParams) -> None:
        for r, share in enumerate(shares):
            meta = {"op": "generate", "step": s, "rank": r, "sampling": sampling_to(sampling)}
            meta |= {k: share[k] for k in ("prompt_texts", "extras") if k in share}
            self.requests[(s, r)] = (meta, encode_prompts(share["tokens"]))
            self._send_ask((s, r), self.version_of(s))

    def _send_ask(self, key: tuple[int, int], version: int) -> None:
        """Ask the worker of ``key`` = (step, rank) for that share, from ``version``."""
        w = self.worker_of(*key)
        meta, tensors = self.requests[key]
        self.asked[key] = (version, w)
        rank, ask = self._rank(w), {**meta, "version": version}
        if self._flight is not None and self._flight.queue((key, version, rank, ask, tensors)):
            return  # the push's thread sends it once the version is through (it has the channel)
        if self.on_loss != "continue":
            with self._reaching(f"asking worker {w} for step {key[0]}"):
                send_message(self.links.commands, rank, ask, tensors)
            return
        try:
            send_message(self.links.commands, rank, ask, tensors)
        except RuntimeError:
            self._await_gone(w)  # its loss asks another worker for what it owed, this share too

    def take(self, step: int) -> Arrived:
        """This rank's share of step ``step`` (rank 0 waits for all of them at most
        ``rollout.timeout_s``, then hands each rank its own)."""
        if step not in self.drawn:
            raise RolloutWorkerError(f"step {step} was never asked for (asked through step {self.submitted})")
        on_rank0(lambda: self._collect(step), carried=(RolloutWorkerError,))
        prompts, extras = self.drawn.pop(step)
        if self.lead:
            for g in range(1, self.world):  # every rank its replica's share
                gen, record = self.arrived[(step, self.dp_of[g])]
                send_json(record, g)
                for f in OUTPUT_FIELDS:  # (bool as uint8: what every backend sends)
                    t = getattr(gen, f)
                    send_json([str(t.dtype).removeprefix("torch."), list(t.shape)], g)
                    dist.send(
                        t.to(comm_device(), torch.uint8 if t.dtype == torch.bool else t.dtype).contiguous(), g
                    )
            gen, record = self.arrived[(step, 0)]
            for r in range(self.dp):
                del self.arrived[(step, r)]
        else:
            record, parts = recv_json(0), {}
            for f in OUTPUT_FIELDS:
                dtype, shape = recv_json(0)
                wire = torch.uint8 if dtype == "bool" else getattr(torch, dtype)
                parts[f] = torch.empty(shape, dtype=wire, device=comm_device())
                dist.recv(parts[f], 0)
                parts[f] = parts[f].to(self.device, getattr(torch, dtype))
            gen = GenerationOutput(**parts)
        return Arrived(
            step,
            record["version"],
            record["worker"],
            prompts,
            extras,
            gen,
            record["generate_s"],
            record["idle_s"],
            record.get("scores"),
            record.get("score_s", 0.0),
        )

    def _collect(self, step: int) -> None:
        """Every share of ``step`` (and of the shares that come before it), on rank 0."""
        deadline = time.monotonic() + self.timeout_s
        while any((step, r) not in self.arrived for r in range(self.dp)):
            left = deadline - time.monotonic()
            try:
                w, meta, tensors = self._inbox.get(timeout=max(left, 0.0))
            except queue.Empty:
                missing = [r for r in range(self.dp) if (step, r) not in self.arrived]
                raise RolloutWorkerError(
                    f"no rollout of step {step} (ranks {missing}) from worker(s) "
                    f"{sorted({self.worker_of(step, r) for r in missing})} within rollout.timeout_s={self.timeout_s:g} s"
                ) from None
            self._accept(w, meta, tensors)

    def _accept(self, w: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """One message from worker ``w``: a share arrived, or the worker is gone or failed."""
        op = meta.get("op")
        if op == "gone":
            self._lose(w, meta["message"])
            return
        if op != "rollout":
            raise RolloutWorkerError(f"rollout worker {w}: {meta.get('message', meta)}")
        key = (int(meta["step"]), int(meta.get("rank", 0)))
        v, want_w = self.asked.pop(key)
        if (int(meta["version"]), w) != (v, want_w):
            raise RolloutWorkerError(
                f"step {key[0]} (rank {key[1]}) came from worker {w} at version {meta['version']}; it was "
                f"asked of worker {want_w} at version {v}"
            )
        self.requests.pop(key, None)
        record = {"version": v, "worker": w, "generate_s": meta["generate_s"], "idle_s": meta["idle_s"]}
        gen = decode_output(tensors, device=self.device)
        if self.scoring:
            scores = meta.get("scores")
            numbers = isinstance(scores, list) and all(type(x) in (int, float) for x in scores)
            if not numbers or len(scores) != gen.tokens.shape[0]:
                raise RolloutWorkerError(
                    f"rollout worker {w} sent step {key[0]} (rank {key[1]}) without a number per row "
                    f"as its scores ({gen.tokens.shape[0]} rows): start the workers with the trainer's rollout.score_on_workers"
                )
            record |= {"scores": scores, "score_s": meta["score_s"]}
        self.arrived[key] = (gen, record)

    def _poll(self) -> None:
        """What the workers sent so far, taken in without waiting."""
        while True:
            try:
                w, meta, tensors = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._accept(w, meta, tensors)

    # -- checkpoints ----------------------------------------------------------------------------

    def pending(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Every step asked for and not yet trained on, once all of it has arrived: JSON and
        tensors for a checkpoint (whole on rank 0, which writes them)."""
        steps = sorted(self.drawn)
        for s in steps:
            on_rank0(functools.partial(self._collect, s), carried=(RolloutWorkerError,))
        mine = {str(s): list(self.drawn[s]) for s in steps}
        drawn = self._by_replica(all_gather_json(mine) if self.world > 1 else [mine])
        entries, tensors = [], {}
        if self.lead:
            for s in steps:
                for r in range(self.dp):
                    gen, record = self.arrived[(s, r)]
                    prompts, extras = drawn[r][str(s)]
                    entries.append({"step": s, "rank": r, **record, "prompts": prompts, "extras": extras})
                    tensors.update(encode_output(gen, prefix=f"step{s}.rank{r}."))
        return {"submitted": self.submitted, "data_parallel_size": self.dp, "steps": entries}, tensors

    def restore(
        self, state: dict[str, Any] | None, tensors: dict[str, torch.Tensor] | None, step: int
    ) -> None:
        """Back to a checkpoint of ``step`` and its :meth:`pending` (None: a checkpoint made
        without workers, nothing pending): what is still in flight is received and dropped, and
        every worker forgets its versions (the next push may repeat a number)."""
        state = state or {"submitted": step, "data_parallel_size": self.dp, "steps": []}
        if state["steps"] and state.get("data_parallel_size", 1) != self.dp:
            raise RolloutWorkerError(
                f"the checkpoint of step {step} holds batches asked for at data-parallel size "
                f"{state.get('data_parallel_size', 1)}; this run has {self.dp}: resume at that size"
            )
        on_rank0(lambda: self._drop_and_reset(state, tensors), carried=(RolloutWorkerError,))
        self.drawn = {
            int(e["step"]): (e["prompts"], e["extras"])
            for e in state["steps"]
            if int(e.get("rank", 0)) == self.rank
        }
        self.submitted, self.pushed = int(state["submitted"]), None

    def _drop_and_reset(self, state: dict[str, Any], tensors: dict[str, torch.Tensor] | None) -> None:
        self._finish()
        dropped = sorted({s for s, _ in self.asked})
        for s in dropped:
            self._collect(s)
        if dropped:
            log.warning("rollout: dropped steps %s of the abandoned continuation", dropped)
        self.arrived.clear()
        for e in state["steps"]:
            s, r = int(e["step"]), int(e.get("rank", 0))
            gen = decode_output(tensors or {}, prefix=f"step{s}.rank{r}.", device=self.device)
            record = {
                k: e[k] for k in ("version", "worker", "generate_s", "idle_s", "scores", "score_s") if k in e
            }
            self.arrived[(s, r)] = (gen, record)
        for w in self.alive:
            send_message(self.links.commands, self._rank(w), {"op": "reset"})

    def close(self) -> None:
        """Tell every worker to stop (they exit 0); on rank 0."""
        if self._flight is not None:  # never leave a thread broadcasting under the stop
            self._flight.settle()
            self._flight = None
        self._closing = True
        if self.links is None:
            return
        for w in self.alive:
            try:
                send_message(self.links.commands, self._rank(w), {"op": "stop"})
            except RuntimeError as e:  # already gone
                log.warning("rollout worker %d: could not send stop: %s", w, e)
