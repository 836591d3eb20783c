"""The critic server's wire contract: the one package both the server and its clients import.

Models, their inputs and outputs (names, dtypes, shapes), the protocol version, the typed
request/response containers, the checks that every request passes before anything is computed or
applied, the errors and their marks, and the run token. The names below are the contract; its
parts live in :mod:`aligner.wire.protocol.spec` (what is on the wire),
:mod:`aligner.wire.protocol.messages` (the typed containers), :mod:`aligner.wire.protocol.validation`
(the checks), :mod:`aligner.wire.protocol.errors` (errors and marks) and
:mod:`aligner.wire.protocol.run_token`; callers import the names from here. Shapes use the
project's notation (docs/design.md, "Tensor conventions"): ``b`` batch, ``s`` padded length;
per-token arrays have length ``s-1`` and element ``t`` describes the state ``0..t``.

- ``critic_infer`` (dynamic batching, ``b`` leading): tokens i64 [b,s], lengths and
  prompt_lengths i64 [b,1], after_step i64 [b,1] (the same critic step in every row; the client
  always sends it), the optional prompt_text, response_text and extras bytes [b,1] (one
  UTF-8 string per row; :data:`OPTIONAL_INFER_INPUTS`), and the optional instance_id bytes
  [b,1] (the server instance the caller works with, the same in every row) -> values f32
  [b,s-1], rewards f32 [b,1], error bytes [b,1].
- ``critic_train`` (no batching: whole shapes): tokens i64 [b,s], lengths i64 [b,1], returns,
  old_values, mask f32 [b,s-1], step and expected_step i64 [1,1], run_token bytes [1] -> loss,
  grad_norm, explained_variance, value_clipfrac, train_ms f32 [1,1], applied_step i64 [1,1]
  (:class:`TrainResult`).
- ``critic_save``: step and expected_step i64 [1,1], run_token bytes [1] -> ok i64 [1,1].
- ``critic_load``: step i64 [1,1], run_token bytes [1] -> ok i64 [1,1].
- ``server_info``: no input -> info bytes [1] (UTF-8 JSON of :class:`ServerInfo`).

Optional inputs. ``server_info``'s ``infer_inputs`` names the optional inputs a server needs:
``extras`` with a reward function (each sample's data-set columns, passed to it; a request
without them counts as "{}" per row), ``prompt_text`` and ``response_text`` when its reward
model reads text with a tokenizer of its own (:data:`TEXT_INPUTS`; a request without them is
refused naming the input). A client sends exactly those. Triton may merge requests that carry
different sets of them into one execution; the server reads each request's own.

Batching decision. ``critic_infer`` is the only model Triton batches: its PyTriton config has
``max_batch_size > 0`` and a dynamic batcher, so Triton sees ``tokens`` as ``[-1]`` per row
with a leading batch dimension, and may merge concurrent requests of the same ``s`` into one
execution. Every other model has ``max_batch_size = 0``: Triton then checks the *full* shape,
so ``step`` is exactly ``[1, 1]`` and a training batch is never merged with another (a merged
train request would apply two steps as one).

One client's samples fail only that client. When the reward function fails on the samples of one
request that Triton merged with others (it raises, answers NaN/inf or the wrong count), that
request's response carries no ``values`` and ``rewards``, only ``error``: one row per sample,
each the message that names the reward function and the failing sample; the other requests get
their values and rewards, and ``error`` rows of ``b""``. A request served alone gets that
message as its Triton error instead. A client asks for ``error`` and raises when it is not empty.

Infer after train. ``critic_infer``'s ``after_step`` names the critic step its values must come
from: the step of the last ``critic_train`` its caller's run sent (or of the load it had the
server do), the same on every data-parallel rank of an actor. The server answers once it holds
exactly that step, waiting for the train (bounded: ``server.infer_wait_s``, then an error naming
both steps), and refuses a request whose step it has moved past (a :class:`ProtocolError` on
``after_step`` naming both); :data:`ANY_CRITIC_STEP` (-1), or a request without it, asks for
none.

Who may write, and against which state (docs/design.md, "Wire protocol"). The mutating models
carry ``run_token``, the run's shared secret (:func:`resolve_run_token`); ``critic_train`` and
``critic_save`` carry ``expected_step``, the critic step the caller believes the server holds, and
a server that holds another one (it restarted, or was rolled back) refuses them with
:class:`FencedError` instead of training or saving a critic that is not the caller's. The server
checks ``critic_train`` in this order: the contract (shapes, values), the run token, exactly once
(a step id already applied whose result is kept gets that result, whatever ``expected_step``
says), fencing, then the in-order rule; ``critic_save``: the contract, the run token, fencing. A
``critic_infer`` that names a server ``instance_id`` (a client that watches for restarts sends
the one it works with) is refused by any other server process with :class:`OtherInstanceError`,
marked as fencing is, before it waits for its ``after_step``: a server restarted between two
requests holds an older step, and the request would wait for a train that never comes; in a
merged execution only that request is refused (its ``error`` rows, marked), the others go on. A
refused request changes nothing.

Errors. A request that breaks the contract raises :class:`ProtocolError`, whose message starts
with :data:`ERROR_MARK` and names the model, the field, what was expected and what came, so a
client can pick it out of Triton's error text; :class:`FencedError` (and :class:`OtherInstanceError`),
:class:`UnauthorizedError` and :class:`BatchPeerError` carry marks of their own (:func:`extract_fenced`,
:func:`extract_unauthorized`). A client reads a mark only where the server's message starts
(:func:`server_message`), and the server echoes what a request sent only neutralized
(:func:`neutralize`), so no request can pass its text off as a mark (:mod:`.errors`). Triton itself rejects a wrong dtype, rank, fixed dimension, a
missing input or an over-long infer batch per request, before batching; everything value-level
is checked here, on the client before sending and again on the server before anything runs.
"""

