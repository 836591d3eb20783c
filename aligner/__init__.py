"""RLHF with PPO: a Megatron-core actor and a PyTriton critic/reward server."""

__version__ = "0.1.0"
