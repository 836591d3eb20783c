"""A rollout worker's own scores (``rollout.score_on_workers``): the worker asks the
critic/reward server for the scores of each batch it generated, as the trainer would have, and
sends them with the batch. The trainer then never waits for them: the reward function (or model)
runs while the trainer trains, beside the generation of the next batch.

For critic-free estimators only (grpo, rloo, reinforce_pp): they need the scores alone, and a
score does not depend on when it is asked for, so the run is the one the trainer scoring its own
batches makes, every number. The ask carries what the trainer would have sent beside the tokens:
each row's prompt text and extra data-set columns; the worker adds the response texts, cut at the
same stop ids. The client sends the server only the inputs it names (``infer_inputs``).
"""

from __future__ import annotations

import time
from typing import Any

from aligner.actor.critic_link import checked_client, sample_texts
from aligner.generation.engine import GenerationOutput
from aligner.wire.readiness import resolve_critic_url

__all__ = ["WorkerScorer"]


class WorkerScorer:
    """One worker's client of the server, checked against it once at start."""

    def __init__(self, cfg: Any, tokenizer: Any, stop_ids: tuple[int, ...]) -> None:
        self.url = resolve_critic_url(cfg.critic.url)
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        # No run token: critic_infer needs none. No restart watch: a score is the server's reward
        # function (or model) of the sample, the same from any server process.
        self.client = checked_client(cfg, self.url, tokenizer)

    def score(self, gen: GenerationOutput, meta: dict[str, Any]) -> tuple[list[float], float]:
        """The scores of ``gen`` (float32 values, as JSON floats: exact) and the seconds taken;
        ``meta``: the ask, with the rows' ``prompt_texts`` and ``extras``."""
        t0 = time.perf_counter()
        _, responses = sample_texts(
            self.tokenizer, gen.tokens, gen.lengths, gen.prompt_lengths, self.stop_ids
        )
        future = self.client.infer(
            gen.tokens.cpu().numpy(),
            gen.lengths.cpu().numpy(),
            gen.prompt_lengths.cpu().numpy(),
            int(meta["step"]),
            prompt_texts=meta.get("prompt_texts"),
            response_texts=responses,
            extras=meta.get("extras"),
        )
        _, rewards = future.result()
        return [float(x) for x in rewards.tolist()], time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()
