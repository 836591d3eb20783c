"""Megatron-core GPT models (policy, critic, reward model) and HF checkpoint conversion."""
