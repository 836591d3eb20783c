"""Run under ``torchrun --nproc_per_node 2``: the PPO update of ``tests/_loss_layout.py``'s fixed
rollout at DP=2, TP=2 and PP=2 against the one-process update (:func:`_loss_layout.layout_report`).

Prints ``RESULT <json>`` from global rank 0: the largest differences of each layout. Used by
tests/actor/test_loss_layout.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _loss_layout

import _loss_layout  # noqa: E402


def main() -> None:
    report = _loss_layout.layout_report()
    if report is not None:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
