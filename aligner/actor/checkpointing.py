"""The actor's checkpoints: saving both roles at the same step, and resuming exactly.

Layout under the run's checkpoint root (shared with the critic server when both mount it)::

    <root>/step_00000040/actor/     written here (complete.json last, then renamed into place)
        policy/                     the policy as a full model checkpoint (meta.json + model.safetensors,
                                    any TP layout loads it; ``init_from`` and ``aligner-convert export``
                                    read it)
        policy_lora/                instead of policy/ when the policy has LoRA adapters (``lora.rank``
                                    > 0): the adapters alone, fp32, at their full shapes (adapter.safetensors
                                    + adapter.json, :func:`aligner.models.lora_io.save_lora_adapter`) and the
                                    frozen base weights' fingerprint; a resume needs the same base
        optim_tp00_pp00.safetensors fp32 masters and AdamW moments of model-parallel rank (0, 0)
                                    (+ optim_tp00_pp00.json), shared by its data-parallel replicas
                                    (gathered from their slices with optim.use_distributed_optimizer:
                                    the same file, which loads at any DP size, sharded or not)
        rng_tp00_pp00_dp000.safetensors
                                    every RNG state of the rank at (tp 0, pp 0, dp 0)
        rollouts.safetensors        with rollout workers and max_staleness > 0: the batches asked
                                    for and not yet trained on (their prompts are in the state)
        trainer_state.json          step, KL controller, score normaliser, data position, LR
                                    schedule position, the config it was made with and its
                                    fingerprint, the run id, checks
    <root>/step_00000040/critic/    written by the server (``critic_save``)
    <root>/best -> step_000000NN    the step with the best validation score (``best.json``)

The per-rank files are named by :func:`aligner.checkpoint.shard_file`. The trainer hands the
checkpointer an :class:`ActorState` (its policy, optimizer and training-state JSON at a step,
taken after the critic's pending training has finished) and applies what a load returns; the
checkpointer never reaches into the trainer.

One step is saved in this order: the critic's pending training has finished,
``critic_save(step)`` (the server writes and answers), then the actor's files into
``<step>/.tmp.actor`` from every rank, then rank 0 writes ``trainer_state.json`` and the marker
and renames the folder. A kill
at any point leaves the previous complete step as the newest step both roles completed, which
is what ``resume=auto`` picks. Old checkpoints are pruned only after a newer one is complete,
and a step after the one saved only when this run loaded an earlier step since (the continuation
it gave up, :attr:`ActorCheckpointer.abandoned`); re-saving such a step first removes its given-up
actor half, before the critic's save, so a kill between the two roles' commits never pairs it
with a new critic half. At start-up rank 0 removes the leftovers of killed saves
(``.tmp.actor``, ``.old.actor.*``), renaming back a step's only complete copy that a commit had
moved aside (:func:`aligner.checkpoint.clean_leftovers`).

``ALIGNER_FAULT_AT=<point>[@<step>]`` makes the process kill itself (SIGKILL) at a named point of
the save, or in the middle of a step (:data:`aligner.faults.ACTOR`): how the tests show a crash never
yields a checkpoint that loads wrongly.

A critic-free run (``ppo.advantage`` grpo, rloo or reinforce_pp) has no server side: the server
holds no state of the run (it may be a reward-only one), so nothing is saved or loaded there, and
a step counts as complete with the actor's folder alone. A critic-free checkpoint never resumes
into a run with a critic ('gae'), nor the other way round.

A timeout or a restarted server met during the critic's save raises before the actor writes
anything of that step: its previous checkpoints stay as they were and the step is not
committed. Which step to resume from, at start-up or after a server restart
(``critic.on_restart=resume``), is decided in :mod:`aligner.actor.resume`;
:meth:`ActorCheckpointer.load` restores it (in-process after a restart, as at start-up).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aligner import faults
from aligner.actor.config import ActorConfig, PolicyOptimConfig
from aligner.actor.fingerprint import config_dict, config_fingerprint
from aligner.checkpoint import (
    CheckpointError,
    clean_leftovers_at_start,
    commit_directory,
    complete_steps,
    load_tensors,
    prune_checkpoints,
    read_json,
    restore_rng_state,
    rng_state_tensors,
    rng_to_restore,
    save_tensors,
    shard_file,
    step_dir_name,
    write_json,
)
from aligner.distributed import ParallelState, all_gather_json, barrier, comm_device, on_rank0
from aligner.models.checkpoint_io import load_model_checkpoint, save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import tensor_state_dict
from aligner.models.lora import LoraConfig, lora_config_of
from aligner.models.lora_io import load_lora_adapter, save_lora_adapter
from aligner.precision import Optimizer
from aligner.rl import CRITIC_FREE_ESTIMATORS
from aligner.tokenizers import Tokenizer
from aligner.wire.handle import CriticHandle, CriticRestartedError

__all__ = [
    "ROLE",
    "ActorState",
    "ActorCheckpointer",
    "checkpoint_root",
    "weights_fingerprint",
    "config_differences",
]

log = logging.getLogger(__name__)

ROLE = "actor"
FORMAT_VERSION = 1
_TMP = ".tmp." + ROLE
LORA_DIR = "policy_lora"
"""The adapters of a LoRA policy in an actor checkpoint (in place of ``policy/``)."""


@dataclass
class ActorState:
    """What an actor checkpoint holds of the trainer at one step (every rank has its own: its
    policy shard, its optimizer shard)."""

    step: int
    """PPO steps completed."""
    policy: torch.nn.Module
    """The policy (this rank's tensor-parallel shard), loaded into in place."""
    optimizer: Optimizer
    """Its optimizer: fp32 masters and AdamW moments (this rank's shard), loaded into in place."""
    precision: str
    """What the policy computes in ('bf16' or 'fp32')."""
    training: dict[str, Any]
    """Everything else the next step depends on, as JSON (KL controller, score normaliser, data
    position, LR schedule position, the critic's last result): ``PPOTrainer.training_state()``."""
    rollouts: dict[str, torch.Tensor] | None = None
    """With rollout workers: the batches asked for and not yet trained on (rank 0 writes them to
    ``rollouts.safetensors``; their JSON half is in ``training``)."""


ROLLOUTS_FILE = "rollouts.safetensors"
"""The batches an asynchronous run asked its rollout workers for and had not trained on yet."""


def checkpoint_root(cfg: ActorConfig) -> Path:
    """``checkpoint.dir``, or ``<logging.run_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or os.path.join(cfg.logging.run_dir, "checkpoints"))


def weights_fingerprint(model: torch.nn.Module, state: ParallelState) -> str:
    """A digest of a model's weights (summed over its TP shards, joined over its pipeline
    stages), to recognise the same frozen reference model on resume without storing it.
    Collective over the TP and PP groups."""
    h = hashlib.sha256()
    for name, t in sorted(tensor_state_dict(model).items()):
        t = t.detach().to("cpu", torch.float64)
        stats = torch.stack([t.sum(), (t * t).sum(), t.abs().max() if t.numel() else t.new_zeros(())])
        if state.tp_size > 1:
            stats = stats.to(comm_device())
            dist.all_reduce(stats, group=state.tp_group)
            stats = stats.cpu()
        h.update(name.encode())
        h.update(stats.numpy().tobytes())
    digest = h.hexdigest()[:32]
    if state.pp_size > 1:
        # One digest for the whole model: each stage's, in stage order.
        stages = all_gather_json(digest, group=state.pp_group)
        digest = hashlib.sha256("".join(stages).encode()).hexdigest()[:32]
    return digest


def config_differences(
    saved: dict[str, Any], cfg: ActorConfig, state: ParallelState, tokenizer: Tokenizer, precision: str
) -> list[str]:
    """What differs between a checkpoint's recorded settings and this run in ways that make it
    impossible to continue (the architecture, the tokenizer, the tensor- and pipeline-parallel
    layout, the set of trained parameters). A changed learning rate, step budget or batch size is not listed."""
    out = []
    diff = ModelConfig.from_dict(saved["model_config"]).architecture_diff(cfg.model)
    if diff:
        out.append("model (checkpoint vs config): " + "; ".join(diff))
    if saved["tokenizer_fingerprint"] != tokenizer.fingerprint():
        out.append(
            f"tokenizer: the checkpoint was made with tokenizer={saved['tokenizer']!r} "
            f"(fingerprint {saved['tokenizer_fingerprint']}), this run uses {cfg.tokenizer!r} "
            f"(fingerprint {tokenizer.fingerprint()})"
        )
    if saved["tensor_model_parallel_size"] != state.tp_size:
        out.append(
            f"parallel.tensor_model_parallel_size: the checkpoint's optimizer state is sharded for "
            f"{saved['tensor_model_parallel_size']}, this run uses {state.tp_size} (resume at the saved "
            "size; the policy alone loads at any size through init_from=<step>/actor/policy)"
        )
    pp_saved = saved.get("pipeline_model_parallel_size", 1)
    if pp_saved != state.pp_size:
        out.append(
            f"parallel.pipeline_model_parallel_size: the checkpoint's optimizer state is sharded for "
            f"{pp_saved} stage(s), this run uses {state.pp_size} (resume at the saved size; the policy alone "
            "loads at any size through init_from=<step>/actor/policy)"
        )
    adv_saved = (saved.get("config") or {}).get("ppo", {}).get("advantage", "gae")
    if _critic_free(adv_saved) != _critic_free(cfg.ppo.advantage):
        has = lambda a: "without a critic" if _critic_free(a) else "with a critic"  # noqa: E731
        out.append(
            f"ppo.advantage: the checkpoint was made by a run {has(adv_saved)} (ppo.advantage={adv_saved!r}), "
            f"this run is one {has(cfg.ppo.advantage)} (ppo.advantage={cfg.ppo.advantage!r}); resume with "
            f"ppo.advantage={adv_saved!r}, or start fresh"
        )
    n_saved, n_now = saved.get("trainable_last_n_layers"), cfg.optim.trainable_last_n_layers
    if n_saved != n_now:
        out.append(f"optim.trainable_last_n_layers: checkpoint {n_saved}, config {n_now}")
    lora_saved, lora_now = saved.get("lora") or LoraConfig().to_dict(), cfg.lora.to_dict()
    for key in ("rank", "alpha", "targets"):  # what the adapters' tensors and their scale depend on
        if lora_saved.get(key) != lora_now[key]:
            out.append(f"lora.{key}: checkpoint {lora_saved.get(key)!r}, config {lora_now[key]!r}")
    if saved["precision"] != precision:
        out.append(
            f"precision: the checkpoint was trained in {saved['precision']}, this run computes in {precision} "
            f"(set precision={saved['precision']})"
        )
    return out


def _critic_free(advantage: str) -> bool:
    return advantage in CRITIC_FREE_ESTIMATORS


class ActorCheckpointer:
    """Saves and restores one run's actor state; asks the server to do the same for the critic.

    Collective: every method that touches files is called on every rank."""

    def __init__(
        self,
        cfg: ActorConfig,
        state: ParallelState,
        critic: CriticHandle,
        tokenizer: Tokenizer,
        *,
        reference_fingerprint: str | None = None,
        print_fn: Callable[..., None] = print,
    ) -> None:
        self.cfg, self.state, self.critic, self.tokenizer = cfg, state, critic, tokenizer
        self.root = checkpoint_root(cfg)
        self.critic_free = _critic_free(cfg.ppo.advantage)
        """A run without a critic: the server holds nothing of it, and is neither saved nor loaded."""
        self.reference_fingerprint = reference_fingerprint
        self.print_fn = print_fn if state.rank == 0 else None
        self.last_saved = -1
        self.abandoned: set[int] = set()
        """Actor steps after the one last loaded (rank 0): the continuation given up, removed at
        the next save."""
        self.run_id: str | None = None
        """The run's id (:mod:`aligner.actor.fingerprint`), recorded in every checkpoint: drawn at a
        fresh start, the checkpoint's on a resume (None: one from before run ids)."""
        if state.rank == 0:
            clean_leftovers_at_start(self.root, ROLE, log)  # of saves killed before this start
        self.exporter: Any = None
        """The policy's exports (:class:`aligner.actor.export.PolicyExporter`), told of every step
        after its checkpoint: ``exporter.after_step(step, metrics, new_best)``; None: no exports."""
        self.best: dict[str, Any] | None = None  # {"step", "validation/scores"}
        best_file = self.root / "best.json"
        if best_file.is_file():
            try:
                self.best = _best(read_json(best_file))
            except CheckpointError:
                self.best = None

    def say(self, msg: str) -> None:
        """``msg`` to the log, and to the console on rank 0."""
        log.info(msg)
        if self.print_fn is not None:
            self.print_fn(msg, flush=True)

    # -- save --------------------------------------------------------------------------------------

    def after_step(
        self, step: int, metrics: dict[str, float], actor_state: Callable[[], ActorState], *, last: bool
    ) -> None:
        """After step ``step``: save when the interval says so, at the end, or (``keep_best``) at a
        new best validation; then the :attr:`exporter`'s exports of the step. ``actor_state`` is
        called only to save."""
        c = self.cfg.checkpoint
        new_best = (
            c.keep_best
            and BEST_KEY in metrics
            and (self.best is None or metrics[BEST_KEY] > float(self.best[BEST_KEY]))
        )
        due = (c.save_interval and step % c.save_interval == 0) or (last and c.save_at_end) or new_best
        if new_best:
            self.best = {"step": step, BEST_KEY: float(metrics[BEST_KEY])}
        if due and self.last_saved != step:
            self.save(actor_state())
        if new_best and self.state.rank == 0:
            self._write_best()
            self.say(
                f"new best validation score {self.best[BEST_KEY]:.4f} at step {step}: {self.root / 'best'}"
            )
        if self.exporter is not None:
            self.exporter.after_step(step, metrics, bool(new_best))

    def save(self, state: ActorState) -> Path:
        """Both roles' checkpoints of ``state.step`` (the critic's by the server). Returns the
        actor's folder."""
        step, st = state.step, self.state
        faults.ACTOR.hit("before_critic_save", step)
        # A timeout or a restarted server raises here, on every rank, before anything of this
        # step is written: the previous checkpoints stay as they were.
        if not self.critic_free:  # a critic-free run has nothing on the server to save
            if st.rank == 0 and step in self.abandoned:
                # The given-up continuation's actor half of this step goes before the server
                # writes the new critic half: a kill between the two commits leaves no pair.
                shutil.rmtree(self.root / step_dir_name(step) / ROLE, ignore_errors=True)
            self._on_rank0(f"critic_save of step {step}", lambda: self.critic.save(step))
        faults.ACTOR.hit("after_critic_save", step)
        step_dir = self.root / step_dir_name(step)
        final, tmp = step_dir / ROLE, step_dir / _TMP
        if st.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
            tmp.mkdir(parents=True)
        barrier()
        if lora_config_of(state.policy) is not None:
            # LoRA: the adapters (their fp32 masters) and the digest of the frozen base they adapt.
            base = weights_fingerprint(state.policy, st)
            save_lora_adapter(
                state.policy, tmp / LORA_DIR, optimizer=state.optimizer, meta={"base_fingerprint": base}
            )
        else:
            save_model_checkpoint(state.policy, self.cfg.model, tmp / "policy", role="policy")
        faults.ACTOR.hit("mid_actor_write", step)
        if st.dp_rank == 0:  # fp32 master weights (bf16), Adam moments and step counts, whole
            tensors, meta = state.optimizer.state_tensors()
            save_tensors(tmp / self._optim_file(), tensors)
            write_json(tmp / self._optim_file(".json"), meta)
        elif state.optimizer.sharded:  # its part of gathering them from every replica's slice
            state.optimizer.state_tensors(keep=False)
        save_tensors(tmp / self._rng_file(), rng_state_tensors())
        if st.rank == 0 and state.rollouts:
            save_tensors(tmp / ROLLOUTS_FILE, state.rollouts)
        barrier()
        faults.ACTOR.hit("before_commit", step)
        if st.rank == 0:
            write_json(tmp / "trainer_state.json", self._state_json(state))
            commit_directory(tmp, final, {"step": step, "role": ROLE})
        barrier()
        self.last_saved = step
        faults.ACTOR.hit("after_commit", step)
        if st.rank == 0:
            self._prune()
        self.say(f"saved checkpoint step {step}: {final}")
        return final

    def _optim_file(self, suffix: str = ".safetensors") -> str:
        """This rank's optimizer shard (one per tensor/pipeline-parallel rank)."""
        return shard_file("optim", tp=self.state.tp_rank, pp=self.state.pp_rank, suffix=suffix)

    def _rng_file(self) -> str:
        """This rank's random states (one per rank)."""
        st = self.state
        return shard_file("rng", tp=st.tp_rank, pp=st.pp_rank, dp=st.dp_rank)

    def _state_json(self, state: ActorState) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        config = config_dict(cfg)
        return {
            "format_version": FORMAT_VERSION,
            "role": ROLE,
            "trainer": state.training,
            "best": self.best,
            "config": config,
            "config_fingerprint": config_fingerprint(config),  # checked by checkpoint.resume=auto
            "run_id": self.run_id,
            "model_config": cfg.model.to_dict(),
            "tokenizer": cfg.tokenizer,
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "tensor_model_parallel_size": st.tp_size,
            "pipeline_model_parallel_size": st.pp_size,
            "data_parallel_size": st.dp_size,
            "world_size": st.world_size,
            "trainable_last_n_layers": cfg.optim.trainable_last_n_layers,
            "lora": cfg.lora.to_dict(),
            "precision": state.precision,
            "reference_fingerprint": self.reference_fingerprint,
            "critic_url": self.critic.url,
        }

    def _write_best(self) -> None:
        """``best.json`` and the ``best`` link (to the step folder), or neither when there is no best."""
        link, tmp_link = self.root / "best", self.root / ".best.tmp"
        for p in (tmp_link,) if self.best else (tmp_link, link, self.root / "best.json"):
            if p.is_symlink() or p.exists():
                p.unlink()
        if not self.best:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(self.root / "best.json", self.best)
        os.symlink(step_dir_name(int(self.best["step"])), tmp_link)
        os.replace(tmp_link, link)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` steps up to the one just saved, and the best; remove the
        :attr:`abandoned` steps after it, and no other (see :func:`prune_checkpoints`)."""
        protect = {int(self.best["step"])} if self.best else set()
        removed = prune_checkpoints(
            self.root, ROLE, self.last_saved, self.cfg.checkpoint.keep_last, protect, abandoned=self.abandoned
        )
        self.abandoned = {s for s in self.abandoned if s > self.last_saved} - set(removed)

    # -- load --------------------------------------------------------------------------------------

    def load(self, state: ActorState, step_dir: Path) -> dict[str, Any]:
        """Restore the policy and optimizer of ``state`` in place from ``step_dir``, and the
        server's critic from the same step; returns the saved training state for the trainer to
        apply (``PPOTrainer.load_training_state``). Everything is checked before anything
        changes. Random states come back when the process layout is the checkpoint's; device
        states that do not fit this process (a GPU's generators on a CPU) are left out with a
        warning."""
        st = self.state
        d = Path(step_dir) / ROLE
        saved = read_json(d / "trainer_state.json")
        if saved.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{d / 'trainer_state.json'}: format_version={saved.get('format_version')!r}, expected "
                f"{FORMAT_VERSION}"
            )
        problems = config_differences(saved, self.cfg, st, self.tokenizer, state.precision)
        ref = saved.get("reference_fingerprint")
        if ref is not None and self.reference_fingerprint is not None and ref != self.reference_fingerprint:
            problems.append(
                "reference model: its weights differ from the ones the checkpoint was trained against "
                "(init_from or seed changed?)"
            )
        lora = lora_config_of(state.policy) is not None
        if lora and (d / LORA_DIR / "adapter.json").is_file():  # else: lora.rank differs, listed above
            # The adapters were trained on a base model: only the same base continues them.
            base = read_json(d / LORA_DIR / "adapter.json").get("base_fingerprint")
            if base != weights_fingerprint(state.policy, st):
                problems.append(
                    f"LoRA base model: the frozen base weights differ from the ones the adapters in "
                    f"{d / LORA_DIR} were trained on (fingerprint {base}; init_from or seed changed?)"
                )
        if problems:
            raise CheckpointError(f"cannot resume from {d}:\n  " + "\n  ".join(problems))
        step = int(saved["trainer"]["step"])
        optim_t = load_tensors(d / self._optim_file())
        optim_meta = read_json(d / self._optim_file(".json"))
        rng_file = d / self._rng_file()
        same_layout = saved["world_size"] == st.world_size and saved["data_parallel_size"] == st.dp_size
        rng = load_tensors(rng_file) if same_layout else None
        if rng is not None:  # checked before anything is applied
            try:
                rng, rng_note = rng_to_restore(rng, rng_state_tensors(), str(rng_file))
            except CheckpointError as e:
                raise CheckpointError(f"cannot resume from {d}: {e}") from e
            if rng_note:  # device states saved on another kind of device: left out
                log.warning("%s", rng_note)

        problems = state.optimizer.state_problems(optim_t, optim_meta)
        if problems:
            raise CheckpointError(f"cannot resume from {d}: optimizer state: " + "; ".join(problems))

        if lora:
            load_lora_adapter(state.policy, d / LORA_DIR)
        else:
            load_model_checkpoint(state.policy, d / "policy")
        state.optimizer.load_state_tensors(optim_t, optim_meta)  # masters, then bf16 weights from them
        _apply_current_hyperparameters(state.optimizer, self.cfg.optim)
        if rng is not None:
            restore_rng_state(rng)
        else:
            self.say(
                f"the checkpoint was made with {saved['world_size']} rank(s) (DP={saved['data_parallel_size']}), "
                f"this run has {st.world_size} (DP={st.dp_size}): random states are not restored"
            )
        self.best = _best(saved.get("best"))
        if st.rank == 0:
            later = [s for s in complete_steps(self.root, role=ROLE) if s > step]
            self.abandoned = set(later)
            if later:
                self.say(
                    f"actor checkpoints after step {step} ({later}) belong to the abandoned continuation of "
                    "this run; they are removed at the next save"
                )
            self._write_best()
        barrier()
        if not self.critic_free:  # a critic-free run has nothing on the server to load
            self._on_rank0(f"critic_load of step {step}", lambda: self.critic.load(step))
        self.last_saved = step
        trainer = dict(saved["trainer"])
        if (d / ROLLOUTS_FILE).is_file():
            trainer["rollout_tensors"] = load_tensors(d / ROLLOUTS_FILE)
        return trainer

    def _on_rank0(self, what: str, fn: Callable[[], None]) -> None:
        """``fn()`` on rank 0 (a request to the server), and its outcome on every rank: rank 0
        raises its own error, the others the same CriticRestartedError, or a CheckpointError
        naming ``what``."""
        on_rank0(
            fn,
            carried=(CriticRestartedError,),
            wrap=lambda e: CheckpointError(f"{what} failed on rank 0: {e}"),
        )


def _apply_current_hyperparameters(optimizer: torch.optim.Optimizer, o: PolicyOptimConfig) -> None:
    """Loaded param groups carry the old run's settings; this run's config wins (the LR is set
    from the schedule when the trainer applies its training state)."""
    for g in optimizer.param_groups:
        g["betas"] = (o.adam_beta1, o.adam_beta2)
        g["eps"] = o.adam_eps
        g["weight_decay"] = o.weight_decay
        g["initial_lr"] = o.lr
        g["lr"] = o.lr


BEST_KEY = "validation/scores"
"""The metric a best checkpoint is chosen by, and its key in ``best.json``."""


def _best(best: dict[str, Any] | None) -> dict[str, Any] | None:
    """A saved best record, its score under :data:`BEST_KEY` (a checkpoint written before the
    metric's rename holds it under ``val/scores``)."""
    if best is not None and BEST_KEY not in best and "val/scores" in best:
        best = {"step": best["step"], BEST_KEY: best["val/scores"]}
    return best
