"""The rollout worker role (``aligner-rollout``): a generation engine in processes of its own,
fed the trainer's weights by version (:mod:`aligner.rollout.worker`)."""
