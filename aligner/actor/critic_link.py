"""The critic/reward server seen from the actor's ranks (docs/design.md, "Roles and data flow",
steps 3 and 6).

- ``critic_infer``: the first rank of each data-parallel replica (tensor-parallel rank 0 of the
  first pipeline stage) sends the replica's rows and broadcasts the values and scores to the
  replica's other ranks (its tensor- and pipeline-parallel peers hold the same rows). Each
  request names ``after_step``, the critic step its values must come from, the same on every
  rank: the step of the last ``critic_train`` the run sent, or, before the first one since the
  run started or rolled back, the step the server held then (rank 0's client's, broadcast
  once: the server's at connection, or the step it had the server load); critic-free runs ask
  for none. The server answers once it holds that step, so every replica gets the values of the
  same critic whichever rank's request arrives first (docs/design.md, "Wire protocol").
- ``critic_train``: every data-parallel rank's rows are gathered (padded to a common length) and
  global rank 0 sends them once per step; the step does not wait for the answer. The one update
  in flight, and the result of the last one until the step that reports it, are kept here.
- Critic-free runs (``ppo.advantage`` grpo, rloo, reinforce_pp) send ``critic_infer`` for the
  scores alone and never ``critic_train``; they pair with a server in ``mode=reward_only``, which
  holds no critic. A run that needs the critic ('gae') refuses such a server at start
  (:func:`server_mode_problem`).
- Failures: a wait on the server fails on the ranks that sent (a timeout, a restarted server),
  yet every rank must leave the step together. Under more than one rank, each wait ends in one
  all-reduce of an outcome code, so that every rank raises: a
  :class:`~aligner.wire.handle.CriticRestartedError` on every rank when any rank found the
  server restarted (the actor then rolls back, on every rank; a rank whose own wait failed
  otherwise, e.g. an infer that waited for a step the restarted server never gets, raises it
  too), else the sender its own error and the others a
  :class:`~aligner.wire.handle.CriticError` naming the failure elsewhere.

Shapes: ``b`` this rank's rows, ``s`` padded length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from aligner.distributed import ParallelState, comm_device
from aligner.rl import CRITIC_FREE_ESTIMATORS
from aligner.wire.client import RemoteCriticClient
from aligner.wire.handle import CriticError, CriticHandle, CriticRestartedError
from aligner.wire.protocol import ANY_CRITIC_STEP, TrainResult

__all__ = [
    "CriticLink",
    "checked_client",
    "prompt_texts",
    "sample_texts",
    "server_has_critic",
    "server_mode_problem",
]

T = TypeVar("T")

_OK, _FAILED, _RESTARTED = 0, 1, 2
"""Outcome codes of a wait, all-reduced with MAX: a restart anywhere wins."""


def sample_texts(
    tokenizer: Any, tokens: Any, lengths: Any, prompt_lengths: Any, stop_ids: Any = None
) -> tuple[list[str], list[str]]:
    """Each sample's prompt and response as text, as critic_infer's ``prompt_text`` and
    ``response_text`` carry them: the prompt ``tokens[:prompt_length]``, the response
    ``tokens[prompt_length:length]`` up to its first stop id (``stop_ids``; None: the tokenizer's
    ``stop_ids``, its eos and the other end ids), both decoded with special tokens skipped.
    ``tokens [b, s]``, ``lengths`` and ``prompt_lengths [b]`` (torch or NumPy)."""
    if stop_ids is None:
        stop_ids = getattr(tokenizer, "stop_ids", (tokenizer.eos_id,))
    stops = {int(t) for t in stop_ids}
    prompts, responses = [], []
    for row, n, p in zip(_rows(tokens), _rows(lengths), _rows(prompt_lengths)):
        response = row[p:n]
        cut = next((j for j, t in enumerate(response) if t in stops), None)
        if cut is not None:
            response = response[:cut]
        prompts.append(tokenizer.decode(row[:p], skip_special=True))
        responses.append(tokenizer.decode(response, skip_special=True))
    return prompts, responses


def prompt_texts(raw: dict[str, str] | None, prompts: list[str], decoded: list[str]) -> list[str]:
    """The prompts' texts for the server: as the data set writes them (``raw``: templated prompt
    -> its text, with a chat template), else their ``decoded`` tokens."""
    return decoded if raw is None else [raw.get(x, d) for x, d in zip(prompts, decoded)]


def checked_client(
    cfg: Any,
    url: str,
    tokenizer: Any,
    *,
    run_token: str | None = None,
    watch_restarts: bool = False,
) -> RemoteCriticClient:
    """A client of the server at ``url`` with the run's ``critic.*`` settings, checked against it
    (protocol, vocabulary, sequence length, tokenizer); closed again if the check fails."""
    c = cfg.critic
    critic = RemoteCriticClient(
        url,
        timeout_s=c.timeout_s,
        ready_timeout_s=c.ready_timeout_s,
        wait_timeout_s=c.wait_timeout_s,
        retries=c.retries,
        run_token=run_token,
        tls=c.tls,
        watch_restarts=watch_restarts,
    )
    try:
        critic.check_compatible(tokenizer.vocab_size, cfg.model.max_seq_len, tokenizer.fingerprint())
    except BaseException:
        critic.close()
        raise
    return critic


def server_has_critic(info: Any) -> bool:
    """Whether the server behind ``info`` (its ``server_info``) holds a critic: False for a server
    in ``mode=reward_only``; True for one older than the field."""
    return bool(getattr(info, "critic", True))


def server_mode_problem(advantage: str, info: Any, url: str) -> str | None:
    """Why a run with ``ppo.advantage=advantage`` cannot train against the server at ``url``
    (``info``: its ``server_info``), or None when it can: 'gae' needs the critic's values and
    trains the critic, which a reward-only server does not hold."""
    if advantage in CRITIC_FREE_ESTIMATORS or server_has_critic(info):
        return None
    return (
        f"ppo.advantage={advantage!r} needs the critic's values and trains the critic, but the server at "
        f"{url} runs mode=reward_only (server_info: critic false; it scores responses and holds no critic): "
        f"set ppo.advantage to one of {list(CRITIC_FREE_ESTIMATORS)}, or start the server with mode=critic"
    )


def _rows(x: Any) -> list:
    return (x.detach().cpu() if hasattr(x, "detach") else x).tolist()


def _takes_after_step(critic: Any) -> bool:
    """Whether ``critic.infer`` takes ``after_step`` (the client does; an in-process handle
    written before it existed, which answers in order by itself, may not)."""
    try:
        params = inspect.signature(critic.infer).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "after_step" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _failed(error: BaseException) -> Future:
    """A future that holds ``error``: a request refused before it was sent fails where it is waited on."""
    future: Future = Future()
    future.set_exception(error)
    return future


class CriticLink:
    """One run's connection to the critic, on every rank (only some ranks send)."""

    def __init__(self, critic: CriticHandle, state: ParallelState, pad_id: int) -> None:
        self.critic, self.state, self.pad_id = critic, state, pad_id
        self.pending: Future | None = None
        """The ``critic_train`` request in flight (global rank 0 only)."""
        self.completed: TrainResult | None = None
        """The result of the last finished ``critic_train``, until a step reports it."""
        self.critic_free = False
        """No critic in this run (:meth:`check_mode`): its infers ask for no critic step."""
        self.after_step: int | None = None
        """The critic step this run's next ``critic_infer`` asks for, on every rank: the last
        ``critic_train``'s step id; None until the first infer since the start or a
        :meth:`drop` learns it from rank 0's client (:meth:`infer_step`)."""
        self._needs_texts: bool | None = None
        self._sends_after_step = _takes_after_step(critic)

    # -- the server's mode ---------------------------------------------------------------------------

    def check_mode(self, advantage: str) -> bool:
        """Whether the server holds a critic, on every rank; raises on every rank when a run with
        ``ppo.advantage=advantage`` cannot use it (:func:`server_mode_problem`; rank 0 asks)."""

        def ask() -> bool:
            if self.state.rank != 0:
                return True
            info = self.critic.server_info()
            problem = server_mode_problem(advantage, info, self.critic.url)
            if problem is not None:
                raise CriticError(problem)
            return server_has_critic(info)

        self.critic_free = advantage in CRITIC_FREE_ESTIMATORS
        has = self.agree("server_info", ask)
        return bool(self._from_rank0(int(has)))

    def _from_rank0(self, value: int) -> int:
        """Rank 0's ``value``, on every rank (collective when there is more than one)."""
        if self.state.world_size > 1:
            flag = torch.tensor([value], dtype=torch.int64, device=comm_device())
            dist.broadcast(flag, 0)
            value = int(flag.item())
        return value

    def infer_step(self) -> int:
        """The critic step this run's ``critic_infer`` asks for (``after_step``), the same on every
        rank: -1 (any) in a critic-free run; the last ``critic_train``'s step id; before the first
        train since the start or a :meth:`drop`, the step rank 0's client expects the server to
        hold (its ``expected_step``: the server's at connection, or the step loaded since; no
        train is in flight then), broadcast from rank 0 (collective: every rank infers together)."""
        if self.critic_free:
            return ANY_CRITIC_STEP
        if self.after_step is None:
            held = getattr(self.critic, "expected_step", None) if self.state.rank == 0 else None
            self.after_step = self._from_rank0(ANY_CRITIC_STEP if held is None else int(held))
        return self.after_step

    # -- critic_infer ------------------------------------------------------------------------------

    @property
    def needs_texts(self) -> bool:
        """Whether the server's reward model reads text (``server_info``'s ``infer_inputs`` names
        ``prompt_text`` and ``response_text``): :meth:`infer` must then get the samples' texts
        (:func:`sample_texts`). Asked once."""
        if self._needs_texts is None:
            inputs = getattr(self.critic.server_info(), "infer_inputs", None) or []
            self._needs_texts = "prompt_text" in inputs or "response_text" in inputs
        return self._needs_texts

    def infer(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        prompt_lengths: torch.Tensor,
        step_id: int,
        *,
        prompt_texts: list[str] | None = None,
        response_texts: list[str] | None = None,
        extras: list[str] | None = None,
    ) -> Future | None:
        """Send ``tokens [b, s]`` (``lengths``, ``prompt_lengths [b]``) of step ``step_id`` for
        values and scores without waiting, asking for the critic step of the last ``critic_train``
        (:meth:`infer_step`; call on every rank); None on the ranks that do not send. ``prompt_texts``,
        ``response_texts`` (``b`` strings, for a server whose reward model reads text:
        :attr:`needs_texts`) and ``extras`` (``b`` JSON objects, each row's extra data-set
        columns, for its reward function) go with the rows when given."""
        after_step = self.infer_step()  # on every rank (may be collective)
        if self.state.tp_rank != 0 or self.state.pp_rank != 0:
            return None
        try:
            given = {"prompt_texts": prompt_texts, "response_texts": response_texts, "extras": extras}
            # Only what is given: a handle written before these inputs existed takes tokens alone.
            kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
            if self._sends_after_step:
                kwargs["after_step"] = after_step
            return self.critic.infer(tokens, lengths, prompt_lengths, step_id, **kwargs)
        except CriticRestartedError as e:  # raised by result(), with the other ranks
            return _failed(e)

    def result(self, future: Future | None, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Values ``[b, s-1]`` and scores ``[b]`` (float32) of the batch of ``shape`` ``[b, s]``
        that :meth:`infer` sent, on every rank of the data-parallel replica."""
        b, s = shape
        st = self.state
        if future is not None:
            values_np, rewards_np = self.agree("critic_infer", future.result)
            # Moved to this rank's device once, on arrival: everything after works there.
            values = torch.as_tensor(values_np, dtype=torch.float32).reshape(b, s - 1).to(st.device)
            scores = torch.as_tensor(rewards_np, dtype=torch.float32).reshape(b).to(st.device)
        else:
            self.agree("critic_infer", lambda: None)
            values, scores = torch.empty(b, s - 1, device=st.device), torch.empty(b, device=st.device)
        if st.tp_size * st.pp_size > 1:
            # From TP rank 0 of the first stage (the model-parallel group's first rank) to the
            # replica's other ranks, on the collectives' device (the rank's own under NCCL).
            group = st.group("mp")
            src = dist.get_global_rank(group, 0)
            values, scores = values.to(comm_device(group)), scores.to(comm_device(group))
            dist.broadcast(values, src, group=group)
            dist.broadcast(scores, src, group=group)
            values, scores = values.to(st.device), scores.to(st.device)
        return values, scores

    # -- critic_train ------------------------------------------------------------------------------

    def train(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        returns: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        step_id: int,
    ) -> Future | None:
        """Send the critic's training batch for ``step_id`` (every rank's rows: ``tokens [b, s]``,
        ``lengths [b]``, ``returns``, ``values``, ``mask [b, s-1]``) without waiting; call on
        every rank after :meth:`wait`. Returns the request in flight (None off rank 0)."""
        if self.pending is not None:
            raise RuntimeError("critic_train while the previous one is in flight: wait() first")
        self.after_step = int(step_id)  # what every rank's next critic_infer asks for
        if self.state.dp_size > 1:
            tokens, lengths, returns, values, mask = self._gather_dp(tokens, lengths, returns, values, mask)
        if self.state.rank == 0:
            try:
                self.pending = self.critic.train(tokens, lengths, returns, values, mask, step_id)
            except CriticRestartedError as e:  # raised by wait(), with the other ranks
                self.pending = _failed(e)
        return self.pending

    def wait(self) -> None:
        """Wait for the ``critic_train`` in flight; its result is kept in :attr:`completed` until
        :meth:`take_completed` (``critic/vf_loss`` is the critic's loss on the previous step's batch)."""
        pending = self.pending
        if pending is None:
            self.agree("critic_train", lambda: None)
            return
        try:
            self.completed = self.agree("critic_train", pending.result)
        finally:
            self.pending = None  # failed or done: nothing of it is in flight any more

    def drop(self) -> None:
        """Forget the update in flight and the last result (after a restarted server, before
        the rollback restores them from a checkpoint), and the critic step the next infer asks
        for (it becomes the step the rollback has the server load)."""
        self.pending, self.completed, self.after_step = None, None, None

    def follow(self, instance_id: str) -> None:
        """After a rollback (the server had the step loaded by rank 0's client): the server
        process ``instance_id`` is the one this rank's client works with from now on, and a
        restart it had found is handled (a client that watches for restarts: the remote one)."""
        follow = getattr(self.critic, "follow", None)
        if follow is not None:
            follow(instance_id)

    def agree(self, call: str, wait: Callable[[], T]) -> T:
        """``wait()`` here, and the same outcome on every rank: with more than one rank, every
        rank raises when any rank's wait on ``call`` failed (one all-reduce per call)."""
        error: BaseException | None = None
        out = None
        try:
            out = wait()
        except Exception as e:  # re-raised below, after the other ranks have heard of it
            error = e
        if self.state.world_size > 1:
            code = (
                _RESTARTED if isinstance(error, CriticRestartedError) else _OK if error is None else _FAILED
            )
            flag = torch.tensor([code], dtype=torch.int64, device=comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
            if code == _RESTARTED and not isinstance(error, CriticRestartedError):
                # A restart anywhere wins: every rank rolls back together, also one whose own
                # wait failed otherwise (an infer that waited for a step the server never gets).
                here = "" if error is None else f"; here: {type(error).__name__}: {error}"
                raise CriticRestartedError(
                    self.critic.url,
                    None,
                    None,
                    call=call,
                    reason=f"another rank found the server restarted{here}",
                ) from error
            if error is None and code == _FAILED:
                raise CriticError(f"{call} failed on another rank (its error is in that rank's log)")
        if error is not None:
            raise error
        return out  # type: ignore[return-value]

    def take_completed(self) -> TrainResult | None:
        """The last finished update's result, once (None when there is none to report)."""
        done, self.completed = self.completed, None
        return done

    def _gather_dp(self, *rows: torch.Tensor) -> list[torch.Tensor]:
        """Concatenate every DP rank's rows (``tokens`` first, then its per-row tensors, padded to
        a common length) on all ranks."""
        group = self.state.dp_group
        dev = comm_device(group)
        s = torch.tensor([rows[0].shape[1]], device=dev)
        dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        pad = int(s) - rows[0].shape[1]
        tokens, lengths, *per_token = rows
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad), value=self.pad_id)
            per_token = [torch.nn.functional.pad(x, (0, pad)) for x in per_token]
        out = []
        for x in (tokens, lengths, *per_token):
            x = x.to(dev).contiguous()
            parts = [torch.empty_like(x) for _ in range(self.state.dp_size)]
            dist.all_gather(parts, x, group=group)
            out.append(torch.cat(parts))
        return out
