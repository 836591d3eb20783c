"""The critic/reward service: the model, its optimiser, the reward source, and the rules of
the protocol (validation, exactly-once training, save/load), independent of PyTriton.

One lock serialises every operation, so inference and training never race and every infer
that starts after a train has returned sees the update.

Tensor parallelism. Under ``torchrun --nproc_per_node N ... parallel.tensor_model_parallel_size=N``
every rank holds a TP shard of the critic (and of the reward model). Rank 0 owns PyTriton and
this object's public methods; before each operation it broadcasts a fixed-size header (op
code, batch, length, step) and then the request's arrays over the default group (gloo on
CPU), and the peers, waiting in :meth:`CriticService.serve_peers`, run the same forward,
backward and optimiser step. Requests are validated on rank 0 *before* anything is
broadcast, so peers only ever see valid work. Idle peers would hit the collective timeout, so
rank 0 broadcasts a heartbeat every :data:`HEARTBEAT_S` seconds when nothing else happens.
Checkpoints are written by rank 0 alone: peers send their shards point-to-point (every TP
shard of a Megatron layer has the same shape), and on load rank 0 reads and checks every
shard before it sends anything, so a bad checkpoint changes nothing on any rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aligner.checkpoint import (
    CheckpointError,
    atomic_directory,
    complete_steps,
    load_tensors,
    prune_checkpoints,
    read_json,
    restore_rng_state,
    rng_state_tensors,
    rng_to_restore,
    save_tensors,
    step_dir_name,
    write_json,
)
from aligner.critic import protocol as P
from aligner.critic.config import CriticServerConfig
from aligner.critic.metrics import MetricsWriter, RequestStats
from aligner.critic.rewards import call_reward_fn, load_policy_trunk, load_reward_fn, load_reward_model
from aligner.distributed import ParallelState
from aligner.models.config import ModelConfig
from aligner.models.gpt import (
    build_critic,
    load_state_dict_strict,
    sequence_scores,
    set_forwards,
    tensor_state_dict,
    token_values,
)
from aligner.precision import (
    load_master_state_dict,
    make_optimizer,
    master_state_dict,
    precision_dtype,
    resolve_precision,
)
from aligner.rl import explained_variance, loss_start, value_loss

__all__ = [
    "CriticService",
    "CriticServiceError",
    "ServiceClosedError",
    "ROLE",
    "CACHED_RESULTS",
    "HEARTBEAT_S",
]

log = logging.getLogger("aligner.critic")

ROLE = "critic"
"""Sub-directory of each ``step_XXXXXXXX`` checkpoint directory the critic writes."""
CACHED_RESULTS = 64
"""How many recent train results are kept for replies to repeated step ids."""
HEARTBEAT_S = 30.0
UNAVAILABLE_MARK = "[critic-unavailable] "

# Ops broadcast to TP peers (header[0]).
_OP_PING, _OP_STOP, _OP_INFER, _OP_TRAIN, _OP_SAVE, _OP_LOAD = range(6)
_HEADER = 8


class CriticServiceError(RuntimeError):
    """An operation failed for a reason other than a malformed request (the message says which)."""


class ServiceClosedError(CriticServiceError):
    """The service is shutting down; the request was not run (clients may retry elsewhere/later)."""

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE_MARK + "the critic server is shutting down; retry after it restarts")


def _hash_keys(tensors: dict[str, torch.Tensor]) -> int:
    blob = ";".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(tensors.items()))
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:7], "big")


class CriticService:
    """Critic (trained) + reward source (frozen), with the server's rules.

    Call :meth:`infer`, :meth:`train`, :meth:`save`, :meth:`load` and :meth:`info` on rank 0;
    peers call :meth:`serve_peers` and return when rank 0 calls :meth:`close`.
    """

    def __init__(
        self, cfg: CriticServerConfig, state: ParallelState, *, metrics: MetricsWriter | None = None
    ) -> None:
        from aligner.tokenizers import build_tokenizer

        self.cfg = cfg
        self.state = state
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.is_rank0 = state.rank == 0
        self.device = state.device
        # Collectives carry CUDA tensors under NCCL and CPU tensors under gloo.
        self._comm_device = (
            state.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        )
        self.metrics = metrics
        self.request_stats = RequestStats()
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.checkpoint_root = Path(cfg.checkpoint.dir)
        self._lock = threading.Lock()
        self._closed = False
        self._last_op = time.monotonic()
        self._results: OrderedDict[int, P.TrainResult] = OrderedDict()
        self.critic_step = -1  # last applied train step
        self.last_saved_step = -1
        self.started_at = time.time()

        self.reward_fn = load_reward_fn(cfg.reward.fn) if cfg.reward.fn else None
        # Every loader below is collective under TP (each rank takes its shard of full tensors).
        self.reward_model, self.rm_cfg = load_reward_model(cfg.reward.model_path, cfg.reward.hf_path)
        self.init_source = self._init_source()
        self.model_cfg = self._critic_config()
        for what, c in (("critic", self.model_cfg), ("reward model", self.rm_cfg)):
            if c is not None and c.vocab_size < self.tokenizer.vocab_size:
                raise CriticServiceError(
                    f"the {what}'s vocab_size={c.vocab_size} is smaller than tokenizer="
                    f"{cfg.tokenizer!r}'s {self.tokenizer.vocab_size}: they cannot belong together"
                )
        self.precision = resolve_precision(cfg.precision, self.device)
        # Built and initialised in fp32; the optimizer keeps those values as its fp32 master
        # weights and casts the critic to bf16 (so the starting point is not rounded).
        self.critic = build_critic(self.model_cfg)
        if self.init_source == "reward":
            # Same architecture and TP layout: the reward model's shards are the critic's.
            load_state_dict_strict(
                self.critic,
                tensor_state_dict(self.reward_model),
                what="critic initialised from the reward model",
            )
        elif self.init_source == "policy":
            load_policy_trunk(self.critic, cfg.init.policy_path)
        # Built (and loaded) on the CPU, as Megatron's use_cpu_initialization does; then moved.
        self.critic.to(self.device)
        if self.reward_model is not None:
            self.reward_model.to(self.device, precision_dtype(self.precision))
        tp = self.tp_size
        rm_cfg = self.rm_cfg
        o = cfg.optim
        self.optimizer = make_optimizer(
            self.critic,
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
            precision=self.precision,
        )
        # After the optimizer, which casts the critic to its compute dtype.
        self.model_forward = set_forwards(
            {"critic": self.critic, "reward model": self.reward_model},
            cfg.model_forward,
            tp,
            log if self.is_rank0 else None,
        )
        # critic_infer's forward kept (with its graph) as the next matching critic_train's first
        # pass: exact when the forward ignores train/eval mode (the fused path has no dropout)
        # and the first minibatch is the whole batch in order.
        self.reuse_infer_forward = bool(
            cfg.optim.reuse_infer_forward
            and cfg.optim.num_minibatches == 1
            and getattr(self.critic, "aligner_fused", None) is not None
        )
        self._kept: tuple[np.ndarray, torch.Tensor] | None = None  # (tokens, values with graph)
        self.reused_forwards = 0
        max_len = (
            self.model_cfg.max_seq_len
            if rm_cfg is None
            else min(self.model_cfg.max_seq_len, rm_cfg.max_seq_len)
        )
        self.limits = P.Limits(
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=max_len,
            max_batch=cfg.server.max_batch_size,
            max_train_batch=cfg.server.max_request_batch,
        )
        if self.is_rank0:
            log.info(
                "critic ready: %s, init=%s, reward fn=%s, reward model=%s, TP=%d, precision=%s",
                self.model_cfg,
                self.init_source,
                cfg.reward.fn,
                cfg.reward.model_path or cfg.reward.hf_path,
                tp,
                self.precision,
            )
        self._heartbeat: threading.Thread | None = None
        if self.is_rank0 and self.state.world_size > 1:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="critic-tp-heartbeat", daemon=True
            )
            self._heartbeat.start()

    # ------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------

    def _init_source(self) -> str:
        source = self.cfg.init.source
        if source == "auto":
            if self.reward_model is not None:
                return "reward"
            return "policy" if self.cfg.init.policy_path else "fresh"
        return source

    def _critic_config(self) -> ModelConfig:
        """The critic's architecture: the reward model's or the policy's when it starts from one."""
        if self.init_source == "reward":
            diff = self.rm_cfg.architecture_diff(self.cfg.model)
            if diff:
                log.warning(
                    "the critic starts from the reward model, so it takes the reward model's "
                    "architecture; model.* settings that differ are ignored: %s",
                    "; ".join(diff),
                )
            return self.rm_cfg
        if self.init_source == "policy":
            from aligner.models.checkpoint_io import read_checkpoint_meta

            return read_checkpoint_meta(self.cfg.init.policy_path)["model_config"]
        return self.cfg.model

    # ------------------------------------------------------------------------------------------
    # Public API (rank 0)
    # ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceClosedError()

    def info(self) -> P.ServerInfo:
        """What clients check before they send anything."""
        c = self.cfg
        return P.ServerInfo(
            protocol_version=P.PROTOCOL_VERSION,
            vocab_size=self.limits.vocab_size,
            max_seq_len=self.limits.max_seq_len,
            tokenizer=c.tokenizer,
            tokenizer_fingerprint=self.tokenizer.fingerprint(),
            critic_step=self.critic_step,
            max_batch_size=self.limits.max_batch,
            max_train_batch=self.limits.max_train_batch,
            reward={
                "fn": c.reward.fn,
                "model_path": c.reward.model_path,
                "hf_path": c.reward.hf_path,
                "fn_scale": c.reward.fn_scale,
                "model_mean": c.reward.model_mean,
                "model_std": c.reward.model_std,
                "model": self.rm_cfg.to_dict() if self.rm_cfg is not None else None,
            },
            model=self.model_cfg.to_dict(),
            parallel={"tensor_model_parallel_size": self.tp_size, "pipeline_model_parallel_size": 1},
            last_saved_step=self.last_saved_step,
            checkpoint_steps=complete_steps(self.checkpoint_root, role=ROLE),
            extra={
                "init_source": self.init_source,
                "pid": os.getpid(),
                "started_at": self.started_at,
                "optim": dict(vars(c.optim)),
                "precision": self.precision,
                "model_forward": self.model_forward,
                "reuse_infer_forward": self.reuse_infer_forward,
                "reused_infer_forwards": self.reused_forwards,
                "requests": self.request_stats.lifetime(),
            },
        )

    def infer(self, tokens: Any, lengths: Any, prompt_lengths: Any) -> P.InferResponse:
        """Values and rewards of one batch (validated here).

        Args:
            tokens: ``[b, s]`` int64; lengths, prompt_lengths: ``[b]`` or ``[b, 1]`` int64.

        Returns:
            values ``[b, s-1]`` float32 and rewards ``[b]`` float32.
        """
        return self.infer_many([P.validate_infer(tokens, lengths, prompt_lengths, self.limits)])[0]

    def infer_many(self, requests: list[P.InferRequest]) -> list[P.InferResponse]:
        """Score several *validated* requests (e.g. merged by Triton's batcher) in as few forwards
        as possible: requests of the same padded length share one forward."""
        out: list[P.InferResponse | None] = [None] * len(requests)
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_len.setdefault(r.tokens.shape[1], []).append(i)
        computed = []
        with self._lock:
            self._check_open()
            for idx in by_len.values():
                tokens = np.concatenate([requests[i].tokens for i in idx])
                lengths = np.concatenate([requests[i].lengths for i in idx])
                prompt_lengths = np.concatenate([requests[i].prompt_lengths for i in idx])
                self._broadcast_op(_OP_INFER, tokens.shape[0], tokens.shape[1], 0, [tokens, lengths])
                values, scores = self._forward(tokens, lengths)
                computed.append((idx, tokens, lengths, prompt_lengths, values, scores))
            self._last_op = time.monotonic()
        # The reward function needs no model: run it outside the lock, so a slow one does not
        # hold up training.
        for idx, tokens, lengths, prompt_lengths, values, scores in computed:
            rewards = self._combine_rewards(tokens, lengths, prompt_lengths, scores)
            start = 0
            for i in idx:
                n = requests[i].tokens.shape[0]
                out[i] = P.InferResponse(values[start : start + n], rewards[start : start + n])
                start += n
        return out  # type: ignore[return-value]

    def train(
        self, tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: Any
    ) -> P.TrainResult:
        """Apply one critic update for ``step``, exactly once.

        A repeated step id returns the result it got the first time and changes nothing; a step
        older than the last applied one returns its kept result, or is rejected if that result is
        no longer kept. Shapes: tokens ``[b, s]``; lengths ``[b]``; returns, old_values, mask
        ``[b, s-1]``.
        """
        req = P.validate_train(tokens, lengths, returns, old_values, mask, step, self.limits)
        with self._lock:
            self._check_open()
            cached = self._results.get(req.step)
            if cached is not None:
                log.info("train step %d repeated: returning its earlier result, nothing applied", req.step)
                return cached
            if req.step <= self.critic_step:
                raise P.ProtocolError(
                    P.TRAIN,
                    "step",
                    f"a step > {self.critic_step} (the last applied step), or "
                    f"one of the last {CACHED_RESULTS} applied steps (whose results are kept)",
                    f"step={req.step}",
                )
            b, s = req.tokens.shape
            self._broadcast_op(
                _OP_TRAIN, b, s, req.step, [req.tokens, req.lengths, req.returns, req.old_values, req.mask]
            )
            t0 = time.perf_counter()
            result = self._train_step(req)
            self._results[req.step] = result
            while len(self._results) > CACHED_RESULTS:
                self._results.popitem(last=False)
            self.critic_step = req.step
            self._last_op = time.monotonic()
            elapsed = time.perf_counter() - t0
        log.info(
            "train step %d: loss %.5f grad_norm %.4f explained_variance %.3f (%.0f ms, %d rows)",
            result.applied_step,
            result.loss,
            result.grad_norm,
            result.explained_variance,
            1000 * elapsed,
            b,
        )
        if self.metrics is not None:
            self.metrics.train_step(
                req.step,
                {
                    "loss/value": result.loss,
                    "critic/grad_norm": result.grad_norm,
                    "critic/explained_variance": result.explained_variance,
                    "critic/value_clipfrac": result.value_clipfrac,
                    "timers/critic_train_ms": round(1000 * elapsed, 3),
                    **self.request_stats.snapshot(),
                },
            )
        return result

    def save(self, step: Any) -> Path:
        """Write critic weights, optimiser, RNG and bookkeeping to ``<dir>/step_XXXXXXXX/critic/``."""
        step = P.validate_step(P.SAVE, step)
        with self._lock:
            self._check_open()
            return self._save_locked(step)

    def load(self, step: Any) -> None:
        """Restore the critic, optimiser, RNG and bookkeeping saved at ``step`` (resume)."""
        step = P.validate_step(P.LOAD, step)
        with self._lock:
            self._check_open()
            payload = self._read_checkpoint(step)  # raises before anything changes
            self._broadcast_op(_OP_LOAD, 0, 0, step, [])
            self._apply_checkpoint(payload)
            self._last_op = time.monotonic()
        log.info("loaded critic checkpoint step %d (critic step %d)", step, self.critic_step)

    def latest_checkpoint(self) -> int | None:
        steps = complete_steps(self.checkpoint_root, role=ROLE)
        return steps[-1] if steps else None

    def close(self, *, save: bool = False) -> Path | None:
        """Finish the in-flight operation, optionally save the last applied step, release peers.

        Later calls of the public methods raise :class:`ServiceClosedError`."""
        saved = None
        with self._lock:
            if self._closed:
                return None
            if save and self.critic_step >= 0 and self.last_saved_step != self.critic_step:
                try:
                    saved = self._save_locked(self.critic_step)
                except Exception:
                    log.exception("saving the critic at shutdown failed")
            self._closed = True
            self._broadcast_op(_OP_STOP, 0, 0, 0, [])
        if self.metrics is not None:
            self.metrics.requests(self.critic_step, self.request_stats.snapshot())
        return saved

    def flush_stats(self) -> None:
        """Write the request statistics of the last interval (called periodically by the server)."""
        if self.metrics is not None:
            self.metrics.requests(self.critic_step, self.request_stats.snapshot())

    # ------------------------------------------------------------------------------------------
    # Peers (TP ranks > 0)
    # ------------------------------------------------------------------------------------------

    def serve_peers(self) -> None:
        """Run the operations rank 0 broadcasts until it sends stop (ranks > 0 only)."""
        assert not self.is_rank0
        while True:
            header = self._bcast(torch.zeros(_HEADER, dtype=torch.int64))
            op, b, s, step = (int(x) for x in header[:4])
            if op == _OP_PING:
                continue
            if op == _OP_STOP:
                return
            if op == _OP_INFER:
                tokens, lengths = self._recv_arrays([((b, s), torch.int64), ((b,), torch.int64)])
                self._forward(tokens, lengths)
            elif op == _OP_TRAIN:
                tokens, lengths, returns, old_values, mask = self._recv_arrays(
                    [((b, s), torch.int64), ((b,), torch.int64)] + [((b, s - 1), torch.float32)] * 3
                )
                try:
                    self._train_step(P.TrainRequest(tokens, lengths, returns, old_values, mask, step))
                    self.critic_step = step
                except CriticServiceError as e:  # rank 0 fails the same way and reports it
                    log.warning("TP rank %d: %s", self.state.rank, e)
            elif op == _OP_SAVE:
                self._send_shards_to_rank0()
            elif op == _OP_LOAD:
                self._apply_checkpoint(self._recv_shards_from_rank0())

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 (every rank passes a tensor of the same shape); CPU result."""
        t = t.contiguous().to(self._comm_device)
        dist.broadcast(t, src=0)
        return t.cpu()

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.detach().contiguous().to(self._comm_device), dst=dst)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self._comm_device)
        dist.recv(t, src=src)
        return t.cpu()

    def _heartbeat_loop(self) -> None:
        while not self._closed:
            time.sleep(1.0)
            if time.monotonic() - self._last_op < HEARTBEAT_S:
                continue
            with self._lock:
                if self._closed:
                    return
                self._broadcast_op(_OP_PING, 0, 0, 0, [])
                self._last_op = time.monotonic()

    def _broadcast_op(self, op: int, b: int, s: int, step: int, arrays: list[np.ndarray]) -> None:
        if self.state.world_size == 1:
            return
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([op, b, s, step])
        self._bcast(header)
        for a in arrays:
            self._bcast(torch.from_numpy(np.ascontiguousarray(a)))

    def _recv_arrays(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[np.ndarray]:
        out = []
        for shape, dtype in specs:
            out.append(self._bcast(torch.empty(shape, dtype=dtype)).numpy())
        return out

    # ------------------------------------------------------------------------------------------
    # The maths (every rank)
    # ------------------------------------------------------------------------------------------

    def _forward(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """tokens [b, s], lengths [b] -> (values [b, s-1] float32, reward-model scores [b] or None).

        With ``reuse_infer_forward`` the values are computed with gradients and kept for
        :meth:`_train_step` (whatever was kept before is dropped)."""
        self._kept = None
        t = torch.from_numpy(tokens).to(self.state.device)
        with torch.set_grad_enabled(self.reuse_infer_forward):
            values = token_values(self.critic, t)  # [b, s-1]
        if self.reuse_infer_forward:
            self._kept = (tokens.copy(), values)
        scores = None
        if self.reward_model is not None:
            with torch.no_grad():
                n = torch.from_numpy(lengths).to(self.state.device)
                scores = sequence_scores(self.reward_model, t, n).cpu().numpy()  # [b]
        return values.detach().cpu().numpy().astype(np.float32, copy=False), scores

    def _take_kept(self, tokens: np.ndarray) -> torch.Tensor | None:
        """The kept infer forward's values (with their graph) if they are of exactly ``tokens``;
        whatever was kept is dropped either way (the weights are about to change)."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0].shape != tokens.shape or not np.array_equal(kept[0], tokens):
            return None
        return kept[1]

    def _combine_rewards(self, tokens, lengths, prompt_lengths, scores: np.ndarray | None) -> np.ndarray:
        """Reward function (scaled) + standardised reward-model score, per sample: [b] float32."""
        r = self.cfg.reward
        total = np.zeros(tokens.shape[0], dtype=np.float64)
        if self.reward_fn is not None:
            try:
                fn_scores = call_reward_fn(self.reward_fn, self.tokenizer, tokens, lengths, prompt_lengths)
            except Exception as e:
                raise CriticServiceError(f"reward function {r.fn!r} failed: {type(e).__name__}: {e}") from e
            total += r.fn_scale * np.asarray(fn_scores, dtype=np.float64)
        if scores is not None:
            total += (scores.astype(np.float64) - r.model_mean) / r.model_std
        return total.astype(np.float32)

    def _grad_norm_and_clip(self, max_norm: float | None) -> float:
        """Global norm of the fp32 (master) gradients over the TP group, clipped to ``max_norm``."""
        return self.optimizer.clip_grad_norm(max_norm, self.state.tp_group, self.tp_size, self.tp_rank)

    def _train_step(self, req: P.TrainRequest) -> P.TrainResult:
        o = self.cfg.optim
        dev = self.state.device
        tokens = torch.from_numpy(np.ascontiguousarray(req.tokens)).to(dev)
        returns = torch.from_numpy(np.ascontiguousarray(req.returns)).to(dev)
        old_values = torch.from_numpy(np.ascontiguousarray(req.old_values)).to(dev)
        mask = torch.from_numpy(np.ascontiguousarray(req.mask)).to(dev)
        b = tokens.shape[0]
        # Same permutation on every TP rank: the generator depends on (seed, step, epoch) only.
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + req.step)
        kept = self._take_kept(req.tokens) if o.num_minibatches == 1 else None
        # Values before the first masked position feed no loss: after the first pass the last
        # layer starts there. The first pass is the infer forward (kept or recomputed the same
        # way, so that reusing it changes nothing), which covers every position.
        start = loss_start(mask)
        if kept is not None:
            self.reused_forwards += 1
        first_pass_values = torch.zeros_like(returns)
        losses, norms, clipfracs = [], [], []
        self.critic.train()
        for epoch in range(o.epochs):
            perm = torch.randperm(b, generator=gen) if o.num_minibatches > 1 else torch.arange(b)
            for idx in torch.tensor_split(perm, o.num_minibatches):
                if idx.numel() == 0:
                    continue
                if epoch == 0 and kept is not None:  # one minibatch: idx is every row, in order
                    values = kept
                else:
                    values = token_values(self.critic, tokens[idx], start if epoch else 0)  # [mb, s-1]
                loss, stats = value_loss(
                    values,
                    old_values[idx],
                    returns[idx],
                    mask[idx],
                    clip_eps=o.value_clip_eps,
                    agg=o.loss_agg,
                )
                if epoch == 0:
                    first_pass_values[idx] = values.detach()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = self._grad_norm_and_clip(o.grad_clip or None)
                if not (math.isfinite(norm) and math.isfinite(loss.item())):
                    # Every TP rank sees the same (all-reduced) norm and loss, so all skip together.
                    self.optimizer.zero_grad(set_to_none=True)
                    if not losses:
                        self.critic.eval()
                        raise CriticServiceError(
                            f"train step {req.step}: non-finite loss {loss.item()} or gradient norm {norm}; "
                            "nothing was applied"
                        )
                    log.warning(
                        "train step %d: non-finite loss or gradient norm in a later minibatch; that "
                        "update was skipped (earlier ones of this step stay applied)",
                        req.step,
                    )
                    continue
                self.optimizer.step()
                losses.append(loss.item())
                norms.append(norm)
                clipfracs.append(float(stats["value_clipfrac"]))
        self.optimizer.zero_grad(set_to_none=True)
        self.critic.eval()
        ev = float(explained_variance(first_pass_values, returns, mask))
        return P.TrainResult(
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(norms)),
            applied_step=req.step,
            explained_variance=ev,
            value_clipfrac=float(np.mean(clipfracs)),
        )

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    def _local_shards(self) -> dict[str, dict[str, torch.Tensor]]:
        optim_tensors, _ = self.optimizer.state_tensors()
        return {
            # The fp32 master weights under bf16: the checkpoint holds the truth, not its rounding.
            "model": master_state_dict(self.critic, self.optimizer),
            "optim": optim_tensors,
            # Every RNG state of this rank (dropout draws from torch's and Megatron's tracker).
            "rng": rng_state_tensors(),
        }

    def _meta(self, step: int) -> dict[str, Any]:
        _, optim_meta = self.optimizer.state_tensors()
        return {
            "role": ROLE,
            "step": step,
            "critic_step": self.critic_step,
            "protocol_version": P.PROTOCOL_VERSION,
            "model_config": self.model_cfg.to_dict(),
            "tensor_model_parallel_size": self.tp_size,
            "pipeline_model_parallel_size": 1,
            "tokenizer": self.cfg.tokenizer,
            "tokenizer_fingerprint": self.tokenizer.fingerprint(),
            "init_source": self.init_source,
            "precision": self.precision,
            "optimizer": optim_meta,
            "results": {str(k): v.to_dict() for k, v in self._results.items()},
            "saved_at": time.time(),
        }

    def _save_locked(self, step: int) -> Path:
        t0 = time.perf_counter()
        self._broadcast_op(_OP_SAVE, 0, 0, step, [])
        shards = [self._local_shards()]
        for peer in range(1, self.tp_size):
            shards.append(self._recv_peer_shards(peer, shards[0]))
        final = self.checkpoint_root / step_dir_name(step) / ROLE
        meta = self._meta(step)
        with atomic_directory(final, marker={"step": step, "role": ROLE}) as tmp:
            for r, sh in enumerate(shards):
                for kind, tensors in sh.items():
                    save_tensors(tmp / f"{kind}_tp{r:02d}.safetensors", tensors)
            write_json(tmp / "meta.json", meta)
        self.last_saved_step = step
        self._prune(step)
        log.info("saved critic checkpoint %s (%.0f ms)", final, 1000 * (time.perf_counter() - t0))
        return final

    def _prune(self, saved: int) -> None:
        """This role's sub-directories beyond the newest keep_last up to ``saved``, and any after
        it (see :func:`aligner.checkpoint.prune_checkpoints`). Step 0, the initial critic
        (checkpoint.save_initial), is the reset point of fresh runs: never pruned, and saving it
        prunes nothing."""
        if saved > 0:
            prune_checkpoints(self.checkpoint_root, ROLE, saved, self.cfg.checkpoint.keep_last, protect={0})

    def _send_shards_to_rank0(self) -> None:
        shards = self._local_shards()
        for kind in sorted(shards):
            tensors = shards[kind]
            self._send(torch.tensor([len(tensors), _hash_keys(tensors)], dtype=torch.int64), 0)
            for k in sorted(tensors):
                self._send(tensors[k], 0)

    def _recv_peer_shards(
        self, peer: int, like: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for kind in sorted(like):
            own = like[kind]
            head = self._recv((2,), torch.int64, peer)
            if int(head[0]) != len(own) or int(head[1]) != _hash_keys(own):
                raise CriticServiceError(
                    f"TP rank {peer} holds different {kind} tensors than rank 0; cannot save"
                )
            out[kind] = {}
            for k in sorted(own):
                out[kind][k] = self._recv(tuple(own[k].shape), own[k].dtype, peer)
        return out

    def _read_checkpoint(self, step: int) -> dict[str, Any]:
        """Read and check every shard of ``step`` (rank 0); raises before anything is applied."""
        d = self.checkpoint_root / step_dir_name(step) / ROLE
        if step not in complete_steps(self.checkpoint_root, role=ROLE):
            have = complete_steps(self.checkpoint_root, role=ROLE)
            raise P.ProtocolError(
                P.LOAD, "step", f"a step with a complete critic checkpoint (have {have})", f"step={step}"
            )
        try:
            meta = read_json(d / "meta.json")
            if meta.get("tensor_model_parallel_size") != self.tp_size:
                raise CheckpointError(
                    f"checkpoint {d} was saved at tensor_model_parallel_size="
                    f"{meta.get('tensor_model_parallel_size')}, this server runs {self.tp_size}"
                )
            diff = ModelConfig.from_dict(meta["model_config"]).architecture_diff(self.model_cfg)
            if diff:
                raise CheckpointError(
                    f"checkpoint {d} holds a different critic architecture: {'; '.join(diff)}"
                )
            own = self._local_shards()
            shards = []
            for r in range(self.tp_size):
                sh = {kind: load_tensors(d / f"{kind}_tp{r:02d}.safetensors") for kind in own}
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
                sh["rng"], note = rng_to_restore(sh["rng"], own["rng"], f"checkpoint {d} rank {r}")
                if note:
                    log.warning("%s", note)
                shards.append(sh)
        except CheckpointError as e:
            raise CriticServiceError(f"cannot load critic step {step}: {e}") from e
        return {"meta": meta, "shards": shards}

    def _apply_checkpoint(self, payload: dict[str, Any]) -> None:
        self._kept = None  # computed with the weights being replaced
        meta = payload["meta"]
        if self.is_rank0:
            for peer in range(1, self.tp_size):
                self._send_payload(peer, meta, payload["shards"][peer])
        mine = payload["shards"][0] if self.is_rank0 else payload["shards"]
        self.optimizer.load_state_tensors(mine["optim"], meta["optimizer"])
        # The model file holds fp32 weights (the masters) whatever the precision it was saved in.
        load_master_state_dict(self.critic, self.optimizer, mine["model"], what="critic checkpoint")
        restore_rng_state(mine["rng"])  # what _read_checkpoint's rng_to_restore kept
        self.critic_step = int(meta["critic_step"])
        self._results = OrderedDict(
            (int(k), P.TrainResult(**v))
            for k, v in sorted(meta["results"].items(), key=lambda kv: int(kv[0]))
        )
        self.last_saved_step = int(meta["step"])

    def _send_payload(
        self, peer: int, meta: dict[str, Any], shard: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        self._send(torch.tensor([blob.numel()], dtype=torch.int64), peer)
        self._send(blob, peer)
        for kind in sorted(shard):
            tensors = shard[kind]
            names = json.dumps(
                [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sorted(tensors.items())]
            ).encode()
            nb = torch.frombuffer(bytearray(names), dtype=torch.uint8)
            self._send(torch.tensor([nb.numel()], dtype=torch.int64), peer)
            self._send(nb, peer)
            for k in sorted(tensors):
                self._send(tensors[k], peer)

    def _recv_shards_from_rank0(self) -> dict[str, Any]:
        def recv_bytes() -> bytes:
            n = self._recv((1,), torch.int64, 0)
            return bytes(self._recv((int(n),), torch.uint8, 0).numpy())

        meta = json.loads(recv_bytes())
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for kind in ("model", "optim", "rng"):
            shards[kind] = {}
            for name, shape, dtype in json.loads(recv_bytes()):
                shards[kind][name] = self._recv(tuple(shape), getattr(torch, dtype), 0)
        return {"meta": meta, "shards": shards}
