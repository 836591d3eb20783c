"""A new command never continues an old run by accident (aligner/actor/fingerprint.py): the config
fingerprint, ``checkpoint.resume=auto``'s guard against a checkpoint of another config (``force``
and a named step resume anyway, a checkpoint from before fingerprints with a warning), and the
run directory's run id that decides whether its metrics and W&B run go on. One tiny run against
the toy server makes the checkpoint the checks read; one resume builds the actor from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _toy_critic import ToyCritic

from aligner.actor.config import ActorConfig
from aligner.actor.fingerprint import (
    RUN_RECORD,
    config_dict,
    config_fingerprint,
    read_run_record,
    run_dir_continues,
    write_run_record,
)
from aligner.actor.resume import check_resume
from aligner.actor.run import build_actor, read_inputs
from aligner.checkpoint import complete_steps, read_json, step_dir_name, write_json
from aligner.config_checks import ConfigError
from aligner.distributed import destroy
from aligner.metrics import read_metrics


def _config(root: Path) -> ActorConfig:
    """Two steps, saved at the end (as tests/actor/test_actor_checkpoint_rules.py runs them)."""
    cfg = ActorConfig()
    cfg.data.task, cfg.data.num_digits, cfg.data.num_prompts = "copy", 3, 256
    cfg.generation.max_new_tokens = 4
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 2, 16, 16, 16
    cfg.optim.lr = 2e-3
    cfg.precision, cfg.tokenizer = "fp32", "char"  # as read_inputs resolves it, for check_resume
    cfg.checkpoint.dir, cfg.checkpoint.save_interval = str(root / "ckpt"), 0
    cfg.checkpoint.keep_best, cfg.checkpoint.resume = False, "auto"
    cfg.validation.interval, cfg.validation.before_train = 0, False
    cfg.logging.run_dir, cfg.logging.tensorboard, cfg.logging.progress_bar = str(root / "run"), False, False
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


SERVER = ToyCritic()
"""The toy server of the made run: it holds the critic's checkpoints of its steps."""


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished two-step run: ``<root>/run`` and its checkpoint root ``<root>/ckpt``."""
    root = tmp_path_factory.mktemp("made")
    actor = build_actor(_config(root), critic=SERVER)
    try:
        actor.trainer.train()
    finally:
        actor.close()
    assert complete_steps(root / "ckpt", role="actor") == [2] and 2 in SERVER.checkpoints
    return root


@pytest.fixture
def copy(made, tmp_path) -> Path:
    """A copy of the made run to change."""
    shutil.copytree(made, tmp_path / "root", symlinks=True)
    return tmp_path / "root"


def _state_file(root: Path) -> Path:
    return root / "ckpt" / step_dir_name(2) / "actor" / "trainer_state.json"


def test_fingerprint_ignores_key_order_and_what_a_resume_may_change_but_not_lr(tmp_path):
    cfg = _config(tmp_path)
    base = config_dict(cfg)
    fp = config_fingerprint(base)
    reordered = {k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v for k, v in base.items()}
    assert config_fingerprint(dict(reversed(list(reordered.items())))) == fp
    cfg.ppo.num_steps, cfg.checkpoint.resume, cfg.checkpoint.save_interval = 99, "force", 7
    cfg.critic.url, cfg.critic.run_token_file, cfg.logging.run_dir = "grpc://elsewhere:1", "/tok", "/r"
    cfg.logging.wandb.mode, cfg.logging.progress_bar, cfg.validation.interval = "offline", True, 5
    assert config_fingerprint(config_dict(cfg)) == fp
    cfg.optim.lr = 1e-3
    assert config_fingerprint(config_dict(cfg)) != fp


def test_checkpoints_and_the_run_dir_record_the_fingerprint_and_the_run_id(made):
    saved = read_json(_state_file(made))
    record = read_run_record(made / "run")
    assert saved["config_fingerprint"] == record["config_fingerprint"] == config_fingerprint(saved["config"])
    assert saved["run_id"] and saved["run_id"] == record["run_id"]
    assert record["resumed_from"] is None and record["config"]["optim"]["lr"] == 2e-3


def test_auto_resumes_a_run_of_the_same_config_and_its_log(copy, capsys):
    """The end-to-end one: the same config (a longer budget) builds the actor from step 2; the run
    dir is the run's own, so its rows and run id go on."""
    run_id = read_run_record(copy / "run")["run_id"]
    cfg = _config(copy)
    cfg.ppo.num_steps = 4
    critic = ToyCritic()
    critic.checkpoints = dict(SERVER.checkpoints)
    actor = build_actor(cfg, critic=critic)
    actor.close()
    assert actor.resume_step == 2
    assert "resume=auto: resuming from step 2" in capsys.readouterr().out
    record = read_run_record(copy / "run")
    assert record["run_id"] == run_id and record["resumed_from"].endswith(step_dir_name(2))
    assert [r["step"] for r in read_metrics(str(copy / "run" / "metrics.jsonl"))] == [1, 2]
    # The same step resumed into another run's dir: the run goes on, that dir's log starts anew.
    write_run_record(copy / "other", record["config"], "another-run", None)
    (copy / "other" / "metrics.jsonl").write_text('{"step": 1, "objective/scores": 0.5}\n')
    cfg.logging.run_dir, cfg.checkpoint.resume = str(copy / "other"), str(copy / "ckpt" / step_dir_name(2))
    actor = build_actor(cfg, critic=critic)
    actor.close()
    assert actor.resume_step == 2 and "is not the run dir of the run resumed" in capsys.readouterr().out
    assert read_run_record(copy / "other")["run_id"] == run_id
    assert read_metrics(str(copy / "other" / "metrics.jsonl")) == []


