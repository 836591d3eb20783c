"""The metrics people read (docs/metrics.md): distributions and histograms over every
data-parallel rank (:mod:`aligner.histograms`), memory and MFU (:mod:`aligner.perf`), the episode
counter (:class:`aligner.actor.step_report.StepReport`), and a tiny run with the real trainer
writing them: the new names in metrics.jsonl, histograms in TensorBoard, the old names nowhere."""

from __future__ import annotations

import json
import socket
import types

import pytest
import torch

from aligner.actor.config import ActorConfig, LoggingConfig
from aligner.actor.rollout import StepRecord
from aligner.actor.step_report import StepReport
from aligner.generation.engine import GenerationOutput
from aligner.histograms import distributions
from aligner.metrics import MetricsLogger, read_metrics
from aligner.perf import PerfMeter, flops_per_step, peak_tflops
from aligner.wire.protocol import TrainResult

RENAMED = (
    "objective/entropy",
    "rollout/response_length",
    "loss/value",
    "critic/explained_variance",
    "critic/value_clipfrac",
    "val/scores",
    "val/kl",
    "val/response_length",
)
"""Names the metrics had before docs/metrics.md: none of them is written any more."""


# -- distributions and histograms ------------------------------------------------------------------


def test_distributions_by_hand():
    x = torch.tensor([[0.0, 1.0, 3.0], [9.0, 2.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    named = {"a": (x, mask), "c": (torch.full((3,), 2.0), None), "e": (x[:0], None)}
    scalars, hists = distributions(named, bins=4)
    assert scalars == {"a/mean": 2.0, "a/max": 3.0, "a/min": 1.0, "c/mean": 2.0, "c/max": 2.0, "c/min": 2.0}
    h = hists["a"]  # values 1, 3, 2 in four buckets of [1, 3]
    assert h.edges == [1.0, 1.5, 2.0, 2.5, 3.0] and h.counts == [1.0, 0.0, 1.0, 1.0]
    assert (h.num, h.sum, h.sum_squares, h.min, h.max) == (3, 6.0, 14.0, 1.0, 3.0)
    assert hists["c"].edges == [1.5, 1.75, 2.0, 2.25, 2.5] and sum(hists["c"].counts) == 3  # widened
    assert "e" not in hists  # no values anywhere: no histogram, no scalars
    assert distributions(named, bins=0)[1] == {}  # scalars only


def test_distributions_over_two_ranks_equal_one_process_over_their_union(tmp_path):
    import torch.multiprocessing as mp
    from _histogram_workers import RANK_MASKS, RANK_VALUES, worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    mp.spawn(worker, args=(2, port, str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    x, m = torch.tensor(sum(RANK_VALUES, [])), torch.tensor(sum(RANK_MASKS, []))
    want_s, want_h = distributions({"v": (x, m), "all": (x, None), "none": (x[:0], None)}, bins=4)
    assert got["scalars"] == pytest.approx(want_s)
    assert got["hists"].keys() == want_h.keys() == {"v", "all"}
    for k, h in want_h.items():
        assert got["hists"][k] == vars(h), k  # exact: small binary fractions


def test_histograms_go_to_tensorboard_not_to_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, hists = distributions({"critic/advantages": (torch.tensor([1.0, 3.0, 2.0]), None)}, bins=4)
    logger = MetricsLogger(str(tmp_path), tensorboard=True)
    logger.log(3, {"critic/advantages/mean": 2.0})
    logger.histograms(3, hists)
    logger.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    ea.Reload()
    assert "critic/advantages" in ea.Tags()["histograms"]
    (event,) = ea.Histograms("critic/advantages")
    h = event.histogram_value
    assert event.step == 3 and (h.min, h.max, h.num, h.sum, h.sum_squares) == (1.0, 3.0, 3, 6.0, 14.0)
    assert list(h.bucket_limit) == [1.5, 2.0, 2.5, 3.0] and list(h.bucket) == [1.0, 0.0, 1.0, 1.0]
    (row,) = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert set(row) == {"step", "time", "critic/advantages/mean"}


# -- memory and MFU -------------------------------------------------------------------------------


def test_peak_tflops_from_the_setting_or_a_known_gpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_tflops(123.0, cpu, False) == 123.0  # a setting wins, anywhere
    assert peak_tflops(None, cpu, True) is None  # never guessed on a CPU
    for name, want in (
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_tflops(None, cuda, True) == want, name
    assert peak_tflops(None, cuda, False) is None  # an fp32 run: no bf16 peak


def test_flops_by_hand():
    # 20 parameters, 16 trained, 7 tokens, 2 epochs: (4*20 + 2*16) * 7 * 2 = 1568; 3 forwards
    # without gradient add 3 * 2 * 20 * 7 = 840.
    assert flops_per_step(20, 16, 7, epochs=2, no_grad_forwards=3) == (1568.0, 2408.0)
    # every parameter trained: the usual 6 N T
    assert flops_per_step(20, 20, 7, epochs=1, no_grad_forwards=0)[0] == 6 * 20 * 7


def _record(**kw) -> StepRecord:
    """Two samples of prompt length 2, responses of 2 and 1 tokens (7 tokens in all)."""
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    z = torch.zeros(2, 3)
    return StepRecord(
        gen=GenerationOutput(
            tokens=torch.zeros(2, 4, dtype=torch.long),
            lengths=torch.tensor([4, 3]),
            prompt_lengths=torch.tensor([2, 2]),
            logprobs=z,
            ended=torch.tensor([True, True]),
        ),
        mask=mask,
        scores=torch.tensor([1.0, 3.0]),
        kl=z,
        non_score=z,
        entropy=z,
        old_logprobs=z,
        values=torch.tensor([[0.0, 1.0, 2.0], [0.0, 4.0, 0.0]]),
        returns=torch.tensor([[0.0, 2.0, 3.0], [0.0, 1.0, 0.0]]),
        kl_coef=0.1,
        lr=1e-3,
        policy_stats={},
        critic_stats=TrainResult(loss=0.5, grad_norm=2.0, applied_step=1, value_clipfrac=0.25),
        timers={"timers/generate": 0.25, "timers/train": 0.5, "timers/step": 1.0},
        advantages=torch.tensor([[0.0, -1.0, 1.0], [0.0, 3.0, 0.0]]),
        **kw,
    )


def _report(histogram_interval: int = 2, peak: float | None = 1e-9) -> StepReport:
    cfg = ActorConfig()
    cfg.ppo.global_batch_size, cfg.ppo.ppo_epochs = 8, 2
    cfg.logging.histogram_interval, cfg.logging.peak_tflops = histogram_interval, peak
    policy = torch.nn.Linear(4, 4)  # 20 parameters, 16 trained
    policy.bias.requires_grad_(False)
    state = types.SimpleNamespace(device=torch.device("cpu"), world_size=1, dp_size=1, dp_group=None)
    return StepReport(cfg, state, policy, "fp32")


def _summarize(report: StepReport, step: int, **kw) -> tuple[dict, dict]:
    kw = {"trained": True, "rollout_forward": True, "reference_forward": True, **kw}
    return report.summarize(_record(), step, **kw)


def test_step_report_by_hand():
    report = _report()
    report.start()
    m, hists = _summarize(report, 1)
    assert m["train/episode"] == 8.0 and hists == {}  # step 1: not a histogram step
    # MFU: 2408 FLOPs in a 1 s step on a device of 1e-9 TFLOP/s (1000 FLOP/s); the training
    # phase's 1568 FLOPs in its 0.5 s.
    assert m["perf/mfu"] == pytest.approx(2.408) and m["perf/mfu/actor"] == pytest.approx(3.136)
    assert m["perf/model_tflops"] == pytest.approx(2408e-12)
    assert (m["perf/total_num_tokens"], m["perf/throughput"]) == (7.0, 7.0)  # 7 tokens in 1 s, 1 device
    assert m["perf/max_rss_gb"] > 0 and "perf/max_memory_allocated_gb" not in m  # a CPU run
    # The distributions (verl's names) over the response tokens: values 1, 2, 4; returns 2, 3, 1.
    assert (m["critic/values/mean"], m["critic/values/max"], m["critic/values/min"]) == (7 / 3, 4.0, 1.0)
    assert (m["critic/returns/mean"], m["critic/returns/max"], m["critic/advantages/max"]) == (2.0, 3.0, 3.0)
    assert (m["critic/score/mean"], m["response_length/mean"], m["response_length/max"]) == (2.0, 1.5, 2.0)
    # returns - values: 1, 1, -3 (variance 32/9); returns' variance 2/3
    assert m["critic/vf_explained_var"] == pytest.approx(1 - (32 / 9) / (2 / 3))
    assert (m["critic/vf_loss"], m["critic/grad_norm"], m["critic/vf_clipfrac"]) == (0.5, 2.0, 0.25)
    assert not set(RENAMED) & set(m)

    m, hists = _summarize(report, 2, trained=False, rollout_forward=True, reference_forward=False)
    assert m["train/episode"] == 16.0  # a warm-up step's samples count too
    assert m["perf/mfu"] == pytest.approx(2 * 2 * 20 * 7 / 1000) and "perf/mfu/actor" not in m
    assert set(hists) == {
        "critic/score",
        "response_length",
        "critic/advantages",
        "critic/returns",
        "critic/values",
    }
    assert hists["response_length"].num == 2 and hists["critic/values"].num == 3


def test_no_mfu_without_a_peak_and_no_histograms_at_interval_0():
    report = _report(histogram_interval=0, peak=None)
    m, hists = _summarize(report, 2)
    assert "perf/mfu" not in m and "perf/mfu/actor" not in m and hists == {}
    assert "perf/model_tflops" in m


def test_the_episode_counter_continues_on_resume():
    report = _report()
    for step in (1, 2, 3):
        _summarize(report, step)
    saved = report.state_dict()
    assert saved == {"episode": 24}
    resumed = _report()
    resumed.load_state_dict({"step": 3, **saved}, 3)
    assert _summarize(resumed, 4)[0]["train/episode"] == 32.0
    older = _report()  # a checkpoint from before the counter: full batches up to its step
    older.load_state_dict({"step": 5}, 5)
    assert older.episode == 40


def test_perf_meter_reports_cuda_memory_when_on_cuda(monkeypatch):
    meter = PerfMeter(torch.nn.Linear(2, 2), torch.device("cuda", 0), None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4e9)
    assert meter.memory() == {"perf/max_memory_allocated_gb": 3.0, "perf/max_memory_reserved_gb": 4.0}


def test_logging_settings_are_checked():
    bad = LoggingConfig(histogram_interval=-1, peak_tflops=0.0).problems()
    assert any("logging.histogram_interval=-1" in p for p in bad)
    assert any("logging.peak_tflops=0.0" in p for p in bad)
    assert not LoggingConfig(histogram_interval=0, peak_tflops=989).problems()


def test_a_best_checkpoint_written_before_the_rename_is_read():
    from aligner.actor.checkpointing import _best

    assert _best({"step": 4, "val/scores": 0.5}) == {"step": 4, "validation/scores": 0.5}
    assert _best({"step": 4, "validation/scores": 0.5}) == {"step": 4, "validation/scores": 0.5}
    assert _best(None) is None


# -- a tiny run with the real trainer -------------------------------------------------------------


def _tiny_config(root, steps: int) -> ActorConfig:
    cfg = ActorConfig()
    cfg.data.task, cfg.data.num_digits, cfg.data.num_prompts = "copy", 3, 64
    cfg.generation.max_new_tokens = 4
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = steps, 8, 8, 8
    cfg.precision = "fp32"
    cfg.checkpoint.dir, cfg.checkpoint.save_interval, cfg.checkpoint.keep_best = str(root / "ckpt"), 2, False
    cfg.validation.interval, cfg.validation.before_train, cfg.validation.num_prompts = 2, False, 4
    cfg.logging.run_dir, cfg.logging.progress_bar, cfg.logging.histogram_interval = (
        str(root / "run"),
        False,
        2,
    )
    return cfg


def test_a_tiny_run_writes_the_metrics_and_resumes_the_episode_counter(tmp_path):
    from _toy_critic import ToyCritic
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from aligner.actor.run import build_actor
    from aligner.distributed import destroy

    critic = ToyCritic()
    try:
        for steps in (2, 3):  # 2 steps, then a run of 3 that resumes from the checkpoint of step 2
            actor = build_actor(_tiny_config(tmp_path, steps), critic=critic)
            assert actor.resume_step == (-1 if steps == 2 else 2)
            try:
                actor.trainer.train()
            finally:
                actor.close()
            destroy()
    finally:
        destroy()
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["train/episode"] for r in rows] == [8.0, 16.0, 24.0]  # the resumed step 3 counts on
    for r in rows:
        assert not set(RENAMED) & set(r), r["step"]
        for k in ("critic/score", "critic/advantages", "critic/returns", "critic/values", "response_length"):
            assert {f"{k}/mean", f"{k}/max", f"{k}/min"} <= set(r), (r["step"], k)
        assert r["perf/max_rss_gb"] > 0 and r["perf/total_num_tokens"] > 0 and "perf/mfu" not in r
    assert {"validation/scores", "validation/kl", "validation/response_length"} <= set(rows[1])
    assert {"critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"} <= set(rows[1])  # step 1's update
    ea = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"histograms": 0})
    ea.Reload()
    assert {"critic/score", "critic/advantages", "critic/returns", "critic/values", "response_length"} <= set(
        ea.Tags()["histograms"]
    )
    assert [e.step for e in ea.Histograms("critic/advantages")] == [2]  # every 2 steps
    assert ea.Histograms("critic/score")[0].histogram_value.num == 8  # the batch's 8 samples
