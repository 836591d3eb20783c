"""Shared by the actor's one-process part tests (tests/actor/test_actor_*.py): the parallel
state of a single rank on the CPU."""

from __future__ import annotations

import torch

from aligner.distributed import ParallelState

ONE_RANK = ParallelState(0, 1, 0, 1, 0, 1, 0, 1, torch.device("cpu"), None, None, None)
