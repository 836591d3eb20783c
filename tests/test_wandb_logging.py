"""Weights & Biases as the third sink of :class:`aligner.metrics.MetricsLogger`, run for real in
offline mode (nothing leaves the machine): what W&B wrote is read back from the run's transaction
log (``run-<id>.wandb``) and compared with what was logged.

The transaction log is a LevelDB-style log (W&B's own format: a 7-byte ``:W&B`` header, then 32 KiB
blocks of records, each a CRC, a length, a type and a piece of a serialized ``Record`` protobuf of
``wandb.proto.wandb_internal_pb2``); :func:`read_wandb_records` reads it the way ``wandb sync``
does.
"""

from __future__ import annotations

import glob
import json
import math
import os
import socket
import struct
import sys
import time

import pytest

from aligner.actor.config import LoggingConfig
from aligner.metrics import (
    WANDB_ID_FILE,
    MetricsLogger,
    WandbConfig,
    WandbMissingError,
    read_metrics,
)

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: str) -> list:
    """Every ``Record`` of a ``.wandb`` transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log (header {data[:7]!r})"
    records, pieces, pos = [], [], 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind == 0:  # zero padding (a preallocated block)
            continue
        if kind in (FULL, FIRST):
            pieces = [payload]
        else:
            pieces.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
    return records


def wandb_run(wandb_dir, wait_s: float = 20.0) -> dict:
    """What the one offline run under ``wandb_dir`` holds: its id, name, tags, config, history
    rows by step (W&B's own ``_*`` keys dropped) and its folder. W&B's service process writes the
    log: read again until it holds the run's record (``wait_s`` at most)."""
    deadline = time.monotonic() + wait_s
    while True:
        out = _read_run(wandb_dir)
        if "id" in out or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _read_run(wandb_dir) -> dict:
    (path,) = glob.glob(os.path.join(str(wandb_dir), "wandb", "offline-run-*", "run-*.wandb"))
    out: dict = {"history": {}, "config": {}, "folder": os.path.dirname(path)}
    for r in read_wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, name=r.run.display_name, tags=list(r.run.tags))
            items = r.run.config.update
        elif kind == "config":
            items = r.config.update
        elif kind == "history":
            row = {}
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
            out["history"].setdefault(r.history.step.num, {}).update(row)
            continue
        else:
            continue
        for item in items:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out["config"][key] = json.loads(item.value_json)
    return out


