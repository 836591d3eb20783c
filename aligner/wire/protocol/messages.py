"""The typed requests and responses of the wire protocol, and how each goes on the wire.

Shapes: ``b`` batch, ``s`` padded length (docs/design.md, "Tensor conventions").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from aligner.wire.protocol.run_token import run_token_array
from aligner.wire.protocol.spec import ANY_CRITIC_STEP, Limits

__all__ = [
    "InferRequest",
    "text_array",
    "InferResponse",
    "infer_error_wire",
    "TrainRequest",
    "TrainResult",
    "ServerInfo",
    "save_inputs",
    "load_inputs",
    "critic_step_after_load",
]


@dataclass
class InferRequest:
    """Samples to score.

    Attributes:
        tokens: ``[b, s]`` int64, prompt + response, right padded.
        lengths: ``[b]`` int64, real length of each sample (2 <= length <= s).
        prompt_lengths: ``[b]`` int64, where each response starts (1 <= prompt_length < length).
        prompt_texts: ``b`` prompts as text, or None (the optional input ``prompt_text``).
        response_texts: ``b`` responses as text up to the end-of-sequence, special tokens skipped,
            or None (``response_text``).
        extras: ``b`` compact JSON objects, each sample's extra data-set columns (``"{}"`` for
            none), or None (``extras``).
        after_step: the critic step the values must come from: the step of the last critic_train
            the caller sent, or of the load it had the server do; the server answers once it
            holds that step, and refuses the request when it holds a later one.
            :data:`~aligner.wire.protocol.spec.ANY_CRITIC_STEP` (-1) asks for none.
        instance_id: the server instance the caller works with (``server_info``'s
            ``instance_id``): another server process refuses the request at once
            (:class:`~aligner.wire.protocol.errors.OtherInstanceError`). None: any.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    prompt_texts: list[str] | None = None
    response_texts: list[str] | None = None
    extras: list[str] | None = None
    after_step: int = ANY_CRITIC_STEP
    instance_id: str | None = None

    def to_wire(self) -> dict[str, np.ndarray]:
        """The critic_infer inputs: tokens [b,s], lengths [b,1], prompt_lengths [b,1], after_step
        [b,1] (the same step in every row), and those of prompt_text, response_text, extras and
        instance_id (BYTES [b,1], UTF-8; instance_id the same in every row) that are set."""
        wire = {
            "tokens": self.tokens,
            "lengths": self.lengths.reshape(-1, 1),
            "prompt_lengths": self.prompt_lengths.reshape(-1, 1),
            "after_step": np.full((self.tokens.shape[0], 1), self.after_step, dtype=np.int64),
        }
        for name, texts in self.texts().items():
            wire[name] = text_array(texts)
        if self.instance_id:
            wire["instance_id"] = text_array([self.instance_id] * self.tokens.shape[0])
        return wire

    def texts(self) -> dict[str, list[str]]:
        """The optional inputs that are set, by their wire names."""
        named = {
            "prompt_text": self.prompt_texts,
            "response_text": self.response_texts,
            "extras": self.extras,
        }
        return {k: v for k, v in named.items() if v is not None}

    def rows(self, start: int, stop: int) -> InferRequest:
        """Rows ``start:stop`` of every input (a chunk of a request that is too large to send whole)."""

        def cut(x: list[str] | None) -> list[str] | None:
            return None if x is None else x[start:stop]

        return InferRequest(
            self.tokens[start:stop],
            self.lengths[start:stop],
            self.prompt_lengths[start:stop],
            cut(self.prompt_texts),
            cut(self.response_texts),
            cut(self.extras),
            self.after_step,
            self.instance_id,
        )


def text_array(texts: list[str]) -> np.ndarray:
    """One string per row as a BYTES input: an object array ``[b, 1]`` of UTF-8 bytes."""
    out = np.empty((len(texts), 1), dtype=np.object_)
    for i, t in enumerate(texts):
        out[i, 0] = t.encode("utf-8")
    return out


@dataclass
class InferResponse:
    """The critic's view of the samples.

    Attributes:
        values: ``[b, s-1]`` float32, ``V(tokens 0..t)``; finite everywhere, meaningful where the
            response mask is 1.
        rewards: ``[b]`` float32, one score per sample (reward function + reward model).
    """

    values: np.ndarray
    rewards: np.ndarray

    def to_wire(self) -> dict[str, np.ndarray]:
        """The critic_infer outputs: values [b,s-1], rewards [b,1], error [b,1] (all empty)."""
        b = self.rewards.shape[0]
        return {
            "values": self.values,
            "rewards": self.rewards.reshape(-1, 1),
            "error": np.full((b, 1), b"", dtype=np.object_),
        }


