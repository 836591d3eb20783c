"""The critic server's wire contract: the one module both the server and its clients import.

Models, their inputs and outputs (names, dtypes, shapes), the protocol version, the typed
request/response containers, and the checks that every request passes before anything is
computed or applied. Shapes use the project's notation (docs/design.md, "Tensor conventions"):
``b`` batch, ``s`` padded length; per-token arrays have length ``s-1`` and element ``t``
describes the state ``0..t``.

| model          | batching            | inputs                                                    | outputs |
|----------------|---------------------|-----------------------------------------------------------|---------|
| critic_infer   | dynamic (b leading) | tokens i64 [b,s], lengths i64 [b,1], prompt_lengths i64 [b,1] | values f32 [b,s-1], rewards f32 [b,1] |
| critic_train   | none (whole shapes) | tokens i64 [b,s], lengths i64 [b,1], returns/old_values/mask f32 [b,s-1], step i64 [1,1] | loss, grad_norm, explained_variance, value_clipfrac f32 [1,1], applied_step i64 [1,1] |
| critic_save    | none                | step i64 [1,1]                                            | ok i64 [1,1] |
| critic_load    | none                | step i64 [1,1]                                            | ok i64 [1,1] |
| server_info    | none                | (none)                                                    | info bytes [1] (UTF-8 JSON) |

Batching decision. ``critic_infer`` is the only model Triton batches: its PyTriton config has
``max_batch_size > 0`` and a dynamic batcher, so Triton sees ``tokens`` as ``[-1]`` per row
with a leading batch dimension, and may merge concurrent requests of the same ``s`` into one
execution. Every other model has ``max_batch_size = 0``: Triton then checks the *full* shape,
so ``step`` is exactly ``[1, 1]`` and a training batch is never merged with another (a merged
train request would apply two steps as one). ``explained_variance`` and ``value_clipfrac``
are additions to the table of docs/design.md ("Wire protocol"); clients that do not ask for them are unaffected.

Errors. A request that breaks the contract raises :class:`ProtocolError`, whose message starts
with :data:`ERROR_MARK` and names the model, the field, what was expected and what came, so a
client can pick it out of Triton's error text. Triton itself rejects a wrong dtype, rank, fixed
dimension or an over-long infer batch per request, before batching; everything value-level is
checked here, on the client before sending and again on the server before anything runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "PROTOCOL_VERSION",
    "INFER",
    "TRAIN",
    "SAVE",
    "LOAD",
    "INFO",
    "MODEL_NAMES",
    "ERROR_MARK",
    "BATCH_PEER_MARK",
    "UNAVAILABLE_MARK",
    "TensorSpec",
    "ModelSpec",
    "MODELS",
    "Limits",
    "ProtocolError",
    "InferRequest",
    "InferResponse",
    "TrainRequest",
    "TrainResult",
    "ServerInfo",
    "validate_infer",
    "validate_train",
    "validate_step",
    "as_numpy",
    "extract_error",
]

PROTOCOL_VERSION = 1
"""Bumped whenever a name, dtype, shape or meaning on the wire changes incompatibly."""

INFER = "critic_infer"
TRAIN = "critic_train"
SAVE = "critic_save"
LOAD = "critic_load"
INFO = "server_info"
MODEL_NAMES = (INFER, TRAIN, SAVE, LOAD, INFO)

ERROR_MARK = "[critic] "
"""Every contract error's message starts with this, so clients can cut it out of Triton's text."""

BATCH_PEER_MARK = "[critic-batch-peer] "
"""Prefix of the error a *valid* infer request gets when another request merged into the same
dynamic batch was invalid (PyTriton 0.7 can only fail a whole execution); safe to retry."""

UNAVAILABLE_MARK = "[critic-unavailable] "
"""Prefix of the error a valid request gets from a server that is shutting down and ran nothing:
retry once a server is ready again."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output on the wire."""

    name: str
    dtype: type
    """NumPy scalar type (np.int64, np.float32, np.bytes_)."""
    shape: tuple[int, ...]
    """Shape as Triton's model config states it: without the batch dimension for a batched model,
    the full shape otherwise; -1 is variable."""

    @property
    def triton_dtype(self) -> str:
        return {np.int64: "INT64", np.float32: "FP32", np.bytes_: "BYTES"}[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """One Triton model of the critic server."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batched: bool
    """True: Triton's dynamic batcher may merge requests along the leading dimension."""

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)


