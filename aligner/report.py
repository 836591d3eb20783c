"""End-of-run report: a summary table and a PNG plot of reward and KL per step, from the run's
metrics.jsonl (so it works for a finished, interrupted or resumed run alike)."""

from __future__ import annotations

import os
from typing import Any

from aligner.metrics import read_metrics

__all__ = ["summarize", "format_summary", "plot_run"]


def summarize(rows: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    """Reward at the start and end (means over ``window`` steps), steps and wall time, and the
    last and best validation scores when the run validated."""
    val = [r for r in rows if "validation/scores" in r]
    rows = [r for r in rows if "objective/scores" in r]  # a step-0 validation row has no rollout
    if not rows:
        raise ValueError("no metrics rows: the run logged no step")
    w = max(1, min(window, len(rows) // 2 or 1))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    scores = [r["objective/scores"] for r in rows]
    out = {
        "steps": len(rows),
        "reward_start": mean(scores[:w]),
        "reward_end": mean(scores[-w:]),
        "reward_best": max(scores),
        "kl_end": mean([r["objective/kl"] for r in rows[-w:]]),
        "wall_s": rows[-1]["time"] - rows[0]["time"] + rows[0].get("timers/step", 0.0),
        "step_s": mean([r.get("timers/step", 0.0) for r in rows]),
    }
    if val:
        out["val_end"] = val[-1]["validation/scores"]
        out["val_best"] = max(r["validation/scores"] for r in val)
    return out


def format_summary(s: dict[str, float]) -> str:
    lines = [
        ("steps", f"{int(s['steps'])}"),
        ("reward at start", f"{s['reward_start']:.3f}"),
        ("reward at end", f"{s['reward_end']:.3f}"),
        ("best step reward", f"{s['reward_best']:.3f}"),
        ("KL at end", f"{s['kl_end']:.3f}"),
        *(
            [("validation at end", f"{s['val_end']:.3f}"), ("best validation", f"{s['val_best']:.3f}")]
            if "val_end" in s
            else []
        ),
        ("mean step time", f"{s['step_s']:.3f} s"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in lines)
    bar = "+" + "-" * (width + 2) + "+" + "-" * 12 + "+"
    body = [f"| {k:<{width}} | {v:>10} |" for k, v in lines]
    return "\n".join([bar, *body, bar])


def plot_run(metrics_path: str, out_path: str) -> str | None:
    """Reward and KL per step as a PNG; returns the path written, or None without matplotlib
    (the ``plot`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = read_metrics(metrics_path)
    rows = [r for r in all_rows if "objective/scores" in r]
    val = [r for r in all_rows if "validation/scores" in r]
    steps = [r["step"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7, 4), dpi=110)
    ax1.plot(
        steps, [r["objective/scores"] for r in rows], color="tab:blue", label="reward (objective/scores)"
    )
    if val:
        ax1.plot(
            [r["step"] for r in val],
            [r["validation/scores"] for r in val],
            "o-",
            color="tab:green",
            markersize=3,
            label="validation (validation/scores, greedy)",
        )
        ax1.legend(loc="lower right", fontsize=8)
    ax1.set_xlabel("PPO step")
    ax1.set_ylabel("mean reward", color="tab:blue")
    ax1.set_ylim(*_limits([r["objective/scores"] for r in rows] + [r["validation/scores"] for r in val]))
    ax2 = ax1.twinx()
    ax2.plot(steps, [r["objective/kl"] for r in rows], color="tab:red", alpha=0.7, label="KL (objective/kl)")
    ax2.set_ylabel("KL to reference", color="tab:red")
    ax1.set_title("PPO: reward and KL per step")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def _limits(values: list[float]) -> tuple[float, float]:
    """The reward axis: [0, 1] (a little wider) for rewards in it, the data's range otherwise
    (rewards of any scale: reward models, penalties)."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    lo, hi = min(finite, default=0.0), max(finite, default=1.0)
    if lo >= 0.0 and hi <= 1.0:
        return -0.02, 1.02
    pad = 0.02 * (hi - lo or 1.0)
    return lo - pad, hi + pad
