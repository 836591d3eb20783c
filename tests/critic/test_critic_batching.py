"""The bookkeeping behind the server's replicas and its merge statistics, in one process: how
rows are split between replicas, the layout checks, the requests-per-execution histogram and
its metrics, and a ``server_info`` that older and newer peers both read.

The multi-process side (a DP=2 server, four concurrent clients) is ``tests/critic/test_critic_dp.py``.
"""

from __future__ import annotations

import json

import pytest

from aligner.config_checks import ConfigError
from aligner.critic.config import ParallelSection, build_config
from aligner.critic.metrics import RequestStats
from aligner.critic.replicas import Layout, row_slices
from aligner.critic.testing import tiny_config
from aligner.wire import protocol as P


@pytest.mark.parametrize("b, n", [(5, 2), (4, 2), (1, 2), (7, 3), (2, 4), (6, 1)])
def test_row_slices_cut_like_tensor_split(b, n):
    import torch

    slices = row_slices(b, n)
    rows = list(range(b))
    assert [rows[s] for s in slices] == [t.tolist() for t in torch.tensor_split(torch.arange(b), n)]
    assert slices[0].stop - slices[0].start == max(s.stop - s.start for s in slices)


def test_layout_finds_each_replicas_ranks():
    # Megatron's order at TP=2, DP=2: the ranks of a TP group are consecutive.
    layout = Layout(tp_rank=(0, 1, 0, 1), dp_rank=(0, 0, 1, 1))
    assert [layout.rank(d, t) for d in (0, 1) for t in (0, 1)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="TP rank 2 of replica 0"):
        layout.rank(0, 2)


def test_world_size_must_be_tp_times_dp_naming_the_keys(tmp_path):
    p = ParallelSection(tensor_model_parallel_size=2, data_parallel_size=2)
    assert p.world_size == 4 and p.world_size_problem(4) is None
    msg = p.world_size_problem(2)
    assert msg.startswith("WORLD_SIZE=2: expected parallel.tensor_model_parallel_size=2 x ")
    assert "data_parallel_size=2 = 4;" in msg
    assert "set parallel.data_parallel_size=1, or launch with torchrun --nproc_per_node 4" in msg
    assert "set parallel" not in p.world_size_problem(3)  # not a multiple of TP: only the launch fits
    with pytest.raises(ConfigError, match=r"parallel.data_parallel_size=0: expected >= 1"):
        build_config(tiny_config(tmp_path, parallel={"data_parallel_size": 0}))


def test_request_stats_count_requests_per_execution():
    stats = RequestStats()
    for merged, rows in ((1, 2), (3, 7), (3, 5), (2, 4)):
        stats.record(P.INFER, 0.01, True, rows, merged)
    stats.record(P.INFER, 0.02, False, 0, 2)  # a failed execution still merged two requests
    stats.record(P.TRAIN, 0.1, True, 1)
    assert stats.batching(P.INFER) == {
        "executions": 5,
        "requests": 11,
        "rows": 18,
        "requests_per_execution_mean": 2.2,
        "requests_per_execution_max": 3,
        "requests_per_execution": {"1": 1, "2": 2, "3": 2},
    }
    snap = stats.snapshot()
    assert snap["server/critic_infer/requests"] == 11 and snap["server/critic_infer/executions"] == 5
    assert snap["server/critic_infer/requests_per_execution_mean"] == 2.2
    assert snap["server/critic_infer/requests_per_execution_max"] == 3
    assert snap["server/critic_infer/errors"] == 1 and snap["server/critic_train/requests"] == 1
    # A new interval starts empty; what happened since start-up stays.
    stats.record(P.INFER, 0.01, True, 1, 1)
    assert stats.snapshot()["server/critic_infer/requests_per_execution_max"] == 1
    assert stats.batching(P.INFER)["executions"] == 6
    assert stats.lifetime()[P.INFER] == {"requests": 12, "executions": 6, "seconds": 0.07}
    assert RequestStats().batching(P.INFER)["requests_per_execution_mean"] == 0.0


def test_server_info_batching_and_replicas_reach_old_and_new_clients():
    info = P.ServerInfo(
        P.PROTOCOL_VERSION,
        14,
        32,
        "char",
        "fp",
        -1,
        8,
        16,
        parallel={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "data_parallel_size": 2,
        },
        batching={"executions": 2, "requests": 5, "requests_per_execution": {"2": 1, "3": 1}},
    )
    assert P.ServerInfo.from_json(info.to_json()) == info
    # A client reads past the fields it does not know, as one older than these fields reads them.
    later = {**json.loads(info.to_json()), "a_later_field": {"x": 1}}
    assert P.ServerInfo.from_json(json.dumps(later)) == info
    # A server older than these fields: a new client reads empty defaults.
    old = {k: v for k, v in json.loads(info.to_json()).items() if k != "batching"}
    old["parallel"] = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    back = P.ServerInfo.from_json(json.dumps(old))
    assert back.batching == {} and back.parallel.get("data_parallel_size", 1) == 1