_I64, _F32, _BYTES = np.int64, np.float32, np.bytes_

MODELS: dict[str, ModelSpec] = {
    INFER: ModelSpec(
        INFER,
        inputs=(
            TensorSpec("tokens", _I64, (-1,)),
            TensorSpec("lengths", _I64, (1,)),
            TensorSpec("prompt_lengths", _I64, (1,)),
        ),
        outputs=(TensorSpec("values", _F32, (-1,)), TensorSpec("rewards", _F32, (1,))),
        batched=True,
    ),
    TRAIN: ModelSpec(
        TRAIN,
        inputs=(
            TensorSpec("tokens", _I64, (-1, -1)),
            TensorSpec("lengths", _I64, (-1, 1)),
            TensorSpec("returns", _F32, (-1, -1)),
            TensorSpec("old_values", _F32, (-1, -1)),
            TensorSpec("mask", _F32, (-1, -1)),
            TensorSpec("step", _I64, (1, 1)),
        ),
        outputs=(
            TensorSpec("loss", _F32, (1, 1)),
            TensorSpec("grad_norm", _F32, (1, 1)),
            TensorSpec("applied_step", _I64, (1, 1)),
            TensorSpec("explained_variance", _F32, (1, 1)),
            TensorSpec("value_clipfrac", _F32, (1, 1)),
        ),
        batched=False,
    ),
    SAVE: ModelSpec(
        SAVE,
        inputs=(TensorSpec("step", _I64, (1, 1)),),
        outputs=(TensorSpec("ok", _I64, (1, 1)),),
        batched=False,
    ),
    LOAD: ModelSpec(
        LOAD,
        inputs=(TensorSpec("step", _I64, (1, 1)),),
        outputs=(TensorSpec("ok", _I64, (1, 1)),),
        batched=False,
    ),
    INFO: ModelSpec(INFO, inputs=(), outputs=(TensorSpec("info", _BYTES, (1,)),), batched=False),
}


