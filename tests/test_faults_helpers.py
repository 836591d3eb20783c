"""The fault suite's own helpers (``tests/_faults.py``) catch what they are there to catch: a
weight that differs by one rounding step, a metric that moved, a rollback line, a write past the
file size limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _faults import (
    MALFORMED,
    MAX_BATCH,
    POISON_PROMPT,
    SERVER_SETTINGS,
    Critic,
    assert_same_weights,
    copy_reward_or_raise,
    file_size_limited,
    infer_request,
    judge,
    last_error,
    metrics_steps,
    rollbacks,
    rss_mib,
    same_metrics,
    samples_batch,
)

pytestmark = pytest.mark.faults


def test_weights_must_be_equal_element_for_element():
    a = {"actor/policy": {"w": torch.arange(6, dtype=torch.float32)}, "critic/model": {"v": torch.ones(3)}}
    same = {part: {k: t.clone() for k, t in d.items()} for part, d in a.items()}
    assert_same_weights(same, a)
    off = {part: {k: t.clone() for k, t in d.items()} for part, d in a.items()}
    off["critic/model"]["v"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(AssertionError, match=r"critic/model: 1 tensor\(s\) differ.*'v'"):
        assert_same_weights(off, a)
    with pytest.raises(AssertionError):
        assert_same_weights({"actor/policy": a["actor/policy"]}, a)


def test_metrics_must_match_at_every_step_but_timers():
    want = [{"step": 1, "critic/vf_loss": 1.0, "timers/step": 0.1}, {"step": 2, "critic/vf_loss": 0.5}]
    same_metrics([{**want[0], "timers/step": 9.0}, dict(want[1])], want)
    with pytest.raises(AssertionError):
        same_metrics([want[0], {"step": 2, "critic/vf_loss": 0.51}], want)
    with pytest.raises(AssertionError):
        same_metrics([want[0]], want)


def test_rollback_lines_are_parsed():
    text = (
        "step 5 scores=0.06\n"
        "critic server restarted (critic step 4, expected 5): rolled both roles back to step 4; "
        "steps 5..6 are redone (restart 1 of at most 3)\n"
    )
    assert rollbacks(text) == [{"server_step": 4, "expected": 5, "to": 4, "first": 5, "last": 6}]
    assert rollbacks("critic server restarted, and nothing else") == []


def test_metrics_steps_skip_a_line_being_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert metrics_steps(tmp_path) == [1]
    assert metrics_steps(tmp_path / "nowhere") == []


def test_a_write_past_the_file_size_limit_fails_with_an_error_not_a_signal(tmp_path):
    write = "import sys; open(sys.argv[1], 'wb').write(b'x' * int(sys.argv[2]))"
    small = subprocess.run(
        file_size_limited([sys.executable, "-c", write, str(tmp_path / "a"), "1000"], 4096),
        capture_output=True,
        text=True,
    )
    assert small.returncode == 0 and (tmp_path / "a").stat().st_size == 1000, small.stderr
    big = subprocess.run(
        file_size_limited([sys.executable, "-c", write, str(tmp_path / "b"), "10000"], 4096),
        capture_output=True,
        text=True,
    )
    assert big.returncode == 1 and "File too large" in big.stderr, (big.returncode, big.stderr)


def test_the_reward_function_fails_only_with_the_poisoned_prompt():
    assert copy_reward_or_raise(["123:", "45:"], ["123", "4"]) == [1.0, 0.5]
    with pytest.raises(ValueError):
        copy_reward_or_raise(["123:", POISON_PROMPT], ["123", "9"])


def test_resident_memory_is_read():
    import os

    assert 1 < rss_mib(os.getpid()) < 1 << 20


def test_the_load_case_judges_every_outcome():
    import numpy as np

    from aligner.wire.protocol import BATCH_PEER_MARK

    tokens, lengths, pl = samples_batch(["12:", "3:"], ["12", ""], 8)
    values, rewards = np.zeros((2, 7), np.float32), np.array([1.0, 0.0], np.float32)
    good = {"values": values + 1e-5, "rewards": rewards.reshape(-1, 1), "error": np.array([[b""], [b""]])}
    assert judge("good", "", good, (values, rewards), atol=1e-3) is None
    assert "values differ" in judge("good", "", good, (values, rewards), atol=1e-6)
    assert "rewards" in judge("good", "", {**good, "rewards": rewards[::-1, None]}, (values, rewards), atol=1)
    assert "error rows" in judge(
        "good", "", {**good, "error": np.array([[b"x"], [b""]])}, (values, rewards), atol=1
    )
    assert judge("good", "", RuntimeError(f"{BATCH_PEER_MARK}merged"), (values, rewards), atol=1) == "retry"
    assert judge("good", "", RuntimeError("unavailable"), (values, rewards), atol=1).startswith("good:")
    for kind in MALFORMED:
        inputs, needle = infer_request(kind, tokens, lengths, pl, max_batch=4)
        assert needle and judge(kind, needle, good, (values, rewards), atol=1) == f"{kind}: accepted"
        assert judge(kind, needle, RuntimeError(f"... {needle} ..."), (values, rewards), atol=1) is None
        assert "does not name" in judge(kind, needle, RuntimeError("some error"), (values, rewards), atol=1)
    inputs, _ = infer_request("batch", tokens, lengths, pl, max_batch=4)
    assert inputs["tokens"].shape == (6, 8) and inputs["lengths"].shape == (6, 1)
    inputs, _ = infer_request("good", tokens, lengths, pl, max_batch=4)
    assert inputs["prompt_lengths"].tolist() == [[3], [2]] and inputs["lengths"].tolist() == [[6], [3]]


def test_the_last_error_line_of_a_traceback():
    text = "Error executing job with overrides: ['a=b']\nTraceback (most recent call last):\n  x\nmod.SomeError: it broke\n\nSet HYDRA_FULL_ERROR=1\n"
    assert last_error(text) == "mod.SomeError: it broke"


def test_every_server_of_the_suite_runs_the_reference_servers_settings(tmp_path):
    """The reference run's server and the ones killed and started again differ in their ports and
    folders only: the actor cuts its batches by ``server.max_batch_size`` and a packed forward
    rounds a row by the rows packed with it, so a restarted run is the reference's bit for bit
    only against the same settings (a default ``max_batch_size`` on the killed servers, 16 on the
    reference's, left the packed runs 1e-7 off)."""

    def settings(c: Critic) -> list[str]:
        return sorted(
            o for o in c.overrides() if str(c.root) not in o and not o.startswith("server.grpc_port=")
        )

    shared, killed = Critic(tmp_path / "shared"), Critic(tmp_path / "server")
    assert settings(shared) == settings(killed)
    assert set(SERVER_SETTINGS) <= set(killed.overrides())
    assert f"server.max_batch_size={MAX_BATCH}" in SERVER_SETTINGS
    assert any(o.startswith("max_tokens_per_micro_batch=") for o in SERVER_SETTINGS)  # packing covered
    with pytest.raises(AssertionError, match="SERVER_SETTINGS"):
        Critic(tmp_path / "other", extra=["server.max_batch_size=256"])
