"""Generation on rollout workers of their own: the ``rollout`` config section, the channels
between a trainer and its workers, and what travels on them (docs/design.md, "Rollout workers").

Three :class:`~aligner.peer_group.PeerGroup` channels over one TCP store that the trainer hosts
at ``rollout.address`` (rank 0: the trainer; rank ``w``: worker ``w``, 1..``rollout.workers``):

- ``commands``, trainer -> worker, one message at a time: ``generate`` (a step's prompt tokens
  and sampling parameters, and the policy version it must be generated from), ``weights`` (a
  version follows on ``weights``), ``reset`` (the trainer rolled back: versions start again),
  ``regroup`` (a worker was lost: the others meet again in channels of a new epoch), ``stop``;
- ``rollouts``, worker -> trainer: ``hello`` first (what the worker serves, checked against the
  trainer's policy), then one ``rollout`` per ``generate`` (the tokens, lengths, the engine's
  log-probs, the version that generated them and the versions taken mid-batch, the worker's
  generate and idle seconds; the scores and the critic's values when it scores) or an
  ``error``; ``regrouped`` last, before a worker moves to the channels of a new epoch;
- ``weights``: the versioned push of :mod:`aligner.generation.weight_push` (all workers at once).

A worker that starts once the run is under way (a replacement for one that was lost) joins
through the store instead (:func:`ask_to_join`, :class:`JoinRequests`): it files a request with
its rank and what it serves, and the trainer, at its next push, answers it with the epoch of the
channels it is to meet the others in (or why it is refused).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aligner.config_checks import Problems
from aligner.distributed import comm_device, recv_json, send_json
from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.peer_group import PeerGroup, open_store, split_address

__all__ = [
    "JoinRequests",
    "RolloutConfig",
    "RolloutLinks",
    "decode_output",
    "decode_prompts",
    "encode_output",
    "encode_prompts",
    "recv_output",
    "send_output",
]
__all__ += ["ask_to_join", "mark_epoch", "run_under_way", "sampling_from", "sampling_to", "worker_identity"]


@dataclass
class RolloutConfig:
    """Rollout workers of their own (``aligner-rollout``), fed the policy's weights by version."""

    workers: int = 0
    """Rollout worker processes (0: the actor's own ranks generate, as they always did)."""
    max_staleness: int = 0
    """k: step t trains on rollouts generated from policy version t-1-k (k = 0: the synchronous
    algorithm on separate workers; k >= 1: workers generate the next batches while the trainer
    trains, corrected by ``ppo.tis_cap``)."""
    address: str = "127.0.0.1:29650"
    """host:port of the store the trainer hosts and the workers join (the trainer's host)."""
    worker_rank: int = 1
    """On a worker: which one it is, 1..workers (each rank once)."""
    tensor_parallel_size: int = 1
    """Processes of each worker, generating tensor-parallel (a worker of more than one is
    started by torchrun, ``--nproc-per-node`` this many; its rank 0 talks to the trainer)."""
    timeout_s: float = 600.0
    """Longest wait for the workers to join, for a rollout, and for a push (a push waits for a
    worker to finish the batch it is generating: longer than the longest generation)."""
    bucket_mb: int = 256
    """Size of the weight push's buckets."""
    weights_backend: str = "auto"
    """The weight push's group: 'gloo', 'nccl', or 'auto' (nccl where the trainer is on a GPU)."""
    on_worker_loss: str = "stop"
    """A worker that goes away: 'stop' the run with an error naming it, or 'continue' with the
    others (what it owed is asked of them; the run stops when none is left)."""
    score_on_workers: bool = False
    """Each worker asks the critic/reward server (``critic.url``, ``critic.tls``) for the scores
    of the batch it generated (with GAE also the critic's values, from the critic step the trainer
    would ask for) and sends them with it, so the trainer never waits for them. The same scores
    and values, so the same run."""
    overlap_push: bool = False
    """At max_staleness >= 1, push each version on a thread of the trainer's while the step takes
    its batch and computes log-probs (only reading the weights), waiting for it before the first
    optimizer step; false: push first, then go on. The same run either way (and at k = 0, where
    the step's batch needs the version pushed, the push is always first). Off by default: on the
    one CPU benchmark measured so far it made runs slower (README, "Rollout workers of their own")."""
    schedule: str = "fixed"
    """'fixed': step t trains on the batch drawn for it, generated from version t-1-k, whenever it
    comes (deterministic; exact resume). 'dynamic': step t trains on the first batch back that
    is at most k versions old, each share asked of the worker with the fewest asks outstanding; a
    batch past the bound is dropped and its prompts asked again (counted, never used twice)."""
    partial: bool = False
    """With ``schedule=dynamic``: a worker takes a version pushed while it generates at the next
    token boundary (partial rollouts: its KV cache kept, the tokens after it generated by the
    new version and tagged with it), instead of after the batch."""

    def problems(self, prefix: str = "rollout") -> Problems:
        p = Problems()
        p.expect(self.workers >= 0, f"{prefix}.workers", self.workers, "an integer >= 0")
        p.expect(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, "an integer >= 0")
        p.expect(self.timeout_s > 0, f"{prefix}.timeout_s", self.timeout_s, "a number of seconds > 0")
        p.expect(self.bucket_mb >= 1, f"{prefix}.bucket_mb", self.bucket_mb, "an integer >= 1")
        p.expect(
            self.tensor_parallel_size >= 1,
            f"{prefix}.tensor_parallel_size",
            self.tensor_parallel_size,
            "an integer >= 1",
        )
        p.expect(
            self.weights_backend in ("auto", "gloo", "nccl"),
            f"{prefix}.weights_backend",
            self.weights_backend,
            "'auto', 'gloo' or 'nccl'",
        )
        p.expect(
            self.on_worker_loss in ("stop", "continue"),
            f"{prefix}.on_worker_loss",
            self.on_worker_loss,
            "'stop' or 'continue'",
        )
        p.expect(
            self.schedule in ("fixed", "dynamic"), f"{prefix}.schedule", self.schedule, "'fixed' or 'dynamic'"
        )
        p.expect(
            not self.partial or self.schedule == "dynamic",
            f"{prefix}.partial",
            self.partial,
            f"false with {prefix}.schedule={self.schedule!r} (a swap mid-batch depends on timing: set "
            f"{prefix}.schedule=dynamic)",
        )
        for key in ("overlap_push", "score_on_workers", "partial"):
            value = getattr(self, key)
            p.expect(isinstance(value, bool), f"{prefix}.{key}", value, "true or false")
        try:
            split_address(self.address)
        except ValueError:
            p.expect(False, f"{prefix}.address", self.address, "host:port")
        return p


