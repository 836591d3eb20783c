"""What is on the wire: the protocol version, the five models, their tensors, and the limits a
server advertises (docs/design.md, "Wire protocol")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "PROTOCOL_VERSION",
    "INFER",
    "TRAIN",
    "SAVE",
    "LOAD",
    "INFO",
    "MODEL_NAMES",
    "MUTATING_MODELS",
    "TensorSpec",
    "ModelSpec",
    "MODELS",
    "Limits",
    "OPTIONAL_INFER_INPUTS",
    "TEXT_INPUTS",
    "ANY_CRITIC_STEP",
]

PROTOCOL_VERSION = 6
"""Bumped whenever a name, dtype, shape or meaning on the wire changes incompatibly (2: the run
token, ``expected_step`` fencing, ``instance_id``, and critic_infer's ``error`` output; 3:
critic_infer's optional text inputs ``prompt_text``, ``response_text`` and ``extras``, and
``server_info``'s ``infer_inputs``, which names those a server needs: a server whose reward
model reads text refuses a request without them, which a client of version 2 never sends; 4:
critic_infer's ``after_step``, the critic step its values must come from, which the server
waits for: a client of version 3 cannot order its infers after another client's trains, and
one of version 4 sends an input a server of version 3 refuses; 5: critic_train's ``train_ms``
output, the server's time for the update, which a client of version 5 asks a server of version 4
for in vain; 6: critic_infer's optional ``instance_id``, the server process its caller works with,
which a server of another process refuses at once (fenced) instead of waiting for a critic step
that will never come, and which a server of version 5 would not read; each refuses the other at
connection, naming both versions)."""

ANY_CRITIC_STEP = -1
"""critic_infer's ``after_step`` that asks for no particular critic step: answered at once with
the critic the server holds (a caller that uses only the scores, such as a critic-free run, or
one that orders its requests itself). Any other value, >= 0, is a step the values must come from
exactly (docs/design.md, "Wire protocol")."""

INFER = "critic_infer"
TRAIN = "critic_train"
SAVE = "critic_save"
LOAD = "critic_load"
INFO = "server_info"
MODEL_NAMES = (INFER, TRAIN, SAVE, LOAD, INFO)
MUTATING_MODELS = (TRAIN, SAVE, LOAD)
"""The models that change the server's state: they carry the run token."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output on the wire."""

    name: str
    dtype: type
    """NumPy scalar type (np.int64, np.float32, np.bytes_)."""
    shape: tuple[int, ...]
    """Shape as Triton's model config states it: without the batch dimension for a batched model,
    the full shape otherwise; -1 is variable."""
    optional: bool = False
    """Whether a request may leave it out (Triton then passes the request on without it)."""

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
_STEP = TensorSpec("step", _I64, (1, 1))
_EXPECTED_STEP = TensorSpec("expected_step", _I64, (1, 1))
_RUN_TOKEN = TensorSpec("run_token", _BYTES, (1,))
_RUN_TOKEN_INFO = TensorSpec("run_token", _BYTES, (1,), optional=True)
"""server_info's: left out (or empty) by the probe and readiness checks, which get the public view."""
_OK = (TensorSpec("ok", _I64, (1, 1)),)

MODELS: dict[str, ModelSpec] = {
    INFER: ModelSpec(
        INFER,
        inputs=(
            TensorSpec("tokens", _I64, (-1,)),
            TensorSpec("lengths", _I64, (1,)),
            TensorSpec("prompt_lengths", _I64, (1,)),
            TensorSpec("prompt_text", _BYTES, (1,), optional=True),
            TensorSpec("response_text", _BYTES, (1,), optional=True),
            TensorSpec("extras", _BYTES, (1,), optional=True),
            # The client always sends it; a request without it (a bare tritonclient, a tool
            # written before it) asks for no particular critic step (ANY_CRITIC_STEP).
            TensorSpec("after_step", _I64, (1,), optional=True),
            # The server instance the caller works with (server_info's instance_id, the same in
            # every row): another server process refuses the request at once, fenced. Left out
            # (or empty): any instance (a caller that does not watch for restarts).
            TensorSpec("instance_id", _BYTES, (1,), optional=True),
        ),
        outputs=(
            TensorSpec("values", _F32, (-1,)),
            TensorSpec("rewards", _F32, (1,)),
            TensorSpec("error", _BYTES, (1,)),
        ),
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
            _STEP,
            _EXPECTED_STEP,
            _RUN_TOKEN,
        ),
        outputs=(
            TensorSpec("loss", _F32, (1, 1)),
            TensorSpec("grad_norm", _F32, (1, 1)),
            TensorSpec("applied_step", _I64, (1, 1)),
            TensorSpec("explained_variance", _F32, (1, 1)),
            TensorSpec("value_clipfrac", _F32, (1, 1)),
            TensorSpec("train_ms", _F32, (1, 1)),
        ),
        batched=False,
    ),
    SAVE: ModelSpec(SAVE, inputs=(_STEP, _EXPECTED_STEP, _RUN_TOKEN), outputs=_OK, batched=False),
    LOAD: ModelSpec(LOAD, inputs=(_STEP, _RUN_TOKEN), outputs=_OK, batched=False),
    INFO: ModelSpec(
        INFO, inputs=(_RUN_TOKEN_INFO,), outputs=(TensorSpec("info", _BYTES, (1,)),), batched=False
    ),
}


OPTIONAL_INFER_INPUTS: dict[str, str] = {
    "prompt_text": "each sample's prompt as text (UTF-8), decoded by the actor",
    "response_text": "each sample's response as text (UTF-8) up to its end-of-sequence, special "
    "tokens skipped, decoded by the actor",
    "extras": "each sample's extra data-set columns as one compact JSON object ('{}' for none)",
}
"""critic_infer's optional inputs, BYTES ``[b, 1]`` (one string per row), and what each holds. A
server names those it needs in ``server_info``'s ``infer_inputs``, and a client sends exactly
those."""

TEXT_INPUTS = ("prompt_text", "response_text")
"""The inputs a server needs when its reward model reads text: its tokenizer differs from the
policy's, so it tokenizes prompt + response itself."""


@dataclass(frozen=True)
class Limits:
    """What a server accepts; advertised in ``ServerInfo`` so clients check the same."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_seq_len: int
    """Longest padded sequence ``s``."""
    max_batch: int
    """Most rows in one critic_infer request."""
    max_train_batch: int
    """Most rows in one critic_train request."""
