"""The actor's PPO loop: configuration, the trainer recipe and its checkpoints.

The maths it runs (log-probs, KL estimators, reward shaping, GAE, losses, KL controllers) is
:mod:`aligner.rl`, shared with the critic server. Nothing is imported here so that importing
the package stays cheap.
"""
