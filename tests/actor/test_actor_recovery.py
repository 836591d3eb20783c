"""The actor's side of a restarted or hung critic server, in one process, against a toy server.

:class:`ToyCritic` stands where the client and the server would: a critic whose values depend on
every update it applied, checkpoints by step, and the client's fencing (the critic step it
expects, a restart remembered until a ``load``). It can "restart" (come back with its newest
checkpoint, as ``checkpoint.resume=auto`` does) during the update of a given step, or after
applying one. A run that meets such a restart rolls both roles back and must end with the
uninterrupted run's policy weights, critic and metrics; ``critic.on_restart=fail`` and
``critic.max_restarts`` stop it, naming the steps; a timeout during the critic's save leaves the
previous checkpoint intact and the new step uncommitted. The real server's side of this (kills,
restarts, fault points) is the fault suite's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _actor_parts import tiny_run_config
from _toy_critic import ToyCritic

from aligner.actor.config import ActorConfig
from aligner.actor.run import build_actor
from aligner.checkpoint import COMPLETE_MARKER, complete_steps, step_dir_name
from aligner.distributed import destroy
from aligner.metrics import read_metrics
from aligner.wire import protocol as P
from aligner.wire.handle import CriticError, CriticHandle, CriticRestartedError, CriticTimeoutError

STEPS = 4


def _config(root: Path, **critic) -> ActorConfig:
    cfg = tiny_run_config()
    cfg.data.task, cfg.data.num_digits, cfg.data.num_prompts = "copy", 3, 256
    cfg.generation.max_new_tokens = 4
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = STEPS, 16, 16, 16
    p.normalize_scores, p.adaptive_kl = True, True
    cfg.optim.min_lr, cfg.optim.warmup_steps = 1e-4, 1  # a decaying schedule: its position matters
    cfg.precision = "fp32"
    cfg.checkpoint.dir, cfg.checkpoint.save_interval = str(root / "ckpt"), 2
    cfg.checkpoint.keep_last, cfg.checkpoint.keep_best, cfg.checkpoint.resume = 0, False, "none"
    cfg.validation.interval, cfg.validation.before_train = 0, False
    cfg.logging.run_dir, cfg.logging.tensorboard, cfg.logging.progress_bar = str(root / "run"), False, False
    for k, v in critic.items():
        setattr(cfg.critic, k, v)
    return cfg


def _run(root: Path, critic: ToyCritic, printed: list[str] | None = None, **critic_cfg):
    """A whole run as the entry point builds it (:func:`aligner.actor.run.build_actor`), with the
    toy standing for the client; returns the trainer, with the steps it rolled back to."""
    actor = build_actor(_config(root, **critic_cfg), critic=critic)
    assert actor.resume_step == -1  # a fresh start
    rollbacks: list[int] = []
    reopen = actor.trainer.on_rollback

    def on_rollback(step: int) -> None:
        rollbacks.append(step)
        reopen(step)

    actor.trainer.on_rollback = on_rollback
    try:
        actor.trainer.train()
    finally:
        actor.close()
    actor.trainer.rollbacks = rollbacks
    return actor.trainer


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    critic = ToyCritic()
    trainer = _run(root, critic)
    assert critic.applied == list(range(1, STEPS + 1)) and trainer.restarts == 0
    return (
        root,
        critic,
        {
            k: v.detach().clone()
            for k, v in trainer.policy.state_dict().items()
            if isinstance(v, torch.Tensor)
        },
    )


def test_the_toy_is_a_critic_handle():
    assert isinstance(ToyCritic(), CriticHandle)


@pytest.mark.parametrize(
    "restart, redone",
    [({"restart_in_train": 4}, "steps 3..4"), ({"restart_after_train": 3}, "steps 3..4")],
    ids=["killed_during_train_4", "restarted_after_train_3"],
)
def test_a_restarted_server_is_rolled_back_and_the_run_ends_as_the_uninterrupted_one(
    tmp_path, uninterrupted, capsys, restart, redone
):
    want_root, want_critic, want_weights = uninterrupted
    critic = ToyCritic(**restart)
    trainer = _run(tmp_path, critic)
    out = capsys.readouterr().out
    assert trainer.restarts == 1 and trainer.rollbacks == [2]
    assert f"rolled both roles back to step 2; {redone} are redone" in out, out
    assert "critic server restarted (critic step 2, expected 3)" in out
    # Both roles end exactly where the uninterrupted run ended.
    assert critic.w == want_critic.w and critic.critic_step == STEPS
    got = trainer.policy.state_dict()
    for name, w in want_weights.items():
        assert torch.equal(got[name], w), name
    want_rows = read_metrics(str(want_root / "run" / "metrics.jsonl"))
    got_rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in got_rows] == list(range(1, STEPS + 1))
    for a, b in zip(got_rows, want_rows):
        for k in b:
            if not k.startswith(("timers/", "throughput/", "perf/")) and k != "time":
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
    assert complete_steps(tmp_path / "ckpt", role="actor") == [2, STEPS]


def test_on_restart_fail_stops_naming_the_servers_step_and_the_actors(tmp_path):
    with pytest.raises(CriticError) as e:
        _run(tmp_path, ToyCritic(restart_in_train=4), on_restart="fail")
    msg = str(e.value)
    assert "critic.on_restart=fail" in msg and "holds critic step 2" in msg, msg
    assert "completed step 4 and expected critic step 3" in msg, msg
    assert isinstance(e.value.__cause__, CriticRestartedError)


def test_more_restarts_than_max_restarts_stop_the_run(tmp_path):
    with pytest.raises(CriticError, match=r"more than critic.max_restarts=0"):
        _run(tmp_path, ToyCritic(restart_after_train=3), max_restarts=0)


def test_a_restart_before_any_common_checkpoint_stops_with_both_lists(tmp_path):
    from aligner.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"no step is complete for both roles") as e:
        _run(tmp_path, ToyCritic(restart_in_train=2))
    assert "critic checkpoints on the server: [0]" in str(e.value)


def test_a_timeout_during_the_critics_save_leaves_the_previous_checkpoint_and_commits_nothing(tmp_path):
    critic = ToyCritic()
    original_save = critic.save

    def save(step: int) -> None:
        if step == STEPS:
            raise CriticTimeoutError(P.SAVE, critic.url, 600.0, step=step)
        original_save(step)

    critic.save = save
    with pytest.raises(
        CriticTimeoutError, match=rf"critic_save of step {STEPS} to the critic server at toy://critic"
    ):
        _run(tmp_path, critic)
    ckpt = tmp_path / "ckpt"
    assert complete_steps(ckpt, role="actor") == [2]
    assert (ckpt / step_dir_name(2) / "actor" / COMPLETE_MARKER).is_file()
    assert not (ckpt / step_dir_name(STEPS)).exists()  # not even a temporary folder
