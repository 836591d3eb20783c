"""Helpers shared by the critic tests and benchmark: tiny configs, digit-task batches, raw requests
(a bare tritonclient: no validation, no retries, no bookkeeping of the critic step).

Not used by the server or client themselves.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from aligner.tasks.digits import sort_reward
from aligner.wire.protocol import (
    INFO,
    LOAD,
    MODELS,
    SAVE,
    TRAIN,
    ServerInfo,
    TrainRequest,
    load_inputs,
    run_token_array,
    save_inputs,
)
from aligner.wire.tls import ClientTLS, grpc_client_options

__all__ = [
    "TINY_MODEL",
    "HTTP_ON",
    "tiny_overrides",
    "tiny_config",
    "encode_samples",
    "digit_batch",
    "train_arrays",
    "picky_reward",
    "raw_infer",
    "raw_error",
    "raw_info",
    "raw_train",
    "raw_save",
    "raw_load",
]

TINY_MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "vocab_size": 14,
    "max_seq_len": 32,
}


HTTP_ON = {"server.http_port": 0, "server.allow_no_token": "true"}
"""For :func:`tiny_overrides`: HTTP on a free port, no run token required (loopback tests only)."""


def tiny_overrides(root: str | Path, **extra: object) -> list[str]:
    """Hydra overrides for a tiny critic server scoring with the sort task's reward, writing under
    ``root``, on free ports, HTTP off (a test that needs HTTP passes ``**HTTP_ON``)."""
    root = Path(root)
    o = {
        "server.grpc_port": 0,
        "server.metrics_port": "null",
        "log.dir": str(root / "log"),
        "log.tensorboard": "false",
        "checkpoint.dir": str(root / "ckpt"),
        "optim.lr": 1e-3,
        "reward.fn": "aligner.tasks.digits:sort_reward",
        "server.exit_timeout_s": 1,
    }
    o.update({f"model.{k}": v for k, v in TINY_MODEL.items()})
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def tiny_config(root: str | Path, **sections: dict) -> dict:
    """The same tiny set-up as a plain dict for :func:`aligner.critic.config.build_config`."""
    root = Path(root)
    d: dict = {
        "server": {"grpc_port": 0, "metrics_port": None, "exit_timeout_s": 1},
        "model": dict(TINY_MODEL),
        "log": {"dir": str(root / "log"), "tensorboard": False},
        "checkpoint": {"dir": str(root / "ckpt")},
        "optim": {"lr": 1e-3},
        "reward": {"fn": "aligner.tasks.digits:sort_reward"},
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


def encode_samples(
    tokenizer, prompts: list[str], responses: list[str], pad_to: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``prompt + response + eos`` per sample, right padded to ``pad_to`` (default: the longest).

    Returns tokens ``[b, s]``, lengths ``[b]``, prompt_lengths ``[b]``.
    """
    rows, pls = [], []
    for prompt, resp in zip(prompts, responses):
        rows.append(tokenizer.encode(prompt) + tokenizer.encode(resp) + [tokenizer.eos_id])
        pls.append(len(tokenizer.encode(prompt)))
    s = pad_to or max(len(r) for r in rows)
    tokens = np.full((len(rows), s), tokenizer.pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.array([len(r) for r in rows], np.int64), np.array(pls, np.int64)


def digit_batch(
    tokenizer, b: int, seed: int = 0, num_digits: int = 4, pad_to: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]]:
    """``b`` sort-task samples ``'<digits>:' + response + eos``, right padded.

    Returns tokens ``[b, s]``, lengths ``[b]``, prompt_lengths ``[b]``, prompts, responses.
    """
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(b):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        prompts.append(digits + ":")
        responses.append(
            "".join(sorted(digits))
            if rng.random() < 0.5
            else "".join(rng.choice("0123456789") for _ in range(rng.randint(1, num_digits)))
        )
    tokens, lengths, prompt_lengths = encode_samples(tokenizer, prompts, responses, pad_to)
    return tokens, lengths, prompt_lengths, prompts, responses


