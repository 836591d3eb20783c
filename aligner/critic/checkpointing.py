"""The critic's checkpoints: save, prune, read and apply, and the shard exchange with TP peers.

The rules that keep every step a request did not name (docs/design.md, "Checkpoints"):

- A save writes the weights the server holds, so it is labelled with their step: ``critic_save(N)``
  is refused unless the server holds critic step N (:meth:`CriticCheckpoints.check_save`; the
  initial critic, held as -1 before any train or load, saves as step 0). It replaces only its own
  step's older copy.
- Pruning after a save of N removes this role's steps older than the newest ``keep_last`` up to
  N (never step 0), and the steps after N only when the server loaded an earlier step since they
  were written (they are the continuation the run gave up: :attr:`CriticCheckpoints.abandoned`).
- At start-up, the leftovers of saves that were killed are cleaned, and a step whose only
  complete copy was moved aside mid-commit is renamed back (:meth:`CriticCheckpoints.clean_leftovers`).

One step's folder, ``<checkpoint.dir>/step_XXXXXXXX/critic/`` (docs/design.md, "Checkpoints"),
with one file of each kind per TP rank ``r``, named by :func:`aligner.checkpoint.shard_file`::

    meta.json                      role, step, architecture, TP size, optimizer layout, and the
                                   service's bookkeeping (critic step, kept train results, ...)
    model_tp{r}_pp00.safetensors   rank r's fp32 (master) weights
    optim_tp{r}_pp00.safetensors   rank r's optimizer state
    rng_tp{r}_pp00.safetensors     rank r's random-number states
    complete.json                  written last: the folder counts only with it

Rank 0 alone writes: the TP peers of its replica send their shards point to point (every TP
shard of a Megatron layer has the same shape, so rank 0 knows what to receive). On load rank 0
reads and checks every TP rank's shards before it sends anything, so a bad checkpoint changes
nothing on any rank.

Data-parallel replicas hold the same weights and optimizer state (every replica takes the same
step, :mod:`aligner.critic.replicas`), so a checkpoint is replica 0's TP shards, written once,
and loads at any ``parallel.data_parallel_size``: rank 0 sends TP shard ``t`` to TP rank ``t``
of every replica. With ``optim.use_distributed_optimizer`` each replica holds a slice of the
masters and moments: a save first gathers them over the replicas (every rank takes part), so
the files are the same as without it, and a load hands every replica the whole state, of which
it keeps its slice. Random states are replica 0's too, and every replica takes them on load (they
feed only dropout, which the fused forward does not have). ``meta.json`` records the DP size it
was saved at, for the record; loading does not require it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aligner import faults
from aligner.checkpoint import (
    CheckpointError,
    atomic_directory,
    clean_leftovers_at_start,
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
from aligner.critic.errors import CriticServiceError
from aligner.critic.peers import PeerLink
from aligner.critic.replicas import Layout
from aligner.distributed import ParallelState, recv_json, send_json
from aligner.models.config import ModelConfig
from aligner.models.gpt import tensor_state_dict
from aligner.precision import load_master_state_dict, master_state_dict
from aligner.wire.protocol import LOAD, SAVE, ProtocolError

__all__ = ["CriticCheckpoints", "LoadedCheckpoint", "ROLE", "SHARD_KINDS"]

log = logging.getLogger("aligner.critic")

ROLE = "critic"
"""Sub-directory of each ``step_XXXXXXXX`` checkpoint directory the critic writes."""
SHARD_KINDS = ("model", "optim", "rng")
"""The per-rank files of a step, in the order they travel between ranks."""

Shards = dict[str, dict[str, torch.Tensor]]
"""One rank's tensors by kind (:data:`SHARD_KINDS`) and name."""


def _hash_keys(tensors: dict[str, torch.Tensor]) -> int:
    """A fingerprint of names, shapes and dtypes (what ranks compare before sending tensors)."""
    blob = ";".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(tensors.items()))
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:7], "big")


