"""The actor end to end against a real critic/reward server (PyTriton on a free loopback port).

Learning is tested for real: copy (through the command line at DP=2, and at PP=2 generating in
a layout of its own) and reverse must reach a mean reward of 0.8-0.9 from under 0.3; the same
run with the policy-gradient sign flipped must stay near chance; a larger KL coefficient must end
with a smaller KL. TP=2 x DP=2 on four processes rolls out as DP=2 does. Each run gets a fresh
server (step ids restart at 1 with every run). DP=2 runs with the server's dynamic batching on
are reproducible: two runs give the same metrics, whichever rank's critic_infer arrives first
and whatever Triton merges.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _actor_runs import (
    FAST,
    best_window,
    check_hf_export,
    critic_step,
    digit_server,
    run_actor,
    torchrun_actor,
)

from aligner.checkpoint import complete_steps
from aligner.metrics import read_metrics
from aligner.wire.client import RemoteCriticClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.subprocess
@pytest.mark.multiprocess
def test_copy_is_learned_through_the_entry_point(tmp_path):
    """The real command line at DP=2: torchrun runs examples/train_actor.py on two processes,
    each generating half of every step's prompts; the critic's batch is gathered and sent once
    per step (the server's critic step ends equal to the actor's). The server batches
    dynamically: each rank's critic_infer names the critic step it must see and gets its own
    forward, so neither the order the two arrive in nor their merging changes a value (see
    test_dp2_runs_with_dynamic_batching_are_reproducible)."""
    with digit_server(tmp_path, "copy") as server:
        out = torchrun_actor(
            2,
            server.url,
            tmp_path / "run",
            [
                "data.task=copy",
                "ppo.num_steps=120",
                f"checkpoint.export_hf={tmp_path / 'hf'}",
                *FAST,
                "ppo.micro_batch_size=32",
            ],
        )
        assert critic_step(server.url) == 120
    assert "TP=1, PP=1, DP=2" in out.stdout
    all_rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    rows = [r for r in all_rows if "objective/scores" in r]
    assert len(rows) == 120
    # aligner/configs/actor.yaml validates before training and every 50 steps, and saves every 100.
    val = {r["step"]: r["validation/scores"] for r in all_rows if "validation/scores" in r}
    assert sorted(val) == [0, 50, 100] and val[100] > val[0]
    assert "validation samples at step 50" in out.stdout
    ckpt = tmp_path / "run" / "checkpoints"
    assert {100, 120} <= set(complete_steps(ckpt, role="actor"))
    assert (ckpt / "best").is_symlink()
    check_hf_export(tmp_path / "hf", task="copy")
    assert rows[0]["objective/scores"] < 0.3
    # From ~0.06 to a plateau within the budget. The plateau depends on the random streams: the
    # best 5-step mean of these 120 steps measured 0.71-1.00 over seeds 1, 2, 3, 4 and 1234 in
    # fp32 (0.71 at the default seed), 0.78 and 0.96 in bf16 (seeds 1, 1234); the same budget with
    # the policy gradient's sign flipped stays under 0.3 (test_flipped_policy_gradient_sign_...).
    assert best_window(rows) >= 0.6, [round(r["objective/scores"], 3) for r in rows[::10]]
    assert "reward at end" in out.stdout and (tmp_path / "run" / "reward_kl.png").is_file()
    for key in (
        "objective/kl",
        "rollout/entropy",
        "policy/approxkl",
        "policy/clipfrac",
        "policy/ratio_mean",
        "loss/policy",
        "critic/vf_loss",
        "critic/vf_explained_var",
        "critic/vf_clipfrac",
        "critic/advantages/mean",
        "critic/values/max",
        "response_length/mean",
        "rollout/ended_fraction",
        "train/episode",
        "perf/max_rss_gb",
        "perf/throughput",
        "timers/generate",
        "timers/logprobs",
        "timers/critic_wait",
        "timers/train",
        "throughput/tokens_per_s",
        "lr",
        "objective/non_score_reward",
    ):
        assert key in rows[-1], key
    assert rows[-1]["train/episode"] == 120 * rows[0]["train/episode"]  # a global batch a step
    for old in ("loss/value", "objective/entropy", "rollout/response_length", "critic/explained_variance"):
        assert old not in rows[-1], old
    # This run computes in bf16 (precision=auto on a CPU with AVX512-BF16, fp32 elsewhere).
    # Generation (KV cache) and the training forward round differently in bf16: their
    # log-probs of the sampled tokens agree to 0.01 on average and 0.25 at worst (fp32: 1e-3,
    # see the TP runs). PPO's ratio uses the training forward's, so this costs nothing.
    assert max(r["rollout/logprob_mismatch_mean"] for r in rows) < 1e-2
    assert max(r["rollout/logprob_mismatch_max"] for r in rows) < 0.25


LATE_TRAIN = """
import os
import time

