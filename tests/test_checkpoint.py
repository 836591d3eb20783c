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
    # Step 5 was just saved by a run that resumed from step 4: step 7 is from the abandoned
    # continuation; keep the newest 2 up to 5 plus the protected step 1.
    assert ck.prune_checkpoints(tmp_path, "actor", saved=5, keep_last=2, protect={1}) == [2, 3, 7]
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
