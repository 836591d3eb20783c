"""Memory and model FLOPs utilisation (MFU) per step: ``perf/*`` metrics (docs/metrics.md).

Memory: on CUDA, the peak memory the caching allocator handed out and reserved during the step
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, reset at each step's start); on
a CPU, the process's peak resident set during the step (Linux's ``VmHWM``, reset at each step's
start through ``/proc/self/clear_refs``; where it cannot be reset, the peak since start-up). The
largest over every rank of the actor.

MFU: the model FLOPs of the step over the step's time and the peak FLOPs of the devices it ran
on. With ``N`` the policy's parameters (all of them: each rank's share summed over the pipeline
and tensor-parallel ranks, so the few that every tensor-parallel rank holds whole, the norms'
weights, and an embedding tied across pipeline stages count once per holder), ``N_t`` those
trained, and ``T`` the tokens of the step's batch (prompt and response, every data-parallel
rank's rows):

- the training forwards and backwards: ``(4 N + 2 N_t) T`` per PPO epoch (forward ``2 N T``, the
  activations' gradients ``2 N T``, the weights' gradients ``2 N_t T``: ``6 N T`` when every
  parameter trains, the usual formula);
- every forward without gradient: ``2 N T`` each: generation (the prompt's prefill and each new
  token once, with a KV cache), the rollout's policy log-probs (unless the first PPO forward gives
  them) and the reference's log-probs (when there is a KL penalty).

Attention's own FLOPs (``~ 4 s d`` per token per layer beyond the matmuls with weights) are left
out: MFU is slightly underestimated for long sequences. The peak is ``logging.peak_tflops``
(per device), or, left null, that of a known accelerator's dense bf16/fp16 tensor cores
(:data:`PEAK_TFLOPS`) when the run computes in bf16/fp16; otherwise MFU is not logged (a CPU
run's never is, unless given a peak).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PEAK_TFLOPS", "PerfMeter", "flops_per_step", "peak_tflops"]

PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
)
"""Dense bf16/fp16 tensor-core peak TFLOP/s per device (vendor data sheets, without sparsity),
by a part of the name ``torch.cuda.get_device_name`` reports; the first match wins."""

_GB = 1e9


def peak_tflops(setting: float | None, device: torch.device, half_precision: bool) -> float | None:
    """Per-device peak TFLOP/s: ``setting`` when given, else the table's for a known accelerator
    computing in bf16/fp16, else None (no MFU)."""
    if setting is not None:
        return float(setting)
    if device.type != "cuda" or not half_precision:
        return None
    name = torch.cuda.get_device_name(device)
    for part, tflops in PEAK_TFLOPS:
        if part.lower() in name.lower():
            return tflops
    return None


def flops_per_step(
    params: float,
    trained_params: float,
    tokens: float,
    *,
    epochs: int,
    no_grad_forwards: int,
) -> tuple[float, float]:
    """``(training FLOPs, all FLOPs)`` of a step (module docstring): ``no_grad_forwards`` counts
    the forwards without gradient over the batch, generation's included."""
    train = epochs * (4.0 * params + 2.0 * trained_params) * tokens
    return train, train + no_grad_forwards * 2.0 * params * tokens


class PerfMeter:
    """``start()`` at a step's start, ``metrics(...)`` after it (collective over the world:
    every rank calls it)."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device, peak: float | None, group: Any = None
    ) -> None:
        self.device = device
        self.peak = peak
        """Per-device peak TFLOP/s, or None (no MFU)."""
        self.group = group
        """The process group of the model's shards (the world), or None in one process."""
        local = torch.tensor(
            [
                float(sum(p.numel() for p in model.parameters())),
                float(sum(p.numel() for p in model.parameters() if p.requires_grad)),
            ],
            dtype=torch.float64,
        )
        self.world = 1
        if group is not None:
            self.world = dist.get_world_size(group)
            local = _all_reduce(local, group, dist.ReduceOp.SUM)
        self.params, self.trained_params = local.tolist()
        """Parameters of the whole model summed over every rank (divided by the data-parallel
        size in :meth:`metrics`: every replica holds them all)."""

    def start(self) -> None:
        """Reset the peak-memory counters for the step that starts."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()

    def memory(self) -> dict[str, float]:
        """This rank's peak memory in the step, in GB."""
        if self.device.type == "cuda":
            return {
                "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(self.device) / _GB,
                "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(self.device) / _GB,
            }
        return {"perf/max_rss_gb": _peak_rss_bytes() / _GB}

    def metrics(
        self,
        *,
        tokens: float,
        step_s: float,
        train_s: float,
        dp_size: int,
        epochs: int,
        no_grad_forwards: int,
    ) -> dict[str, float]:
        """``perf/*`` of the step: ``tokens`` of the batch over every data-parallel rank, the
        step's and the training phase's seconds, the PPO epochs (0 when the policy did not train)
        and the forwards without gradient over the batch. ``perf/mfu/actor`` is the training
        phase's alone (its FLOPs over ``train_s``; when the first PPO forward also gave the
        rollout's log-probs, that forward ran before ``train_s`` began: a slight overestimate)."""
        mem = self.memory()
        if self.group is not None:  # the largest over every rank
            keys = list(mem)
            peak = _all_reduce(
                torch.tensor([mem[k] for k in keys], dtype=torch.float64), self.group, dist.ReduceOp.MAX
            )
            mem = dict(zip(keys, peak.tolist()))
        out = {
            **mem,
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": float(tokens) / max(step_s, 1e-9) / self.world,
        }
        params, trained = self.params / dp_size, self.trained_params / dp_size
        train, total = flops_per_step(
            params, trained, tokens, epochs=epochs, no_grad_forwards=no_grad_forwards
        )
        out["perf/model_tflops"] = total / 1e12
        if self.peak:
            capacity = self.peak * 1e12 * self.world
            out["perf/mfu"] = total / max(step_s, 1e-9) / capacity
            if epochs and train_s > 0:
                out["perf/mfu/actor"] = train / train_s / capacity
        return out


def _all_reduce(x: torch.Tensor, group: Any, op: Any) -> torch.Tensor:
    from aligner.distributed import comm_device

    y = x.to(comm_device(group))
    dist.all_reduce(y, op=op, group=group)
    return y.cpu()


def _reset_peak_rss() -> None:
    """Reset Linux's peak resident set (``VmHWM``) of this process; nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak_rss_bytes() -> float:
    """This process's peak resident set: ``VmHWM`` (since the last reset) on Linux, else the
    peak since start-up."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak) * (1 if sys.platform == "darwin" else 1024)