_delay = float(os.environ.get("ALIGNER_TEST_LATE_TRAIN_S") or 0)
if _delay:  # critic_train reaches the server late: after the other rank's next critic_infer
    from aligner.wire import client as _client

    _send = _client.RemoteCriticClient._train_task

    def _late(self, *args, **kwargs):
        time.sleep(_delay)
        return _send(self, *args, **kwargs)

    _client.RemoteCriticClient._train_task = _late
"""
"""A ``sitecustomize`` for the actor's processes: with ``$ALIGNER_TEST_LATE_TRAIN_S`` set, rank 0's
client sends each critic_train that many seconds late."""


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.subprocess
@pytest.mark.multiprocess
def test_dp2_runs_with_dynamic_batching_are_reproducible(tmp_path, monkeypatch):
    """Two DP=2 runs against one server with dynamic batching on (the second a fresh run, which
    resets the server to its step-0 critic) give the same metrics, value for value, although in
    the second each critic_train reaches the server a second late: the other rank's
    critic_infer of the next step comes first, and waits for the train of the step it names
    (``after_step``), where it used to get the values from before the update. Whether Triton
    merges the two ranks' requests, and in which order, changes nothing: each is its own
    forward."""
    small = [
        "data.task=copy",
        "ppo.num_steps=4",
        "ppo.global_batch_size=64",
        "ppo.mini_batch_size=32",
        "ppo.micro_batch_size=16",
        "validation.num_prompts=16",
        "validation.interval=2",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false",
        *FAST[:2],
        *FAST[5:],
    ]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(LATE_TRAIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    with digit_server(tmp_path, "copy", "server.max_queue_delay_us=20000") as server:  # merges close requests
        runs, waits = [], []
        for name, late in (("prompt", ""), ("late", "1.0")):
            monkeypatch.setenv("ALIGNER_TEST_LATE_TRAIN_S", late)
            torchrun_actor(2, server.url, tmp_path / name, small)
            rows = read_metrics(str(tmp_path / name / "metrics.jsonl"))
            skip = ("time", "timers/", "throughput/", "perf/")
            runs.append([{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows])
            assert critic_step(server.url) == 4
            with RemoteCriticClient(server.url, timeout_s=30) as c:
                info = c.info()
            waits.append(info["extra"]["infer_after_step"])
    assert info["batching"]["dynamic_batching"] is True
    # The late run's second rank waited for the train of every step but the last (and for the
    # validation after step 2), and no request was refused or timed out.
    assert waits[1]["waited"] - waits[0]["waited"] >= 3, waits
    assert waits[1]["timed_out"] == waits[1]["refused_passed"] == 0, waits
    a, b = runs
    assert len(a) == len(b) and len([r for r in a if "objective/scores" in r]) == 4
    for ra, rb in zip(a, b):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}


@pytest.mark.slow
@pytest.mark.server
def test_reverse_is_learned(tmp_path, monkeypatch):
    """Learned in fp32 (the copy run computes in bf16 where the CPU has it), with generation on
    more threads than training, which makes each step wait for the server's pending critic
    update before generating, and with the compiled decode step where torch.compile works."""
    from aligner.actor.critic_link import CriticLink
    from aligner.generation.native import NativeEngine
    from aligner.models.fused import compile_available

    # No generation may start while a critic update is in flight on the server.
    inflight, checked = [], []
    send, wait, generate = CriticLink.train, CriticLink.wait, NativeEngine.generate

    def sending(self, *a, **k):
        future = send(self, *a, **k)
        inflight.append(future)
        return future

    def waiting(self):
        wait(self)
        inflight.clear()

    def generating(self, *a, **k):
        checked.append(not inflight)
        return generate(self, *a, **k)

    monkeypatch.setattr(CriticLink, "train", sending)
    monkeypatch.setattr(CriticLink, "wait", waiting)
    monkeypatch.setattr(NativeEngine, "generate", generating)
    extra = ["generation.num_threads=2"]
    if compile_available() is None:
        extra.append("generation.decode_step=compiled")
    with digit_server(tmp_path, "reverse") as server:
        rows = run_actor(
            server.url,
            tmp_path / "run",
            ["data.task=reverse", "ppo.num_steps=300", "precision=fp32", *extra, *FAST],
        )
    assert best_window(rows) >= 0.9, [round(r["objective/scores"], 3) for r in rows[::10]]
    assert len(checked) >= 300 and all(checked), checked.count(False)


@pytest.mark.server
def test_reused_forwards_change_nothing(tmp_path, monkeypatch):
    """One minibatch per step: the rollout log-probs from the first PPO forward and the critic's
    values from its first training pass (both kept, not recomputed) give the same run, metric
    for metric, as separate no-grad forwards; and both reuses do happen."""
    from aligner.actor.trainer import PPOTrainer
    from aligner.wire.client import RemoteCriticClient

    reuse_flags = []
    init = PPOTrainer.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        reuse_flags.append(self.reuse_rollout_forward)

    monkeypatch.setattr(PPOTrainer, "__init__", recording)
    runs = {}
    for reuse in ("true", "false"):
        server = digit_server(
            tmp_path / reuse, "copy", "optim.epochs=2", f"optim.reuse_infer_forward={reuse}"
        )
        with server:
            runs[reuse] = run_actor(
                server.url,
                tmp_path / reuse / "run",
                [
                    "data.task=copy",
                    "ppo.num_steps=3",
                    "precision=fp32",
                    *FAST,
                    "ppo.global_batch_size=64",
                    f"ppo.reuse_rollout_forward={reuse}",
                    "validation.before_train=false",
                    "validation.interval=0",
                    "checkpoint.save_at_end=false",
                ],
            )
            with RemoteCriticClient(server.url, timeout_s=30) as c:
                runs[reuse + "_server"] = c.info()["extra"]["reused_infer_forwards"]
    assert reuse_flags == [True, False]
    assert runs["true_server"] == 3 and runs["false_server"] == 0
    on, off = runs["true"], runs["false"]
    assert len(on) == len(off) == 3
    for a, b in zip(on, off):
        for key in (
            "objective/scores",
            "objective/kl",
            "rollout/entropy",
            "loss/policy",
            "policy/approxkl",
        ):
            assert a[key] == b[key], (key, a[key], b[key])
    assert all(r["policy/ratio_mean"] != 1.0 for r in on)  # epochs after the first moved the policy


@pytest.mark.slow
@pytest.mark.server
def test_flipped_policy_gradient_sign_does_not_learn(tmp_path, monkeypatch):
    """The same budget as the copy run with the advantage sign flipped stays near chance."""
    from aligner import rl as core

    real = core.policy_loss

    def flipped(logp, old_logp, advantages, mask, **kw):
        return real(logp, old_logp, -advantages, mask, **kw)

    monkeypatch.setattr(core, "policy_loss", flipped)
    with digit_server(tmp_path, "copy") as server:
        rows = run_actor(server.url, tmp_path / "run", ["data.task=copy", "ppo.num_steps=120", *FAST])
    assert best_window(rows) < 0.3, [round(r["objective/scores"], 3) for r in rows[::10]]
    # It is not for lack of updates: the policy moved.
    assert rows[-1]["objective/kl"] > 0.1


@pytest.mark.slow
@pytest.mark.server
def test_larger_kl_coefficient_ends_with_smaller_kl(tmp_path):
    finals = {}
    for beta in (0.005, 0.5):
        with digit_server(tmp_path / f"b{beta}", "copy") as server:
            rows = run_actor(
                server.url,
                tmp_path / f"run{beta}",
                ["data.task=copy", "ppo.num_steps=40", f"ppo.init_kl_coef={beta}", *FAST],
            )
        finals[beta] = sum(r["objective/kl"] for r in rows[-5:]) / 5
    assert finals[0.5] < finals[0.005], finals


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.multiprocess
def test_pipeline_parallel_actor_learns_copy_generating_in_its_own_layout(tmp_path):
    """PP=2 on two processes, generating at TP=2 (the two stages' ranks form the generation
    group, and each holds half of every layer after each refit): the policy trains through
    Megatron's pipeline schedule and learns copy through the real server."""
    with digit_server(tmp_path, "copy") as server:
        out = torchrun_actor(
            2,
            server.url,
            tmp_path / "run",
            [
                "parallel.pipeline_model_parallel_size=2",
                "generation.tensor_parallel_size=2",
                "data.task=copy",
                "ppo.num_steps=90",
                *FAST,
                "ppo.micro_batch_size=32",
                "checkpoint.save_interval=0",
            ],
        )
        assert critic_step(server.url) == 90
    assert "TP=1, PP=2, DP=1" in out.stdout
    rows = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "objective/scores" in r]
    assert len(rows) == 90 and rows[0]["objective/scores"] < 0.3
    # From ~0.07 to above 0.8 in 90 steps (measured: 0.86 by step 80, 0.9 by step 100).
    assert best_window(rows) >= 0.8, [round(r["objective/scores"], 3) for r in rows[::10]]
    # Each step moved the updated policy into the engine, except those right after a validation
    # (before training and every 50 steps), which refitted it already.
    moved = [r["step"] for r in rows if r["refit/mbytes"] > 0]
    assert moved == [s for s in range(2, 91) if (s - 1) % 50], moved
    assert "timers/refit" in rows[-1]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.multiprocess
