"""What ``server_info`` tells of a :class:`~aligner.critic.service.CriticService`: the contract a
client checks before it sends anything (protocol, limits, tokenizer, critic step, instance), and
for a caller with the run token (:func:`aligner.critic.security.info_for`) what the server runs
with, what it has done, and its capacity (queue bound and memory budget, when the server that
binds the service to Triton gives them: :attr:`CriticService.capacity`)."""

from __future__ import annotations

import os
from typing import Any

from aligner.wire.protocol import INFER, PROTOCOL_VERSION, ServerInfo

__all__ = ["service_info"]


def service_info(svc: Any) -> ServerInfo:
    """What clients check before they send anything, of ``svc`` (a CriticService: this module is
    below it, so it names no type)."""
    c = svc.cfg
    return ServerInfo(
        protocol_version=PROTOCOL_VERSION,
        vocab_size=svc.limits.vocab_size,
        max_seq_len=svc.limits.max_seq_len,
        tokenizer=c.tokenizer,
        tokenizer_fingerprint=svc.tokenizer.fingerprint(),
        critic_step=svc.critic_step,
        max_batch_size=svc.limits.max_batch,
        max_train_batch=svc.limits.max_train_batch,
        reward={
            "fn": c.reward.fn,
            "fn_convention": svc.reward_fn.convention if svc.reward_fn is not None else None,
            "fn_calls": svc.reward_fn.stats() if svc.reward_fn is not None else None,
            "fn_kwargs": sorted(c.reward.fn_kwargs),
            "model_path": c.reward.model_path,
            "hf_path": c.reward.hf_path,
            "fn_scale": c.reward.fn_scale,
            "model_mean": c.reward.model_mean,
            "model_std": c.reward.model_std,
            "model": svc.rm_cfg.to_dict() if svc.rm_cfg is not None else None,
            # A reward model that reads text: its tokenizer, and how many samples it read and
            # cut from the left to its max_seq_len since start-up.
            "text": None
            if svc.reward_tokens is None
            else {
                "tokenizer": svc.reward_tokens.spec,
                "chat_template": svc.reward_tokens.chat_template,
                "max_len": svc.reward_tokens.max_len,
                "rows": svc.reward_tokens.rows,
                "truncated": svc.reward_tokens.truncated,
            },
        },
        infer_inputs=svc.infer_inputs,
        critic=not svc.reward_only,
        model={} if svc.reward_only else svc.model_cfg.to_dict(),
        parallel={
            "tensor_model_parallel_size": svc.tp_size,
            "pipeline_model_parallel_size": 1,
            "data_parallel_size": svc.dp_size,
        },
        last_saved_step=svc.last_saved_step,
        checkpoint_steps=[] if svc.checkpoints is None else svc.checkpoints.steps(),
        instance_id=svc.instance_id,
        run_token_required=svc.run_token is not None,
        batching={
            "dynamic_batching": c.server.dynamic_batching,
            "max_queue_delay_us": c.server.max_queue_delay_us,
            **svc.request_stats.batching(INFER),
        },
        infer_wait_s=float(c.server.infer_wait_s),
        extra={
            "mode": svc.cfg.mode,
            "init_source": svc.init_source,
            "pid": os.getpid(),
            "started_at": svc.started_at,
            "optim": dict(vars(c.optim)),
            "precision": svc.precision,
            "model_forward": svc.model_forward,
            "reuse_infer_forward": svc.reuse_infer_forward,
            "reused_infer_forwards": svc.reused_forwards,
            "infer_after_step": svc.order.stats(),
            "requests": svc.request_stats.lifetime(),
            "metrics_dropped": svc.metric_failures.count + getattr(svc.metrics, "dropped", 0),
            "capacity": svc.capacity() if svc.capacity is not None else None,
        },
    )
