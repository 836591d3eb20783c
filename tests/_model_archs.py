"""Shared by the forward tests (tests/models/test_fused_forward.py, test_packing.py): the
architectures the fused forward reproduces, as ModelConfig overrides, and the three heads'
builders."""

from __future__ import annotations

from aligner.models import gpt

ARCHS = {
    "llama": dict(),
    "gqa": dict(num_query_groups=2),
    "gpt2": dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding="learned_absolute",
        add_bias_linear=True,
        tie_embeddings=True,
    ),
    # Qwen3-style: heads 32 wide (not 64 / 4), per-head q/k RMSNorm, and Llama 3.1's RoPE
    # scaling with an original context of 8 (the tokens run past it).
    "qwen3": dict(
        num_query_groups=2,
        kv_channels=32,
        qk_layernorm=True,
        rope_scaling="llama3",
        rope_original_max_position=8,
    ),
}
HEADS = {"lm": gpt.build_policy, "value": gpt.build_critic, "reward": gpt.build_reward_model}