def test_tensor_and_data_parallel_actor_on_four_processes(tmp_path):
    """TP=2 x DP=2 on four processes against DP=2 on two: TP-invariant weights and per-DP-rank
    sampling streams, so the TP=2 run's first rollout is the TP=1 run's (fp32), and the critic is
    trained once per step in both."""
    small = [
        "data.task=copy",
        "ppo.num_steps=3",
        "ppo.global_batch_size=64",
        "ppo.mini_batch_size=32",
        "ppo.micro_batch_size=16",
        "precision=fp32",
        "validation.num_prompts=16",
        *FAST[:2],
        *FAST[5:],
    ]
    runs = {}
    for name, nproc, extra in (("dp2", 2, []), ("tp2dp2", 4, ["parallel.tensor_model_parallel_size=2"])):
        with digit_server(tmp_path / name, "copy") as server:
            out = torchrun_actor(nproc, server.url, tmp_path / name / "run", [*small, *extra])
            assert critic_step(server.url) == 3
        rows = read_metrics(str(tmp_path / name / "run" / "metrics.jsonl"))
        runs[name] = [r for r in rows if "objective/scores" in r]
    assert "TP=2, PP=1, DP=2" in out.stdout
    assert len(runs["tp2dp2"]) == 3
    assert abs(runs["dp2"][0]["objective/scores"] - runs["tp2dp2"][0]["objective/scores"]) < 1e-6
    assert max(r["rollout/logprob_mismatch_max"] for r in runs["tp2dp2"]) < 1e-3


