"""The rules that keep the critic's checkpoints from any request (docs/design.md, "Checkpoints"),
in-process: a save is labelled with the critic step held, pruning removes a later step only after
a rollback, a load rewinds the exactly-once results with the weights, step ids of any size, the
leftovers of killed saves, and metrics that cannot be written (a full disk)."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from _critic_service import _batch, _service

from aligner.checkpoint import complete_steps, step_dir_name
from aligner.critic.config import build_config
from aligner.critic.exactly_once import AppliedSteps
from aligner.critic.metrics import MetricsWriter
from aligner.critic.service import CriticService
from aligner.critic.testing import tiny_config
from aligner.wire import protocol as P


def _files(root: Path, step: int) -> dict[str, bytes]:
    d = root / step_dir_name(step) / "critic"
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _train_and_save(svc, batch, steps):
    """Train and save each of ``steps`` in turn (fenced as the actor does); the values after each."""
    tokens, lengths, pl, returns, old_values, mask, *_ = batch
    values = {}
    for step in steps:
        svc.train(tokens, lengths, returns, old_values, mask, step, svc.critic_step)
        svc.save(step, step)
        values[step] = svc.infer(tokens, lengths, pl).values
    return values


def test_a_save_of_another_step_than_the_one_held_is_refused_and_destroys_nothing(pstate, tmp_path):
    """The attack: holding critic step 3, "save step 1" (expected_step 3, so the fence passes)
    used to write step 3's weights as step 1 and prune steps 2 and 3 as a stale future; loading
    step 1 then served step 3's weights, and a retrain of step 2 was answered from the cache."""
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    batch = _batch(svc)
    tokens, lengths, pl, returns, old_values, mask, *_ = batch
    # Before any train, the initial critic saves as step 0 and as nothing else.
    with pytest.raises(
        P.ProtocolError, match=r"critic_save: field 'step': expected step=-1 \(or 0: the initial"
    ):
        svc.save(1, -1)
    svc.save(0, -1)
    values = _train_and_save(svc, batch, (1, 2, 3))
    files = {s: _files(root, s) for s in (0, 1, 2, 3)}

    with pytest.raises(P.ProtocolError) as refused:
        svc.save(1, 3)
    msg = str(refused.value)
    assert msg.startswith(
        "[critic] critic_save: field 'step': expected step=3, the critic step this server holds"
    )
    assert msg.endswith("got step=1") and "critic_load" in msg, msg
    with pytest.raises(P.ProtocolError, match="field 'step'"):
        svc.save(4)  # in-process callers too: step 4 was never trained
    assert complete_steps(root, role="critic") == [0, 1, 2, 3]
    assert {s: _files(root, s) for s in (0, 1, 2, 3)} == files  # not a byte changed
    assert svc.critic_step == 3 and svc.last_saved_step == 3

    # Loading step 1 serves step 1's weights, and step 2 is applied again, not answered from the cache.
    svc.load(1)
    assert svc.critic_step == 1 and svc.applied.kept(2) is None
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, values[1])
    svc.train(tokens, lengths, returns, old_values, mask, 2, 1)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, values[2])
    assert not np.array_equal(values[1], values[2])
    assert complete_steps(root, role="critic") == [0, 1, 2, 3]  # a load removes nothing


def test_pruning_removes_later_steps_only_after_a_rollback(pstate, tmp_path):
    """Steps after the one saved are the continuation a rollback gave up only when the server
    loaded an earlier step since they were written; without a load they stay."""
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    batch = _batch(svc)
    svc.save(0)
    _train_and_save(svc, batch, (1, 2, 3, 4))
    # A server restarted without resume=auto on the same folder: it trains and saves step 1
    # again (its own step), and the steps after it, which it never loaded past, stay.
    fresh = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    _train_and_save(fresh, batch, (1,))
    assert complete_steps(root, role="critic") == [0, 1, 2, 3, 4]
    # The actor rolls back to step 2 (critic_load(2)): steps 3 and 4 are now a future that will
    # be redone. The load removes nothing; the next save (step 3, redone) removes step 4.
    svc.load(2)
    assert svc.checkpoints.abandoned == {3, 4}
    assert complete_steps(root, role="critic") == [0, 1, 2, 3, 4]
    _train_and_save(svc, batch, (3,))
    assert complete_steps(root, role="critic") == [0, 1, 2, 3]
    assert svc.checkpoints.abandoned == set()
    _train_and_save(svc, batch, (4,))
    assert complete_steps(root, role="critic") == [0, 1, 2, 3, 4]


