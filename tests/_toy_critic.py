"""A stand-in for the critic server and its client in one process (:class:`ToyCritic`, a
:class:`~aligner.wire.handle.CriticHandle`): a critic whose values depend on every update it
applied, checkpoints by step, and the client's fencing; it can "restart" during or after a given
update. The actor's recovery tests and the LoRA resume test run the real trainer against it."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from aligner.tasks import get_task
from aligner.tokenizers import CharTokenizer
from aligner.wire import protocol as P
from aligner.wire.handle import CriticRestartedError

TOK = CharTokenizer()


class ToyCritic:
    """A critic server and its client in one object (:class:`CriticHandle`).

    The critic is one number ``w``: values are ``w * token / 10`` and each update adds a tenth
    of the mean masked return, so every value depends on every update applied before. Scores
    are the copy task's. ``restart_in_train=N``: the server restarts while it runs the update of
    step N (not applied; the request fails as a reconnect to another instance);
    ``restart_after_train=N``: it restarts right after applying it (the next update is
    fenced). Either way it comes back with its newest checkpoint.
    """

    url = "toy://critic"

    def __init__(self, restart_in_train: int | None = None, restart_after_train: int | None = None) -> None:
        self.w, self.critic_step, self.expected = 0.0, -1, -1
        self.checkpoints: dict[int, tuple[float, int]] = {0: (0.0, 0)}  # checkpoint.save_initial
        self.instance = 1
        self.restarted: CriticRestartedError | None = None
        self.restart_in_train, self.restart_after_train = restart_in_train, restart_after_train
        self.save_error: Exception | None = None
        self.applied: list[int] = []

    # -- the server's state --------------------------------------------------------------------

    def server_info(self) -> P.ServerInfo:
        return P.ServerInfo(
            protocol_version=P.PROTOCOL_VERSION,
            vocab_size=TOK.vocab_size,
            max_seq_len=32,
            tokenizer="char",
            tokenizer_fingerprint=TOK.fingerprint(),
            critic_step=self.critic_step,
            max_batch_size=64,
            max_train_batch=64,
            checkpoint_steps=sorted(self.checkpoints),
            instance_id=f"toy{self.instance}",
        )

    def _come_back(self) -> None:
        """Killed and started again: the newest checkpoint, as checkpoint.resume=auto loads it."""
        newest = max(self.checkpoints)
        self.w, self.critic_step = self.checkpoints[newest]
        self.instance += 1

    def _restart(self, call: str, reason: str) -> CriticRestartedError:
        self.restarted = CriticRestartedError(
            self.url, self.server_info(), self.expected, call=call, reason=reason
        )
        return self.restarted

    # -- the calls -------------------------------------------------------------------------------

    def check_compatible(self, vocab_size, max_seq_len, tokenizer_fingerprint) -> None:
        return None

    def infer(self, tokens, lengths, prompt_lengths, step=None) -> Future:
        if self.restarted is not None:
            raise self.restarted
        values = self.w * tokens[:, :-1].float() / 10
        prompts, responses = [], []
        for row, n, p in zip(tokens.tolist(), lengths.tolist(), prompt_lengths.tolist()):
            prompts.append(TOK.decode(row[:p]))
            responses.append(TOK.decode(row[p:n]))
        scores = torch.tensor(get_task("copy", 3).reward(prompts, responses), dtype=torch.float32)
        return done((values.numpy(), scores.numpy()))

    def train(self, tokens, lengths, returns, old_values, mask, step) -> Future:
        if self.restarted is not None:
            raise self.restarted
        if step == self.restart_in_train:
            self.restart_in_train = None
            self._come_back()
            return failed(self._restart(P.TRAIN, "reconnected to another server instance"))
        if self.expected != self.critic_step:
            return failed(self._restart(P.TRAIN, "fenced"))
        self.w += 0.1 * float((returns * mask).sum() / mask.sum())
        self.critic_step = self.expected = step
        self.applied.append(step)
        if step == self.restart_after_train:
            self.restart_after_train = None
            self._come_back()
        return done(P.TrainResult(loss=self.w, grad_norm=1.0, applied_step=step))

    def save(self, step: int) -> None:
        if self.save_error is not None:
            raise self.save_error
        if self.restarted is not None:
            raise self.restarted
        if self.critic_step != step:
            raise self._restart(P.SAVE, "fenced")
        self.checkpoints[step] = (self.w, step)

    def load(self, step: int) -> None:
        self.w, self.critic_step = self.checkpoints[step]
        self.expected, self.restarted = step, None

    def close(self) -> None:
        return None


def done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def failed(error: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(error)
    return f
