"""The run's MetricsLogger on a full disk (or any sink that fails): the row is dropped and
counted, the failure said once (rate-limited), the next rows are written again, and a row cut
short costs that row alone."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from aligner import metrics as M


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot write metrics" in r.getMessage()]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_drops_rows_and_says_so_once(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    (tmp_path / "val_samples.jsonl").symlink_to("/dev/full")
    logger = M.MetricsLogger(str(tmp_path), tensorboard=False, print_fn=None)
    with caplog.at_level(logging.WARNING, logger="aligner.metrics"):
        for step in range(3):
            logger.log(step, {"critic/vf_loss": 0.5})
        logger.samples(2, [{"prompt": "p", "response": "r", "score": 1.0}])
    assert logger.dropped == 4
    (line,) = _warnings(caplog)
    assert "metrics.jsonl" in line and "No space left on device" in line and str(tmp_path) in line
    logger.close()


def test_a_row_cut_short_costs_that_row_alone(tmp_path, monkeypatch, caplog):
    logger = M.MetricsLogger(str(tmp_path), tensorboard=False)
    logger.log(1, {"critic/vf_loss": 1.0})
    real = os.write
    state = {"fail": True}

    def write(fd, data):
        if state["fail"]:  # half the row reaches the disk, then it is full
            state["fail"] = False
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(M.os, "write", write)
    with caplog.at_level(logging.WARNING, logger="aligner.metrics"):
        logger.log(2, {"critic/vf_loss": 2.0})  # cut short
        logger.log(3, {"critic/vf_loss": 3.0})  # room again
    logger.close()
    assert logger.dropped == 1 and len(_warnings(caplog)) == 1
    rows = M.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["critic/vf_loss"]) for r in rows] == [(1, 1.0), (3, 3.0)]


def test_the_warning_is_rate_limited_and_counts_what_it_did_not_say(caplog, monkeypatch):
    failures = M.WriteFailures("here", every_s=60.0)
    clock = [1000.0]
    monkeypatch.setattr(M.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="aligner.metrics"):
        for _ in range(5):
            assert not failures.guard("metrics.jsonl", _raise_enospc)
        clock[0] += 61
        failures.guard("metrics.jsonl", _raise_enospc)
    first, second = _warnings(caplog)
    assert failures.count == 6
    assert "1 write(s) dropped since the last such line, 1 since start-up" in first
    assert "5 write(s) dropped since the last such line, 6 since start-up" in second


def _raise_enospc() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


class _FlakyWriter:
    """A SummaryWriter whose writer thread died on a full disk after ``fail_after`` scalars."""

    made: list[_FlakyWriter] = []

    def __init__(self, log_dir=None, purge_step=None) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.fail = not self.made  # the first one fails; a reopened one works
        self.made.append(self)

    def add_scalar(self, tag, value, step) -> None:
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step) -> None:
        self.add_scalar(tag, 0.0, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_tensorboard_writer_that_died_is_reopened_at_the_next_row(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    _FlakyWriter.made = []
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _FlakyWriter)
    logger = M.MetricsLogger(str(tmp_path), tensorboard=True)
    logger.log(1, {"critic/vf_loss": 1.0})  # TensorBoard fails; the JSONL row is written
    logger.log(2, {"critic/vf_loss": 2.0})  # a new event file
    logger.close()
    assert logger.dropped == 1 and len(_FlakyWriter.made) == 2
    assert _FlakyWriter.made[1].scalars == [("critic/vf_loss", 2.0, 2)]
    assert [r["step"] for r in M.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]
