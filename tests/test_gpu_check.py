"""The GPU check (aligner.gpu_check, docs/gpu-check.md): its reduced form end to end on the CPU, as
CI runs it, and the pieces that turn measurements into its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aligner.gpu_check.figures import summarize, weight_bytes
from aligner.gpu_check.measure import PeakMemory, datasheet
from aligner.gpu_check.pytest_run import parse_collect_only, parse_junit
from aligner.gpu_check.workload import TINY, reward, write_prompts

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_reduced_check_runs_every_section_and_writes_a_sane_report(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "aligner.gpu_check", "--reduced", "--out", str(out)],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["problems"] == [] and r["mode"] == "reduced"
    assert "gpu_check: ok" in proc.stdout

    env = r["environment"]
    assert env["packages"]["megatron-core"] and env["packages"]["hydra-core"]
    assert env["measured"]["copy_bandwidth_gb_s"] > 0 and env["measured"]["matmul_tflops"] > 0

    # The GPU tests are collected (the marks exist), not run.
    tests = r["pytest"]
    assert tests["mode"] == "collect-only" and tests["collected"] >= 1 and not tests["timed_out"]
    assert all("::" in test_id for test_id in tests["ids"])

    ppo = r["ppo"]
    assert ppo["steps_done"] == ppo["steps_requested"] == 3
    assert ppo["shape"]["vocab_size"] == TINY.vocab_size
    assert set(ppo["placement"].values()) == {"cpu"}
    assert ppo["model"]["parameters"] > 0 and ppo["model"]["weight_bytes_per_decode_step"] > 0
    for phase in ("step", "refit", "generate", "logprobs", "train"):
        assert ppo["phases_s"][f"timers/{phase}"]["mean"] >= 0, phase
    assert ppo["phases_s"]["timers/step"]["mean"] > 0
    gen, train = ppo["generation"], ppo["training"]
    assert gen["tokens_per_s"] > 0 and 0 < gen["ratio_to_floor"]
    assert gen["response_tokens_per_call"] == 8 * 8  # batch 8, every response runs to 8 new tokens
    assert train["tokens_per_s"] > 0 and train["mfu"] > 0
    assert ppo["refit"]["engine_owns_weights"] is False  # fp32, TP=1: the engine shares the policy
    assert ppo["critic"]["infer_s_mean"] > 0 and ppo["critic"]["train_s_mean"] > 0
    assert len(ppo["steps"]) == 3 and 0 <= ppo["scores"]["last"] <= 1
    assert ppo["memory_peak_gib"] is None  # no device memory to read on a CPU


# ----------------------------------------------------------------------------------------------
# The figures
# ----------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    """Named like a Megatron GPT: an embedding table of 10 x 4 and one 4 x 4 weight (56 numbers)."""

    def __init__(self, untied: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 4, bias=False)
        if untied:
            self.output_layer = nn.Linear(4, 10, bias=False)


def test_a_decode_step_reads_every_weight_but_an_untied_embedding_table():
    assert weight_bytes(_Tiny(), tied=True, dtype=None) == (56, 56 * 4)
    # Untied: the table is looked up (a few rows), the output layer's 40 weights are read.
    assert weight_bytes(_Tiny(untied=True), tied=False, dtype=torch.bfloat16) == (96, (16 + 40) * 2)


def test_summarize_reads_the_floor_ratio_and_mfu_off_the_steady_steps():
    rows = [
        {"timers/step": 9.0, "timers/generate": 8.0, "timers/refit": 0.5, "throughput/tokens_per_s": 1.0},
        {"timers/step": 3.0, "timers/generate": 2.0, "timers/refit": 0.1, "throughput/tokens_per_s": 3.0},
    ]
    call = {"seconds": 2.0, "rows": 2.0, "prompt_min": 3.0, "prompt_max": 5.0, "length_max": 9.0}
    call.update(response_max=7.0, tokens=14.0, response_tokens=6.0)
    calls = [{**call, "seconds": 8.0}, call]
    # 56 fp32 weights = 224 bytes a step; at 2.24e-6 GB/s a step's floor is 0.1 s.
    sticks = {"copy_bandwidth_gb_s": 2.24e-6, "matmul_tflops": 6 * 56 * 14 / 0.5 / 1e12, "datasheet": None}
    engine = SimpleNamespace(dtype=None, owns_weights=False, backend="megatron")
    out = summarize(
        rows,
        calls,
        [5.0, 0.5],
        {"infer": [1.0, 0.2], "train": [1.0, 0.4]},
        policy=_Tiny(),
        tied=True,
        engine=engine,
        ppo_epochs=1,
        yardsticks=sticks,
    )
    assert out["steady_steps"] == 1  # the first step is left out of the means
    assert out["phases_s"]["timers/step"] == {"first": 9.0, "mean": 3.0}
    g = out["generation"]
    # The megatron backend teacher-forces. Steady call: 6 response tokens in 2 s; forward steps
    # 9 - 3 = 6 decode steps + 1 prefill = 7, floor 7 x 0.1 = 0.7 s: 6 / 0.7 = 8.571 tokens/s at
    # the floor (8.6 to one decimal), a ratio of 0.7 / 2 = 0.35.
    assert g["decode"] == "teacher_forced"
    assert g["tokens_per_s"] == 3.0 and g["forward_steps_per_call"] == 7.0
    assert g["teacher_forced_steps_per_call"] == 2.0 and "live_rows_per_step" not in g
    assert g["floor_tokens_per_s"] == 8.6 and g["ratio_to_floor"] == 0.35
    # 6 x 56 parameters x 14 tokens in 0.5 s, against a peak of exactly that: an MFU of 1.
    assert out["training"]["mfu"] == 1.0 and out["training"]["tokens_per_step"] == 14.0
    assert out["refit"] == {
        "engine_owns_weights": False,
        "seconds_first": 0.5,
        "seconds_mean": 0.1,
        "mbytes_mean": 0.0,
    }
    assert out["critic"] == {"infer_s_mean": 0.2, "train_s_mean": 0.4}


def test_a_ragged_call_takes_as_many_forward_steps_as_its_longest_response():
    # The lean backend: one prefill (the first response token) and a decode step per further token
    # of the longest response, whatever the prompts' lengths: 3 steps for responses of 3 and 1.
    rows = [{"timers/step": 1.0, "throughput/tokens_per_s": 1.0}]
    call = {"seconds": 0.3, "rows": 2.0, "prompt_min": 3.0, "prompt_max": 50.0, "length_max": 53.0}
    call.update(response_max=3.0, tokens=57.0, response_tokens=4.0)
    sticks = {"copy_bandwidth_gb_s": 2.24e-6, "matmul_tflops": None, "datasheet": None}
    # "auto" runs the lean backend where it can: always with weights of the engine's own (not
    # on this toy model, which falls back to the megatron backend's teacher forcing).
    for backend, owns in (("lean", False), ("auto", True)):
        g = summarize(
            rows,
            [call],
            [0.1],
            {},
            policy=_Tiny(),
            tied=True,
            engine=SimpleNamespace(dtype=None, owns_weights=owns, backend=backend),
            ppo_epochs=1,
            yardsticks=sticks,
        )["generation"]
        assert g["decode"] == "ragged" and g["forward_steps_per_call"] == 3.0
        assert "teacher_forced_steps_per_call" not in g
        # 4 tokens over 3 steps: the batch shrank from 2 rows to 1; floor 3 x 0.1 s = the call.
        assert g["live_rows_per_step"] == 1.3 and g["ratio_to_floor"] == 1.0
    fallback = SimpleNamespace(dtype=None, owns_weights=False, backend="auto")
    g = summarize(
        rows, [call], [0.1], {}, policy=_Tiny(), tied=True, engine=fallback, ppo_epochs=1, yardsticks=sticks
    )["generation"]
    assert g["decode"] == "teacher_forced" and g["forward_steps_per_call"] == 51.0  # 53 - 3 + 1


def test_datasheets_are_found_by_the_device_name():
    assert datasheet("NVIDIA H100 80GB HBM3")["name"] == "H100 SXM"
    assert datasheet("NVIDIA H100 PCIe")["name"] == "H100 PCIe"
    assert datasheet("NVIDIA H200")["memory_tb_s"] == 4.8
    assert datasheet("NVIDIA A100-SXM4-80GB") is None


def test_peak_memory_measures_nothing_on_a_cpu():
    peaks = PeakMemory(torch.device("cpu"))
    with peaks.step(), peaks.role("generation"):
        torch.ones(10)
    assert not peaks.available and peaks.gib() is None and peaks.allocated() is None


# ----------------------------------------------------------------------------------------------
# The workload and pytest's output
# ----------------------------------------------------------------------------------------------


def test_prompts_have_lengths_in_range_and_the_reward_counts_even_ids(tmp_path):
    stats = write_prompts(tmp_path / "p.jsonl", 50, 256, 4, 9, seed=3)
    lengths = [len(json.loads(x)["prompt"].split()) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(lengths) == 50 and min(lengths) >= 4 and max(lengths) <= 9
    assert stats["min"] == min(lengths) and stats["max"] == max(lengths)
    assert reward(["a", "b", "c"], ["", "", ""], response_ids=[[2, 3, 4, 5], [7], []]) == [0.5, 0.0, 0.0]


def test_junit_counts_separate_modules_that_could_not_be_imported(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite errors="2" failures="1" skipped="1" tests="5">'
        '<testcase classname="" name="tests.critic.test_x"><error message="collection failure">'
        "ImportError while importing\nE   ModuleNotFoundError: No module named 'tritonclient'</error></testcase>"
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="boom">x</failure></testcase>'
        '<testcase classname="tests.a" name="test_err"><error message="fixture">x</error></testcase>'
        '<testcase classname="tests.a" name="test_skip"><skipped message="no gpu">x</skipped></testcase>'
        "</testsuite></testsuites>"
    )
    r = parse_junit(xml)
    assert (r["passed"], r["failed"], r["errors"], r["skipped"]) == (1, 1, 1, 1)
    assert r["failing"] == ["tests.a::test_bad"] and r["erroring"] == ["tests.a::test_err"]
    assert r["collection_errors"] == [
        {"module": "tests.critic.test_x", "reason": "ModuleNotFoundError: No module named 'tritonclient'"}
    ]


def test_collect_only_output_gives_the_ids_and_the_modules_that_failed():
    out = (
        "tests/g/test_a.py::test_one[cuda]\n\n"
        "____ ERROR collecting tests/c/test_b.py ____\nTraceback:\n"
        "E   ModuleNotFoundError: No module named 'tritonclient'\n"
        "=== short test summary info ===\nERROR tests/c/test_b.py\n"
        "1/54 tests collected (53 deselected), 1 error in 1.66s\n"
    )
    r = parse_collect_only(out)
    assert r["ids"] == ["tests/g/test_a.py::test_one[cuda]"] and r["collected"] == 1
    assert (r["total"], r["deselected"]) == (54, 53)
    assert r["collection_errors"] == [
        {"module": "tests/c/test_b.py", "reason": "ModuleNotFoundError: No module named 'tritonclient'"}
    ]


def test_an_option_is_passed_on_where_the_tree_has_its_key_and_refused_by_name_where_not():
    import dataclasses

    from aligner.actor.config import PolicyOptimConfig
    from aligner.gpu_check.ppo_run import OptionUnavailable, PPOOptions, option_keys
    from aligner.models.config import ModelConfig

    def opts(**kw) -> PPOOptions:
        return PPOOptions(TINY, 1, 8, 4, 4, 8, 4, 24, "fp32", 60.0, **kw)

    assert option_keys(opts()) == ([], {})
    for kw, cls, key, flag in (
        ({"recompute": "full"}, ModelConfig, "recompute", "--recompute"),
        (
            {"distributed_optimizer": True},
            PolicyOptimConfig,
            "use_distributed_optimizer",
            "--distributed-optimizer",
        ),
    ):
        if key in {f.name for f in dataclasses.fields(cls)}:
            assert any(key in o for o in option_keys(opts(**kw))[0])
        else:
            with pytest.raises(OptionUnavailable, match=flag):
                option_keys(opts(**kw))