class RolloutLinks:
    """One process's end of the three channels: the trainer (``rank`` 0, hosting the store) or
    worker ``rank``. Returns once every process of the run has joined each channel.

    After a worker is lost (``rollout.on_worker_loss=continue``) the others meet again in channels
    of a new ``epoch``, on the same store (``store``), ``workers`` of them."""

    def __init__(
        self,
        cfg: RolloutConfig,
        rank: int,
        weights_backend: str = "gloo",
        *,
        epoch: int = 0,
        workers: int | None = None,
        store: Any = None,
    ) -> None:
        workers = cfg.workers if workers is None else workers
        self.rank, self.size, self.epoch = rank, workers + 1, epoch
        self.store = (
            store if store is not None else open_store(cfg.address, self.size, rank == 0, cfg.timeout_s)
        )
        at = "" if epoch == 0 else f".{epoch}"
        try:
            self.commands = PeerGroup(self.store, f"commands{at}", rank, self.size, cfg.timeout_s)
            self.rollouts = PeerGroup(self.store, f"rollouts{at}", rank, self.size, cfg.timeout_s)
            self.weights = PeerGroup(
                self.store, f"weights{at}", rank, self.size, cfg.timeout_s, weights_backend
            )
        except RuntimeError as e:
            who = "every rollout worker to join" if rank == 0 else "the trainer and every other worker"
            raise RuntimeError(
                f"rollout.address={cfg.address}: waited {cfg.timeout_s:g} s for {who} "
                f"({workers} worker(s){' left' if epoch else ' configured'}): {e}"
            ) from e


_EPOCH = "aligner/rollout/epoch"
"""Set by the trainer once the channels of an epoch are formed: the run is under way."""
_JOINS = "aligner/rollout/joins"
"""How many workers asked to join the run under way (each request is ``_JOINS/<n>``)."""


def mark_epoch(store: Any, epoch: int) -> None:
    """The trainer: the channels of ``epoch`` are formed (a worker starting now joins late)."""
    store.set(_EPOCH, str(epoch))


def run_under_way(store: Any) -> bool:
    """Whether the trainer has formed its channels (a worker starting now must ask to join)."""
    return bool(store.check([_EPOCH]))


def ask_to_join(
    store: Any, rank: int, identity: dict[str, Any], timeout_s: float, say: Any = None
) -> dict[str, Any] | None:
    """A worker starting: None when the run is not under way (it joins the channels of epoch 0
    with the others); else it files a request to join as ``rank`` and waits, at most
    ``timeout_s``, for the trainer's answer: ``{"epoch", "rank", "workers"}`` (``say``: told
    once the request is filed).

    Raises:
        RuntimeError: the trainer refused it (naming why), or did not answer in time.
    """
    if not run_under_way(store):
        return None
    n = store.add(_JOINS, 1)
    store.set(f"{_JOINS}/{n}", json.dumps({"rank": rank, "identity": identity}))
    if say is not None:
        say(f"the run is under way: asked the trainer to join as worker {rank}")
    key = f"{_JOINS}/{n}/answer"
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except dist.DistStoreError:  # the wait's own timeout (a trainer gone is another error)
        raise RuntimeError(
            f"asked to join the run under way as worker {rank}; the trainer did not admit it within "
            f"rollout.timeout_s={timeout_s:g} s (it admits a worker at its next push, only with "
            "rollout.on_worker_loss=continue and in place of one it lost)"
        ) from None
    answer = json.loads(store.get(key))
    if "refused" in answer:
        raise RuntimeError(f"the trainer refused this worker: {answer['refused']}")
    return answer


