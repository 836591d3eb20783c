"""The trainer's side of rollout workers of their own (``rollout.workers`` >= 1; docs/design.md,
"Rollout workers"): it pushes each policy version to every worker, asks them for each step's
batch ahead of time within the staleness bound, and takes the batches back in step order.

The schedule is fixed by ``k = rollout.max_staleness``: step ``s`` is generated from policy
version ``max(0, s - 1 - k)`` (the policy after that many updates) by worker ``(s - 1) % n + 1``,
and asked for as soon as that version is pushed. So step ``t`` trains on rollouts of version
``t - 1 - k`` in the same order in every run: the run is deterministic, and k = 0 is the
synchronous algorithm generated elsewhere. The prompts and sampling seeds of each step are the
ones the in-process run draws for it (the sampler simply runs k steps ahead).

A checkpoint holds the batches asked for but not yet trained on (they were generated from
versions a resumed run no longer has): :meth:`RolloutWorkers.pending` waits for them and returns
them, :meth:`RolloutWorkers.restore` puts them back (and, after a roll-back, first receives and
drops whatever the abandoned continuation still had in flight, so that nothing is used twice).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.remote import RolloutLinks, decode_output, encode_output, encode_prompts, sampling_to
from aligner.generation.weight_push import PushReport, WeightPusher
from aligner.models.layout import iter_megatron_tensors
from aligner.peer_group import recv_message, send_message

log = logging.getLogger(__name__)

__all__ = ["Arrived", "Draw", "RolloutWorkerError", "RolloutWorkers"]


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed, went away, or did not answer in time: the run stops."""


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


