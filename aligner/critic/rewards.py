"""Reward sources of the critic server, and where its weights come from.

- a reward *function* named by import path (``aligner.tasks.digits:sort_reward``), trlx-style:
  ``fn(prompts, responses, prompt_ids=..., response_ids=...) -> list[float]``; a failure on one
  request's samples is that request's alone (:func:`score_requests`);
- a reward *model*: a Megatron GPT with a scalar head, read at each sample's last token, from
  this project's model checkpoint folder (``meta.json`` + ``model.safetensors``, see
  :mod:`aligner.models.checkpoint_io`; ``aligner-convert import`` writes one from HF) or from a
  HF sequence-classification folder (:func:`aligner.models.hf.import_hf`).

Weights are loaded onto the current TP layout by those modules (full tensors in the files,
this rank's shard in the model), so a reward model saved at TP=1 serves a TP=2 critic.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aligner.critic.errors import CriticServiceError

__all__ = [
    "load_reward_fn",
    "reward_fn_problem",
    "split_samples",
    "RewardFunctionError",
    "call_reward_fn",
    "score_requests",
    "checkpoint_folder_problem",
    "load_reward_model",
    "load_policy_trunk",
    "HEAD_TENSORS",
]

HEAD_TENSORS = frozenset({"output_layer.weight", "output_layer.bias"})
"""The scalar head's tensors (what a policy's trunk does not provide)."""


def _resolve(path: str) -> Callable[..., Any]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while importing it
        raise ValueError(f"cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a callable")
    return obj


def reward_fn_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as a reward function, or None when it can."""
    try:
        _resolve(path)
    except ValueError as e:
        return str(e)
    return None


def load_reward_fn(path: str) -> Callable[..., list[float]]:
    """The callable named by ``'module:function'``; ValueError naming the path otherwise."""
    try:
        return _resolve(path)
    except ValueError as e:
        raise ValueError(f"reward.fn={path!r}: {e}") from None


