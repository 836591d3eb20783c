"""The actor's side of the critic on one process without a server: the critic handle the
client satisfies, the link that sends to it and keeps the update in flight, a restart or a
timeout where the step waits, and the restarted error crossing to other ranks."""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Future

import pytest
import torch
from _actor_parts import ONE_RANK

from aligner.actor.critic_link import CriticLink
from aligner.wire.client import RemoteCriticClient
from aligner.wire.handle import CriticHandle
from aligner.wire.protocol import TrainResult

# -- the critic handle ---------------------------------------------------------------------------


def _protocol_methods() -> list[str]:
    return [n for n, v in vars(CriticHandle).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_client_has_every_call_of_the_handle_with_its_signature():
    names = _protocol_methods()
    assert {"infer", "train", "save", "load", "server_info", "check_compatible", "close"} <= set(names)
    for name in names:
        want = inspect.signature(getattr(CriticHandle, name))
        got = inspect.signature(getattr(RemoteCriticClient, name))
        assert [(p.name, p.kind) for p in got.parameters.values()] == [
            (p.name, p.kind) for p in want.parameters.values()
        ], name


class FakeCritic:
    """Answers at once: values t / 10 at position t, reward = the row's length."""

    url = "fake://critic"

    def __init__(self) -> None:
        self.trained: list[int] = []

    def server_info(self):
        raise NotImplementedError

    def check_compatible(self, vocab_size, max_seq_len, tokenizer_fingerprint):
        return None

    def infer(self, tokens, lengths, prompt_lengths, step=None):
        b, s = tokens.shape
        f: Future = Future()
        f.set_result((torch.arange(s - 1).float().repeat(b, 1).numpy() / 10, lengths.float().numpy()))
        return f

    def train(self, tokens, lengths, returns, old_values, mask, step):
        self.trained.append(step)
        f: Future = Future()
        f.set_result(TrainResult(loss=0.5, grad_norm=1.5, applied_step=step))
        return f

    def save(self, step):
        return None

    def load(self, step):
        return None

    def close(self):
        return None


class InferOnly:
    url = "fake://critic"

    def infer(self, tokens, lengths, prompt_lengths):
        raise NotImplementedError


def test_a_client_is_a_critic_handle_and_an_incomplete_object_is_not():
    client = object.__new__(RemoteCriticClient)  # no server needed: the structure is what counts
    client.url = "grpc://127.0.0.1:1"
    assert isinstance(client, CriticHandle)
    assert isinstance(FakeCritic(), CriticHandle)
    assert not isinstance(InferOnly(), CriticHandle)


def test_the_link_sends_keeps_the_update_in_flight_and_reports_its_result_once():
    critic = FakeCritic()
    link = CriticLink(critic, ONE_RANK, pad_id=13)
    tokens, lengths = torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 4])
    values, scores = link.result(link.infer(tokens, lengths, torch.tensor([2, 2]), 7), tokens.shape)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert values[1].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3]) and scores.tolist() == [5.0, 4.0]
    per_token = torch.zeros(2, 4)
    assert link.train(tokens, lengths, per_token, per_token, per_token, 7) is link.pending is not None
    with pytest.raises(RuntimeError, match="in flight"):
        link.train(tokens, lengths, per_token, per_token, per_token, 8)
    link.wait()
    assert link.pending is None and critic.trained == [7]
    assert link.take_completed() == TrainResult(loss=0.5, grad_norm=1.5, applied_step=7)
    assert link.take_completed() is None


def test_a_restart_known_when_sending_is_raised_where_the_link_waits():
    """A request the client refuses at once (a restart it found earlier) fails where the
    step waits for it, as one that failed on the server does; the link then holds nothing."""
    from aligner.wire.errors import CriticRestartedError

    class Restarted(FakeCritic):
        def infer(self, *args):
            raise CriticRestartedError(self.url, None, 3, call="critic_infer", reason="found earlier")

        train = infer

    link = CriticLink(Restarted(), ONE_RANK, pad_id=13)
    tokens, lengths, per_token = torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 4]), torch.zeros(2, 4)
    future = link.infer(tokens, lengths, torch.tensor([2, 2]), 4)
    with pytest.raises(CriticRestartedError, match="found earlier"):
        link.result(future, tokens.shape)
    link.completed = {"loss": 1.0}
    link.train(tokens, lengths, per_token, per_token, per_token, 4)
    with pytest.raises(CriticRestartedError, match="expected critic step 3"):
        link.wait()
    assert link.pending is None and link.completed == {"loss": 1.0}
    link.drop()
    assert link.take_completed() is None


def test_a_critic_future_times_out_naming_call_step_and_address_and_keeps_the_requests_own_error():
    from aligner.wire.errors import CriticTimeoutError
    from aligner.wire.transport import CriticFuture, run_into

    f = CriticFuture("critic_train", "grpc://10.0.0.1:8001", 0.05, step=7)
    t0 = time.monotonic()
    with pytest.raises(CriticTimeoutError) as e:
        f.result()
    assert 0.05 <= time.monotonic() - t0 < 2
    assert str(e.value).startswith("critic_train of step 7 to the critic server at grpc://10.0.0.1:8001: ")
    own = CriticTimeoutError("critic_train", "grpc://10.0.0.1:8001", 600.0, step=7, what="the request's")
    run_into(f, lambda: (_ for _ in ()).throw(own))
    with pytest.raises(CriticTimeoutError) as e:
        f.result()
    assert e.value is own
    done = CriticFuture("critic_infer", "grpc://10.0.0.1:8001", 0.05)
    run_into(done, lambda x: x + 1, 1)
    assert done.result() == 2


def test_a_restarted_error_crosses_to_other_ranks_as_json():
    from aligner.wire.errors import CriticRestartedError
    from aligner.wire.protocol import ServerInfo

    info = ServerInfo(2, 14, 32, "char", "fp", 3, 64, 64, checkpoint_steps=[0, 2], instance_id="ab12")
    e = CriticRestartedError("grpc://h:1", info, 5, call="critic_train", reason="fenced")
    back = CriticRestartedError.from_json(e.to_json())
    assert (back.critic_step, back.expected_step, back.checkpoint_steps, back.instance_id) == (
        3,
        5,
        [0, 2],
        "ab12",
    )
    assert str(back) == str(e)
    assert "it holds critic step 3" in str(e) and "the actor expected critic step 5" in str(e)
    assert CriticRestartedError("u", None, None, call="c", reason="r").critic_step is None
