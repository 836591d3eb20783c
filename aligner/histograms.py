"""Distributions of a step's values over every data-parallel rank: their mean, max and min (every
step, to every sink) and, on the steps that ask for them, histograms (TensorBoard and W&B only:
metrics.jsonl keeps scalars).

Nothing is gathered: each rank bins its own values into the same buckets and the counts are
summed, so a histogram is the one of the union of every rank's values (as a single process would
draw it) for two small all-reduces a step, whatever the batch: the first takes the global min and
max (the buckets' range), the second sums the counts, sums, sums of squares and element counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_BINS", "Histogram", "distributions"]

DEFAULT_BINS = 64
"""Buckets of a histogram: equal widths between the global min and max."""


@dataclass
class Histogram:
    """One histogram: ``counts[i]`` values in ``[edges[i], edges[i+1])`` (the last bucket includes
    its right edge), and the moments TensorBoard shows beside it."""

    edges: list[float]
    """``bins + 1`` bucket edges, increasing."""
    counts: list[float]
    """``bins`` counts."""
    num: float
    sum: float
    sum_squares: float
    min: float
    max: float

    def to_tensorboard(self, writer: Any, tag: str, step: int) -> None:
        """``writer.add_histogram_raw`` (a torch SummaryWriter): TensorBoard's buckets are given
        by their right edges."""
        writer.add_histogram_raw(
            tag,
            min=self.min,
            max=self.max,
            num=self.num,
            sum=self.sum,
            sum_squares=self.sum_squares,
            bucket_limits=self.edges[1:],
            bucket_counts=self.counts,
            global_step=step,
        )

    def to_wandb(self, wandb: Any) -> Any:
        """A ``wandb.Histogram`` of the same buckets."""
        return wandb.Histogram(np_histogram=(self.counts, self.edges))


def distributions(
    named: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    group: Any = None,
    bins: int = 0,
) -> tuple[dict[str, float], dict[str, Histogram]]:
    """``named``: name -> ``(x, mask)`` (any shape; ``mask`` of the same shape, or None for every
    element). Returns ``{name/mean, name/max, name/min}`` of the values over every rank in
    ``group`` (a name without values on any rank has none), and, with ``bins`` > 0, a
    :class:`Histogram` per name. Non-finite values are left out. Collective over ``group`` (None: this process alone): every rank
    calls it with the same names and ``bins``."""
    names = list(named)
    if not names:
        return {}, {}
    vals = []
    for x, mask in named.values():
        x = x.detach().float().reshape(-1)
        if mask is not None:
            x = x[mask.detach().reshape(-1) != 0]
        vals.append(x[torch.isfinite(x)])
    device = vals[0].device
    inf = torch.tensor(math.inf, device=device)
    ext = torch.stack(
        [torch.stack([-v.min(), v.max()]) if v.numel() else torch.stack([-inf, -inf]) for v in vals]
    )  # [k, 2]: -min, max
    if group is not None:
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
    lo, hi = (-ext[:, 0]).tolist(), ext[:, 1].tolist()
    rows = []
    for v, a, b in zip(vals, lo, hi):
        v64 = v.double()
        moments = torch.stack(
            [torch.tensor(float(v.numel()), device=device).double(), v64.sum(), (v64 * v64).sum()]
        )
        if bins > 0:
            a, b = _range(a, b)
            counts = torch.histc(v, bins=bins, min=a, max=b).double() if v.numel() else v64.new_zeros(bins)
            moments = torch.cat([moments, counts])
        rows.append(moments)
    sums = torch.stack(rows)  # [k, 3 (+ bins)]
    if group is not None:
        dist.all_reduce(sums, group=group)
    sums = sums.cpu().tolist()
    scalars: dict[str, float] = {}
    hists: dict[str, Histogram] = {}
    for name, row, a, b in zip(names, sums, lo, hi):
        n, s, sq = row[:3]
        if n <= 0:
            continue
        scalars.update({f"{name}/mean": s / n, f"{name}/max": b, f"{name}/min": a})
        if bins > 0:
            e0, e1 = _range(a, b)
            edges = [e0 + (e1 - e0) * i / bins for i in range(bins + 1)]
            hists[name] = Histogram(edges, row[3:], n, s, sq, a, b)
    return scalars, hists


def _range(lo: float, hi: float) -> tuple[float, float]:
    """The buckets' range: ``[lo, hi]``, widened by 0.5 each way when every value is the same."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0, 1.0
    return (lo - 0.5, hi + 0.5) if hi <= lo else (lo, hi)
