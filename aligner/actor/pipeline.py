"""The policy's and the reference's forwards and backwards under pipeline parallelism, through
Megatron's pipeline schedule (``get_forward_backward_func``: 1F1B across the stages).

Each rank holds one stage. A call cuts this rank's rows into micro-batches (the last one padded
with copies of a real row, whose outputs are dropped, because the schedule's stage-to-stage
buffers have one shape per call), runs them through the schedule, and the last stage, which alone
has logits, computes what the caller asks of them:

- :meth:`PipelineSchedule.no_grad`: the log-probs (and entropy) ``[b, s-1]`` of the rows, in eval
  mode and without gradients, then broadcast from the last stage to every stage of the pipeline,
  so that every rank of a data-parallel replica continues the step with the same tensors;
- :meth:`PipelineSchedule.train`: a loss per micro-batch (the clipped surrogate); the schedule
  runs each stage's backward, and the loss's statistics, summed (or averaged) over the
  micro-batches, reach every stage. The stages' gradients of a tied embedding are then summed
  over Megatron's embedding group (first and last stage) by
  :func:`allreduce_tied_embedding_grads`, on the optimizer's fp32 masters under mixed precision,
  as Megatron's optimizer does.

What the gradients are of (``reduce``): Megatron's schedule divides each micro-batch's loss by
the number of micro-batches before its backward (``reduce="mean"``: the mean of the micro-batch
losses, Megatron's convention). The PPO update's micro-batch losses are already divided by the
count of the whole global minibatch (:func:`aligner.rl.aggregate`'s ``normaliser``), so it asks
for their sum (``reduce="sum"``): the loss goes to backward as it is (the schedule is told the
loss is final, Megatron's ``calculate_per_token_loss``), as the unpipelined path takes it, and the
gradients of one minibatch are the same under both.

Micro-batches here are always ``micro_batch_size`` rows of the padded length, never packed
(``ppo.max_tokens_per_micro_batch`` does not apply under PP > 1): Megatron's schedule sends
activations ``[s, micro_batch_size, h]`` of one fixed shape from stage to stage (the receiving
stage allocates its buffer from ``seq_length`` and ``micro_batch_size`` before it knows what
comes), which micro-batches of varying packed lengths would break.

Shapes: ``b`` rows, ``s`` padded length, ``v`` this TP rank's vocabulary shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from aligner.actor.logprobs import PolicyLogprobs
from aligner.distributed import ParallelState, broadcast_json
from aligner.models import gpt

__all__ = ["PipelineSchedule", "allreduce_tied_embedding_grads"]

#: ``loss_fn(logits [m, s - start, v], rows [m]) -> (loss, {name: float tensor})`` for one micro-batch.
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def allreduce_tied_embedding_grads(
    model: torch.nn.Module, state: ParallelState, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Sum the gradient of the word embedding tied to the LM head over the first and the last
    pipeline stage (each holds a copy; Megatron's ``_allreduce_word_embedding_grads``), in fp32,
    so that both copies take the same step. With a mixed-precision ``optimizer`` (its fp32
    masters collect the gradients during backward) the master's gradient is the one summed.
    A no-op without pipeline parallelism, tied weights or a trained embedding; collective over
    the embedding group, whose two stages agree on all three."""
    m = gpt.unwrap(model)
    if state.pp_size == 1 or not m.share_embeddings_and_output_weights:
        return
    if state.embedding_group is None:  # a middle stage
        return
    weight = m.shared_embedding_or_output_weight()
    if weight is None or not weight.requires_grad:
        return
    target = weight
    if optimizer is not None and hasattr(optimizer, "grad_params"):  # the fp32 gradient's holder
        optimizer.copy_grads_to_master()
        target = next(mt for p, mt in zip(optimizer.model_params, optimizer.grad_params) if p is weight)
    grad = target.grad if target.grad is not None else torch.zeros_like(target)
    total = grad.float()
    dist.all_reduce(total, group=state.group("embedding"))
    target.grad = total.to(grad.dtype)


