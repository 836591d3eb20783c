"""A rollout worker's own scores (``rollout.score_on_workers``): the worker asks the
critic/reward server for the scores of each batch it generated (and the critic's values, for
GAE), as the trainer would have, and sends them with the batch. The trainer then never waits for
them: the reward function (or model) and the critic's forward run while the trainer trains,
beside the generation of the next batch.

A score does not depend on when it is asked for. Values do: the ask names the critic step they
must come from (``after_step``: the one the trainer itself would name for that step under the
fixed schedule, and the server waits for that critic update; any step under the dynamic one),
so with either estimator the fixed schedule's run is the one the trainer asking makes, every
number. The ask carries what the trainer would have sent beside the tokens:
each row's prompt text and extra data-set columns; the worker adds the response texts, cut at the
same stop ids. The client sends the server only the inputs it names (``infer_inputs``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

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

    def score(
        self, gen: GenerationOutput, meta: dict[str, Any]
    ) -> tuple[list[float], torch.Tensor | None, float]:
        """The scores of ``gen`` (float32 values, as JSON floats: exact), the critic's values
        ``[b, s-1]`` float32 when the ask names the critic step they come from (``after_step``;
        else None) and the seconds taken; ``meta``: the ask, with the rows' ``prompt_texts`` and
        ``extras``."""
        after_step = meta.get("after_step")
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
            after_step=after_step,
        )
        values, rewards = future.result()
        values = None if after_step is None else torch.as_tensor(values, dtype=torch.float32)
        return [float(x) for x in rewards.tolist()], values, time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()