def table_rows(run: dict, step: int, key: str) -> dict:
    """The W&B table logged under ``key`` (``key/...`` history items) at ``step``, as its JSON."""
    path = run["history"][step][f"{key}/path"]
    with open(os.path.join(run["folder"], "files", path)) as f:
        return json.load(f)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, its every folder in tmp_path, and no way out: any connection from this process
    other than to the local W&B service fails the test, and W&B's service process is pointed at a
    closed loopback port for its server and proxies."""
    pytest.importorskip("wandb")
    for k in list(os.environ):
        if k.startswith("WANDB_"):
            monkeypatch.delenv(k)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(k, str(tmp_path / "home" / k.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_default"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    dead = "http://127.0.0.1:9"
    monkeypatch.setenv("WANDB_BASE_URL", dead)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(k, dead)
    for k in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(k, raising=False)

    outside = []
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            outside.append(address)
            raise OSError(f"test: no network ({address})")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield tmp_path
    assert outside == [], f"connections off the machine: {outside}"


def wandb_cfg(tmp_path, name: str, **kw) -> WandbConfig:
    return WandbConfig(**{"enabled": True, "mode": "offline", "dir": str(tmp_path / name), **kw})


def rows(step: int) -> dict[str, float]:
    return {"objective/scores": 0.25 * step, "objective/kl": 0.01 * step, "critic/vf_loss": 1.0 / (1 + step)}


def test_offline_run_logs_metrics_samples_and_config(offline):
    tmp_path = offline
    run_dir = tmp_path / "my_run"
    said = []
    logger = MetricsLogger(
        str(run_dir),
        tensorboard=False,
        resume_step=-1,
        print_fn=said.append,
        wandb=wandb_cfg(tmp_path, "w", tags=["ppo", "tiny"]),
        run_config={"ppo": {"num_steps": 3, "init_kl_coef": 0.05}, "seed": 7},
    )
    for step in (1, 2, 3):
        logger.log(step, {**rows(step), "timers/step": float("nan") if step == 2 else 0.5})
    samples = [
        {"prompt": "12 + 3 =", "response": "15", "score": 1.0},
        {"prompt": "a|b", "response": "x\ny", "score": -0.5},
    ]
    logger.samples(3, samples)
    logger.close()

    run = wandb_run(tmp_path / "w")
    assert run["id"] == (run_dir / WANDB_ID_FILE).read_text().strip()
    assert run["name"] == "my_run"  # the run dir's name
    assert run["tags"] == ["ppo", "tiny"]
    assert run["config"]["ppo"] == {"num_steps": 3, "init_kl_coef": 0.05}
    assert run["config"]["seed"] == 7

    # The same names and values as metrics.jsonl, at the same steps.
    jsonl = {r["step"]: r for r in read_metrics(str(run_dir / "metrics.jsonl"))}
    assert sorted(run["history"]) == [1, 2, 3] == sorted(jsonl)
    for step in (1, 2, 3):
        got = run["history"][step]
        for k, v in rows(step).items():
            assert got[k] == pytest.approx(v) == pytest.approx(jsonl[step][k]), (step, k)
    assert math.isnan(float(run["history"][2]["timers/step"]))  # NaN kept, as in metrics.jsonl
    assert run["history"][3]["timers/step"] == 0.5

    table = table_rows(run, 3, "validation/samples")
    assert table["columns"] == ["prompt", "response", "score", "step"]
    assert table["data"] == [["12 + 3 =", "15", 1.0, 3], ["a|b", "x\ny", -0.5, 3]]
    assert said == [f"validation samples at step 3:\n{said[0].split(chr(10), 1)[1]}"]  # no W&B notice


def test_histograms_go_to_wandb_beside_the_step_row(offline):
    import torch

    from aligner.histograms import distributions

    tmp_path = offline
    _, hists = distributions({"critic/advantages": (torch.tensor([1.0, 3.0, 2.0]), None)}, bins=4)
    logger = MetricsLogger(str(tmp_path / "run"), tensorboard=False, wandb=wandb_cfg(tmp_path, "w"))
    logger.log(2, {**rows(2), "critic/advantages/mean": 2.0})
    logger.histograms(2, hists)
    logger.close()
    got = wandb_run(tmp_path / "w")["history"][2]
    assert got["critic/advantages/mean"] == 2.0 and got["objective/kl"] == pytest.approx(0.02)
    h = {k: got[f"critic/advantages/{k}"] for k in ("_type", "bins", "values")}  # a nested item
    assert h == {"_type": "histogram", "bins": [1.0, 1.5, 2.0, 2.5, 3.0], "values": [1, 0, 1, 1]}
    (row,) = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert "critic/advantages" not in row  # the JSONL keeps scalars


def test_resume_continues_the_run_and_skips_steps_it_has(offline):
    tmp_path = offline
    run_dir = str(tmp_path / "run")
    first = MetricsLogger(run_dir, tensorboard=False, resume_step=-1, wandb=wandb_cfg(tmp_path, "a"))
    for step in range(1, 6):
        first.log(step, rows(step))
    first.close()
    run_id = wandb_run(tmp_path / "a")["id"]

    # Resumed from a checkpoint of step 3: steps 4 and 5 are redone (other values), 6 is new.
    said = []
    second = MetricsLogger(
        run_dir, tensorboard=False, resume_step=3, print_fn=said.append, wandb=wandb_cfg(tmp_path, "b")
    )
    for step in (4, 5, 6):
        second.log(step, {k: v + 100 for k, v in rows(step).items()})
    second.samples(5, [{"prompt": "p", "response": "r", "score": 0.0}])
    second.samples(6, [{"prompt": "p", "response": "r", "score": 1.0}])
    second.log(2, rows(2))  # below this run's last step: never sent
    second.close()

    resumed = wandb_run(tmp_path / "b")
    assert resumed["id"] == run_id
    assert sorted(resumed["history"]) == [6]
    assert resumed["history"][6]["objective/scores"] == pytest.approx(rows(6)["objective/scores"] + 100)
    assert table_rows(resumed, 6, "validation/samples")["data"] == [["p", "r", 1.0, 6]]
    notices = [s for s in said if s.startswith("W&B")]
    assert len(notices) == 1 and run_id in notices[0] and "step 5" in notices[0], said
    # metrics.jsonl has every redone row (as before: only W&B skips them).
    steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6]

    # A fresh start in the same run dir is a new W&B run.
    third = MetricsLogger(run_dir, tensorboard=False, resume_step=-1, wandb=wandb_cfg(tmp_path, "c"))
    third.log(1, rows(1))
    third.close()
    fresh = wandb_run(tmp_path / "c")
    assert fresh["id"] != run_id
    assert sorted(fresh["history"]) == [1]


def test_only_the_logging_rank_and_only_when_enabled(offline):
    tmp_path = offline
    other_rank = MetricsLogger(str(tmp_path / "r1"), enabled=False, wandb=wandb_cfg(tmp_path, "x"))
    other_rank.log(1, rows(1))
    other_rank.close()
    off = MetricsLogger(str(tmp_path / "r2"), tensorboard=False, wandb=WandbConfig(dir=str(tmp_path / "y")))
    off.log(1, rows(1))
    off.close()
    disabled = MetricsLogger(
        str(tmp_path / "r3"), tensorboard=False, wandb=wandb_cfg(tmp_path, "z", mode="disabled")
    )
    disabled.close()
    for name in ("x", "y", "z"):
        assert not (tmp_path / name).exists()
    assert not (tmp_path / "r2" / WANDB_ID_FILE).exists()


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(WandbMissingError, match=r"pip install 'aligner-rlhf\[wandb\]'"):
        MetricsLogger(str(tmp_path / "run"), tensorboard=False, wandb=wandb_cfg(tmp_path, "w"))
    assert not (tmp_path / "w").exists()
    problems = LoggingConfig(wandb=WandbConfig(enabled=True)).problems()
    assert len(problems) == 1 and "logging.wandb.enabled" in problems[0]
    assert "pip install 'aligner-rlhf[wandb]'" in problems[0]
    # Off, or mode 'disabled': the package is not needed.
    assert LoggingConfig().problems() == []
    assert LoggingConfig(wandb=WandbConfig(enabled=True, mode="disabled")).problems() == []
    MetricsLogger(
        str(tmp_path / "run"), tensorboard=False, wandb=WandbConfig(enabled=True, mode="disabled")
    ).close()


def test_bad_values_name_the_key():
    problems = WandbConfig(enabled=True, mode="sometimes", project="", tags=["ok", ""]).problems()
    assert "logging.wandb.mode='sometimes': expected one of ['online', 'offline', 'disabled']" in problems
    assert any(p.startswith("logging.wandb.project=''") for p in problems)
    assert any(p.startswith("logging.wandb.tags=['ok', '']") for p in problems)
    with pytest.raises(ValueError, match="logging.wandb.mode='sometimes'"):
        MetricsLogger("unused", enabled=True, wandb=WandbConfig(enabled=True, mode="sometimes"))