@dataclass(frozen=True)
class Limits:
    """What a server accepts; advertised in :class:`ServerInfo` so clients check the same."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_seq_len: int
    """Longest padded sequence ``s``."""
    max_batch: int
    """Most rows in one critic_infer request."""
    max_train_batch: int
    """Most rows in one critic_train request."""


class ProtocolError(ValueError):
    """A request broke the contract; the message names the model, field, expectation and value."""

    def __init__(self, model: str, field: str, expected: str, got: str) -> None:
        self.model, self.field, self.expected, self.got = model, field, expected, got
        super().__init__(f"{ERROR_MARK}{model}: field {field!r}: expected {expected}, got {got}")


# ----------------------------------------------------------------------------------------------
# Typed containers
# ----------------------------------------------------------------------------------------------


@dataclass
class InferRequest:
    """Samples to score.

    Attributes:
        tokens: ``[b, s]`` int64, prompt + response, right padded.
        lengths: ``[b]`` int64, real length of each sample (2 <= length <= s).
        prompt_lengths: ``[b]`` int64, where each response starts (1 <= prompt_length < length).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray

    def to_wire(self) -> dict[str, np.ndarray]:
        """The critic_infer inputs: tokens [b,s], lengths [b,1], prompt_lengths [b,1]."""
        return {
            "tokens": self.tokens,
            "lengths": self.lengths.reshape(-1, 1),
            "prompt_lengths": self.prompt_lengths.reshape(-1, 1),
        }


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
        return {"values": self.values, "rewards": self.rewards.reshape(-1, 1)}


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
    """

    tokens: np.ndarray
    lengths: np.ndarray
    returns: np.ndarray
    old_values: np.ndarray
    mask: np.ndarray
    step: int

    def to_wire(self) -> dict[str, np.ndarray]:
        return {
            "tokens": self.tokens,
            "lengths": self.lengths.reshape(-1, 1),
            "returns": self.returns,
            "old_values": self.old_values,
            "mask": self.mask,
            "step": np.array([[self.step]], dtype=np.int64),
        }


@dataclass
class TrainResult:
    """What one applied (or replayed) update reports."""

    loss: float
    """Value loss before the update (``loss/value``)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    applied_step: int
    """The step id this result belongs to."""
    explained_variance: float = 0.0
    """``1 - Var(R - V) / Var(R)`` over the mask, with the values before the update."""
    value_clipfrac: float = 0.0
    """Fraction of tokens where the clipped value term was the larger one."""

    def to_wire(self) -> dict[str, np.ndarray]:
        f = np.float32
        return {
            "loss": np.array([[self.loss]], f),
            "grad_norm": np.array([[self.grad_norm]], f),
            "applied_step": np.array([[self.applied_step]], np.int64),
            "explained_variance": np.array([[self.explained_variance]], f),
            "value_clipfrac": np.array([[self.value_clipfrac]], f),
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
        )

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


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
    """Last applied train step (-1 before the first)."""
    max_batch_size: int
    """Rows per critic_infer request (and per merged execution)."""
    max_train_batch: int
    """Rows per critic_train request."""
    reward: dict[str, Any] = field(default_factory=dict)
    """Where rewards come from: function path, reward model, normalisation."""
    model: dict[str, Any] = field(default_factory=dict)
    """The critic's ModelConfig."""
    parallel: dict[str, int] = field(default_factory=dict)
    """Tensor/pipeline parallel sizes."""
    last_saved_step: int = -1
    """Newest step this server saved or loaded (-1: none)."""
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps with a complete critic checkpoint under the server's checkpoint dir (ascending)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else (pid, start time, optimizer settings)."""

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


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def as_numpy(x: Any) -> np.ndarray:
    """A NumPy view of a NumPy array, torch tensor (any device) or nested list."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _describe(a: np.ndarray) -> str:
    return f"dtype {a.dtype} shape {list(a.shape)}"


def _first_bad(bad: np.ndarray, values: np.ndarray) -> str:
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    v = values[idx]
    return f"{v.item()!r} at index {list(idx)} ({int(bad.sum())} such element(s))"


def _check_array(model: str, name: str, a: Any, dtype: type, ndim: int) -> np.ndarray:
    a = as_numpy(a)
    if a.dtype != np.dtype(dtype):
        raise ProtocolError(model, name, f"dtype {np.dtype(dtype)}", _describe(a))
    if a.ndim != ndim:
        raise ProtocolError(model, name, f"rank {ndim}", _describe(a))
    return a


def _column(model: str, name: str, a: Any, b: int) -> np.ndarray:
    """Accept ``[b]`` or ``[b, 1]`` int64 and return ``[b]``."""
    a = as_numpy(a)
    if a.dtype != np.int64:
        raise ProtocolError(model, name, "dtype int64", _describe(a))
    if a.shape not in ((b,), (b, 1)):
        raise ProtocolError(model, name, f"shape [{b}, 1] (or [{b}]) to match tokens' batch", _describe(a))
    return a.reshape(b)


def _check_tokens(model: str, tokens: Any, limits: Limits, max_batch: int) -> np.ndarray:
    tokens = _check_array(model, "tokens", tokens, np.int64, 2)
    b, s = tokens.shape
    if b == 0:
        raise ProtocolError(
            model, "tokens", "at least one row (b >= 1)", "an empty batch, shape " + str([b, s])
        )
    if b > max_batch:
        raise ProtocolError(
            model, "tokens", f"at most {max_batch} rows (the server's batch limit)", f"{b} rows"
        )
    if s < 2:
        raise ProtocolError(
            model, "tokens", "padded length s >= 2 (a prompt token and a response token)", f"s={s}"
        )
    if s > limits.max_seq_len:
        raise ProtocolError(model, "tokens", f"padded length s <= max_seq_len={limits.max_seq_len}", f"s={s}")
    bad = (tokens < 0) | (tokens >= limits.vocab_size)
    if bad.any():
        raise ProtocolError(model, "tokens", f"ids in [0, {limits.vocab_size})", _first_bad(bad, tokens))
    return tokens


def _check_lengths(model: str, lengths: Any, b: int, s: int) -> np.ndarray:
    lengths = _column(model, "lengths", lengths, b)
    bad = (lengths < 2) | (lengths > s)
    if bad.any():
        raise ProtocolError(model, "lengths", f"2 <= length <= padded length {s}", _first_bad(bad, lengths))
    return lengths


def validate_infer(tokens: Any, lengths: Any, prompt_lengths: Any, limits: Limits) -> InferRequest:
    """Check a critic_infer request and return it typed (lengths as ``[b]``).

    Args:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` or ``[b, 1]`` int64.
        prompt_lengths: ``[b]`` or ``[b, 1]`` int64.

    Raises:
        ProtocolError: naming the first field that breaks the contract.
    """
    tokens = _check_tokens(INFER, tokens, limits, limits.max_batch)
    b, s = tokens.shape
    lengths = _check_lengths(INFER, lengths, b, s)
    prompt_lengths = _column(INFER, "prompt_lengths", prompt_lengths, b)
    bad = (prompt_lengths < 1) | (prompt_lengths >= lengths)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        raise ProtocolError(
            INFER,
            "prompt_lengths",
            "1 <= prompt_length < length (at least one response token)",
            f"prompt_length {int(prompt_lengths[i])} with length {int(lengths[i])} at row {i} "
            f"({int(bad.sum())} such row(s))",
        )
    return InferRequest(tokens, lengths, prompt_lengths)


def validate_step(model: str, step: Any) -> int:
    """``step``: an int or an int64 array of shape ``[1, 1]``; must be >= 0."""
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        value = int(step)
    else:
        a = as_numpy(step)
        if a.dtype != np.int64:
            raise ProtocolError(model, "step", "dtype int64", _describe(a))
        if a.shape != (1, 1):
            raise ProtocolError(model, "step", "shape [1, 1]", _describe(a))
        value = int(a[0, 0])
    if value < 0:
        raise ProtocolError(model, "step", "step >= 0", f"step={value}")
    return value


def validate_train(
    tokens: Any, lengths: Any, returns: Any, old_values: Any, mask: Any, step: Any, limits: Limits
) -> TrainRequest:
    """Check a critic_train request and return it typed.

    Args:
        tokens: ``[b, s]`` int64.
        lengths: ``[b]`` or ``[b, 1]`` int64.
        returns, old_values: ``[b, s-1]`` float32, finite everywhere.
        mask: ``[b, s-1]`` float32 in {0, 1}, zero at ``t >= length-1``, at least one 1 per row.
        step: int or int64 ``[1, 1]``, >= 0.

    Raises:
        ProtocolError: naming the first field that breaks the contract.
    """
    tokens = _check_tokens(TRAIN, tokens, limits, limits.max_train_batch)
    b, s = tokens.shape
    lengths = _check_lengths(TRAIN, lengths, b, s)
    arrays = {}
    for name, a in (("returns", returns), ("old_values", old_values), ("mask", mask)):
        a = _check_array(TRAIN, name, a, np.float32, 2)
        if a.shape != (b, s - 1):
            raise ProtocolError(TRAIN, name, f"shape [{b}, {s - 1}] (tokens' [b, s-1])", _describe(a))
        bad = ~np.isfinite(a)
        if bad.any():
            raise ProtocolError(
                TRAIN, name, "finite values everywhere (use 0 where the mask is 0)", _first_bad(bad, a)
            )
        arrays[name] = a
    m = arrays["mask"]
    bad = (m != 0) & (m != 1)
    if bad.any():
        raise ProtocolError(TRAIN, "mask", "values in {0, 1}", _first_bad(bad, m))
    positions = np.arange(s - 1)[None, :]
    beyond = (m != 0) & (positions >= (lengths[:, None] - 1))
    if beyond.any():
        i, t = (int(v) for v in np.argwhere(beyond)[0])
        raise ProtocolError(
            TRAIN,
            "mask",
            "0 at positions t >= length-1 (padding)",
            f"1 at [{i}, {t}] with length {int(lengths[i])}",
        )
    empty = m.sum(axis=1) == 0
    if empty.any():
        rows = [int(i) for i in np.flatnonzero(empty)[:8]]
        raise ProtocolError(
            TRAIN, "mask", "at least one response token (a 1) in every row", f"no 1 in row(s) {rows}"
        )
    return TrainRequest(
        tokens, lengths, arrays["returns"], arrays["old_values"], m, validate_step(TRAIN, step)
    )


_ERROR_RE = re.compile(re.escape(ERROR_MARK.strip()) + r" ?(.*?)(?:\\n|\n|\"|$)")


def extract_error(text: str) -> str | None:
    """The contract error inside Triton's error text (which wraps it in tracebacks), or None."""
    m = _ERROR_RE.search(text or "")
    return (ERROR_MARK + m.group(1)).rstrip("\\ ") if m else None
