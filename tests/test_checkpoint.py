from __future__ import annotations

import os

import pytest
import torch

from aligner import checkpoint as ck


def test_atomic_directory_commits_and_replaces(tmp_path):
    final = tmp_path / "step_00000001"
    with ck.atomic_directory(final, marker={"step": 1}) as d:
        (d / "a.txt").write_text("one")
        assert not final.exists()  # nothing under the final name while writing
    assert (final / "a.txt").read_text() == "one"
    assert ck.read_json(final / ck.COMPLETE_MARKER) == {"step": 1}
    with ck.atomic_directory(final) as d:
        (d / "a.txt").write_text("two")
    assert (final / "a.txt").read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]  # no temporary leftovers


def test_atomic_directory_failure_leaves_previous_whole(tmp_path):
    final = tmp_path / "step_00000002"
    with ck.atomic_directory(final) as d:
        (d / "a.txt").write_text("good")
    with pytest.raises(RuntimeError), ck.atomic_directory(final) as d:
        (d / "a.txt").write_text("half")
        raise RuntimeError("crash while writing")
    assert (final / "a.txt").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]


def test_complete_steps_ignores_partial_and_prune(tmp_path):
    for s in (1, 2, 3, 4, 5, 7):
        with ck.atomic_directory(tmp_path / ck.step_dir_name(s) / "actor"):
            pass
    for s in (2, 3):  # the other role's files share some step folders
        with ck.atomic_directory(tmp_path / ck.step_dir_name(s) / "critic"):
            pass
    (tmp_path / ck.step_dir_name(6) / "actor").mkdir(parents=True)  # no marker: incomplete
    (tmp_path / ".tmp.step_00000008.x").mkdir()
    assert ck.complete_steps(tmp_path, role="actor") == [1, 2, 3, 4, 5, 7]
    assert ck.complete_steps(tmp_path, role="critic") == [2, 3]
    # A later step is never pruned unless the caller loaded an earlier one since (it is abandoned).
    assert ck.prune_checkpoints(tmp_path, "actor", saved=5, keep_last=0) == []
    assert ck.complete_steps(tmp_path, role="actor") == [1, 2, 3, 4, 5, 7]
    # Step 5 was just saved by a run that resumed from step 4: step 7 is from the abandoned
    # continuation; keep the newest 2 up to 5 plus the protected step 1.
    assert ck.prune_checkpoints(tmp_path, "actor", saved=5, keep_last=2, protect={1}, abandoned={7}) == [
        2,
        3,
        7,
    ]
    assert ck.complete_steps(tmp_path, role="actor") == [1, 4, 5]
    assert ck.complete_steps(tmp_path, role="critic") == [2, 3]  # untouched
    assert not (tmp_path / ck.step_dir_name(7)).exists()  # emptied folder removed
    assert (tmp_path / ck.step_dir_name(6)).is_dir()  # incomplete: left alone
    assert ck.prune_checkpoints(tmp_path, "actor", saved=5, keep_last=0) == []  # 0 keeps all


def test_tensors_and_optimizer_roundtrip_without_pickle(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    tensors, meta = ck.optimizer_to_safe(opt)
    ck.save_tensors(tmp_path / "opt.safetensors", tensors)
    ck.write_json(tmp_path / "opt.json", meta)
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    ck.optimizer_from_safe(
        opt2, ck.load_tensors(tmp_path / "opt.safetensors"), ck.read_json(tmp_path / "opt.json")
    )
    a, b = opt.state_dict(), opt2.state_dict()
    for pid in a["state"]:
        for k, v in a["state"][pid].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][pid][k]))
    assert a["param_groups"] == b["param_groups"]


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load_tensors(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="bad.json.*not valid JSON"):
        ck.read_json(bad)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match="junk.safetensors"):
        ck.load_tensors(junk)


