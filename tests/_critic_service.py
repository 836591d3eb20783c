"""Shared by the in-process CriticService tests (tests/critic/test_critic_service*.py): a tiny
service on the module's parallel state, and a batch of digit-sorting samples to infer and train on."""

from __future__ import annotations

import numpy as np

from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays


def _service(pstate, root, precision: str | None = None, **sections) -> CriticService:
    cfg = tiny_config(root, **sections)
    if precision is not None:  # default: the config's 'auto'
        cfg["precision"] = precision
    return CriticService(build_config(cfg), pstate)


def _batch(svc, b=4, seed=0):
    tokens, lengths, pl, prompts, responses = digit_batch(svc.tokenizer, b, seed=seed)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=seed)
    return tokens, lengths, pl, returns, old_values, mask, prompts, responses


def assert_values_of_real_positions(got, want, lengths, atol: float = 0.0) -> None:
    """critic_infer's ``values [b, s-1]`` against a padded forward's ``want``: equal (to ``atol``)
    at each row's real positions ``t < lengths`` (capped at ``s - 1``); after them the packed forward
    (``max_tokens_per_micro_batch``) computes nothing and nothing reads them."""
    got, want = np.asarray(got), np.asarray(want)
    real = np.arange(got.shape[1])[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=atol)


def concurrently(fns: list) -> list:
    """Run each function in its own thread, released together (a barrier), so that the server
    gets their requests at once; their results, or the exceptions they raised, in order."""
    import threading

    results: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns))

    def run(i):
        barrier.wait()
        try:
            results[i] = fns[i]()
        except Exception as e:  # the caller looks at what each one got
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results
