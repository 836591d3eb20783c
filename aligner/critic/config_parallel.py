"""The ``parallel`` section of the critic server's configuration (:mod:`aligner.critic.config`):
how the critic is split across processes, and how long its ranks wait for each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ParallelSection"]


@dataclass
class ParallelSection:
    """How the critic is split across processes (launch with torchrun for TP x DP > 1)."""

    tensor_model_parallel_size: int = 1
    """Megatron tensor parallel size: the ranks of one replica of the critic."""
    data_parallel_size: int = 1
    """Replicas of the critic behind the one PyTriton front end (on global rank 0): each merged
    critic_infer batch and each critic_train step is split across them by rows. The world size
    must equal TP x DP."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline parallel size (only 1 is supported by the critic server)."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'."""
    timeout_s: float = 600.0
    """Longest wait of one collective between the server's ranks; a collective that waits longer
    fails, and the server exits (1) to be restarted (:mod:`aligner.critic.liveness`)."""
    peer_timeout_s: float = 60.0
    """A rank that shows no sign of life for this long (it beats every few seconds from a thread
    of its own, even while it computes) is taken as hung, and the server exits (1) to be restarted
    from its last checkpoint (:mod:`aligner.critic.liveness`). Keep it below the actor's
    ``critic.wait_timeout_s``, so that the actor finds the restarted server before it gives up."""

    @property
    def world_size(self) -> int:
        """The processes this layout needs: TP x PP x DP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    def world_size_problem(self, world: int) -> str | None:
        """Why a launch of ``world`` processes does not fit this layout, or None when it does."""
        if world == self.world_size:
            return None
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        fix = f"launch with torchrun --nproc_per_node {self.world_size}"
        if world % (tp * pp) == 0:
            fix = f"set parallel.data_parallel_size={world // (tp * pp)}, or {fix}"
        return (
            f"WORLD_SIZE={world}: expected parallel.tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} x data_parallel_size={self.data_parallel_size} = "
            f"{self.world_size}; {fix}"
        )

    def problems(self) -> list[str]:
        """What is wrong with this section alone, one message per field."""
        e = []
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
            v = getattr(self, key)
            if v < 1:
                e.append(f"parallel.{key}={v}: expected >= 1")
        if self.pipeline_model_parallel_size != 1:
            e.append(
                f"parallel.pipeline_model_parallel_size={self.pipeline_model_parallel_size}: the critic "
                "server supports tensor parallelism only; set it to 1"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            e.append(f"parallel.backend={self.backend!r}: expected one of 'auto', 'gloo', 'nccl'")
        for key in ("timeout_s", "peer_timeout_s"):
            v = getattr(self, key)
            if not math.isfinite(v) or v <= 0:
                e.append(f"parallel.{key}={v}: expected a positive number of seconds")
        return e
