"""Which Megatron ``GPTModel`` instances a forward over the model's own parameters reproduces.

Two forwards bypass Megatron's module forward and compute the same function directly on the
model's parameter tensors: the lean KV-cache decoder (:mod:`aligner.generation.decoder`) and
the fused full-sequence forward (:mod:`aligner.models.fused`), with attention by SDPA
(:mod:`aligner.models.attention`: Megatron's results to the kernels' round-off). Both apply
only to the architecture :mod:`aligner.models.gpt` builds with Megatron's local layer spec
(pre-norm, RMSNorm/LayerNorm, RoPE (plain or with scaled frequencies: the tables come from the
model's own rotary embedding) or learned absolute positions, MHA/GQA/MQA, any head width,
optional q/k norms per head, optional biases, gated or plain MLP, tied or untied head, TP
without sequence parallelism); :func:`unsupported_reason` says whether a model is one, and if not,
why. Anything else runs Megatron's own forward.
"""

from __future__ import annotations

from torch import nn

__all__ = ["unsupported_reason", "qk_norms"]


def _is_identity(m) -> bool:
    return m is None or type(m).__name__ in ("IdentityOp", "IdentityFuncOp", "Identity")


def qk_norms(attention: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """An attention module's ``(q_layernorm, k_layernorm)``, or None when it has none."""
    q, k = getattr(attention, "q_layernorm", None), getattr(attention, "k_layernorm", None)
    if _is_identity(q) and _is_identity(k):
        return None
    return q, k


def _qk_norm_problem(attention: nn.Module, head_dim: int) -> str | None:
    norms = qk_norms(attention)
    if norms is None:
        return None
    for name, m in zip(("q_layernorm", "k_layernorm"), norms):
        if type(m) not in (nn.RMSNorm, nn.LayerNorm):
            return f"{name} is a {type(m).__name__}, not a torch RMSNorm/LayerNorm"
        if tuple(m.normalized_shape) != (head_dim,):
            return f"{name} normalises {tuple(m.normalized_shape)}, not one head ({head_dim},)"
        if m.weight is None or (type(m) is nn.LayerNorm and m.bias is None):
            return f"{name} has no affine weights"
    return None


def unsupported_reason(
    model: nn.Module, heads: tuple[str, ...] = ("lm",), *, stage: bool = False
) -> str | None:
    """None when a forward over ``model``'s own parameters (the lean decoder, the fused
    forward) computes what ``model``'s forward does (to the attention kernels' round-off),
    else why not. ``heads``: the heads
    (``model.aligner_head``) accepted; the lean decoder needs an LM head, the trunk is the same
    for all (:mod:`aligner.models.fused` accepts value and reward heads). ``stage``: ``model``
    may be one pipeline stage, and what it holds is checked as a part of a whole model of the
    same architecture (an engine that owns its weights gathers the whole model from the
    stages)."""
    if type(model).__name__ != "GPTModel":
        return f"model is a {type(model).__name__}, not a megatron GPTModel"
    if not stage and not (model.pre_process and model.post_process):
        return "pipeline-parallel stage (pre_process/post_process not both set)"
    if getattr(model, "aligner_head", "lm") not in heads:
        return f"head {getattr(model, 'aligner_head', 'lm')!r} is not one of {list(heads)}"
    cfg = model.config
    checks = {
        "multi_latent_attention": getattr(cfg, "multi_latent_attention", False),
        "mtp_num_layers": getattr(cfg, "mtp_num_layers", None),
        "sequence_parallel": cfg.sequence_parallel,
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "fp32_residual_connection": cfg.fp32_residual_connection,
        "apply_query_key_layer_scaling": getattr(cfg, "apply_query_key_layer_scaling", False),
        "attention_output_gate": getattr(cfg, "attention_output_gate", False),
        "num_moe_experts": getattr(cfg, "num_moe_experts", None),
        "qk_l2_norm": getattr(cfg, "qk_l2_norm", False),
        "no_rope_freq": getattr(cfg, "no_rope_freq", None),
        "activation_func_clamp_value": getattr(cfg, "activation_func_clamp_value", None),
        "glu_linear_offset": getattr(cfg, "glu_linear_offset", 0.0),
        "flash_decode": getattr(cfg, "flash_decode", False),
    }
    on = [k for k, v in checks.items() if v]
    if on:
        return f"config options not handled by the lean path: {on}"
    if getattr(cfg, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={cfg.softmax_type!r}"
    if model.position_embedding_type not in ("rope", "learned_absolute"):
        return f"position_embedding_type={model.position_embedding_type!r}"
    if model.position_embedding_type == "rope":
        if cfg.rotary_interleaved:
            return "interleaved RoPE"
        rot_dim = model.rotary_pos_emb.inv_freq.numel() * 2
        if rot_dim != cfg.kv_channels:
            return f"partial RoPE (rotary dim {rot_dim} != head dim {cfg.kv_channels})"
    if cfg.num_query_groups is not None and cfg.num_query_groups < cfg.tensor_model_parallel_size:
        return "fewer query groups than tensor-parallel ranks"
    for i, layer in enumerate(model.decoder.layers):
        names = (type(layer).__name__, type(layer.self_attention).__name__, type(layer.mlp).__name__)
        if names != ("TransformerLayer", "SelfAttention", "MLP"):
            return f"layer {i} is {names}"
        att = layer.self_attention
        problem = _qk_norm_problem(att, cfg.kv_channels)
        if problem is not None:
            return f"layer {i}: {problem}"
        flag = bool(getattr(cfg, "qk_layernorm", False))
        if (qk_norms(att) is not None) != flag:
            return f"layer {i} {'has no' if flag else 'has'} q/k norms, but config.qk_layernorm={flag}"
        if not _is_identity(getattr(layer, "cross_attention", None)):
            return f"layer {i} has cross attention"
        if _is_identity(layer.input_layernorm) or _is_identity(layer.pre_mlp_layernorm):
            return f"layer {i} fuses its layernorm into a linear layer"
    if getattr(model.decoder, "final_layernorm", None) is None and model.post_process:
        return "no final layernorm"
    return None
