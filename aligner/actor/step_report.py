"""What the trainer reports of one step beyond the :class:`~aligner.actor.rollout.StepRecord`'s own
metrics: the episode counter (``train/episode``), the histograms every
``logging.histogram_interval`` steps, memory and MFU (``perf/*``, :mod:`aligner.perf`), and with
rollout workers their batch's and the weight push's (:func:`worker_metrics`).

Every method that reduces is collective: every rank of the actor calls it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from aligner.actor.config import ActorConfig
from aligner.actor.rollout import StepRecord
from aligner.actor.rollout_schedule import token_staleness
from aligner.actor.rollout_workers import Arrived, RolloutWorkers
from aligner.distributed import ParallelState
from aligner.histograms import DEFAULT_BINS, Histogram
from aligner.perf import PerfMeter, peak_tflops

__all__ = ["StepReport", "worker_metrics"]


def worker_metrics(
    workers: RolloutWorkers, a: Arrived, step: int, timers: dict[str, float]
) -> dict[str, float]:
    """Staleness (and with the dynamic schedule the ask taken and the shares asked again; with
    partial rollouts the swaps and the staleness per response token), the worker's time, how many workers are left, the trainer's wait (for the batch
    and the push) over the step, from its ``timers``; and this step's push: its seconds, GB/s,
    MB, share of the step, the seconds the step waited for it (a serial push: all of them) and
    the share of it the step did not wait for (``push/hidden_frac``: 0 for a serial push)."""
    step_s, push = max(timers["timers/step"], 1e-9), workers.step_push
    overlapped = push is not None and workers.push_wait_s is not None
    out = {
        "rollout/workers": float(len(workers.alive)),
        "rollout/staleness": float(step - 1 - a.version),
        "rollout/worker_generate_s": float(a.generate_s),
        "rollout/worker_idle_frac": float(a.idle_s / max(a.idle_s + a.generate_s + a.score_s, 1e-9)),
    }
    if workers.dynamic:  # which batch came, and what was asked again meanwhile
        out |= {"rollout/ask": float(a.step), "rollout/regenerated": float(a.regenerated)}
    if workers.partial:  # versions taken mid-batch: staleness per response token
        lengths = (a.gen.lengths - a.gen.prompt_lengths).tolist()
        mean, swapped = token_staleness(step, a.version, a.swaps, lengths)
        out |= {"rollout/swaps": float(len(a.swaps)), "rollout/token_staleness": mean}
        out["rollout/swapped_token_frac"] = swapped
    if a.scores is not None:  # the worker asked the server for the scores (rollout.score_on_workers)
        out["rollout/worker_score_s"] = float(a.score_s)
    if push is not None:
        wait = workers.push_wait_s if overlapped else push.seconds
        hidden = min(max(1.0 - wait / push.seconds, 0.0), 1.0) if overlapped and push.seconds > 0 else 0.0
        out |= {"push/seconds": push.seconds, "push/gbps": push.gbps, "push/mbytes": push.bytes / 1e6}
        out |= {"push/step_frac": push.seconds / step_s, "push/wait_s": wait, "push/hidden_frac": hidden}
    waited = timers["timers/generate"] + timers["timers/refit"] + (workers.push_wait_s if overlapped else 0.0)
    out["rollout/trainer_wait_frac"] = waited / step_s
    return out


class StepReport:
    """One run's step reports; ``episode`` is saved with the training state (a resume goes on
    counting from it)."""

    def __init__(
        self, cfg: ActorConfig, state: ParallelState, policy: torch.nn.Module, precision: str
    ) -> None:
        self.cfg, self.state = cfg, state
        self.episode = 0
        """Samples trained on since the run began (``train/episode``)."""
        peak = peak_tflops(cfg.logging.peak_tflops, state.device, precision in ("bf16", "fp16"))
        world = dist.group.WORLD if state.world_size > 1 else None
        self.perf = PerfMeter(policy, state.device, peak, world)
        self._dp_group = state.dp_group if state.dp_size > 1 else None

    def start(self) -> None:
        """At a step's start (resets the peak-memory counters)."""
        self.perf.start()

    def summarize(
        self,
        record: StepRecord,
        step: int,
        *,
        trained: bool,
        rollout_forward: bool,
        reference_forward: bool,
    ) -> tuple[dict[str, float], dict[str, Histogram]]:
        """The step's metrics (``record``'s, the episode counter and ``perf/*``) and, on the steps
        ``logging.histogram_interval`` names, its histograms. ``trained``: the policy was updated
        (not during the critic warm-up); ``rollout_forward``: a separate no-grad forward of the
        policy gave the rollout's log-probs; ``reference_forward``: the reference ran."""
        p, every = self.cfg.ppo, self.cfg.logging.histogram_interval
        self.episode += p.global_batch_size
        record.episode = self.episode
        record.histogram_bins = DEFAULT_BINS if every and step % every == 0 else 0
        metrics, hists = record.summary(self._dp_group)
        tokens = record.gen.lengths.sum().double().reshape(1)
        if self._dp_group is not None:
            dist.all_reduce(tokens, group=self._dp_group)
        metrics.update(
            self.perf.metrics(
                tokens=float(tokens.item()),
                step_s=record.timers.get("timers/step", 0.0),
                train_s=record.timers.get("timers/train", 0.0),
                dp_size=self.state.dp_size,
                epochs=p.ppo_epochs if trained else 0,
                no_grad_forwards=1 + int(rollout_forward) + int(reference_forward),
            )
        )
        return metrics, hists

    def state_dict(self) -> dict[str, Any]:
        return {"episode": self.episode}

    def load_state_dict(self, d: dict[str, Any], step: int) -> None:
        """From a checkpoint's training state; one saved before the counter (at ``step``) counts
        ``step`` full batches."""
        self.episode = int(d.get("episode", step * self.cfg.ppo.global_batch_size))
