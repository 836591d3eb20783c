"""Which step a run continues from (docs/design.md, "Checkpoints"): at start-up, per
``checkpoint.resume`` (:func:`resolve_resume`); after a restarted critic server, per
``critic.on_restart`` (:func:`check_restart`, then :func:`rollback_dir`).

At start-up:

- ``none``: a fresh start, refused when the checkpoint root already holds this role's checkpoints
  of a run (a fresh run would mix with them);
- ``auto``: the newest step both roles completed (critic-free: the actor's newest step), or a
  fresh start when the actor has none; a checkpoint made with another config has stopped the run
  before anything was built (:func:`check_resume`, :mod:`aligner.actor.fingerprint`);
- ``force``: as ``auto``, whatever the checkpoint's config;
- a path: that step's folder (or its ``actor/`` folder), which must hold a complete actor
  checkpoint of a step the server holds too (critic-free: the actor's folder alone).

A fresh start against a server that has already trained resets it to its step-0 checkpoint
(``checkpoint.save_initial``), or stops with an error when there is none. A critic-free run
(``ppo.advantage`` grpo, rloo, reinforce_pp) keeps nothing on the server: its own checkpoints
alone decide. Rank 0 asks the server and decides; every other rank follows, and raises when rank
0 does. :class:`~aligner.actor.checkpointing.ActorCheckpointer` then loads the step chosen.

After a restarted server (:class:`~aligner.wire.handle.CriticRestartedError`), the run stops
(``critic.on_restart=fail``, no checkpointer, more than ``critic.max_restarts`` restarts) or
rolls both roles back to the newest step both still hold.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from aligner.actor import fingerprint as fp
from aligner.actor.checkpointing import ROLE, ActorCheckpointer, checkpoint_root
from aligner.actor.config import ActorConfig, CriticClientConfig
from aligner.actor.critic_link import server_mode_problem
from aligner.checkpoint import COMPLETE_MARKER, CheckpointError, complete_steps, read_json, step_dir_name
from aligner.config_checks import ConfigError
from aligner.distributed import on_rank0
from aligner.wire.handle import CriticError, CriticRestartedError
from aligner.wire.protocol import ServerInfo

__all__ = ["check_resume", "check_restart", "resolve_resume", "rollback_dir", "rolled_back"]

log = logging.getLogger(__name__)


# -- at start-up -------------------------------------------------------------------------------


def _resumed_state(cfg: ActorConfig) -> tuple[Path, dict[str, Any]] | None:
    """The actor folder and ``trainer_state.json`` that ``checkpoint.resume`` points at before the
    server is asked: auto and force, the newest complete actor step of the checkpoint root; a path,
    that step. None when there is none or it cannot be read (:func:`resolve_resume` says why)."""
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    if mode in ("auto", "force"):
        root = checkpoint_root(cfg)
        steps = [s for s in complete_steps(root, role=ROLE) if s > 0]
        if not steps:
            return None
        folder = root / step_dir_name(steps[-1]) / ROLE
    else:
        path = Path(mode)
        folder = path if path.name == ROLE else path / ROLE
    try:
        return folder, read_json(folder / "trainer_state.json")
    except CheckpointError:
        return None


def check_resume(cfg: ActorConfig, say: Any = print) -> None:
    """Before anything is built: with ``checkpoint.resume=auto``, a :class:`ConfigError` when the
    newest actor checkpoint was made with another config (``fp.FINGERPRINT_IGNORES`` aside),
    naming the run dir, the keys that differ (old -> new) and how to go on. A checkpoint from
    before fingerprints resumes with a warning; ``force`` and a named step resume whatever the
    config, saying what differs. ``say``: the console (None: the log alone)."""
    found = _resumed_state(cfg)
    if found is None:
        return
    folder, saved = found
    mode = cfg.checkpoint.resume

    def tell(msg: str) -> None:
        log.warning("%s", msg)
        if say is not None:
            say(msg, flush=True)

    new = fp.config_dict(cfg)
    changes = fp.config_changes(saved.get("config") or {}, new)
    differs = f"; its config differs from this one in:\n{fp.changes_listed(changes)}" if changes else ""
    if saved.get("config_fingerprint") is None:
        tell(
            f"{folder} is a checkpoint from before config fingerprints: resuming it without checking "
            f"that it is this command's run{differs}"
        )
        return
    if saved["config_fingerprint"] == fp.config_fingerprint(new) or not changes:
        return
    if mode != "auto":
        tell(f"checkpoint.resume={mode}: resuming {folder} whatever its config{differs}")
        return
    c = cfg.checkpoint
    new_dir = (
        "another logging.run_dir (its checkpoints go to <run_dir>/checkpoints)"
        if c.dir is None
        else f"another checkpoint.dir (this one, {c.dir}, holds that run's checkpoints) and logging.run_dir"
    )
    raise ConfigError(
        f"checkpoint.resume=auto: cannot resume the run in {cfg.logging.run_dir} (its newest checkpoint "
        f"{folder}) with this command: it was made with another config. Keys that differ (old -> new):\n"
        f"{fp.changes_listed(changes)}\n"
        f"To start a new run, give it {new_dir}. To continue that run with this config, pass "
        f"checkpoint.resume=force (the newest step, whatever the config) or "
        f"checkpoint.resume={folder.parent} (that step). Keys a resume may change freely: "
        f"{', '.join(fp.FINGERPRINT_IGNORES)}"
    )


def resolve_resume(checkpointer: ActorCheckpointer) -> Path | None:
    """The actor step folder to resume from, or None for a fresh start, per
    ``checkpoint.resume``; resets the server's critic to step 0 for a fresh start when it has
    trained. Call on every rank (rank 0 asks the server and decides; the rest follow)."""

    def decide() -> str | None:
        try:
            return _decide(checkpointer)
        except Exception as e:  # the same error on every rank
            raise CheckpointError(f"{type(e).__name__}: {e}") from e

    path = on_rank0(decide, carried=(CheckpointError,))
    return None if path is None else Path(path)


def _decide(ck: ActorCheckpointer) -> str | None:
    mode = ck.cfg.checkpoint.resume
    info = ck.critic.server_info()
    problem = server_mode_problem(ck.cfg.ppo.advantage, info, ck.critic.url)
    if problem is not None:
        raise CheckpointError(problem)
    server_steps = sorted(int(s) for s in info.checkpoint_steps)
    if ck.critic_free:
        return _decide_critic_free(ck, mode)
    if mode == "none":
        mine = complete_steps(ck.root, role=ROLE)
        if mine:
            raise CheckpointError(
                f"checkpoint.resume=none, but {ck.root} already holds this role's checkpoints of a run "
                f"(steps {mine}); a fresh run would mix with them. Continue that run with "
                "checkpoint.resume=auto, or give the fresh run another checkpoint.dir (or delete them)"
            )
        _reset_critic(ck, info, server_steps, "checkpoint.resume=none")
        return None
    if mode in ("auto", "force"):
        mine = [s for s in complete_steps(ck.root, role=ROLE) if s > 0]
        common = sorted(set(mine) & set(server_steps))
        if not mine:
            ck.say(f"resume={mode}: no actor checkpoint under {ck.root}; starting fresh")
            _reset_critic(ck, info, server_steps, "a fresh start")
            return None
        if not common:
            raise CheckpointError(
                f"resume={mode}: actor checkpoints under {ck.root} are at steps {mine}, but the critic "
                f"server at {ck.critic.url} has critic checkpoints at {server_steps or 'no steps'}; "
                "no step is complete for both roles. Point the server's checkpoint.dir at this run's "
                "checkpoints, resume from a folder with checkpoint.resume=PATH, or start over with "
                "checkpoint.resume=none"
            )
        step = common[-1]
        path = ck.root / step_dir_name(step)
        skipped = [s for s in mine if s > step]
        note = f" (newer actor steps {skipped} have no critic checkpoint)" if skipped else ""
        ck.say(f"resume={mode}: resuming from step {step}: {path / ROLE}, critic step {step}{note}")
        return str(path)
    step_dir = _named_step_dir(mode)
    step = int(read_json(step_dir / ROLE / "trainer_state.json")["trainer"]["step"])
    if step not in server_steps:
        raise CheckpointError(
            f"checkpoint.resume={mode!r} is step {step}, but the critic server at {ck.critic.url} has "
            f"critic checkpoints at {server_steps or 'no steps'} only"
        )
    ck.say(f"resuming from step {step}: {step_dir / ROLE}, critic step {step}")
    return str(step_dir)


def _named_step_dir(mode: str) -> Path:
    """The step folder ``checkpoint.resume`` names (the step's folder or its actor folder),
    after checking it holds a complete actor checkpoint."""
    path = Path(mode)
    step_dir = path.parent if path.name == ROLE else path
    if not (step_dir / ROLE / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"checkpoint.resume={mode!r}: {step_dir / ROLE} is not a complete actor checkpoint "
            f"(no {COMPLETE_MARKER}); complete steps under {step_dir.parent}: "
            f"{complete_steps(step_dir.parent, role=ROLE)}"
        )
    return step_dir


def _decide_critic_free(ck: ActorCheckpointer, mode: str) -> str | None:
    """:func:`_decide` for a critic-free run: the actor's checkpoints alone decide."""
    mine = [s for s in complete_steps(ck.root, role=ROLE) if s > 0]
    if mode == "none":
        if mine:
            raise CheckpointError(
                f"checkpoint.resume=none, but {ck.root} already holds this role's checkpoints of a run "
                f"(steps {mine}); a fresh run would mix with them. Continue that run with "
                "checkpoint.resume=auto, or give the fresh run another checkpoint.dir (or delete them)"
            )
        return None
    if mode in ("auto", "force"):
        if not mine:
            ck.say(f"resume={mode}: no actor checkpoint under {ck.root}; starting fresh")
            return None
        path = ck.root / step_dir_name(mine[-1])
        ck.say(f"resume={mode}: resuming from step {mine[-1]}: {path / ROLE} (critic-free: no server state)")
        return str(path)
    step_dir = _named_step_dir(mode)
    ck.say(f"resuming from {step_dir / ROLE} (critic-free: no server state)")
    return str(step_dir)


def _reset_critic(ck: ActorCheckpointer, info: ServerInfo, server_steps: list[int], why: str) -> None:
    if info.critic_step < 1:
        return
    if 0 not in server_steps:
        raise CheckpointError(
            f"{why}, but the critic server at {ck.critic.url} has already applied training step "
            f"{info.critic_step} and holds no step-0 checkpoint to reset to (checkpoint.save_initial "
            "was off); start a fresh server, or resume the run that trained it"
        )
    ck.critic.load(0)
    ck.say(f"{why}: reset the critic server to its initial state (its step-0 checkpoint)")


# -- after a restarted server ------------------------------------------------------------------


def _steps(error: CriticRestartedError) -> tuple[Any, Any]:
    """The critic steps the server holds and the actor expected, "?" where unknown."""
    held = "?" if error.critic_step is None else error.critic_step
    expected = "?" if error.expected_step is None else error.expected_step
    return held, expected


def check_restart(
    error: CriticRestartedError,
    c: CriticClientConfig,
    checkpointer: ActorCheckpointer | None,
    url: str,
    *,
    reached: int,
    completed: int,
    restarts: int,
) -> None:
    """Raise CriticError, naming both roles' steps, when the run stops after the restarted server
    at ``url`` of ``error`` (met during step ``reached``, with ``completed`` steps done) instead of
    rolling back: ``critic.on_restart=fail``, no ``checkpointer`` to roll back with, or
    ``restarts`` (this one counted) more than ``critic.max_restarts``."""
    held, expected = _steps(error)
    # Found by another instance_id alone, the server may hold the very step expected: say so.
    new = "a new instance at " if held == expected else ""
    found = f"critic server restarted ({new}critic step {held}, expected {expected}) during step {reached}"
    if c.on_restart == "fail":
        raise CriticError(
            f"{found}: critic.on_restart=fail, stopping. The server at {url} holds "
            f"critic step {held}; the actor completed step {completed} and expected critic step "
            f"{expected}. Run again with checkpoint.resume=auto to continue from the newest step both "
            f"roles saved. ({error})"
        ) from error
    if checkpointer is None:
        raise CriticError(f"{found}, and this trainer has no checkpointer to roll back with") from error
    if restarts > c.max_restarts:
        raise CriticError(
            f"{found}: that is {restarts} restarts in this run, more than critic.max_restarts="
            f"{c.max_restarts}; stopping. ({error})"
        ) from error


def rollback_dir(checkpointer: ActorCheckpointer, error: CriticRestartedError) -> tuple[Path, int, str]:
    """The step folder to roll both roles back to after ``error``: the newest step that both
    this run's actor checkpoints and the server's critic checkpoints (as the server lists
    them now) hold; the critic step the server holds now, and its ``instance_id`` (the server
    process every rank's client follows from now on). CheckpointError naming both lists when
    there is none. Call on every rank."""
    ck = checkpointer

    def decide() -> tuple[str, int, str]:
        try:
            info = ck.critic.server_info()
            server_steps = sorted(int(s) for s in info.checkpoint_steps)
            mine = [s for s in complete_steps(ck.root, role=ROLE) if s > 0]
            common = mine if ck.critic_free else sorted(set(mine) & set(server_steps))
        except CriticRestartedError:  # restarted again: the caller counts it and retries
            raise
        except Exception as e:  # the same error on every rank
            raise CheckpointError(f"{type(e).__name__}: {e}") from e
        if not common:
            raise CheckpointError(
                f"cannot roll back after the critic server restarted ({error}): no step is "
                f"complete for both roles (actor checkpoints under {ck.root}: {mine or 'none'}; "
                f"critic checkpoints on the server: {server_steps or 'none'}). Save more often "
                "(checkpoint.save_interval), or point the server's checkpoint.dir at this run's"
            )
        return str(ck.root / step_dir_name(common[-1])), info.critic_step, str(info.instance_id)

    path, critic_step, instance = on_rank0(decide, carried=(CriticRestartedError, CheckpointError))
    return Path(path), int(critic_step), instance


def rolled_back(
    error: CriticRestartedError, held_now: int, *, to: int, reached: int, restarts: int, max_restarts: int
) -> str:
    """The line that says both roles were rolled back to step ``to`` after ``error`` (the server
    holding critic step ``held_now`` when asked), and which steps are redone."""
    held, expected = _steps(error)
    if error.critic_step is None:
        held = held_now
    return (
        f"critic server restarted (critic step {held}, expected {expected}): rolled both roles back to "
        f"step {to}; steps {to + 1}..{max(reached, to + 1)} are redone "
        f"(restart {restarts} of at most {max_restarts})"
    )
