"""Run under ``torchrun --nproc_per_node 2``: builds a policy at the requested TP/PP, runs a
forward and backward through Megatron's pipeline schedule, and checks the parallel layout.

Prints ``RESULT <json>`` from global rank 0. Used by tests/test_distributed.py.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from aligner import distributed
from aligner.models import forward, gpt
from aligner.models.config import ModelConfig


def main(tp: int, pp: int) -> None:
    state = distributed.initialize(distributed.ParallelConfig(tp, pp), seed=7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, max_seq_len=16)
    model = gpt.build_policy(cfg)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.manual_seed(0)  # same data on every rank
    tokens = torch.randint(0, 16, (4, 12))

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = (
            forward.policy_logits(model, batch)
            if state.pp_size == 1
            else model(batch, gpt.position_ids_for(batch), attention_mask=None)
        )

        def loss_func(output):
            loss = output.float().pow(2).mean()
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[model],
        num_microbatches=1,
        seq_length=12,
        micro_batch_size=4,
        forward_only=False,
    )
    grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)

    # The small collectives: rank 0 decides, every rank gets its answer or its error.
    decided = distributed.on_rank0(lambda: {"from": dist.get_rank()})
    errors = []
    for carried in ((), (KeyError,)):

        def fail() -> None:
            raise KeyError(f"only on rank {dist.get_rank()}")

        try:
            distributed.on_rank0(fail, carried=carried)
        except Exception as e:
            errors.append([type(e).__name__, str(e)])
    result = {
        "rank": state.rank,
        "world": state.world_size,
        "tp": [state.tp_rank, state.tp_size],
        "pp": [state.pp_rank, state.pp_size],
        "dp": [state.dp_rank, state.dp_size],
        "device": str(state.device),
        "has_grads": grads > 0,
        "loss": float(losses[0]["loss"]) if losses else None,
        "decided": decided,
        "errors": errors,
        "gathered": distributed.all_gather_json({"rank": state.rank}),
        "mp_ranks": dist.get_process_group_ranks(state.group("mp")),
        "in_embedding_group": state.group("embedding") is not None,
    }
    gathered = [None] * state.world_size
    dist.all_gather_object(gathered, result)
    if state.rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    distributed.destroy()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