def test_shard_file_names_every_rank_file_one_way():
    assert ck.shard_file("model") == "model_tp00_pp00.safetensors"
    assert ck.shard_file("optim", tp=1, pp=2) == "optim_tp01_pp02.safetensors"
    assert ck.shard_file("optim", tp=1, suffix=".json") == "optim_tp01_pp00.json"
    assert ck.shard_file("rng", tp=0, pp=1, dp=2) == "rng_tp00_pp01_dp002.safetensors"
    # names sort by tp, then pp, then dp
    names = [ck.shard_file("rng", tp=t, pp=p, dp=d) for t in range(2) for p in range(2) for d in range(3)]
    assert names == sorted(names)
    with pytest.raises(ValueError, match="tp=-1"):
        ck.shard_file("optim", tp=-1)
    with pytest.raises(ValueError, match="kind="):
        ck.shard_file("my_optim")


def test_a_failed_write_names_its_file(tmp_path):
    # a folder where the file should be: the OS refuses the write, and the error says which path
    (tmp_path / "optim_tp00_pp00.safetensors").mkdir()
    with pytest.raises(ck.CheckpointError, match="optim_tp00_pp00.safetensors"):
        ck.save_tensors(tmp_path / "optim_tp00_pp00.safetensors", {"a": torch.zeros(2)})
    with pytest.raises(ck.CheckpointError, match="missing/meta.json"):
        ck.write_json(tmp_path / "missing" / "meta.json", {"a": 1})


def test_step_folders_of_any_size_list_and_prune(tmp_path):
    """Steps of 9 digits and more are listed, in numeric order, and pruned like the others; the
    8-digit zero padding of small steps stays (the checkpoints written so far are still found)."""
    assert ck.step_dir_name(7) == "step_00000007"
    assert ck.step_dir_name(123_456_789) == "step_123456789"
    big = [99_999_999, 100_000_000, 123_456_789, 10**12]
    for s in (3, *big):
        assert ck.parse_step_dir_name(ck.step_dir_name(s)) == s
        with ck.atomic_directory(tmp_path / ck.step_dir_name(s) / "critic"):
            pass
    # Another spelling of a step is not that step's folder (the step's own is step_00000003).
    for name in ("step_000000003", "step_0000003", "step_3", "step_00000003x", "best"):
        assert ck.parse_step_dir_name(name) is None, name
    (tmp_path / "step_000000003" / "critic").mkdir(parents=True)
    (tmp_path / "step_000000003" / "critic" / ck.COMPLETE_MARKER).write_text("{}")
    assert ck.complete_steps(tmp_path, role="critic") == [3, *big]
    assert ck.prune_checkpoints(tmp_path, "critic", saved=123_456_789, keep_last=2) == [3, 99_999_999]
    assert ck.complete_steps(tmp_path, role="critic") == [100_000_000, 123_456_789, 10**12]
    assert ck.prune_checkpoints(tmp_path, "critic", saved=100_000_000, keep_last=1, abandoned={10**12}) == [
        10**12
    ]
    assert ck.complete_steps(tmp_path, role="critic") == [100_000_000, 123_456_789]


def _complete(d, marker=None):
    d.mkdir(parents=True)
    (d / "weights.txt").write_text(str(d))
    if marker is not None:
        ck.write_json(d / ck.COMPLETE_MARKER, marker)


