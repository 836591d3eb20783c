"""The TRL side-by-side benchmark (benchmarks/bench_vs_trl.py and benchmarks/vs_trl/): its shared
inputs, its FLOP count, its report, and one update of each side at a miniature shape through the
script (TRL's only when trl is installed); and a short run of the balancing benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vs_trl.cases import CASES, build_inputs
from benchmarks.vs_trl.flops import forward_flops, update_flops
from benchmarks.vs_trl.report import report, round_ratios

ROOT = Path(__file__).resolve().parents[1]
MINI = CASES["mini"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(MINI, tmp_path_factory.mktemp("bench-inputs"))


def test_inputs_serve_both_sides(inputs):
    """One tokenizer folder both sides load, prompts of the case's length, HF model folders."""
    from transformers import AutoTokenizer

    from aligner.tokenizers import build_tokenizer

    ours = build_tokenizer(inputs["tokenizer"])
    assert (ours.vocab_size, ours.pad_id, ours.eos_id) == (MINI.vocab, 0, 1)
    theirs = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    lines = Path(inputs["prompts"]).read_text().splitlines()
    prompt = json.loads(lines[0])["prompt"]
    assert ours.encode(prompt) == theirs.encode(prompt, add_special_tokens=False)
    assert len(ours.encode(prompt)) == MINI.prompt_len and len(lines) >= 8 * MINI.batch
    for role, arch in (("policy", "LlamaForCausalLM"), ("reward", "LlamaForSequenceClassification")):
        cfg = json.loads((Path(inputs[role]) / "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["vocab_size"] == MINI.vocab


def test_flop_count_matches_the_parameter_count(inputs):
    """At zero context a token's forward costs 2 FLOPs per weight of every matmul (embedding
    lookups and norms excluded)."""
    import transformers

    for role, head in (("policy", "lm"), ("reward", "value")):
        model = getattr(
            transformers, "LlamaForCausalLM" if head == "lm" else "LlamaForSequenceClassification"
        )
        m = model.from_pretrained(inputs[role])
        weights = sum(p.numel() for n, p in m.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
        assert forward_flops(MINI, 1, 0, head) == 2 * weights
    f = update_flops(CASES["B1"])
    assert f["total"] == f["generate"] + f["rollout_forwards"] + f["train"] > 0
    # The train phase is 3x (forward + backward) the forwards of policy and value per epoch.
    b2 = update_flops(CASES["B2"])
    assert f["train"] / f["rollout_forwards"] > 4 * b2["train"] / b2["rollout_forwards"] * 0.9


def _result(s_per_update: float) -> dict:
    return {"s_per_update": s_per_update, "gen_tokens_per_s": 100.0, "phases_s": {}, "idle_share": 0.0}


def test_rounds_pair_each_systems_runs_of_one_round():
    # Round 2's TRL run failed: that round gives no ratio. Best medians: ours 1.0, TRL 2.0.
    rounds = [
        {"ours": 1.0, "ours_idle": 0.021, "trl": 2.5},
        {"ours": 1.5, "ours_idle": 0.048},
        {"ours": 1.2, "ours_idle": 0.057, "trl": 3.0},
        {"ours": 1.0, "ours_idle": 0.004, "trl": 2.0},
    ]
    assert round_ratios(rounds) == [2.5, 2.5, 2.0]
    results = {"B1": {"ours": _result(1.0), "trl": _result(2.0), "rounds": rounds}}
    text = report(results, {"fp32": 100.0, "bf16": 400.0}, "bf16")
    assert "B1   TRL/ours     2.00x" in text
    assert "B1   rounds   2.50x, 2.50x, 2.00x  (TRL/ours within each round; median 2.50x)" in text
    assert "B1   idle     2.1%, 4.8%, 5.7%, 0.4%  (our actor's share of the step waiting" in text
    # One round: the best-of line is all there is.
    results["B1"]["rounds"] = rounds[:1]
    text = report(results, {"fp32": 100.0, "bf16": 400.0}, "bf16")
    assert "rounds" not in text and "B1   idle" not in text


def _run(tmp_path, systems: str) -> dict:
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_vs_trl.py"),
        "--cases",
        "mini",
        "--systems",
        systems,
        "--warmup",
        "1",
        "--updates",
        "1",
        "--trl-attn",
        "eager",
        # fp32: a smoke test of the script, not of bf16 (which a CPU without it runs 40x slower)
        "--precision",
        "fp32",
        "--workdir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["results"]["mini"]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.subprocess
def test_our_side_runs_one_update(tmp_path):
    r = _run(tmp_path, "ours")["ours"]
    assert r["s_per_update"] > 0 and r["gen_tokens_per_s"] > 0
    assert r["precision"] == {"actor": "fp32", "server": "fp32"}
    assert set(r["phases_s"]) >= {"generate", "logprobs", "critic_wait", "train"}
    assert 0 <= r["idle_share"] < 1


@pytest.mark.slow
@pytest.mark.subprocess
def test_trl_side_runs_one_update(tmp_path):
    pytest.importorskip("trl.experimental.ppo", reason="the bench extra (trl 1.12) is not installed")
    r = _run(tmp_path, "trl")["trl"]
    assert r["s_per_update"] > 0 and r["gen_tokens_per_s"] > 0
    assert r["precision"] == "fp32"


def test_balance_bench_runs_and_balances_tokens(capsys):
    from benchmarks.bench_balance import main

    out = main(["--steps", "4"])["balance"]
    assert [r["global_batch"] for r in out] == [64, 256]
    for r in out:
        assert r["contiguous_ms"] > 0 and r["balanced_ms"] > 0
        # Snake dealing by length evens the ranks' tokens out (measured 1.003 vs 1.037 at 64 rows).
        assert r["balanced_imbalance"] < r["contiguous_imbalance"]
    assert "| global batch |" in capsys.readouterr().out