def train_arrays(
    lengths: np.ndarray, prompt_lengths: np.ndarray, s: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(returns, old_values, mask), each ``[b, s-1]`` float32, with the response mask of docs/design.md
    ("Tensor conventions")."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    t = np.arange(s - 1)[None, :]
    mask = ((t >= prompt_lengths[:, None] - 1) & (t < lengths[:, None] - 1)).astype(np.float32)
    returns = (rng.normal(size=(b, s - 1)) * mask).astype(np.float32)
    old_values = (rng.normal(size=(b, s - 1)) * 0.1 * mask).astype(np.float32)
    return returns, old_values, mask


def picky_reward(prompts, responses, prompt_ids=None, response_ids=None, **_: object) -> list[float]:
    """The sort task's reward, made to fail each way a reward function can, for the tests of one
    client's bad samples: a prompt without ':' makes it raise (as the sort reward does), a
    response ``','`` scores NaN, ``',,'`` infinity, and ``',,,'`` makes it answer one score too
    few."""
    scores = sort_reward(prompts, responses)
    scores = [{",": float("nan"), ",,": float("inf")}.get(r, x) for r, x in zip(responses, scores)]
    return scores[:-1] if ",,," in responses else scores


def _mod(url: str):
    scheme = url.split("://", 1)[0]
    if scheme == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod
    return mod, url.split("://", 1)[1]


def raw_infer(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str] | None = None,
    tls: ClientTLS | None = None,
) -> dict[str, np.ndarray]:
    """One request with a bare tritonclient (no validation, no retries): what any client could
    send; ``tls``: what a ``grpcs://`` one trusts and presents."""
    mod, hostport = _mod(url)
    client = mod.InferenceServerClient(hostport, **grpc_client_options(url.split("://", 1)[0], tls))
    try:
        ins = []
        for name, a in inputs.items():
            a = np.asarray(a)
            dtype = {"i": "INT64", "f": "FP32"}.get(a.dtype.kind, "BYTES")
            if a.dtype == np.int32:
                dtype = "INT32"
            if a.dtype == np.float64:
                dtype = "FP64"
            i = mod.InferInput(name, list(a.shape), dtype)
            i.set_data_from_numpy(a)
            ins.append(i)
        outputs = outputs or [t.name for t in MODELS[model].outputs]
        r = client.infer(model, ins, outputs=[mod.InferRequestedOutput(n) for n in outputs])
        return {n: r.as_numpy(n) for n in outputs}
    finally:
        client.close()


def raw_error(url: str, model: str, inputs: dict[str, np.ndarray]) -> str:
    """The error text a bare tritonclient gets for a request that must fail (AssertionError if it does not)."""
    try:
        raw_infer(url, model, inputs)
    except Exception as e:  # InferenceServerException
        return str(e)
    raise AssertionError(f"{model} accepted a request that breaks the contract: {sorted(inputs)}")


def raw_info(url: str, run_token: str | None = None, tls: ClientTLS | None = None) -> ServerInfo:
    """``server_info`` through a bare tritonclient, with ``run_token`` if given (a server that has
    one tells a caller without it only the public fields)."""
    inputs = {"run_token": run_token_array(run_token)} if run_token else {}
    return ServerInfo.from_json(raw_infer(url, INFO, inputs, tls=tls)["info"].reshape(-1)[0])


def raw_train(url: str, req: TrainRequest, run_token: str | None = None) -> dict[str, np.ndarray]:
    """One critic_train of ``req`` (its ``expected_step`` set) through a bare tritonclient."""
    return raw_infer(url, TRAIN, req.to_wire(run_token))


def raw_save(url: str, step: int, expected_step: int, run_token: str | None = None) -> None:
    """critic_save of ``step`` when the server holds ``expected_step``, through a bare tritonclient."""
    raw_infer(url, SAVE, save_inputs(step, expected_step, run_token))


def raw_load(url: str, step: int, run_token: str | None = None) -> None:
    """critic_load of ``step`` through a bare tritonclient."""
    raw_infer(url, LOAD, load_inputs(step, run_token))
