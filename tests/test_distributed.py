"""Two-process launches with torchrun on CPU (gloo): TP=2, PP=2 and DP=2 each build a policy
and run forward + backward through Megatron's pipeline schedule."""

from __future__ import annotations

import pytest
from _torchrun import run_worker


def _torchrun(tp: int, pp: int) -> list[dict]:
    return run_worker("dist_check.py", str(tp), str(pp), timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tp,pp,expect",
    [
        (2, 1, {"tp": [[0, 2], [1, 2]], "pp": [[0, 1], [0, 1]], "dp": [[0, 1], [0, 1]]}),
        (1, 2, {"tp": [[0, 1], [0, 1]], "pp": [[0, 2], [1, 2]], "dp": [[0, 1], [0, 1]]}),
        (1, 1, {"tp": [[0, 1], [0, 1]], "pp": [[0, 1], [0, 1]], "dp": [[0, 2], [1, 2]]}),
    ],
    ids=["tp2", "pp2", "dp2"],
)
def test_two_process_layouts(tp, pp, expect):
    results = sorted(_torchrun(tp, pp), key=lambda r: r["rank"])
    assert [r["world"] for r in results] == [2, 2]
    for key in ("tp", "pp", "dp"):
        assert [r[key] for r in results] == expect[key]
    assert all(r["device"] == "cpu" for r in results)
    # Every rank holds parameters that received gradients through the schedule.
    assert all(r["has_grads"] for r in results)
    if pp == 2:
        assert results[0]["loss"] is None and results[1]["loss"] is not None  # loss on the last stage
    if tp == 1 and pp == 1:
        assert results[0]["loss"] == results[1]["loss"]  # same data, same weights on both DP ranks
    # on_rank0: rank 0's answer everywhere; its error raised as itself on rank 0, and on rank 1 as
    # itself when carried, else as a RankZeroError naming it.
    assert [r["decided"] for r in results] == [{"from": 0}, {"from": 0}]
    own = ["KeyError", "'only on rank 0'"]
    assert results[0]["errors"] == [own, own]
    assert results[1]["errors"] == [
        ["RankZeroError", "KeyError: 'only on rank 0'"],
        ["KeyError", "\"'only on rank 0'\""],
    ]
    assert all(r["gathered"] == [{"rank": 0}, {"rank": 1}] for r in results)
    # The model-parallel group is the replica's TP x PP ranks; the embedding group spans the stages.
    assert [r["mp_ranks"] for r in results] == ([[0], [1]] if tp == pp == 1 else [[0, 1], [0, 1]])
    assert [r["in_embedding_group"] for r in results] == [pp == 2, pp == 2]


def test_invalid_parallel_config_names_field():
    from aligner.distributed import ParallelConfig

    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        ParallelConfig(backend="mpi")


@pytest.mark.multiprocess
def test_data_parallel_ranks_save_and_export_without_racing_the_writer(tmp_path):
    """Two data-parallel ranks, the second late: every rank checks the output folder before the
    writer creates it, so neither sees the other's finished folder as one in the way."""
    result = run_worker("dp_save.py", str(tmp_path), timeout=180)
    assert result["errors"] == [[], []]
    assert result["files"] == ["hf/model.safetensors", "policy/model.safetensors"]


def test_spare_port_is_free_and_below_the_ephemeral_range():
    """A port for another process to bind later lies outside the range bind(0) draws from, so that
    no ephemeral port can take it first, and is free when returned."""
    import socket

    from aligner.distributed import spare_port

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range")
    ports = {spare_port() for _ in range(20)}
    assert len(ports) > 10  # drawn at random, not from a seeded stream
    for port in ports:
        assert (10000 <= port < low) if low > 11000 else port >= low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
