"""What the trainer reports of one step beyond the :class:`~aligner.actor.rollout.StepRecord`'s own
metrics: the episode counter (``train/episode``), the histograms every
``logging.histogram_interval`` steps, and memory and MFU (``perf/*``, :mod:`aligner.perf`).

Every method that reduces is collective: every rank of the actor calls it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from aligner.actor.config import ActorConfig
from aligner.actor.rollout import StepRecord
from aligner.distributed import ParallelState
from aligner.histograms import DEFAULT_BINS, Histogram
from aligner.perf import PerfMeter, peak_tflops

__all__ = ["StepReport"]


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