def split_samples(tokens, lengths, prompt_lengths, eos_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cut each sample into prompt ids and response ids (stopping at the first end-of-sequence).

    Args:
        tokens: ``[b, s]`` ints; lengths, prompt_lengths: ``[b]``.

    Returns:
        (prompt_ids, response_ids), lists of ``b`` lists.
    """
    prompts, responses = [], []
    for row, n, p in zip(tokens.tolist(), lengths.tolist(), prompt_lengths.tolist()):
        prompts.append(row[:p])
        resp = row[p:n]
        if eos_id in resp:
            resp = resp[: resp.index(eos_id)]
        responses.append(resp)
    return prompts, responses


class RewardFunctionError(CriticServiceError):
    """The reward function failed on one request's samples: it raised, or answered the wrong
    number of scores or one that is not a finite number. The message names the function and,
    when one sample is to blame, its index in the request (``sample``)."""

    def __init__(self, fn_name: str, detail: str, sample: int | None = None) -> None:
        self.fn_name, self.detail, self.sample = fn_name, detail, sample
        where = "on the request's samples" if sample is None else f"on sample {sample} of the request"
        super().__init__(f"reward function {fn_name!r} failed {where}: {detail}")


def call_reward_fn(
    fn: Callable[..., Sequence[float]], name: str, tokenizer, tokens, lengths, prompt_lengths
) -> np.ndarray:
    """Decode the samples and score them with ``fn`` (named ``name`` in messages).

    Args:
        tokens: ``[b, s]`` ints; lengths, prompt_lengths: ``[b]``.

    Returns:
        ``[b]`` float64 scores, every one finite.

    Raises:
        RewardFunctionError: ``fn`` raised, or answered other than ``b`` finite numbers (with the
            sample's index when one is to blame).
    """
    prompt_ids, response_ids = split_samples(tokens, lengths, prompt_lengths, tokenizer.eos_id)
    prompts = [tokenizer.decode(ids) for ids in prompt_ids]
    responses = [tokenizer.decode(ids) for ids in response_ids]
    try:
        answer = list(fn(prompts, responses, prompt_ids=prompt_ids, response_ids=response_ids))
    except Exception as e:  # the function's own error, whatever it is, is the message
        raise RewardFunctionError(name, f"{type(e).__name__}: {e}") from e
    if len(answer) != len(prompts):
        raise RewardFunctionError(name, f"it returned {len(answer)} scores for {len(prompts)} samples")
    scores = np.zeros(len(answer), dtype=np.float64)
    for i, x in enumerate(answer):
        try:
            scores[i] = float(x)
        except (TypeError, ValueError):
            raise RewardFunctionError(name, f"its score {x!r} is not a number", sample=i) from None
        if not np.isfinite(scores[i]):
            raise RewardFunctionError(name, f"its score is {scores[i]}, not a finite number", sample=i)
    return scores


def score_requests(
    fn: Callable[..., Sequence[float]], name: str, tokenizer, requests: list[tuple[Any, Any, Any]]
) -> list[np.ndarray | RewardFunctionError]:
    """Score the samples of several requests (merged into one execution) so that one request's
    failure never touches another's scores.

    One call scores them all; when it fails, each request is scored alone, and in a request that
    fails alone each sample, to name the one to blame. Every request thus gets what an unmerged
    call would give it: its ``[b_i]`` float64 scores, or its :class:`RewardFunctionError`.

    Args:
        requests: ``(tokens [b_i, s], lengths [b_i], prompt_lengths [b_i])`` per request, all of
            the same ``s``.
    """
    if len(requests) > 1:
        try:
            merged = call_reward_fn(fn, name, tokenizer, *(np.concatenate(a) for a in zip(*requests)))
        except RewardFunctionError:
            pass
        else:
            ends = np.cumsum([len(r[1]) for r in requests])
            return list(np.split(merged, ends[:-1]))
    out: list[np.ndarray | RewardFunctionError] = []
    for tokens, lengths, prompt_lengths in requests:
        try:
            out.append(call_reward_fn(fn, name, tokenizer, tokens, lengths, prompt_lengths))
        except RewardFunctionError as e:
            out.append(
                e
                if e.sample is not None
                else _blame_one(fn, name, tokenizer, tokens, lengths, prompt_lengths, e)
            )
    return out


def _blame_one(fn, name: str, tokenizer, tokens, lengths, prompt_lengths, err: RewardFunctionError):
    """``err`` (what the request's call answered) with the index of the first sample that fails
    alone; ``err`` itself when none does."""
    if len(lengths) == 1:
        return RewardFunctionError(name, err.detail, sample=0)
    for i in range(len(lengths)):
        try:
            call_reward_fn(
                fn, name, tokenizer, tokens[i : i + 1], lengths[i : i + 1], prompt_lengths[i : i + 1]
            )
        except RewardFunctionError:
            return RewardFunctionError(name, err.detail, sample=i)
    return err


def checkpoint_folder_problem(path: str, hf: bool = False) -> str | None:
    """Why ``path`` is not a model checkpoint folder (or, with ``hf``, a HF folder), or None."""
    folder = Path(path)
    if not folder.is_dir():
        return "the folder does not exist"
    want = "config.json" if hf else "meta.json"
    if not (folder / want).is_file():
        what = (
            "a Hugging Face folder (config.json + safetensors)"
            if hf
            else "this project's checkpoint folder (meta.json + model.safetensors; `aligner-convert import` "
            "makes one from a HF folder)"
        )
        return f"no {want} in it: expected {what}"
    return None


def load_reward_model(model_path: str | None, hf_path: str | None):
    """(reward model on the current TP layout, its ModelConfig), or (None, None) without one."""
    if model_path:
        from aligner.models.checkpoint_io import build_from_checkpoint

        model, cfg, _ = build_from_checkpoint(model_path, role="reward")
    elif hf_path:
        # Imported lazily: the HF converter (and transformers) are needed only here.
        from aligner.models.hf import import_hf

        model, cfg = import_hf(hf_path, role="reward")
    else:
        return None, None
    model.requires_grad_(False)
    model.eval()
    return model, cfg


def load_policy_trunk(critic: torch.nn.Module, path: str) -> None:
    """Copy a policy checkpoint's trunk (everything but the LM head) into ``critic``, keeping the
    critic's fresh value head (collective under TP, like every loader here)."""
    from safetensors import safe_open

    from aligner.models.checkpoint_io import read_checkpoint_meta
    from aligner.models.config import ConversionError
    from aligner.models.layout import load_megatron_tensors

    folder = Path(path)
    saved = read_checkpoint_meta(folder)["model_config"]
    diff = critic.aligner_config.architecture_diff(saved)
    if diff:
        raise ConversionError(f"init.policy_path={path!r} holds a different architecture: {'; '.join(diff)}")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        load_megatron_tensors(critic, critic.aligner_config, fh.get_tensor, skip=HEAD_TENSORS)
