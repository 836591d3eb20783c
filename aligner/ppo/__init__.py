"""PPO for language models.

``aligner.ppo.core`` holds the numerics (log-probs, KL estimators, reward shaping, GAE,
losses, KL controllers) as pure tensor functions. It is deliberately not imported here so
that importing the package stays cheap and free of import cycles with the trainer modules
that also live in this package.
"""