def test_keep_last_prunes_older_steps_only(pstate, tmp_path):
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 2})
    batch = _batch(svc)
    svc.save(0)
    _train_and_save(svc, batch, (1, 2, 3, 4))
    assert complete_steps(root, role="critic") == [0, 3, 4]  # step 0, the initial critic, stays
    svc.load(3)
    _train_and_save(svc, batch, (4,))  # its own stale copy replaced; step 3 kept by keep_last
    assert complete_steps(root, role="critic") == [0, 3, 4]


def test_a_load_rewinds_the_kept_results_of_later_steps():
    """A checkpoint written before saves had to be labelled with the step held may carry the
    results of later steps: a load keeps those up to the loaded step only."""
    applied = AppliedSteps()
    for step in (1, 2, 3):
        applied.record(step, P.TrainResult(float(step), 0.1, 0.5, 0.0, step))
    saved = applied.to_json()
    applied.restore(1, saved)
    assert applied.last == 1 and list(applied.results) == [1]
    assert applied.kept(1) == P.TrainResult(1.0, 0.1, 0.5, 0.0, 1) and applied.kept(2) is None
    applied.check_new(2)  # applied again, not answered from the cache


def test_an_old_checkpoint_with_later_results_loads_and_retrains(pstate, tmp_path):
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    batch = _batch(svc)
    tokens, lengths, pl, returns, old_values, mask, *_ = batch
    values = _train_and_save(svc, batch, (1, 2))
    # What the attack used to write: step 1's meta holding step 2's result.
    meta1 = root / step_dir_name(1) / "critic" / "meta.json"
    meta = json.loads(meta1.read_text())
    meta["results"] = json.loads((root / step_dir_name(2) / "critic" / "meta.json").read_text())["results"]
    assert "2" in meta["results"]
    meta1.write_text(json.dumps(meta))
    svc.load(1)
    assert svc.applied.kept(2) is None
    svc.train(tokens, lengths, returns, old_values, mask, 2, 1)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, values[2])


def test_steps_of_nine_digits_save_list_load_and_prune(pstate, tmp_path):
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 2})
    batch = _batch(svc)
    tokens, lengths, pl, returns, old_values, mask, *_ = batch
    svc.save(0)
    big = [99_999_999, 100_000_000, 100_000_001]
    values = _train_and_save(svc, batch, big)
    assert (root / "step_100000001" / "critic" / "complete.json").is_file()
    assert complete_steps(root, role="critic") == [0, 100_000_000, 100_000_001]
    assert svc.info().checkpoint_steps == [0, 100_000_000, 100_000_001]
    assert svc.latest_checkpoint() == 100_000_001
    svc.load(100_000_000)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, values[100_000_000])
    assert svc.checkpoints.abandoned == {100_000_001}
    _train_and_save(svc, batch, (100_000_001,))
    assert complete_steps(root, role="critic") == [0, 100_000_000, 100_000_001]


