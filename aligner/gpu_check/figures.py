"""The figures of the PPO run, from what was measured during it: the steps' metrics (the trainer's
``timers/*`` among them), the engine's calls, the policy update's seconds, the critic's calls, and
the device's yardsticks measured in the same run.

- generation: response tokens per second, and its ratio to the weight-bandwidth floor. A decode
  step reads every weight the step multiplies by once (the LM head included, the embedding table
  not: a lookup reads only its rows), so no step can take less than ``weight bytes / bandwidth``.
  The native engine's lean backend prefills every prompt in one packed forward and then decodes
  every row from the first step at its own position, stopped rows leaving the batch, so a call
  makes ``longest response - 1`` decode steps plus the prefill: ``longest response`` forward
  steps (on a GPU up to ``check_every - 1`` more, the steps between two host checks, are not
  counted). ``live_rows_per_step`` is response tokens / forward steps: the mean batch a step
  ran, which shrinks as rows stop. The megatron backend (the fallback for an architecture the
  lean backend cannot run) still teacher-forces: it prefills the shortest prompt and steps one
  position at a time until the longest row is done, ``longest row - shortest prompt`` decode
  steps (the teacher-forced prompt positions, ``teacher_forced_steps_per_call``, included) plus
  the prefill. The floor of a call is its forward steps at the floor. The ratio is floor /
  measured (1.0 would be the bandwidth bound; the KV cache's reads, not counted, lower the
  ceiling a little further at long contexts).
- training: model FLOP utilisation, ``6 x parameters x tokens / seconds / peak`` over the policy
  update's forward and backward passes (the tokens are the rows' real tokens, pad excluded, times
  the PPO epochs), against the dense matrix-product throughput measured in the same run and,
  where the GPU is known, its datasheet peak.

The first step (CUDA graphs captured, kernels tuned, the allocator warmed) is reported apart; the
means are over the steps after it ("steady"), or over the one step when only one ran.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

import torch

from aligner.models.local_spec import unsupported_reason

__all__ = ["summarize", "weight_bytes", "STEP_KEYS"]

STEP_KEYS = (
    "objective/scores",
    "objective/kl",
    "response_length/mean",
    "throughput/tokens_per_s",
    "loss/policy",
    "critic/vf_loss",
    "policy/grad_norm",
    "refit/mbytes",
    "perf/mfu",
    "perf/max_memory_allocated_gb",
)
"""The metrics each step's row in the report keeps, beside its ``timers/*``."""


def weight_bytes(policy: torch.nn.Module, tied: bool, dtype: torch.dtype | None) -> tuple[int, int]:
    """``(parameters, bytes a decode step reads)``: every parameter once, and in ``dtype`` (None:
    each parameter's own) those of every weight but an untied embedding table."""
    params = read = 0
    for name, p in policy.named_parameters():
        params += p.numel()
        if tied or "word_embeddings" not in name:
            read += p.numel() * torch.empty((), dtype=dtype or p.dtype).element_size()
    return params, read


def _teacher_forced(engine: Any, policy: torch.nn.Module) -> bool:
    """Whether the native engine's calls ran the megatron backend's teacher-forced loop: asked for,
    or ``auto`` on a policy the lean backend cannot run (an engine owning its weights is lean)."""
    backend = getattr(engine, "backend", None)
    if backend != "auto" or getattr(engine, "owns_weights", False):
        return backend == "megatron"
    return unsupported_reason(policy) is not None


