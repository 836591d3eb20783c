"""The actor's side of the checkpoint rules (docs/design.md, "Checkpoints"), in one process
against the toy server: the leftovers of its killed saves are cleaned at start-up (never the
critic's), and a step it gave up by loading an earlier one loses its actor half before the
critic saves that step again (a kill between the two commits pairs no given-up half)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _actor_parts import tiny_run_config
from _toy_critic import ToyCritic

from aligner.actor.config import ActorConfig
from aligner.actor.run import build_actor
from aligner.checkpoint import COMPLETE_MARKER, complete_steps, step_dir_name, write_json
from aligner.distributed import destroy


def _config(root: Path) -> ActorConfig:
    """Four steps, saved every two (as tests/actor/test_actor_recovery.py runs them)."""
    cfg = tiny_run_config()
    cfg.data.task, cfg.data.num_digits, cfg.data.num_prompts = "copy", 3, 256
    cfg.generation.max_new_tokens = 4
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 4, 16, 16, 16
    cfg.precision = "fp32"
    cfg.checkpoint.dir, cfg.checkpoint.save_interval = str(root / "ckpt"), 2
    cfg.checkpoint.keep_last, cfg.checkpoint.keep_best, cfg.checkpoint.resume = 0, False, "none"
    cfg.validation.interval, cfg.validation.before_train = 0, False
    cfg.logging.run_dir, cfg.logging.tensorboard, cfg.logging.progress_bar = str(root / "run"), False, False
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    yield
    destroy()


def _train(cfg, critic):
    actor = build_actor(cfg, critic=critic)
    try:
        actor.trainer.train()
    finally:
        actor.close()
    return actor


def test_a_resumed_run_cleans_its_leftovers_and_redoes_a_given_up_step_without_a_mixed_pair(tmp_path):
    critic = ToyCritic()
    _train(_config(tmp_path), critic)
    ckpt = tmp_path / "ckpt"
    assert complete_steps(ckpt, role="actor") == [2, 4] and sorted(critic.checkpoints) == [0, 2, 4]
    s2, s3, s4 = (ckpt / step_dir_name(s) for s in (2, 3, 4))
    (s4 / ".tmp.actor" / "policy").mkdir(parents=True)  # a save of step 4 killed while writing
    (s2 / ".old.actor.77").mkdir()  # a copy moved aside, its commit finished (no marker)
    (s3 / ".old.actor.78").mkdir(parents=True)  # the only complete copy of step 3, moved aside
    write_json(s3 / ".old.actor.78" / COMPLETE_MARKER, {"step": 3})
    (s4 / ".tmp.critic.abc").mkdir()  # the server's: it may be writing it now

    # Go back to step 2: step 4 is the continuation given up, redone by this run.
    seen_at_critic_save: dict[int, bool] = {}
    save = critic.save

    def watched_save(step: int) -> None:
        seen_at_critic_save[step] = (ckpt / step_dir_name(step) / "actor").exists()
        save(step)

    critic.save = watched_save
    cfg = _config(tmp_path)
    cfg.checkpoint.resume = str(s2)
    actor = build_actor(cfg, critic=critic)
    try:
        assert sorted(p.name for p in s4.iterdir()) == [".tmp.critic.abc", "actor"]
        assert sorted(p.name for p in s2.iterdir()) == ["actor"]
        assert (s3 / "actor" / COMPLETE_MARKER).is_file()  # recovered
        assert actor.resume_step == 2 and actor.trainer.checkpointer.abandoned == {3, 4}
        actor.trainer.train()
    finally:
        actor.close()
    # Step 4's given-up actor half was gone when the server saved the new critic half.
    assert seen_at_critic_save == {4: False}
    # Step 3 (given up, not saved again) is an older step now: keep_last's to prune, as any other.
    assert complete_steps(ckpt, role="actor") == [2, 3, 4]
    assert (s4 / ".tmp.critic.abc").is_dir()
    assert actor.trainer.checkpointer.abandoned == set()