def infer_error_wire(message: str, b: int) -> dict[str, np.ndarray]:
    """The critic_infer outputs of a request of ``b`` rows that failed on its own (in a merged
    execution): no values or rewards, and ``error`` [b,1] holding ``message`` in every row."""
    return {"error": np.array([[message.encode("utf-8")]] * b, dtype=np.object_)}


@dataclass
class TrainRequest:
    """One critic update.

    Attributes:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` int64.
        returns: ``[b, s-1]`` float32 value targets.
        old_values: ``[b, s-1]`` float32 values at rollout time (for the clipped loss).
        mask: ``[b, s-1]`` float32 response mask in {0, 1}; zero at ``t >= length-1``; at least one
            1 per row.
        step: the step id; applied exactly once, in increasing order.
        expected_step: the critic step the caller believes the server holds (the last step id it
            saw applied, or the step it had the server load; -1 for a server that applied
            nothing); the server refuses the update with
            :class:`~aligner.wire.protocol.errors.FencedError` when it holds another. None
            only for a caller that holds the service in-process (no fencing); on the wire it is
            always set.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    returns: np.ndarray
    old_values: np.ndarray
    mask: np.ndarray
    step: int
    expected_step: int | None = None

    def to_wire(self, run_token: str | None = None) -> dict[str, np.ndarray]:
        """The critic_train inputs, with ``run_token`` (None: no token, sent empty)."""
        if self.expected_step is None:
            raise ValueError("a critic_train request on the wire needs expected_step")
        return {
            "tokens": self.tokens,
            "lengths": self.lengths.reshape(-1, 1),
            "returns": self.returns,
            "old_values": self.old_values,
            "mask": self.mask,
            "step": np.array([[self.step]], dtype=np.int64),
            "expected_step": np.array([[self.expected_step]], dtype=np.int64),
            "run_token": run_token_array(run_token),
        }


@dataclass
class TrainResult:
    """What one applied (or replayed) update reports."""

    loss: float
    """Value loss before the update (``critic/vf_loss``)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    applied_step: int
    """The step id this result belongs to."""
    explained_variance: float = 0.0
    """``1 - Var(R - V) / Var(R)`` over the mask, with the values before the update."""
    value_clipfrac: float = 0.0
    """Fraction of tokens where the clipped value term was the larger one."""
    train_ms: float = field(default=0.0, compare=False)
    """The server's wall time for the update, in milliseconds (``timers/critic_train_ms``): a
    measurement, not part of the result (two results of the same update compare equal)."""

    def to_wire(self) -> dict[str, np.ndarray]:
        f = np.float32
        return {
            "loss": np.array([[self.loss]], f),
            "grad_norm": np.array([[self.grad_norm]], f),
            "applied_step": np.array([[self.applied_step]], np.int64),
            "explained_variance": np.array([[self.explained_variance]], f),
            "value_clipfrac": np.array([[self.value_clipfrac]], f),
            "train_ms": np.array([[self.train_ms]], f),
        }

    @classmethod
    def from_wire(cls, out: dict[str, np.ndarray]) -> TrainResult:
        def scalar(name: str, default: float = 0.0) -> float:
            a = out.get(name)
            return default if a is None else float(np.asarray(a).reshape(-1)[0])

        return cls(
            loss=scalar("loss"),
            grad_norm=scalar("grad_norm"),
            applied_step=int(scalar("applied_step")),
            explained_variance=scalar("explained_variance"),
            value_clipfrac=scalar("value_clipfrac"),
            train_ms=scalar("train_ms"),
        )

    def metrics(self) -> dict[str, float]:
        """The update's figures as metrics (docs/metrics.md), as both the server's metrics.jsonl
        and the actor's name them (the actor computes ``critic/vf_explained_var`` itself)."""
        return {
            "critic/vf_loss": float(self.loss),
            "critic/grad_norm": float(self.grad_norm),
            "critic/vf_clipfrac": float(self.value_clipfrac),
            "timers/critic_train_ms": float(self.train_ms),
        }

    def to_dict(self) -> dict[str, float | int]:
        """As JSON-ready fields (e.g. the actor's checkpoint of its last critic result)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainResult:
        """Inverse of :meth:`to_dict`."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class ServerInfo:
    """What ``server_info`` returns (as JSON)."""

    protocol_version: int
    vocab_size: int
    """Tokenizer vocabulary: token ids must be < this."""
    max_seq_len: int
    tokenizer: str
    """Tokenizer spec ('char', a folder, ...)."""
    tokenizer_fingerprint: str
    critic_step: int
    """The critic step held: the last applied train step, or the step last loaded; -1 before either."""
    max_batch_size: int
    """Rows per critic_infer request (and per merged execution)."""
    max_train_batch: int
    """Rows per critic_train request."""
    reward: dict[str, Any] = field(default_factory=dict)
    """Where rewards come from: function path, reward model, normalisation."""
    model: dict[str, Any] = field(default_factory=dict)
    """The critic's ModelConfig."""
    parallel: dict[str, int] = field(default_factory=dict)
    """Tensor, pipeline and data parallel sizes (``data_parallel_size``: the critic's replicas
    behind this one address; absent from servers older than it, which had one)."""
    last_saved_step: int = -1
    """Newest step this server saved or loaded (-1: none)."""
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps with a complete critic checkpoint under the server's checkpoint dir (ascending)."""
    instance_id: str = ""
    """A random hex id made once per server process start: another one means another process."""
    run_token_required: bool = False
    """Whether critic_train, critic_save and critic_load need the run token."""
    infer_inputs: list[str] = field(default_factory=list)
    """critic_infer's optional inputs this server needs (``protocol.OPTIONAL_INFER_INPUTS``):
    ``extras`` when it has a reward function, ``prompt_text`` and ``response_text`` when its
    reward model reads text (its tokenizer differs from the policy's). A client sends exactly
    these; empty from a server that needs none, or from one older than protocol 3."""
    critic: bool = True
    """Whether the server holds a critic (``mode: critic``). False for ``mode: reward_only``: its
    critic_infer values are zeros, and critic_train, critic_save and critic_load are refused; a
    server older than the field holds one."""
    batching: dict[str, Any] = field(default_factory=dict)
    """How Triton merged critic_infer requests since start-up (empty from servers older than
    it): ``dynamic_batching``, ``max_queue_delay_us``, ``executions``, ``requests``, ``rows``,
    ``requests_per_execution_mean`` and ``_max``, and ``requests_per_execution``, a histogram
    (requests in one execution, as a string -> executions that merged that many)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else (pid, start time, optimizer settings)."""
    infer_wait_s: float = 0.0
    """How long a critic_infer waits on the server for the critic step it names (``after_step``,
    ``server.infer_wait_s``) before it fails: a client gives such a request this much on top of
    its own per-request timeout, so that it never resends one the server still holds. 0 from a
    server older than the field."""
    full: bool = True
    """False: the view a caller without the run token gets from a server that has one (only what a
    client checks; ``tokenizer`` empty, the dicts and ``checkpoint_steps`` empty, ``last_saved_step``
    -1). Send the token with server_info for the rest (:mod:`aligner.critic.security`)."""

    @property
    def limits(self) -> Limits:
        return Limits(self.vocab_size, self.max_seq_len, self.max_batch_size, self.max_train_batch)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, blob: bytes | str) -> ServerInfo:
        d = json.loads(blob)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def _int(value: int) -> np.ndarray:
    return np.array([[int(value)]], dtype=np.int64)


def save_inputs(step: int, expected_step: int, run_token: str | None = None) -> dict[str, np.ndarray]:
    """The critic_save inputs: save the critic as ``step`` if the server holds critic step
    ``expected_step`` (for the actor's save of step N, N), with ``run_token`` (None: none)."""
    return {"step": _int(step), "expected_step": _int(expected_step), "run_token": run_token_array(run_token)}


def load_inputs(step: int, run_token: str | None = None) -> dict[str, np.ndarray]:
    """The critic_load inputs: load the critic saved as ``step``, with ``run_token``."""
    return {"step": _int(step), "run_token": run_token_array(run_token)}


def critic_step_after_load(step: int) -> int:
    """The critic step a server holds after ``critic_load(step)``: ``step`` itself.

    The critic saved as step N is the critic after train step N; the initial critic, saved as
    step 0 before any train (``checkpoint.save_initial``), loads as critic step 0 too, so a
    caller that had the server load step N sends ``expected_step`` N next."""
    return int(step)