def _steady(xs: list[Any]) -> list[Any]:
    return xs[1:] if len(xs) > 1 else xs


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def summarize(
    rows: list[dict[str, float]],
    calls: list[dict[str, float]],
    update_seconds: list[float],
    critic_seconds: dict[str, list[float]],
    *,
    policy: torch.nn.Module,
    tied: bool,
    engine: Any,
    ppo_epochs: int,
    yardsticks: dict[str, Any],
) -> dict[str, Any]:
    """The figures the report's ``ppo`` section holds (the module docstring)."""
    if not rows:
        return {"figures": None}
    engine_dtype = getattr(engine, "dtype", None)
    params, wbytes = weight_bytes(policy, tied, engine_dtype)
    bandwidth = yardsticks.get("copy_bandwidth_gb_s")
    peak = yardsticks.get("matmul_tflops")
    sheet = yardsticks.get("datasheet")
    out: dict[str, Any] = {
        "model": {
            "parameters": params,
            "weight_bytes_per_decode_step": wbytes,
            "weight_dtype": str(engine_dtype or next(policy.parameters()).dtype).replace("torch.", ""),
        },
        "steady_steps": len(_steady(rows)),
    }
    timers = [k for k in rows[0] if k.startswith("timers/")]
    out["phases_s"] = {
        k: {"first": _r(rows[0][k]), "mean": _r(mean(r.get(k, 0.0) for r in _steady(rows)))} for k in timers
    }

    gen = _steady(calls[: len(rows)])
    if gen:
        seconds = sum(c["seconds"] for c in gen)
        tokens = sum(c["response_tokens"] for c in gen)
        teacher_forced = _teacher_forced(engine, policy)
        if teacher_forced:  # prefill to the shortest prompt, then one position a step
            steps = [c["length_max"] - c["prompt_min"] + 1 for c in gen]
        else:  # ragged: the prefill gives the first token, a decode step each further one
            steps = [max(c["response_max"], 1.0) for c in gen]
        g: dict[str, Any] = {
            "tokens_per_s": _r(tokens / seconds, 1),
            "trainer_tokens_per_s": _r(mean(r["throughput/tokens_per_s"] for r in _steady(rows)), 1),
            "seconds_per_call": _r(seconds / len(gen)),
            "rows_per_call": gen[0]["rows"],
            "response_tokens_per_call": _r(tokens / len(gen), 1),
            "forward_steps_per_call": _r(mean(steps), 1),
            "decode": "teacher_forced" if teacher_forced else "ragged",
            "ms_per_forward_step": _r(1000 * seconds / sum(steps), 3),
        }
        if not teacher_forced:
            g["live_rows_per_step"] = _r(tokens / sum(steps), 1)
        else:
            g["teacher_forced_steps_per_call"] = _r(mean(c["prompt_max"] - c["prompt_min"] for c in gen), 1)
        if bandwidth:
            floor_step = wbytes / (bandwidth * 1e9)
            floor = floor_step * sum(steps)
            g.update(
                floor_ms_per_forward_step=_r(1000 * floor_step, 4),
                floor_tokens_per_s=_r(tokens / floor, 1),
                ratio_to_floor=_r(floor / seconds),
            )
        out["generation"] = g

    upd = _steady(update_seconds[: len(rows)])
    if upd and gen:
        tokens = mean(c["tokens"] for c in gen) * ppo_epochs
        seconds = mean(upd)
        tflops = 6 * params * tokens / seconds / 1e12
        t: dict[str, Any] = {
            "tokens_per_step": _r(tokens, 1),
            "update_seconds_per_step": _r(seconds),
            "tokens_per_s": _r(tokens / seconds, 1),
            "model_tflops": _r(tflops, 3),
            "mfu": _r(tflops / peak) if peak else None,
            "mfu_peak": "matmul_tflops measured in this run",
        }
        if sheet:
            t["mfu_vs_datasheet"] = _r(tflops / sheet["bf16_dense_tflops"])
            t["datasheet"] = sheet["name"]
        out["training"] = t

    out["refit"] = {
        "engine_owns_weights": getattr(engine, "owns_weights", None),
        "seconds_first": _r(rows[0].get("timers/refit")),
        "seconds_mean": _r(mean(r.get("timers/refit", 0.0) for r in _steady(rows))),
        "mbytes_mean": _r(mean(r.get("refit/mbytes", 0.0) for r in _steady(rows)), 1),
    }
    out["critic"] = {
        f"{name}_s_mean": _r(mean(_steady(xs))) if xs else None for name, xs in critic_seconds.items()
    }
    out["scores"] = {
        "first": _r(rows[0].get("objective/scores")),
        "last": _r(rows[-1].get("objective/scores")),
    }
    out["steps"] = [
        {k: _r(v) for k, v in r.items() if k.startswith("timers/") or k in STEP_KEYS} for r in rows
    ]
    return out
