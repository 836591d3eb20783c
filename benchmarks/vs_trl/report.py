"""The TRL comparison's table: seconds per update, generated tokens per second, MFU and the phase
split of each system and case, with TRL/ours ratios overall and round by round."""

from __future__ import annotations

import statistics

from benchmarks.vs_trl.cases import CASES
from benchmarks.vs_trl.flops import update_flops


def round_ratios(rounds: list[dict[str, float]]) -> list[float]:
    """TRL's seconds per update over ours, for each round in which both systems ran."""
    return [x["trl"] / x["ours"] for x in rounds if x.get("ours") and x.get("trl")]


def report(results: dict, peaks: dict[str, float], precision: str) -> str:
    peak = peaks[precision]
    lines = [
        f"matmul peak here: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s "
        f"(MFU below against {precision})",
        f"{'case':<5}{'system':<7}{'s/update':>10}{'gen tok/s':>11}{'MFU':>7}  phases (s)",
    ]
    for case, r in results.items():
        flops = update_flops(CASES[case])["total"]
        for system in ("ours", "trl"):
            x = r.get(system)
            if x is None:
                lines.append(f"{case:<5}{system:<7}{'-':>10}{'-':>11}{'-':>7}  (not run)")
                continue
            mfu = flops / x["s_per_update"] / (peak * 1e9)
            ph = "  ".join(f"{k} {v:.3f}" for k, v in x["phases_s"].items() if k != "step")
            if system == "ours":
                ph += f"  idle {100 * x['idle_share']:.1f}%"
            lines.append(
                f"{case:<5}{system:<7}{x['s_per_update']:>10.3f}{x['gen_tokens_per_s']:>11.0f}"
                f"{100 * mfu:>6.1f}%  {ph}"
            )
        if r.get("ours") and r.get("trl"):
            o, t = r["ours"], r["trl"]
            lines.append(
                f"{case:<5}{'TRL/ours':<9}{t['s_per_update'] / o['s_per_update']:>8.2f}x"
                f"{o['gen_tokens_per_s'] / t['gen_tokens_per_s']:>10.2f}x  (seconds per update; tokens/s ours/TRL)"
            )
        paired = round_ratios(r.get("rounds", []))
        if len(paired) > 1:
            lines.append(
                f"{case:<5}{'rounds':<9}"
                + ", ".join(f"{x:.2f}x" for x in paired)
                + f"  (TRL/ours within each round; median {statistics.median(paired):.2f}x)"
            )
        idle = [x["ours_idle"] for x in r.get("rounds", []) if "ours_idle" in x]
        if len(idle) > 1:
            lines.append(
                f"{case:<5}{'idle':<9}"
                + ", ".join(f"{100 * x:.1f}%" for x in idle)
                + "  (our actor's share of the step waiting on the server, each round)"
            )
    return "\n".join(lines)