class JoinRequests:
    """The trainer's side of :func:`ask_to_join`: the requests filed since the last look."""

    def __init__(self, store: Any) -> None:
        self.store, self.seen = store, 0
        self.unfiled: set[int] = set()
        """Tickets taken whose request was not there yet (its worker may still be writing it)."""

    def new(self) -> list[tuple[int, dict[str, Any]]]:
        """(ticket, request) of each request filed since the last call, in ticket order (none: one
        store read). A request that is not a JSON object is refused here, naming why; a ticket
        whose request is not filed yet is looked at again next time (never waited for: a worker
        that died between taking a ticket and filing holds up nothing)."""
        n = self.store.add(_JOINS, 0)
        tickets = sorted(self.unfiled | set(range(self.seen + 1, n + 1)))
        self.seen = max(self.seen, n)
        out = []
        for t in tickets:
            key = f"{_JOINS}/{t}"
            if not self.store.check([key]):
                self.unfiled.add(t)
                continue
            self.unfiled.discard(t)
            try:
                req = json.loads(self.store.get(key))
                if not isinstance(req, dict):
                    raise ValueError(f"a JSON {type(req).__name__}, not an object")
            except ValueError as e:  # bad JSON, bad UTF-8, not an object
                self.answer(t, {"refused": f"an unreadable request to join ({e})"})
                continue
            out.append((t, req))
        return out

    def answer(self, ticket: int, answer: dict[str, Any]) -> None:
        self.store.set(f"{_JOINS}/{ticket}/answer", json.dumps(answer))


def worker_identity(model: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """What a worker serves, as the trainer checks it: the architecture (a
    :class:`~aligner.models.config.ModelConfig`), the tokenizer's fingerprint and the dtype it
    generates in ('bf16' or 'fp32')."""
    return {"model": model.to_dict(), "tokenizer": tokenizer.fingerprint(), "dtype": dtype}


# -- what travels -------------------------------------------------------------------------------


def encode_prompts(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """A batch of prompt token lists as two tensors (the tokens end to end, and each length)."""
    flat = [t for p in prompts for t in p]
    return {
        "prompt_tokens": torch.tensor(flat, dtype=torch.int64),
        "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
    }


def decode_prompts(t: dict[str, torch.Tensor]) -> list[list[int]]:
    flat, lengths = t["prompt_tokens"].tolist(), t["prompt_lengths"].tolist()
    if sum(lengths) != len(flat) or min(lengths, default=1) < 1:
        raise ValueError(f"prompt_lengths {lengths} do not cut {len(flat)} prompt tokens into prompts")
    out, at = [], 0
    for n in lengths:
        out.append(flat[at : at + n])
        at += n
    return out


OUTPUT_FIELDS = ("tokens", "lengths", "prompt_lengths", "logprobs", "ended")
"""The tensors of a :class:`~aligner.generation.engine.GenerationOutput`, as they travel."""


def encode_output(gen: GenerationOutput, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + f: getattr(gen, f).detach().cpu() for f in OUTPUT_FIELDS}


def decode_output(
    t: dict[str, torch.Tensor], prefix: str = "", device: torch.device | None = None
) -> GenerationOutput:
    missing = [prefix + f for f in OUTPUT_FIELDS if prefix + f not in t]
    if missing:
        raise ValueError(f"a rollout without {missing}")
    return GenerationOutput(
        **{f: t[prefix + f].to(device) if device is not None else t[prefix + f] for f in OUTPUT_FIELDS}
    )


def send_output(gen: GenerationOutput, dst: int) -> None:
    """``gen`` to global rank ``dst`` of the default group (:func:`recv_output` there): each
    tensor's dtype and shape, then the tensor (bool as uint8: what every backend sends)."""
    for f in OUTPUT_FIELDS:
        t = getattr(gen, f)
        send_json([str(t.dtype).removeprefix("torch."), list(t.shape)], dst)
        dist.send(t.to(comm_device(), torch.uint8 if t.dtype == torch.bool else t.dtype).contiguous(), dst)


def recv_output(src: int, device: torch.device) -> GenerationOutput:
    """What :func:`send_output` sent from global rank ``src``, on ``device``."""
    parts = {}
    for f in OUTPUT_FIELDS:
        dtype, shape = recv_json(src)
        wire = torch.uint8 if dtype == "bool" else getattr(torch, dtype)
        parts[f] = torch.empty(shape, dtype=wire, device=comm_device())
        dist.recv(parts[f], src)
        parts[f] = parts[f].to(device, getattr(torch, dtype))
    return GenerationOutput(**parts)


def sampling_to(s: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(s)


def sampling_from(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)
