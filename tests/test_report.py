"""The end-of-run report: the summary of a hand-made metrics file, the plot's reward axis
following the data, and the plot skipped without matplotlib."""

from __future__ import annotations

import json
import sys

import pytest

from aligner.report import _limits, format_summary, plot_run, summarize


def _rows(scores, kl=0.1):
    return [
        {"step": i + 1, "time": 100.0 + i, "objective/scores": s, "objective/kl": kl, "timers/step": 1.0}
        for i, s in enumerate(scores)
    ]


def test_summary_of_a_hand_worked_run():
    rows = [
        {"step": 0, "validation/scores": 0.1},
        *_rows([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        {"step": 6, "validation/scores": 0.7},
    ]
    s = summarize(rows, window=2)
    assert s["steps"] == 6
    assert s["reward_start"] == pytest.approx(0.1) and s["reward_end"] == pytest.approx(0.9)
    assert s["reward_best"] == 1.0 and s["kl_end"] == pytest.approx(0.1)
    assert s["wall_s"] == pytest.approx(6.0) and s["step_s"] == pytest.approx(1.0)
    assert s["val_end"] == 0.7 and s["val_best"] == 0.7
    table = format_summary(s)
    assert "| reward at end     |      0.900 |" in table
    with pytest.raises(ValueError, match="no metrics rows"):
        summarize([{"step": 0, "validation/scores": 0.1}])


def test_the_reward_axis_follows_the_data():
    assert _limits([0.0, 0.5, 1.0]) == (-0.02, 1.02)
    lo, hi = _limits([-3.0, 0.5, 7.0])
    assert lo < -3.0 and hi > 7.0 and hi - lo == pytest.approx(10.4)
    assert _limits([float("nan"), 2.0, 2.0]) == pytest.approx((1.98, 2.02))


def test_plot_written_and_skipped_without_matplotlib(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows([-2.0, 0.5, 3.0])))
    out = plot_run(str(metrics), str(tmp_path / "plot" / "reward_kl.png"))
    assert out and (tmp_path / "plot" / "reward_kl.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_run(str(metrics), str(tmp_path / "again.png")) is None
    assert not (tmp_path / "again.png").exists()


def test_the_console_line_names_each_figure_once():
    from aligner.metrics import format_console

    m = {"objective/scores": 0.4123, "objective/kl": 0.0312, "policy/clipfrac": 0.05, "timers/step": 0.2403}
    assert format_console(12, m) == "step 12 reward=0.4123 kl=0.0312 clipfrac=0.05 0.24s"
    assert format_console(3, {"critic/vf_loss": 1.5}) == "step 3 vf_loss=1.5"