@pytest.mark.subprocess
def test_bad_config_fails_before_any_model_is_built(tmp_path):
    """Every problem reported at once, naming key and value; no server is needed to get there."""
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_actor.py"),
        "critic.url=grpc://127.0.0.1:9",
        "ppo.global_batch_size=100",
        "ppo.mini_batch_size=64",
        "generation.temperature=0",
        "ppo.kl_estimator=k9",
        "generation.decode_step=fast",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode != 0
    err = out.stderr
    assert "ppo.global_batch_size (100) must be divisible by ppo.mini_batch_size (64)" in err
    assert "generation.temperature=0" in err
    assert "ppo.kl_estimator='k9'" in err
    assert "generation.decode_step='fast'" in err
    assert "building" not in err.lower()


@pytest.mark.parametrize(
    "lines,fragment",
    [
        ([], "holds no prompts"),
        (['{"prompt": "12:"}', "not json"], ":2: not valid JSON"),
        (['{"text": "12:"}'], 'expected an object with a non-empty string "prompt"'),
        (['{"prompt": "' + "1" * 40 + '"}'], "prompt has 40 tokens, more than the 9"),
        (['{"prompt": "12x"}'], "character 'x'"),
    ],
)
def test_bad_prompt_files_are_reported_with_line_numbers(tmp_path, lines, fragment):
    from aligner.actor.prompts import load_prompts
    from aligner.config_checks import ConfigError
    from aligner.tokenizers import CharTokenizer

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(ConfigError) as e:
        load_prompts(str(path), CharTokenizer(), max_prompt_tokens=9)
    assert fragment in str(e.value)


@pytest.mark.subprocess
def test_unknown_config_key_is_an_error(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "train_actor.py"), "ppo.bogus=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode != 0 and "bogus" in out.stderr