def test_leftovers_of_killed_saves_are_cleaned_at_start_up(pstate, tmp_path):
    """A save killed while writing leaves ``.tmp.critic.*``; one killed between the two renames of
    its commit leaves the step's previous copy as ``.old.critic.*`` and no ``critic/``: a new
    server removes the first and renames the second back, and loads it."""
    root = tmp_path / "ckpt"
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    batch = _batch(svc)
    tokens, lengths, pl, *_ = batch
    values = _train_and_save(svc, batch, (1, 2))
    step1, step2, step3 = (root / step_dir_name(s) for s in (1, 2, 3))
    shutil.copytree(step2 / "critic", step2 / ".tmp.critic.k1ll3d")
    (step2 / "critic").rename(step2 / ".old.critic.4242")
    shutil.copytree(step1 / "critic", step3 / ".tmp.critic.x")  # a first save of step 3, killed
    (step1 / ".old.critic.17").mkdir()  # a copy aside, removed after the commit finished
    (step1 / ".tmp.actor").mkdir()  # the actor's: never touched by the server
    assert complete_steps(root, role="critic") == [1]

    fresh = _service(pstate, tmp_path, checkpoint={"keep_last": 0})
    assert complete_steps(root, role="critic") == [1, 2] == fresh.info().checkpoint_steps
    assert sorted(p.name for p in step1.iterdir()) == [".tmp.actor", "critic"]
    assert sorted(p.name for p in step2.iterdir()) == ["critic"]
    assert not step3.exists()
    fresh.load(2)
    np.testing.assert_array_equal(fresh.infer(tokens, lengths, pl).values, values[2])


class _FullDiskMetrics:
    """A metrics writer on a full disk: every write raises ENOSPC."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    train_step = requests = _fail


def test_metrics_that_cannot_be_written_never_fail_an_applied_train(pstate, tmp_path, caplog):
    """A full log disk: the applied step's result is returned, the failure logged once (rate
    limited), and the service goes on (trains, saves, shuts down with a save)."""
    metrics = _FullDiskMetrics()
    svc = CriticService(
        build_config(tiny_config(tmp_path, checkpoint={"keep_last": 0})), pstate, metrics=metrics
    )
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    with caplog.at_level(logging.WARNING, logger="aligner.critic"):
        r1 = svc.train(tokens, lengths, returns, old_values, mask, 1, -1)
        assert r1.applied_step == 1 and svc.critic_step == 1
        r2 = svc.train(tokens, lengths, returns, old_values, mask, 2, 1)
        assert r2.applied_step == 2
        svc.flush_stats()
    assert metrics.calls == 3 and svc.info().extra["metrics_dropped"] == 3
    lines = [r for r in caplog.records if "cannot write metrics" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0].getMessage()
    assert svc.train(tokens, lengths, returns, old_values, mask, 2, 2) == r2  # a repeat, from the cache
    assert svc.close(save=True) == tmp_path / "ckpt" / step_dir_name(2) / "critic"
    assert complete_steps(tmp_path / "ckpt", role="critic") == [2]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_the_metrics_writer_on_a_full_disk_drops_rows_and_counts_them(tmp_path, caplog):
    """The real writer, its files on /dev/full (every write: ENOSPC)."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    for name in ("metrics.jsonl", "requests.jsonl"):
        (log_dir / name).symlink_to("/dev/full")
    writer = MetricsWriter(log_dir, tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="aligner.critic"):
        writer.train_step(1, {"critic/vf_loss": 0.5})
        writer.requests(1, {"server/critic_infer/requests": 3})
        writer.train_step(2, {"critic/vf_loss": 0.4})
    assert writer.dropped == 3
    assert len([r for r in caplog.records if "cannot write metrics" in r.getMessage()]) == 1
    writer.close()


def test_the_metrics_rewind_to_a_loaded_step_and_the_redone_steps_replace_the_rest(tmp_path):
    """As the actor's metrics on a rollback: after a load of step 1, the rows of steps 2 and 3
    (trained, then abandoned) go; the redone step 2 writes its own; a fresh start drops all."""
    writer = MetricsWriter(tmp_path / "log", tensorboard=True)
    for step in (1, 2, 3):
        writer.train_step(step, {"critic/vf_loss": float(step)})
    writer.rewind(1)
    writer.train_step(2, {"critic/vf_loss": 20.0})

    def rows():
        text = (tmp_path / "log" / "metrics.jsonl").read_text()
        return [(r["step"], r["critic/vf_loss"]) for r in map(json.loads, text.splitlines())]

    assert rows() == [(1, 1.0), (2, 20.0)]
    writer.rewind(-1)
    assert rows() == []
    writer.train_step(1, {"critic/vf_loss": 5.0})
    writer.close()
    writer.rewind(0)  # closed: nothing happens
    assert rows() == [(1, 5.0)] and writer.dropped == 0
