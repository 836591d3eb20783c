"""The critic's maths on every TP rank: the infer forward (values, reward-model scores) and the
value update of one ``critic_train`` step, with the infer forward it may reuse.

The update is PPO's clipped value loss (:func:`aligner.rl.value_loss`) over ``optim.epochs``
passes of ``optim.num_minibatches`` minibatches, each followed by a clipped optimiser step. Its
first pass is the infer forward: with ``optim.reuse_infer_forward`` the last ``critic_infer``'s
forward is kept with its graph and taken as that pass when the train is of the same tokens,
which saves one forward and changes nothing (bit for bit).

Packed sequences (``max_tokens_per_micro_batch``, :mod:`aligner.models.packing`): every forward
here (values, scores, each training pass) runs over a replica's rows packed without padding, in
micro-batches of consecutive rows under the token budget (:func:`plan_micro_batches`, a function
of the lengths alone: every TP rank runs the same plan). A minibatch's gradient accumulates over
its micro-batches, each micro-batch's loss weighted by its share of the minibatch's loss on this
replica (its response tokens for ``token_mean``, its rows for ``seq_mean_token_mean``), so the
step is the unpacked one to float round-off. The infer forward is kept for the train only when
the replica's rows fit one micro-batch (keeping more would hold every micro-batch's activations
at once, which the budget is there to bound).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aligner import faults
from aligner.critic.config import CriticServerConfig
from aligner.critic.errors import CriticServiceError
from aligner.critic.replicas import row_slices
from aligner.distributed import ParallelState, comm_device
from aligner.models.forward import sequence_scores, sequence_scores_packed, token_values, token_values_packed
from aligner.models.packing import pack, plan_micro_batches
from aligner.rl import explained_variance, loss_start, value_loss
from aligner.wire.protocol import TrainRequest, TrainResult

__all__ = ["ValueUpdate"]

log = logging.getLogger("aligner.critic")


class ValueUpdate:
    """Forward and update of ``critic`` (trained by ``optimizer``), scores of ``reward_model``.

    Args:
        critic: the value model (this rank's TP shard), in eval mode between updates; None for a
            server in reward-only mode (:meth:`forward` then answers values of zeros, and
            :meth:`train_step` is never called).
        optimizer: the mixed-precision optimizer of :func:`aligner.precision.make_optimizer`,
            whole or sharded over the replicas (``optim.use_distributed_optimizer``; its step
            then all-gathers the weights); None without a critic.
        reward_model: the frozen reward model, or None.
        cfg: the server's configuration: ``optim`` (epochs, minibatches, value clipping, loss
            aggregation, gradient clipping), ``seed`` (with the step id, it seeds each step's
            minibatch permutation) and ``max_tokens_per_micro_batch`` (packed micro-batches, or
            None: one padded forward).
        state: this rank's place (device, TP group).
        reward_reads_text: the reward model reads its own tokenizer's ids (:meth:`score`), not
            the critic's: :meth:`forward` then computes values only.
    """

    def __init__(
        self,
        critic: torch.nn.Module | None,
        optimizer: Any,
        reward_model: torch.nn.Module | None,
        cfg: CriticServerConfig,
        state: ParallelState,
        *,
        reward_reads_text: bool = False,
    ) -> None:
        self.critic = critic
        self.optimizer = optimizer
        self.reward_model = reward_model
        self.scores_with_values = reward_model is not None and not reward_reads_text
        """Whether :meth:`forward` scores the critic's tokens with the reward model too."""
        self.optim = optim = cfg.optim
        self.seed = cfg.seed
        self.state = state
        self.max_tokens: int | None = getattr(cfg, "max_tokens_per_micro_batch", None)
        """The packed micro-batches' token budget; None: unpacked."""
        # critic_infer's forward kept (with its graph) as the next matching critic_train's first
        # pass: exact when the forward ignores train/eval mode (the fused path has no dropout)
        # and the first minibatch is the whole batch in order.
        self.reuse_infer_forward = bool(
            optim.reuse_infer_forward
            and optim.num_minibatches == 1
            and getattr(critic, "aligner_fused", None) is not None
        )
        self.kept: tuple[np.ndarray, torch.Tensor] | None = None
        """(tokens ``[b, s]``, their values ``[b, s-1]`` with the graph) of the last infer forward."""
        self.reused_forwards = 0
        """How many train steps took the kept forward as their first pass."""

    def forward(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """tokens [b, s], lengths [b] -> (values [b, s-1] float32, reward-model scores [b] or None:
        None without a reward model, or with one that reads text, which :meth:`score` runs).
        Without a critic (reward-only mode) the values are zeros.

        With ``reuse_infer_forward`` the values are computed with gradients and kept for
        :meth:`train_step` (whatever was kept before is dropped); packed, only when the rows fit
        one micro-batch. Packed, the values past each row's length are 0."""
        self.kept = None
        if self.critic is None:  # reward-only: no values to compute
            scores = self.score(tokens, lengths) if self.scores_with_values else None
            return np.zeros((tokens.shape[0], tokens.shape[1] - 1), dtype=np.float32), scores
        dev = self.state.device
        plan = self._plan(lengths)
        # Packed, the forward is kept only when it is one micro-batch (see the module's doc).
        keep = self.reuse_infer_forward and (plan is None or len(plan) == 1)
        if keep:
            # Copies of the server's own: the kept graph reads the token ids in its backward (the
            # embedding's; packed, the index built from the lengths too), and on a CPU
            # from_numpy(...).to(dev) shares the request's memory, which PyTriton hands to the
            # next request once this one is answered.
            tokens, lengths = tokens.copy(), np.array(lengths, copy=True)
        t = torch.from_numpy(tokens).to(dev)
        with torch.set_grad_enabled(keep):
            if plan is None:
                values = token_values(self.critic, t)  # [b, s-1]
            else:
                values = torch.cat([self._values_packed(t[part], lengths[part]) for part in plan])
        if keep:
            self.kept = (tokens, values)
        scores = self.score(tokens, lengths) if self.scores_with_values else None
        return values.detach().cpu().numpy().astype(np.float32, copy=False), scores

    def score(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The reward model's scores ``[b]`` float32 of ``tokens [b, s]`` (its own vocabulary's
        ids, right padded) read at each row's last token, ``lengths [b]``."""
        assert self.reward_model is not None
        dev = self.state.device
        plan = self._plan(lengths)
        with torch.no_grad():
            t = torch.from_numpy(np.ascontiguousarray(tokens)).to(dev)
            if plan is not None:
                parts = [sequence_scores_packed(self.reward_model, pack(t[p], lengths[p])) for p in plan]
                return torch.cat(parts).float().cpu().numpy()  # [b]
            n = torch.from_numpy(np.ascontiguousarray(lengths)).to(dev)
            return sequence_scores(self.reward_model, t, n).float().cpu().numpy()  # [b]

    def _plan(self, lengths: np.ndarray) -> list[slice] | None:
        """The packed micro-batches of rows of ``lengths [b]``, as slices (consecutive rows);
        None when packing is off."""
        if self.max_tokens is None:
            return None
        return [slice(int(p[0]), int(p[-1]) + 1) for p in plan_micro_batches(lengths, self.max_tokens)]

    def _values_packed(self, tokens: torch.Tensor, lengths: np.ndarray, start: int = 0) -> torch.Tensor:
        """The critic's values of ``tokens [n, s]`` (``lengths [n]``) in one packed forward:
        ``[n, s-1]``, as :func:`token_values` gives them at the real positions, 0 past them
        (and, with ``start``, before it)."""
        rows = pack(tokens, lengths)
        return rows.unpack(token_values_packed(self.critic, rows, start), tokens.shape[1])[:, :-1]

    def drop_kept(self) -> None:
        """Forget the kept forward (its weights are being replaced)."""
        self.kept = None

    def _take_kept(self, tokens: np.ndarray) -> torch.Tensor | None:
        """The kept infer forward's values (with their graph) if they are of exactly ``tokens``;
        whatever was kept is dropped either way (the weights are about to change)."""
        kept, self.kept = self.kept, None
        if kept is None or kept[0].shape != tokens.shape or not np.array_equal(kept[0], tokens):
            return None
        return kept[1]

    def _backward(
        self,
        batch: tuple,
        mine: torch.Tensor,
        start: int,
        kept: torch.Tensor | None,
        loss_share: float | None,
        first_pass_values: torch.Tensor | None,
    ) -> tuple[float, float]:
        """The value loss of this replica's rows ``mine`` (``[m]`` indices) of a minibatch and
        its backward (gradients accumulate in the optimizer's fp32 holders): ``(loss, value
        clip fraction)`` of those rows.

        ``batch``: the step's ``(tokens [b, s], returns, old_values, mask [b, s-1] on the
        device, response tokens per row [b] and lengths [b] on the host)``. ``start``: the
        values are computed from there on (later passes). ``kept``: the kept infer forward's
        values ``[m, s-1]`` (with their graph) to use instead of a forward. ``loss_share``:
        this replica's share of the minibatch's loss, which the backward is scaled by (None at
        DP=1: unscaled, bit for bit). ``first_pass_values``: ``[b, s-1]``, filled at ``mine``.

        Packed, the rows run in micro-batches (:func:`plan_micro_batches` in ``mine``'s order),
        each backward on its own, its loss weighted by its share of the rows' loss (response
        tokens for ``token_mean``, rows for ``seq_mean_token_mean``: every row has a response
        token) and its clip fraction by its share of the response tokens: their sums are the
        loss and clip fraction of the rows in one forward, to round-off.
        """
        o = self.optim
        tokens, returns, old_values, mask, row_tokens, lengths = batch
        host = mine.cpu().numpy()
        if kept is not None or self.max_tokens is None:
            parts = [np.arange(len(host))]
        else:
            parts = [p.numpy() for p in plan_micro_batches(lengths[host], self.max_tokens)]
        tokens_all = float(row_tokens[host].sum())
        loss_value = clipfrac_value = 0.0
        for part in parts:
            rows = mine if len(parts) == 1 else mine[torch.from_numpy(part)]
            if kept is not None:
                values = kept
            elif self.max_tokens is None:
                values = token_values(self.critic, tokens[rows], start)  # [mb, s-1]
            else:
                values = self._values_packed(tokens[rows], lengths[host[part]], start)
            loss, stats = value_loss(
                values, old_values[rows], returns[rows], mask[rows], clip_eps=o.value_clip_eps, agg=o.loss_agg
            )
            if first_pass_values is not None:
                first_pass_values[rows] = values.detach()
            weight = token_weight = 1.0
            if len(parts) > 1:
                part_tokens = float(row_tokens[host[part]].sum())
                token_weight = part_tokens / tokens_all if tokens_all > 0 else 0.0
                weight = token_weight if o.loss_agg == "token_mean" else len(part) / len(host)
            scale = weight * (1.0 if loss_share is None else loss_share)
            # One forward at DP=1: the loss is left as it is (bit for bit).
            (loss if len(parts) == 1 and loss_share is None else loss * scale).backward()
            loss_value += weight * loss.item()
            clipfrac_value += token_weight * float(stats["value_clipfrac"])
        return loss_value, clipfrac_value

    def _grad_norm_and_clip(self, max_norm: float | None) -> float:
        """Global norm of the fp32 (master) gradients over the TP group, clipped to ``max_norm``."""
        st = self.state
        return self.optimizer.clip_grad_norm(max_norm, st.tp_group, st.tp_size, st.tp_rank)

    def _share(self, mask: torch.Tensor, idx: torch.Tensor, mine: torch.Tensor) -> tuple[float, float]:
        """This replica's share of a minibatch ``idx`` (its rows ``mine``): of its loss (tokens
        for ``token_mean``, rows for ``seq_mean_token_mean``; every row has a response token)
        and of its tokens (what ``value_clipfrac`` is a mean over)."""
        tokens_all = float(mask[idx].sum())
        tokens_mine = float(mask[mine].sum()) if mine.numel() else 0.0
        token_share = tokens_mine / tokens_all if tokens_all > 0 else 0.0
        if self.optim.loss_agg == "token_mean":
            return token_share, token_share
        return mine.numel() / idx.numel(), token_share

    def _sum_over_replicas(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum the fp32 (master) gradients and ``stats`` (a 1-D float64 tensor) over the
        data-parallel group, in one collective; every replica gets the same bits, the whole
        gradient (a sharded optimizer then steps its slice of it). A replica without rows in
        this minibatch adds zeros."""
        st = self.state
        opt = self.optimizer
        opt.copy_grads_to_master()
        grads = []
        for m in opt.grad_params:
            if m.grad is None:
                m.grad = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
            grads.append(m.grad)
        flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads] + [stats.to(torch.float64)])
        flat = flat.to(comm_device())
        dist.all_reduce(flat, group=st.dp_group)
        flat = flat.to(grads[0].device)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[offset:]

    def train_step(self, req: TrainRequest) -> TrainResult:
        """Apply ``req`` (validated): every epoch and minibatch, on every TP rank alike.

        Under data parallelism every rank receives the whole batch; in each minibatch replica
        ``r`` takes its rows (:func:`~aligner.critic.replicas.row_slices` of the minibatch's
        rows), and the gradients are summed over the replicas weighted by their share of the
        minibatch's loss (:meth:`_share`), in fp64: the step equals the DP=1 step on the whole
        minibatch up to float rounding, and is the same on every replica. Packed, each
        replica's rows of a minibatch run in micro-batches whose gradients accumulate
        (:meth:`_backward`): the same step, to round-off.

        A non-finite loss or gradient norm skips that optimiser step; in the first minibatch it
        fails the step with nothing applied (:class:`CriticServiceError`).
        """
        o = self.optim
        st = self.state
        dev = st.device
        tokens = torch.from_numpy(np.ascontiguousarray(req.tokens)).to(dev)  # [b, s]
        returns = torch.from_numpy(np.ascontiguousarray(req.returns)).to(dev)  # [b, s-1]
        old_values = torch.from_numpy(np.ascontiguousarray(req.old_values)).to(dev)  # [b, s-1]
        mask = torch.from_numpy(np.ascontiguousarray(req.mask)).to(dev)  # [b, s-1]
        # Host copies for planning and weighting the packed micro-batches (no device syncs).
        lengths = np.asarray(req.lengths).reshape(-1)  # [b]
        row_tokens = np.asarray(req.mask, dtype=np.float64).sum(axis=1)  # [b] response tokens per row
        b = tokens.shape[0]
        replicated = st.dp_size > 1
        # Same permutation on every rank: the generator depends on (seed, step, epoch) only.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + req.step)
        kept = None
        if o.num_minibatches == 1:  # the first minibatch is every row in order: this replica's slice
            kept = self._take_kept(req.tokens[row_slices(b, st.dp_size)[st.dp_rank]])
        # Values before the first masked position feed no loss: after the first pass the last
        # layer starts there. The first pass is the infer forward (kept or recomputed the same
        # way, so that reusing it changes nothing), which covers every position. Taken over the
        # whole batch, so that every replica computes the positions DP=1 computes.
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
                mine = idx[row_slices(idx.numel(), st.dp_size)[st.dp_rank]]  # this replica's rows
                self.optimizer.zero_grad(set_to_none=True)
                loss_share, token_share = self._share(mask, idx, mine) if replicated else (1.0, 1.0)
                loss_value = clipfrac_value = 0.0
                if mine.numel():
                    # One minibatch: mine is this replica's slice, what the kept forward is of.
                    reuse = kept if epoch == 0 else None
                    batch = (tokens, returns, old_values, mask, row_tokens, lengths)
                    loss_value, clipfrac_value = self._backward(
                        batch,
                        mine,
                        start if epoch else 0,
                        reuse,
                        loss_share if replicated else None,
                        first_pass_values if epoch == 0 else None,
                    )
                faults.SERVER.hit("train", req.step)  # tests only: a crash mid-step (aligner.faults)
                if replicated:
                    # The minibatch's loss and clip fraction: the replicas' shares of them, summed.
                    summed = self._sum_over_replicas(
                        torch.tensor(
                            [loss_value * loss_share, clipfrac_value * token_share], dtype=torch.float64
                        )
                    )
                    loss_value, clipfrac_value = float(summed[0]), float(summed[1])
                norm = self._grad_norm_and_clip(o.grad_clip or None)
                if not (math.isfinite(norm) and math.isfinite(loss_value)):
                    # Every rank sees the same (all-reduced) norm and loss, so all skip together.
                    self.optimizer.zero_grad(set_to_none=True)
                    if not losses:
                        self.critic.eval()
                        raise CriticServiceError(
                            f"train step {req.step}: non-finite loss {loss_value} or gradient norm {norm}; "
                            "nothing was applied"
                        )
                    log.warning(
                        "train step %d: non-finite loss or gradient norm in a later minibatch; that "
                        "update was skipped (earlier ones of this step stay applied)",
                        req.step,
                    )
                    continue
                self.optimizer.step()
                losses.append(loss_value)
                norms.append(norm)
                clipfracs.append(clipfrac_value)
        self.optimizer.zero_grad(set_to_none=True)
        self.critic.eval()
        if replicated:  # each replica filled its own rows; the others are zero
            first_pass_values = first_pass_values.to(comm_device())
            dist.all_reduce(first_pass_values, group=st.dp_group)
            first_pass_values = first_pass_values.to(dev)
        ev = float(explained_variance(first_pass_values, returns, mask))
        return TrainResult(
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(norms)),
            applied_step=req.step,
            explained_variance=ev,
            value_clipfrac=float(np.mean(clipfracs)),
        )
