"""What a checkpoint keeps of a trainer's rollout workers: the batches asked for and not yet
trained on (generated from versions a resumed run no longer has), each with what was asked (to
ask it again once it is past the bound or its worker is lost), and the count of shares asked
again so far. :meth:`PendingBatches.pending` waits for them and returns them (JSON and tensors),
:meth:`PendingBatches.restore` puts them back, and after a roll-back first receives and drops
whatever the abandoned continuation still had in flight, so that nothing is used twice.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from aligner.actor.worker_membership import RolloutWorkerError
from aligner.distributed import all_gather_json, on_rank0
from aligner.generation.remote import decode_output, encode_output
from aligner.peer_group import send_message

log = logging.getLogger(__name__)

__all__ = ["PendingBatches"]


class PendingBatches:
    """The checkpoint half of :class:`~aligner.actor.rollout_workers.RolloutWorkers` (a mixin: it
    uses that class's state and its ``_collect``, ``_finish``, ``_by_replica`` and ``_rank``).
    Every method is called on every rank."""

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
                    request, asked = self.requests.get((s, r), (None, {}))  # (to ask again if need be)
                    record = dict(record)
                    values = record.pop("values", None)
                    if values is not None:  # the critic's values the worker asked for
                        tensors[f"step{s}.rank{r}.values"] = values.cpu()
                    entries.append({"step": s, "rank": r, **record, "prompts": prompts, "extras": extras})
                    if request is not None:  # (none restored from a checkpoint made without them)
                        entries[-1]["request"] = request
                    tensors.update(encode_output(gen, prefix=f"step{s}.rank{r}."))
                    tensors.update({f"ask{s}.rank{r}.{k}": t for k, t in asked.items()})
        state = {"submitted": self.submitted, "data_parallel_size": self.dp, "steps": entries}
        return state | {"regenerated": self.regenerated}, tensors

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
        lost = on_rank0(lambda: self._drop_and_reset(state, tensors), carried=(RolloutWorkerError,))
        self.drawn = {
            int(e["step"]): (e["prompts"], e["extras"])
            for e in state["steps"]
            if int(e.get("rank", 0)) == self.rank
        }
        self.submitted, self.pushed = int(state["submitted"]), None
        # the shares the abandoned continuation held count as asked again (the first step says so)
        self.reported = int(state.get("regenerated", 0))
        self.regenerated = self.reported + lost

    def _drop_and_reset(self, state: dict[str, Any], tensors: dict[str, torch.Tensor] | None) -> int:
        """On rank 0: what is in flight received and dropped, the checkpoint's batches put back,
        the workers told to forget their versions; the number of shares dropped that the
        checkpoint does not hold (0 at a resume: nothing was in flight)."""
        self._finish()
        dropped = sorted({s for s, _ in self.asked})
        for s in dropped:
            self._collect(s)
        if dropped:
            log.warning("rollout: dropped steps %s of the abandoned continuation", dropped)
        kept = {(int(e["step"]), int(e.get("rank", 0))) for e in state["steps"]}
        lost = len(set(self.arrived) - kept)
        self.arrived.clear()
        self.requests.clear()
        for e in state["steps"]:
            s, r = int(e["step"]), int(e.get("rank", 0))
            gen = decode_output(tensors or {}, prefix=f"step{s}.rank{r}.", device=self.device)
            if "request" in e:  # (not in a checkpoint made before the dynamic schedule)
                asked = {k: tensors[f"ask{s}.rank{r}.{k}"] for k in ("prompt_tokens", "prompt_lengths")}
                self.requests[(s, r)] = (e["request"], asked)
            record = {
                k: e[k]
                for k in ("version", "worker", "generate_s", "idle_s", "scores", "score_s", "swaps")
                if k in e
            }
            values = (tensors or {}).get(f"step{s}.rank{r}.values")
            if values is not None:
                record["values"] = values.to(self.device)
            self.arrived[(s, r)] = (gen, record)
        for w in self.alive:
            send_message(self.links.commands, self._rank(w), {"op": "reset"})
        return lost