class RolloutWorkers:
    """The trainer's end: the channels, the push, and the steps asked for and arrived."""

    def __init__(self, cfg: Any, identity: dict[str, Any], policy_cfg: Any, device: torch.device) -> None:
        r = cfg.rollout
        self.n, self.k, self.timeout_s, self.device = r.workers, r.max_staleness, r.timeout_s, device
        self.policy_cfg = policy_cfg
        backend = r.weights_backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        print(
            f"rollout: waiting for {self.n} worker(s) at {r.address} (rollout.timeout_s={r.timeout_s:g})",
            flush=True,
        )
        self.links = RolloutLinks(r, 0, backend)
        self.pusher = WeightPusher(self.links.weights, src=0, bucket_bytes=r.bucket_mb << 20)
        self._closing = False
        for w in range(1, self.n + 1):
            meta, _ = recv_message(self.links.rollouts, w)
            differ = {k: (v, meta.get(k)) for k, v in identity.items() if meta.get(k) != v}
            if meta.get("op") != "hello" or differ:
                self.close()
                raise RolloutWorkerError(
                    f"rollout worker {w} serves something else than this trainer's policy "
                    f"(trainer, worker): {differ}; give it the trainer's model, tokenizer and precision overrides"
                )
        self._inbox: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._listen, args=(w,), name=f"rollout-{w}", daemon=True)
            for w in range(1, self.n + 1)
        ]
        for t in self._threads:
            t.start()
        self.asked: dict[int, tuple[int, int, list[str], list[str] | None]] = {}
        """Step -> (version, worker, prompts, extras), asked for and not yet arrived."""
        self.arrived: dict[int, Arrived] = {}
        self.submitted = 0
        """The last step asked for."""
        self.pushed: int | None = None
        """The last version pushed."""
        print(f"rollout: {self.n} worker(s) joined; max_staleness {self.k}", flush=True)

    def worker_of(self, step: int) -> int:
        return (step - 1) % self.n + 1

    def version_of(self, step: int) -> int:
        """The policy version step ``step`` is generated from."""
        return max(0, step - 1 - self.k)

    # -- the step -------------------------------------------------------------------------------

    def push(self, version: int, policy: torch.nn.Module) -> PushReport | None:
        """Push ``version`` (the policy after that many updates) to every worker, once."""
        if self.pushed == version:
            return None
        with self._reaching(f"the push of version {version}"):
            for w in range(1, self.n + 1):
                send_message(self.links.commands, w, {"op": "weights", "version": version})
            report = self.pusher.push(version, iter_megatron_tensors(policy, self.policy_cfg))
        if report.refused:
            raise RolloutWorkerError(
                f"{report.refused} rollout worker(s) refused version {version} (their logs say why); nothing was swapped"
            )
        self.pushed = version
        return report

    def ask_through(self, last_step: int, draw: Draw) -> None:
        """Ask for every step up to ``last_step`` whose version has been pushed."""
        while self.submitted < last_step and self.version_of(self.submitted + 1) == self.pushed:
            s = self.submitted + 1
            prompts, extras, tokens, sampling = draw(s)
            w, v = self.worker_of(s), self.version_of(s)
            meta = {"op": "generate", "step": s, "version": v, "sampling": sampling_to(sampling)}
            with self._reaching(f"asking worker {w} for step {s}"):
                send_message(self.links.commands, w, meta, encode_prompts(tokens))
            self.asked[s] = (v, w, prompts, extras)
            self.submitted = s

    @contextlib.contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """A worker that went away (a send or the push failed) stops the run, with what came from
        the workers first (a worker's own error says more than the broken connection)."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, RolloutWorkerError):
                raise
            said = self._said()
            raise RolloutWorkerError(f"{what} failed: a rollout worker went away ({e}){said}") from e

    def _said(self) -> str:
        """What the workers sent that was not a rollout, as a suffix for an error."""
        notes = []
        while True:
            try:
                w, meta, _ = self._inbox.get(timeout=1.0)
            except queue.Empty:
                return "".join(f"; worker {w}: {m}" for w, m in notes)
            if meta.get("op") != "rollout":
                notes.append((w, meta.get("message", meta)))

    def take(self, step: int) -> Arrived:
        """Step ``step``'s batch (waiting for it at most ``rollout.timeout_s``)."""
        if step not in self.asked and step not in self.arrived:
            raise RolloutWorkerError(f"step {step} was never asked for (asked through step {self.submitted})")
        self._collect(step)
        return self.arrived.pop(step)

    def _collect(self, step: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while step not in self.arrived:
            left = deadline - time.monotonic()
            try:
                w, meta, tensors = self._inbox.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise RolloutWorkerError(
                    f"no rollout of step {step} from worker {self.worker_of(step)} within "
                    f"rollout.timeout_s={self.timeout_s:g} s"
                ) from None
            op = meta.get("op")
            if op != "rollout":
                why = meta.get("message", meta)
                raise RolloutWorkerError(f"rollout worker {w}: {why}")
            s = int(meta["step"])
            v, want_w, prompts, extras = self.asked.pop(s)
            if (int(meta["version"]), w) != (v, want_w):
                raise RolloutWorkerError(
                    f"step {s} came from worker {w} at version {meta['version']}; it was asked of worker "
                    f"{want_w} at version {v}"
                )
            gen = decode_output(tensors, device=self.device)
            self.arrived[s] = Arrived(s, v, w, prompts, extras, gen, meta["generate_s"], meta["idle_s"])

    def _listen(self, w: int) -> None:
        """Worker ``w``'s messages into the inbox, until it goes away."""
        while True:
            try:
                meta, tensors = recv_message(self.links.rollouts, w)
            except RuntimeError as e:
                if not self._closing:
                    self._inbox.put((w, {"op": "gone", "message": f"went away ({e})"}, {}))
                return
            self._inbox.put((w, meta, tensors))

    @staticmethod
    def metrics(a: Arrived, step: int, push: PushReport | None, step_s: float) -> dict[str, float]:
        """Staleness, the worker's time, and this step's push (its share of the step too)."""
        out = {
            "rollout/staleness": float(step - 1 - a.version),
            "rollout/worker_generate_s": float(a.generate_s),
            "rollout/worker_idle_frac": float(a.idle_s / max(a.idle_s + a.generate_s, 1e-9)),
        }
        if push is not None:
            out.update(
                {"push/seconds": push.seconds, "push/gbps": push.gbps, "push/mbytes": push.bytes / 1e6}
            )
            out["push/step_frac"] = push.seconds / max(step_s, 1e-9)
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def pending(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Every step asked for and not yet trained on, once all of it has arrived: JSON and
        tensors for a checkpoint."""
        for s in sorted(self.asked):
            self._collect(s)
        steps, tensors = [], {}
        for s, a in sorted(self.arrived.items()):
            steps.append(
                {
                    "step": s,
                    "version": a.version,
                    "worker": a.worker,
                    "prompts": a.prompts,
                    "extras": a.extras,
                    "generate_s": a.generate_s,
                    "idle_s": a.idle_s,
                }
            )
            tensors.update(encode_output(a.gen, prefix=f"step{s}."))
        return {"submitted": self.submitted, "steps": steps}, tensors

    def restore(
        self, state: dict[str, Any] | None, tensors: dict[str, torch.Tensor] | None, step: int
    ) -> None:
        """Back to a checkpoint of ``step`` and its :meth:`pending` (None: a checkpoint made
        without workers, nothing pending): what is still in flight is received and dropped, and
        every worker forgets its versions (the next push may repeat a number)."""
        dropped = sorted(self.asked)
        for s in dropped:
            self._collect(s)
        if dropped:
            log.warning("rollout: dropped steps %s of the abandoned continuation", dropped)
        self.arrived.clear()
        state = state or {"submitted": step, "steps": []}
        for e in state["steps"]:
            s = int(e["step"])
            gen = decode_output(tensors or {}, prefix=f"step{s}.", device=self.device)
            self.arrived[s] = Arrived(
                s, e["version"], e["worker"], e["prompts"], e["extras"], gen, e["generate_s"], e["idle_s"]
            )
        self.submitted, self.pushed = int(state["submitted"]), None
        for w in range(1, self.n + 1):
            send_message(self.links.commands, w, {"op": "reset"})

    def close(self) -> None:
        """Tell every worker to stop (they exit 0)."""
        self._closing = True
        for w in range(1, self.n + 1):
            try:
                send_message(self.links.commands, w, {"op": "stop"})
            except RuntimeError as e:  # already gone
                log.warning("rollout worker %d: could not send stop: %s", w, e)