def test_leftovers_of_killed_saves_are_cleaned_and_an_only_copy_recovered(tmp_path):
    """At start-up each role removes its leftovers (``.tmp.<role>*`` being written, ``.old.<role>.*``
    moved aside by a commit) and renames back a step's only complete copy: a commit killed
    between moving the previous copy aside and renaming the new one in."""
    s1, s2, s3, s4 = (tmp_path / ck.step_dir_name(s) for s in (1, 2, 3, 4))
    # Step 1: whole, with both kinds of leftovers beside it.
    _complete(s1 / "critic", {"step": 1})
    _complete(s1 / ".old.critic.123", {"step": 1})
    _complete(s1 / ".tmp.critic.abcd", {"step": 1})
    # Step 2: killed between the two renames of commit_directory: the previous copy is aside,
    # the new one complete but never renamed in (its save was never answered).
    _complete(s2 / ".old.critic.77", {"step": 2, "copy": "previous"})
    _complete(s2 / ".tmp.critic.zz", {"step": 2, "copy": "new"})
    # Step 3: a first save killed while writing: nothing else in the folder.
    _complete(s3 / ".tmp.critic.q1")
    # Step 4: the actor's fixed temporary name, an incomplete copy aside, and the critic's files.
    _complete(s4 / ".tmp.actor")
    _complete(s4 / ".old.actor.5")  # no marker: not a copy to recover
    _complete(s4 / "critic", {"step": 4})
    _complete(s4 / ".tmp.critic.live")  # the other role may be writing it right now
    assert ck.complete_steps(tmp_path, role="critic") == [1, 4]

    done = ck.clean_leftovers(tmp_path, "critic")
    assert done["recovered"] == ["step_00000002/critic"]
    assert ck.read_json(s2 / "critic" / ck.COMPLETE_MARKER)["copy"] == "previous"
    assert ck.complete_steps(tmp_path, role="critic") == [1, 2, 4]
    assert sorted(os.listdir(s1)) == ["critic"] and sorted(os.listdir(s2)) == ["critic"]
    assert not s3.exists()  # emptied by the cleaning: removed
    assert sorted(os.listdir(s4)) == [".old.actor.5", ".tmp.actor", "critic"]  # the actor's are its own
    assert sorted(done["removed"]) == [
        "step_00000001/.old.critic.123",
        "step_00000001/.tmp.critic.abcd",
        "step_00000002/.tmp.critic.zz",
        "step_00000003/.tmp.critic.q1",
        "step_00000004/.tmp.critic.live",
    ]
    done = ck.clean_leftovers(tmp_path, "actor")
    assert done == {"removed": ["step_00000004/.old.actor.5", "step_00000004/.tmp.actor"], "recovered": []}
    assert sorted(os.listdir(s4)) == ["critic"]
    assert ck.clean_leftovers(tmp_path, "critic") == {"removed": [], "recovered": []}


_KILLED_COMMIT = """
import os, signal, sys
from pathlib import Path
from aligner import checkpoint as ck

final = Path(sys.argv[1]) / ck.step_dir_name(5) / "actor"
with ck.atomic_directory(final, marker={"step": 5}) as d:
    (d / "a.txt").write_text("first")
real, calls = os.replace, []

def replace(src, dst):
    calls.append(src)
    if len(calls) == 2:  # the new copy's rename: the process is killed here
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)

ck.os.replace = replace
with ck.atomic_directory(final, marker={"step": 5}) as d:
    (d / "a.txt").write_text("second")
"""


@pytest.mark.subprocess
def test_a_commit_killed_between_its_renames_leaves_a_copy_that_is_recovered(tmp_path):
    """The crash window of commit_directory: killed after it moved the previous copy aside and
    before it renamed the new one in."""
    import subprocess
    import sys
    from pathlib import Path

    env = {
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _KILLED_COMMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == -9, out.stderr[-2000:]
    step = tmp_path / ck.step_dir_name(5)
    assert ck.complete_steps(tmp_path, role="actor") == []  # only the copy moved aside is whole
    assert {p.name.split(".")[1] for p in step.iterdir()} == {"old", "tmp"}
    assert ck.clean_leftovers(tmp_path, "actor")["recovered"] == ["step_00000005/actor"]
    assert (step / "actor" / "a.txt").read_text() == "first" and ck.complete_steps(
        tmp_path, role="actor"
    ) == [5]
    assert sorted(os.listdir(step)) == ["actor"]


def test_a_failed_rename_in_a_commit_puts_the_previous_copy_back(tmp_path, monkeypatch):
    final = tmp_path / ck.step_dir_name(6) / "critic"
    with ck.atomic_directory(final, marker={"step": 6}) as d:
        (d / "a.txt").write_text("first")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(OSError, match="No space"), ck.atomic_directory(final, marker={"step": 6}) as d:
        (d / "a.txt").write_text("second")
    monkeypatch.undo()
    assert (final / "a.txt").read_text() == "first" and sorted(os.listdir(final.parent)) == ["critic"]
