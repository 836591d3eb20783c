"""The rollout worker: a native generation engine in a process of its own that joins a trainer's
channels (:mod:`aligner.generation.remote`), takes its weights by version, generates the batches
the trainer asks for and sends them back with the version that generated them.

    aligner-rollout <the actor's overrides> rollout.workers=2 rollout.worker_rank=1
    python -m aligner.rollout.worker ...                    # the same

    torchrun --nproc-per-node 2 -m aligner.rollout.worker ... rollout.tensor_parallel_size=2

A worker of ``rollout.tensor_parallel_size`` = g > 1 processes generates tensor-parallel: its rank
0 alone joins the trainer's channels and relays what its peers need over the worker's own world
(:mod:`aligner.rollout.relay`). With ``rollout.score_on_workers`` it also asks the server for the
scores of each batch it generated, and with GAE the critic's values (:mod:`aligner.rollout.scoring`).
Its commands are read as they come by a thread of their own (:mod:`aligner.rollout.mailbox`);
with ``rollout.partial`` a version pushed while it generates is taken at the next token
boundary (the engine's ``between_steps``), and the batch reports its swaps.

It reads the actor's config (``actor.yaml``, the same overrides as the trainer's): the model and
tokenizer it serves, the generation settings, ``rollout.*``. It builds the policy's architecture
with random weights, then generates only from versions the trainer pushed (version 0 before the
first batch), each verified whole before it is swapped in. It exits when the trainer says stop
(0), or with an error when the trainer goes away or a version is refused (1). Started once the run
is under way (a replacement for a lost worker, e.g. a retried pod), it asks the trainer to join
and is admitted at the trainer's next push, with ``rollout.on_worker_loss=continue``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from aligner import distributed, faults
from aligner.actor.config import ActorConfig
from aligner.actor.model_source import model_keys_named, resolve_model_config
from aligner.actor.run import build_engine  # (also registers the config's schema, actor_schema)
from aligner.config_checks import ConfigError, Problems
from aligner.distributed import ParallelConfig
from aligner.generation.engine import GenerationOutput
from aligner.generation.native import NativeEngine
from aligner.generation.remote import (
    RolloutLinks,
    ask_to_join,
    decode_prompts,
    encode_output,
    run_under_way,
    sampling_from,
    worker_identity,
)
from aligner.generation.weight_push import WeightPushError, WeightReceiver, receive_into
from aligner.models import gpt
from aligner.peer_group import open_store, send_message
from aligner.precision import precision_dtype, resolve_precision
from aligner.rollout.mailbox import Mailbox
from aligner.rollout.relay import Relay
from aligner.rollout.scoring import WorkerScorer
from aligner.tokenizers import build_tokenizer, resolve_tokenizer_spec

__all__ = ["RolloutWorker", "main", "serve", "worker_problems"]


def worker_problems(cfg: ActorConfig, vocab_size: int) -> Problems:
    """What a worker uses of the actor's config, checked: the model, generation, precision and
    ``rollout`` sections (not the data, the critic's address or its files, nor the trainer's
    layout: a worker is its own processes, on a machine that may not hold the trainer's files)."""
    e = cfg.served_problems(vocab_size, tp=cfg.rollout.tensor_parallel_size)
    e += cfg.rollout_problems()  # += keeps it a Problems (a + makes a plain list)
    g, world = cfg.rollout.tensor_parallel_size, int(os.environ.get("WORLD_SIZE", "1"))
    e.expect(
        world == g,
        "rollout.tensor_parallel_size",
        g,
        f"the worker's number of processes ({world}, WORLD_SIZE): start a worker of g processes with "
        "torchrun --nproc-per-node g",
    )
    return e


class RolloutWorker:
    """One worker's engine and its end of the channels."""

    def __init__(self, cfg: ActorConfig, model_keys: set[str] | None = None) -> None:
        r = cfg.rollout
        if not 1 <= r.worker_rank <= r.workers:
            raise ValueError(
                f"rollout.worker_rank={r.worker_rank}: expected 1..rollout.workers ({r.workers})"
            )
        cfg.model, _ = resolve_model_config(cfg.model, cfg.init_from, model_keys or ())
        cfg.tokenizer = resolve_tokenizer_spec(cfg.tokenizer, cfg.init_from)
        self.tokenizer = build_tokenizer(cfg.tokenizer, cfg.init_from)
        worker_problems(cfg, self.tokenizer.vocab_size).raise_if_any("rollout worker config", ConfigError)
        self.cfg, self.rank = cfg, r.worker_rank
        # A world of its own (its tensor-parallel processes); its lead joins the trainer's groups
        # through the store. The peers wait in the world's broadcasts as long as the lead may
        # wait for the trainer's next command.
        g = r.tensor_parallel_size
        parallel = ParallelConfig(
            tensor_model_parallel_size=g, backend=cfg.parallel.backend, timeout_s=r.timeout_s
        )
        self.state = distributed.initialize(parallel, seed=cfg.seed)
        self.relay = Relay(self.state.device) if g > 1 else None
        self.lead = self.relay is None or self.relay.lead
        """Rank 0 of the worker: the one the trainer sees (the others follow it)."""
        self.precision = resolve_precision(cfg.precision, self.state.device)
        dtype = precision_dtype(self.precision)
        # The architecture only: every weight the engine uses comes from a pushed version.
        self.policy = gpt.build_policy(cfg.model, params_dtype=dtype).to(self.state.device).eval()
        self.policy.requires_grad_(False)
        # The native engine, or TensorRT-LLM refitted from the policy module at each version
        # (its files in a folder of this worker's under the run dir).
        workdir = os.path.join(cfg.logging.run_dir, f"rollout_{r.worker_rank}")
        self.engine = build_engine(cfg, self.policy, self.tokenizer, self.state, workdir=workdir)
        backend = r.weights_backend
        if backend == "auto":
            backend = "nccl" if self.state.device.type == "cuda" else "gloo"
        self.backend = backend
        self.identity = worker_identity(cfg.model, self.tokenizer, self.precision)
        self.version: int | None = None
        self.swaps: list[list[int]] = []
        """The last batch's swaps (``rollout.partial``): ``[k, version]``, response tokens ``k`` on
        generated by ``version``."""
        self.late = False
        self.scorer: WorkerScorer | None = None
        if not self.lead:
            return
        self.start_error: str | None = None
        """Why it cannot serve, told to the trainer in place of its hello (at the run's start)."""
        if r.score_on_workers:  # the stops the trainer cuts response texts at (Trainer._reward_inputs)
            stops = (*self.engine.stop_ids, *cfg.generation.stop_token_ids)
            try:
                self.scorer = WorkerScorer(cfg, self.tokenizer, stops)
            except Exception as e:  # the trainer stops at once, naming it, instead of waiting for it
                self.start_error = (
                    f"cannot score its batches (rollout.score_on_workers): {type(e).__name__}: {e}"
                )
        store = open_store(r.address, r.workers + 1, False, r.timeout_s)
        if self.start_error is not None and run_under_way(store):
            raise RuntimeError(self.start_error)  # a replacement that cannot serve never asks to join
        joined = ask_to_join(store, self.rank, self.identity, r.timeout_s, say=self.say)
        self.late = joined is not None
        """It joined the run under way, in place of a worker the trainer lost (no hello: the
        trainer checked what it serves with its request)."""
        if joined is None:  # the run's start: every worker meets the trainer in epoch 0
            self.links = RolloutLinks(r, self.rank, backend, store=store)
        else:
            self.links = RolloutLinks(
                r, joined["rank"], backend, epoch=joined["epoch"], workers=joined["workers"], store=store
            )
        self.retired: list[RolloutLinks] = []
        """Channels of earlier epochs (kept: a group is not torn down under a peer that died)."""
        self.receiver = WeightReceiver(self.links.weights, src=0)
        self.mailbox = Mailbox(self.links)

    def say(self, msg: str) -> None:
        print(f"[rollout {self.rank}] {msg}", flush=True)

    def _send(self, meta: dict[str, Any], tensors: dict | None = None) -> None:
        send_message(self.links.rollouts, 0, meta, tensors)

    def serve(self) -> int:
        """Answer the trainer's commands until it says stop (the lead; its peers follow it).
        Returns the exit status."""
        if not self.lead:
            return self._follow()
        status = self._serve()
        if self.relay is not None:  # at a command's boundary: the peers wait for the next one
            self.relay.message({"op": "exit", "status": status})
        return status

    def _follow(self) -> int:
        """A peer of a worker of several processes: what the lead relays, until it exits."""
        while True:
            meta, tensors = self.relay.message()
            op = meta.get("op")
            if op == "exit":
                return int(meta["status"])
            if op == "weights":
                self.relay.load(self.policy, meta["tensors"])
                self.engine.refit(self.policy)
            elif op == "generate":
                try:
                    self._generate(meta, tensors)
                except _Exit as e:  # the lead stopped mid-batch (a version it refused)
                    return e.status
            else:
                raise RuntimeError(f"the worker's lead relayed an unknown command {op!r}")

    def _generate(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> GenerationOutput:
        """An ask's batch, drawn with the random streams of the trainer rank whose rows these are;
        with ``rollout.partial``, taking a version pushed meanwhile between decode steps
        (:attr:`swaps`)."""
        rank = int(meta.get("rank", 0))
        if isinstance(self.engine, NativeEngine):
            self.engine.seed_rank = rank
        else:  # TensorRT-LLM: each request's seed is (seed, rank, row)
            self.engine.dp_rank = rank
        self.swaps = []
        prompts, sampling = decode_prompts(tensors), sampling_from(meta["sampling"])
        if not self.cfg.rollout.partial:
            return self.engine.generate(prompts, sampling)
        return self.engine.generate(prompts, sampling, between_steps=self._between_steps)

    def _between_steps(self, k: int) -> bool:
        """At a token boundary: take a version announced meanwhile (the lead decides, and tells its
        peers, which follow it into the relay of that version). True when one was swapped in."""
        if not self.lead:
            said, _ = self.relay.message()
            if said.get("op") == "go":
                return False
            listing, _ = self.relay.message()  # the version, or the lead's exit (it refused it)
            if listing.get("op") == "exit":
                raise _Exit(int(listing["status"]))
            self.relay.load(self.policy, listing["tensors"])
            return True
        meta = self.mailbox.take_weights()
        if self.relay is not None:
            self.relay.message({"op": "go" if meta is None else "swap"})
        if meta is None:
            return False
        self._receive(int(meta["version"]))
        self.swaps.append([k, self.version])
        return True

    def _receive(self, version: int) -> None:
        """Receive announced ``version`` into the policy (relayed to the peers once verified);
        raises WeightPushError when it is refused (nothing swapped)."""
        faults.WORKER.hit("weights", version)  # tests only: a worker lost mid-push
        if self.relay is None:
            self.version = receive_into(self.receiver, self.policy)
        else:
            self.version = self.relay.receive_into(self.receiver, self.policy)

    def _serve(self) -> int:
        if self.start_error is not None:
            self._send({"op": "error", "message": self.start_error})
            self.say(f"stopping: {self.start_error}")
            return 1
        if not self.late:
            self._send({"op": "hello", "rank": self.rank, **self.identity})
        idle_since, generated = time.perf_counter(), 0
        while True:
            meta, tensors = self.mailbox.get()
            op = meta.get("op")
            if op == "stop":
                self.say(f"stopped by the trainer after {generated} batch(es); last version {self.version}")
                return 0
            if op == "reset":  # the trainer rolled back: its next version may repeat an older number
                self.receiver.last_version, self.version = None, None
            elif op == "regroup":  # a worker was lost: the others meet again, this one as ``rank``
                self._send({"op": "regrouped"})  # the last word on these channels
                self.retired.append(self.links)
                self.links = RolloutLinks(
                    self.cfg.rollout,
                    int(meta["rank"]),
                    self.backend,
                    epoch=int(meta["epoch"]),
                    workers=int(meta["workers"]),
                    store=self.links.store,
                )
                last = self.receiver.last_version
                self.receiver = WeightReceiver(self.links.weights, src=0)
                self.receiver.last_version = last
                self.mailbox.moved(self.links)
                self.say(f"regrouped: {meta['workers']} worker(s) left, this one now rank {meta['rank']}")
            elif op == "weights":
                try:
                    self._receive(int(meta["version"]))
                except WeightPushError as e:
                    self.say(f"{e}")  # the trainer's push reports the refusal too, and stops
                    return 1
                self.engine.refit(self.policy)
            elif op == "generate":
                idle = time.perf_counter() - idle_since
                asked = meta.get("version")
                # a version taken mid-batch (rollout.partial) may be newer than the one asked for
                newer = self.cfg.rollout.partial and isinstance(asked, int) and (self.version or 0) > asked
                if self.version is None or (self.version != asked and not newer):
                    self._send(
                        {
                            "op": "error",
                            "step": meta.get("step"),
                            "message": (
                                f"asked for step {meta.get('step')} from version {meta.get('version')}, "
                                f"holding version {self.version}"
                            ),
                        }
                    )
                    return 1
                faults.WORKER.hit("generate", int(meta["step"]))  # tests only: a worker lost mid-step
                t0 = time.perf_counter()
                if self.relay is not None:  # the peers generate with it (tensor-parallel)
                    self.relay.message(meta, tensors)
                start_version = self.version
                try:
                    gen = self._generate(meta, tensors)
                except WeightPushError as e:  # a version taken mid-batch, refused: nothing swapped
                    self.say(f"{e}")
                    return 1
                except Exception as e:  # the trainer stops naming this worker and what it met
                    self._send(
                        {"op": "error", "step": meta.get("step"), "message": f"{type(e).__name__}: {e}"}
                    )
                    raise
                seconds = time.perf_counter() - t0
                scored: dict[str, Any] = {}
                values = None
                if self.scorer is not None:
                    try:
                        scores, values, score_s = self.scorer.score(gen, meta)
                    except Exception as e:  # the server refused or is gone: the trainer stops, naming it
                        message = f"scoring step {meta['step']} at {self.scorer.url}: {type(e).__name__}: {e}"
                        self._send({"op": "error", "step": meta.get("step"), "message": message})
                        return 1
                    scored = {"scores": scores, "score_s": score_s}
                out = encode_output(gen)
                if values is not None:  # the critic's values, asked for (GAE)
                    out["values"] = values
                generated += 1
                self._send(
                    {
                        "op": "rollout",
                        "step": meta["step"],
                        "rank": meta.get("rank", 0),
                        "version": start_version,
                        "swaps": self.swaps,
                        "generate_s": seconds,
                        "idle_s": idle,
                        **scored,
                    },
                    out,
                )
                idle_since = time.perf_counter()
            else:
                self.say(f"an unknown command {op!r} from the trainer: stopping")
                return 1


class _Exit(Exception):
    """A peer told by its lead, mid-batch, to exit with ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"exit {status}")
        self.status = status


def serve(cfg: ActorConfig, model_keys: set[str] | None = None) -> int:
    worker = None
    try:
        worker = RolloutWorker(cfg, model_keys)
        if worker.lead:
            late = f", in the run under way (epoch {worker.links.epoch})" if worker.late else ""
            g = cfg.rollout.tensor_parallel_size
            worker.say(
                f"joined {cfg.rollout.address} as worker {worker.rank} of {cfg.rollout.workers}{late} "
                f"({worker.state.device}, {worker.precision}{f', {g} processes, tensor-parallel' if g > 1 else ''})"
            )
        return worker.serve()
    except RuntimeError as e:  # the trainer went away, or never came
        print(f"[rollout {cfg.rollout.worker_rank}] stopping: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if worker is not None and worker.scorer is not None:
            worker.scorer.close()
        if worker is not None and hasattr(worker.engine, "close"):  # TensorRT-LLM's processes
            worker.engine.close()
        distributed.destroy()


@hydra.main(config_path="pkg://aligner.configs", config_name="actor", version_base=None)
def _hydra_main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg: ActorConfig = OmegaConf.to_object(dcfg)
    status = serve(cfg, model_keys_named(list(HydraConfig.get().overrides.task)))
    if status:
        sys.exit(status)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
