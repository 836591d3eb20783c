"""``make bench``: every benchmark in turn, each printing JSON and a table.

.venv/bin/python benchmarks/run.py [actor|critic|generation|attention|balance|estimators|vs_trl|shapes|packing|ragged|weight_push|async ...]

``vs_trl`` (benchmarks/bench_vs_trl.py) runs TRL's PPOTrainer beside our system when trl is
installed (``pip install -e '.[bench]'``; ``make bench`` does it), else our side alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {
    "actor": ["bench_actor.py"],
    "critic": ["bench_critic.py"],
    "generation": ["bench_generation.py"],
    "attention": ["bench_attention.py"],
    "balance": ["bench_balance.py"],
    "estimators": ["bench_estimators.py"],
    "vs_trl": ["bench_vs_trl.py"],
    "shapes": ["bench_shapes.py"],
    "packing": ["bench_packing.py"],
    "ragged": ["bench_ragged.py"],
    "weight_push": ["bench_weight_push.py"],
    "async": ["bench_async.py"],
}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}: expected some of {list(BENCHES)}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        script, *args = BENCHES[name]
        print(f"\n=== {name} ({script}) ===", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / script), *args], env=dict(os.environ))
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