def test_auto_refuses_another_lr_naming_the_run_dir_the_keys_and_the_ways_on(copy):
    cfg = _config(copy)
    cfg.optim.lr, cfg.ppo.clip_eps = 1e-3, 0.3
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, say=None)
    msg = str(err.value)
    assert f"cannot resume the run in {copy / 'run'}" in msg
    assert "optim.lr: 0.002 -> 0.001" in msg and "ppo.clip_eps: 0.2 -> 0.3" in msg
    assert "another checkpoint.dir" in msg and "checkpoint.resume=force" in msg
    assert f"checkpoint.resume={copy / 'ckpt' / step_dir_name(2)}" in msg
    assert "ppo.num_steps" in msg  # the keys a resume may change
    cfg.tokenizer = "auto"  # the entry point's first step refuses it, before reading any prompt
    with pytest.raises(ConfigError, match="optim.lr: 0.002 -> 0.001"):
        read_inputs(cfg)
    # Refused before anything was built: nothing of the run changed.
    assert read_run_record(copy / "run")["config"]["optim"]["lr"] == 2e-3


def test_the_refusal_lists_at_most_ten_keys(copy):
    cfg = _config(copy)
    cfg.seed, cfg.optim.lr, cfg.optim.warmup_steps = 1, 1e-3, 9
    p = cfg.ppo
    p.clip_eps, p.gamma, p.lam, p.init_kl_coef, p.ppo_epochs, p.kl_estimator = 0.3, 0.9, 0.9, 0.1, 3, "k3"
    p.global_batch_size = p.mini_batch_size = 32
    p.adaptive_kl, p.micro_batch_size = True, 8  # the micro-batches' size is no change
    with pytest.raises(ConfigError, match=r"\.\.\. and 2 more"):
        check_resume(cfg, say=None)


def test_force_and_a_named_step_resume_whatever_the_config(copy):
    said: list[str] = []
    cfg = _config(copy)
    cfg.optim.lr = 1e-3
    cfg.checkpoint.resume = "force"
    check_resume(cfg, say=lambda m, **_: said.append(m))
    cfg.checkpoint.resume = str(copy / "ckpt" / step_dir_name(2))
    check_resume(cfg, say=lambda m, **_: said.append(m))
    assert len(said) == 2 and all(
        "config differs from this one in:\n  optim.lr: 0.002 -> 0.001" in m for m in said
    )
    assert said[0].startswith("checkpoint.resume=force: resuming")


def test_a_checkpoint_from_before_fingerprints_resumes_with_a_warning(copy, caplog):
    state = read_json(_state_file(copy))
    del state["config_fingerprint"], state["run_id"]
    write_json(_state_file(copy), state)
    cfg = _config(copy)
    cfg.optim.lr = 1e-3
    check_resume(cfg, say=None)  # not refused
    assert "from before config fingerprints" in caplog.text and "optim.lr: 0.002 -> 0.001" in caplog.text


def test_a_config_key_another_version_added_is_no_change(copy):
    state = read_json(_state_file(copy))
    del state["config"]["ppo"]["clip_eps"]
    state["config"]["ppo"]["a_key_of_old"] = 1
    state["config_fingerprint"] = config_fingerprint(state["config"])
    write_json(_state_file(copy), state)
    said: list[str] = []
    check_resume(_config(copy), say=lambda m, **_: said.append(m))
    assert said == []


def test_the_run_dir_goes_on_only_for_the_run_resumed(tmp_path):
    """W&B's run id (and the metrics rows) in a run dir continue only for its own run."""
    config = config_dict(_config(tmp_path))
    write_run_record(tmp_path / "a", config, "run-a", None)
    assert run_dir_continues(tmp_path / "a", "run-a")
    assert not run_dir_continues(tmp_path / "a", "run-b")
    assert not run_dir_continues(tmp_path / "a", None)  # a checkpoint from before run ids
    assert not run_dir_continues(tmp_path / "empty", "run-a")  # a new dir: a new log
    assert run_dir_continues(tmp_path / "empty", None)  # both from before run ids: as before
    assert (tmp_path / "a" / RUN_RECORD).is_file()