@dataclass
class LoadedCheckpoint:
    """A checked step, ready to apply.

    Attributes:
        meta: the step's ``meta.json``.
        shards: on rank 0 every TP rank's shards (index = TP rank); on another rank its own
            TP rank's alone.
    """

    meta: dict[str, Any]
    shards: list[Shards]


class CriticCheckpoints:
    """The checkpoints of one critic (this rank's ``critic`` shard and its ``optimizer``).

    Rank 0 calls :meth:`save`, :meth:`read` and :meth:`apply`; after rank 0 broadcast the
    operation, every other rank calls :meth:`send_shards` (save: a no-op outside replica 0) or
    :meth:`receive` then :meth:`apply` (load). ``layout`` places every global rank.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int,
        critic: torch.nn.Module,
        optimizer: Any,
        model_cfg: ModelConfig,
        state: ParallelState,
        peers: PeerLink,
        layout: Layout | None = None,
    ) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.critic = critic
        self.optimizer = optimizer
        self.model_cfg = model_cfg
        self.state = state
        self.peers = peers
        self.layout = layout or Layout((0,), (0,))
        self.last_saved = -1
        """The step last saved or loaded; -1 before either."""
        self.abandoned: set[int] = set()
        """Steps after the one last loaded that were on disk when it was loaded (rank 0): the
        continuation the run gave up, removed by the next save (the rule above)."""

    def steps(self) -> list[int]:
        """Steps with a complete critic checkpoint, ascending."""
        return complete_steps(self.root, role=ROLE)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def clean_leftovers(self) -> None:
        """Remove the leftovers of critic saves that were killed, and rename back a step's only
        complete copy that a commit had moved aside (rank 0, at start-up: see
        :func:`aligner.checkpoint.clean_leftovers`). A failure is logged: the checkpoints are what
        they were."""
        clean_leftovers_at_start(self.root, ROLE, log)

    # -- save -----------------------------------------------------------------------------------

    @staticmethod
    def check_save(step: int, held: int) -> None:
        """A save of ``step`` by a server that holds critic step ``held`` writes ``held``'s weights,
        so ``step`` must be ``held`` (0 for the initial critic, held as -1 before any train or
        load); anything else would put another step's weights under ``step`` and prune the steps
        after it.

        Raises:
            ProtocolError: on the field ``step``, with nothing written.
        """
        if step == held or (held == -1 and step == 0):
            return
        initial = " (or 0: the initial critic, before any train or load)" if held == -1 else ""
        raise ProtocolError(
            SAVE,
            "step",
            f"step={held}{initial}, the critic step this server holds: a save writes the weights it "
            f"holds, under their own step (to go back to step {step}, critic_load it)",
            f"step={step}",
        )

    def _local_shards(self) -> Shards:
        """This rank's shards of a save: collective over the replicas when the optimizer is
        sharded (replica 0 gathers its state, the others' :meth:`send_shards` take part)."""
        optim_tensors, _ = self.optimizer.state_tensors()
        masters = [optim_tensors[f"master.{i}"] for i in range(len(self.optimizer.model_params))]
        return {
            # The fp32 master weights under bf16: the checkpoint holds the truth, not its rounding.
            "model": master_state_dict(self.critic, self.optimizer, masters),
            "optim": optim_tensors,
            # Every RNG state of this rank (dropout draws from torch's and Megatron's tracker).
            "rng": rng_state_tensors(),
        }

    def _meta(self, step: int) -> dict[str, Any]:
        optim_meta = self.optimizer.state_meta()
        return {
            "role": ROLE,
            "step": step,
            "model_config": self.model_cfg.to_dict(),
            "tensor_model_parallel_size": self.state.tp_size,
            "pipeline_model_parallel_size": 1,
            "data_parallel_size": self.state.dp_size,
            "optimizer": optim_meta,
            "saved_at": time.time(),
        }

    def save(self, step: int, bookkeeping: dict[str, Any]) -> Path:
        """Write ``step`` with every rank's shards (rank 0; the peers run :meth:`send_shards`),
        ``bookkeeping`` added to its ``meta.json``; then prune. Returns the folder."""
        t0 = time.perf_counter()
        shards = [self._local_shards()]
        for tp in range(1, self.state.tp_size):
            shards.append(self._recv_peer_shards(self.layout.rank(0, tp), shards[0]))
        final = self.root / step_dir_name(step) / ROLE
        meta = {**bookkeeping, **self._meta(step)}
        with atomic_directory(final, marker={"step": step, "role": ROLE}) as tmp:
            for r, sh in enumerate(shards):
                for kind, tensors in sh.items():
                    save_tensors(tmp / shard_file(kind, tp=r), tensors)
            write_json(tmp / "meta.json", meta)
            faults.SERVER.hit("save", step)  # tests only: a crash before the commit (aligner.faults)
        self.last_saved = step
        self._prune(step)
        log.info("saved critic checkpoint %s (%.0f ms)", final, 1000 * (time.perf_counter() - t0))
        return final

    def _prune(self, saved: int) -> None:
        """This role's sub-directories beyond the newest keep_last up to ``saved``, and the
        :attr:`abandoned` ones after it (see :func:`aligner.checkpoint.prune_checkpoints`); never
        another step after it. Step 0, the initial critic (checkpoint.save_initial), is the reset
        point of fresh runs: never pruned, and saving it prunes nothing."""
        if saved <= 0:
            return
        removed = prune_checkpoints(
            self.root, ROLE, saved, self.keep_last, protect={0}, abandoned=self.abandoned
        )
        later = [s for s in removed if s > saved]
        if later:
            log.info(
                "removed critic steps %s: the continuation given up when an earlier step was loaded", later
            )
        # Those up to `saved` are old steps now (keep_last's); those after it are gone.
        self.abandoned = {s for s in self.abandoned if s > saved} - set(removed)

    def send_shards(self) -> None:
        """A peer's part of a save: its shards to rank 0, each kind after its fingerprint; a rank
        of another replica than rank 0's sends nothing (its shards are the same), but takes part
        in gathering a sharded optimizer's state."""
        if self.state.dp_rank != 0:
            if self.optimizer.sharded:  # its part of gathering the state to replica 0
                self.optimizer.state_tensors(keep=False)
            return
        shards = self._local_shards()
        for kind in sorted(shards):
            tensors = shards[kind]
            self.peers.send(torch.tensor([len(tensors), _hash_keys(tensors)], dtype=torch.int64), 0)
            for k in sorted(tensors):
                self.peers.send(tensors[k], 0)

    def _recv_peer_shards(self, peer: int, like: Shards) -> Shards:
        out: Shards = {}
        for kind in sorted(like):
            own = like[kind]
            head = self.peers.recv((2,), torch.int64, peer)
            if int(head[0]) != len(own) or int(head[1]) != _hash_keys(own):
                raise CriticServiceError(
                    f"rank {peer} holds different {kind} tensors than rank 0; cannot save"
                )
            out[kind] = {}
            for k in sorted(own):
                out[kind][k] = self.peers.recv(tuple(own[k].shape), own[k].dtype, peer)
        return out

    # -- load -----------------------------------------------------------------------------------

    def read(self, step: int) -> LoadedCheckpoint:
        """Read and check every rank's shards of ``step`` (rank 0); raises before anything is
        applied.

        Raises:
            ProtocolError: no complete critic checkpoint of ``step``.
            CriticServiceError: it is unreadable or does not fit this critic.
        """
        d = self.root / step_dir_name(step) / ROLE
        if step not in self.steps():
            raise ProtocolError(
                LOAD,
                "step",
                f"a step with a complete critic checkpoint (have {self.steps()})",
                f"step={step}",
            )
        tp = self.state.tp_size
        try:
            meta = read_json(d / "meta.json")
            if meta.get("tensor_model_parallel_size") != tp:
                raise CheckpointError(
                    f"checkpoint {d} was saved at tensor_model_parallel_size="
                    f"{meta.get('tensor_model_parallel_size')}, this server runs {tp}"
                )
            diff = ModelConfig.from_dict(meta["model_config"]).architecture_diff(self.model_cfg)
            if diff:
                raise CheckpointError(
                    f"checkpoint {d} holds a different critic architecture: {'; '.join(diff)}"
                )
            own_rng = rng_state_tensors()  # what this process's random states look like
            shards = []
            for r in range(tp):
                sh = {kind: load_tensors(d / shard_file(kind, tp=r)) for kind in SHARD_KINDS}
                want, got = tensor_state_dict(self.critic), sh["model"]
                bad = sorted(set(want) ^ set(got)) + [
                    k for k in want if k in got and want[k].shape != got[k].shape
                ]
                if bad:
                    raise CheckpointError(
                        f"checkpoint {d} rank {r}: model tensors do not match the critic: {bad[:8]}"
                    )
                problems = self.optimizer.state_problems(sh["optim"], meta["optimizer"])
                if problems:
                    raise CheckpointError(
                        f"checkpoint {d} rank {r}: optimizer state does not match the critic's "
                        f"parameters: {'; '.join(problems)}"
                    )
                sh["rng"], note = rng_to_restore(sh["rng"], own_rng, f"checkpoint {d} rank {r}")
                if note:
                    log.warning("%s", note)
                shards.append(sh)
        except CheckpointError as e:
            raise CriticServiceError(f"cannot load critic step {step}: {e}") from e
        return LoadedCheckpoint(meta, shards)

    def apply(self, loaded: LoadedCheckpoint) -> dict[str, Any]:
        """Load the weights, optimizer state and RNG states of ``loaded`` on this rank; rank 0
        first sends every other rank its TP rank's shards (they take them in :meth:`receive`).
        Returns the meta."""
        meta = loaded.meta
        if self.state.rank == 0:
            for peer in range(1, self.state.world_size):
                self._send_loaded(peer, meta, loaded.shards[self.layout.tp_rank[peer]])
        mine = loaded.shards[0]
        self.optimizer.load_state_tensors(mine["optim"], meta["optimizer"])
        # The model file holds fp32 weights (the masters) whatever the precision it was saved in.
        load_master_state_dict(self.critic, self.optimizer, mine["model"], what="critic checkpoint")
        restore_rng_state(mine["rng"])  # what read()'s rng_to_restore kept
        self.last_saved = int(meta["step"])
        if self.state.rank == 0:  # steps after it on disk: the continuation given up (a rollback)
            self.abandoned = {s for s in self.steps() if s > self.last_saved}
            if self.abandoned:
                log.info(
                    "loaded critic step %d: steps %s belong to the continuation given up; they are "
                    "removed at the next save",
                    self.last_saved,
                    sorted(self.abandoned),
                )
        return meta

    def _send_loaded(self, peer: int, meta: dict[str, Any], shard: Shards) -> None:
        send_json(meta, peer)
        for kind in SHARD_KINDS:
            tensors = shard[kind]
            send_json(
                [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sorted(tensors.items())],
                peer,
            )
            for k in sorted(tensors):
                self.peers.send(tensors[k], peer)

    def receive(self) -> LoadedCheckpoint:
        """A peer's part of a load: the meta and its own shards, as rank 0's :meth:`apply` sends them."""
        meta = recv_json(0)
        shards: Shards = {}
        for kind in SHARD_KINDS:
            shards[kind] = {
                name: self.peers.recv(tuple(shape), getattr(torch, dtype), 0)
                for name, shape, dtype in recv_json(0)
            }
        return LoadedCheckpoint(meta, [shards])