from __future__ import annotations

from aligner.wire.protocol.errors import (
    BATCH_PEER_MARK,
    ERROR_MARK,
    FENCED_MARK,
    MARK_KINDS,
    OVERLOADED_MARK,
    RUN_TOKEN_ENV,
    UNAUTHORIZED_MARK,
    UNAVAILABLE_MARK,
    BatchPeerError,
    FencedError,
    OtherInstanceError,
    ProtocolError,
    UnauthorizedError,
    error_kind,
    extract_error,
    extract_fenced,
    extract_unauthorized,
    mark_of,
    neutralize,
    quote,
    server_message,
    wire_text,
)
from aligner.wire.protocol.messages import (
    InferRequest,
    InferResponse,
    ServerInfo,
    TrainRequest,
    TrainResult,
    critic_step_after_load,
    infer_error_wire,
    load_inputs,
    save_inputs,
    text_array,
)
from aligner.wire.protocol.run_token import (
    check_run_token,
    resolve_run_token,
    run_token_array,
    validate_run_token,
)
from aligner.wire.protocol.spec import (
    ANY_CRITIC_STEP,
    INFER,
    INFO,
    LOAD,
    MODEL_NAMES,
    MODELS,
    MUTATING_MODELS,
    OPTIONAL_INFER_INPUTS,
    PROTOCOL_VERSION,
    SAVE,
    TEXT_INPUTS,
    TRAIN,
    Limits,
    ModelSpec,
    TensorSpec,
)
from aligner.wire.protocol.validation import (
    InputLimits,
    as_numpy,
    json_depth,
    validate_after_step,
    validate_expected_step,
    validate_infer,
    validate_instance_id,
    validate_step,
    validate_texts,
    validate_train,
)

__all__ = [
    "PROTOCOL_VERSION",
    "INFER",
    "TRAIN",
    "SAVE",
    "LOAD",
    "INFO",
    "MODEL_NAMES",
    "MUTATING_MODELS",
    "OPTIONAL_INFER_INPUTS",
    "TEXT_INPUTS",
    "ANY_CRITIC_STEP",
    "ERROR_MARK",
    "BATCH_PEER_MARK",
    "UNAVAILABLE_MARK",
    "OVERLOADED_MARK",
    "FENCED_MARK",
    "UNAUTHORIZED_MARK",
    "MARK_KINDS",
    "RUN_TOKEN_ENV",
    "TensorSpec",
    "ModelSpec",
    "MODELS",
    "Limits",
    "InputLimits",
    "ProtocolError",
    "FencedError",
    "OtherInstanceError",
    "UnauthorizedError",
    "BatchPeerError",
    "InferRequest",
    "InferResponse",
    "text_array",
    "infer_error_wire",
    "TrainRequest",
    "TrainResult",
    "ServerInfo",
    "save_inputs",
    "load_inputs",
    "critic_step_after_load",
    "validate_infer",
    "validate_after_step",
    "validate_instance_id",
    "validate_texts",
    "validate_train",
    "validate_step",
    "validate_expected_step",
    "validate_run_token",
    "check_run_token",
    "resolve_run_token",
    "run_token_array",
    "as_numpy",
    "json_depth",
    "neutralize",
    "quote",
    "mark_of",
    "wire_text",
    "server_message",
    "error_kind",
    "extract_error",
    "extract_fenced",
    "extract_unauthorized",
]