class PipelineSchedule:
    """Forwards and backwards of a pipeline-parallel policy (or reference) on this rank's stage."""

    def __init__(self, state: ParallelState, logprobs: PolicyLogprobs) -> None:
        if state.pp_size < 2:
            raise ValueError(f"PipelineSchedule needs pipeline_model_parallel_size >= 2, got {state.pp_size}")
        self.state, self.logprobs = state, logprobs
        self._last = dist.get_global_rank(state.pp_group, state.pp_size - 1)

    # -- the two calls -------------------------------------------------------------------------

    def no_grad(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        micro_batch_size: int,
        *,
        with_entropy: bool = False,
        start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[b, s-1]`` (and entropy ``[b, s-1]``) of ``tokens [b, s]`` in eval mode,
        without gradients, on every stage; 0 before ``start`` (as
        :meth:`PolicyLogprobs.no_grad`)."""
        lp_ = self.logprobs

        def outputs(logits: torch.Tensor, rows: torch.Tensor):
            batch = tokens[rows]
            out = {"logprobs": lp_.sequence_logprobs(logits, batch, start)}
            if with_entropy:
                out["entropy"] = lp_.entropy(logits, start)
            return logits.new_zeros(()), out

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                parts = self._run(model, tokens, micro_batch_size, outputs, start, forward_only=True)
        finally:
            model.train(was_training)
        b, s = tokens.shape
        keys = ["logprobs"] + (["entropy"] if with_entropy else [])
        out = []
        for key in keys:
            if self.state.is_last_stage:
                t = torch.cat([p[key] for p in parts])[:b].float().contiguous()
            else:
                t = torch.empty(b, s - 1, dtype=torch.float32, device=tokens.device)
            dist.broadcast(t, self._last, group=self.state.pp_group)
            out.append(t)
        return out[0], (out[1] if with_entropy else None)

    def train(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        micro_batch_size: int,
        loss_fn: LossFn,
        start: int,
        *,
        reduce: str = "mean",
    ) -> dict[str, float]:
        """Forward and backward of every micro-batch of ``tokens [b, s]`` (``b`` divisible by
        ``micro_batch_size``), accumulating gradients into the stage's parameters. ``reduce``:
        ``"mean"``, the gradients of the mean of the micro-batch losses (Megatron's convention)
        and the mean of each statistic ``loss_fn`` reports; ``"sum"``, the gradients of their
        sum (losses already divided by a whole batch's count) and the sum of each statistic.
        Returns the statistics, on every stage. A tied embedding's two copies still hold their
        own stage's gradient: :func:`allreduce_tied_embedding_grads` sums them."""
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if tokens.shape[0] % micro_batch_size:
            raise ValueError(f"{tokens.shape[0]} rows do not split into micro-batches of {micro_batch_size}")
        n = tokens.shape[0] // micro_batch_size if reduce == "mean" else 1

        def with_stats(logits: torch.Tensor, rows: torch.Tensor):
            loss, stats = loss_fn(logits, rows)
            # Copies: the schedule may divide the loss in place, and a detached statistic may
            # share the loss's storage. In float64: sums of counts stay exact.
            return loss, {k: torch.as_tensor(v).detach().double().clone() for k, v in stats.items()}

        parts = self._run(
            model, tokens, micro_batch_size, with_stats, start, forward_only=False, final_loss=reduce == "sum"
        )
        stats: dict[str, float] = {}
        if self.state.is_last_stage:
            for part in parts:
                for k, v in part.items():
                    stats[k] = stats.get(k, 0.0) + float(v) / n
        return broadcast_json(stats, self._last, group=self.state.pp_group)

    # -- the schedule ----------------------------------------------------------------------------

    def _run(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        micro_batch_size: int,
        on_logits: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
        start: int,
        *,
        forward_only: bool,
        final_loss: bool = False,
    ) -> list[dict[str, Any]]:
        """Run ``tokens`` through the schedule in micro-batches of ``micro_batch_size`` rows;
        ``on_logits(logits, row indices)`` on the last stage gives each micro-batch's loss and
        outputs. ``final_loss``: each loss goes to backward as it is; else the schedule divides
        it by the number of micro-batches. Returns the outputs (the last stage's; empty
        elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, s = tokens.shape
        mbs = min(micro_batch_size, b)
        batches = []
        for i in range(0, b, mbs):
            rows = torch.arange(i, min(i + mbs, b), device=tokens.device)
            if len(rows) < mbs:  # the schedule's buffers are [s, mbs, h]: pad with row 0
                rows = torch.cat([rows, rows.new_zeros(mbs - len(rows))])
            batches.append(rows)
        m = gpt.unwrap(model)
        # Stage-to-stage buffers in the dtype the stage computes in (bf16 once mixed precision
        # has cast the policy).
        m.config.pipeline_dtype = next(m.parameters()).dtype

        def forward_step(data_iterator, module):
            rows = next(data_iterator)
            batch = tokens[rows]
            out = module(batch, gpt.position_ids_for(batch), attention_mask=None)

            def loss_func(output: torch.Tensor):
                logits = self.logprobs.masked(output.float()[:, start:])
                loss, outputs = on_logits(logits, rows)
                if final_loss:
                    # Megatron's (loss, num_tokens, outputs) form under calculate_per_token_loss:
                    # the loss is not divided (the token count only adds up in a counter no
                    # finalize step reads: this project sets no finalize_model_grads_func).
                    return loss, torch.ones((), dtype=torch.int), outputs
                return loss, outputs

            return out, loss_func

        per_token = m.config.calculate_per_token_loss
        m.config.calculate_per_token_loss = final_loss
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=len(batches),
                seq_length=s,
                micro_batch_size=mbs,
                forward_only=forward_only,
            )
        finally:
            m.config.calculate_per_token_loss = per_token
