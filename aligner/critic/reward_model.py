"""Reward models of the critic server: a Megatron GPT with a scalar head, frozen, read at each
sample's last token, from this project's model checkpoint folder (``meta.json`` +
``model.safetensors``, see :mod:`aligner.models.checkpoint_io`; ``aligner-convert import`` writes
one from HF) or from a HF sequence-classification folder (:func:`aligner.models.hf.import_hf`).
When its tokenizer (``reward.tokenizer``, or the tokenizer files of ``reward.hf_path``) is not the
policy's, it reads the samples' text, tokenized its own way (:class:`RewardTokens`).

Weights are loaded onto the current TP layout by those modules (full tensors in the files, this
rank's shard in the model), so a reward model saved at TP=1 serves a TP=2 critic. The checks of
the folders the configuration names (:func:`checkpoint_folder_problem`, :func:`tokenizer_folder`)
are here too: a reward model's, and the policy's a critic starts from.

The other reward source, a reward function, is :mod:`aligner.critic.reward_fn`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from aligner.critic.errors import RequestRewardError
from aligner.models.checkpoint_io import build_from_checkpoint
from aligner.models.hf import import_hf

__all__ = [
    "RewardTextError",
    "RewardTokens",
    "TOKENIZER_FILES",
    "tokenizer_folder",
    "checkpoint_folder_problem",
    "load_reward_model",
]

log = logging.getLogger("aligner.critic")


class RewardTextError(RequestRewardError):
    """A sample's text gives the reward model nothing to read (its tokenizer makes no token of it)."""

    def __init__(self, tokenizer: str, detail: str, sample: int) -> None:
        self.detail, self.sample = detail, sample
        super().__init__(
            f"reward model tokenizer {tokenizer!r} failed on sample {sample} of the request: {detail}"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder with any of these holds a tokenizer (``transformers.AutoTokenizer`` reads it)."""


def tokenizer_folder(path: str | None) -> str | None:
    """``path`` when it is a folder holding tokenizer files (:data:`TOKENIZER_FILES`), else None."""
    if path and Path(path).is_dir() and any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        return str(path)
    return None


class RewardTokens:
    """Prompt and response text -> the reward model's token ids, with its own tokenizer.

    ``prompt + response`` is tokenized with the tokenizer's special tokens (a BOS or CLS is
    added as the model was trained), or, with ``chat_template``, formatted first as a user turn
    (the prompt) and an assistant turn (the response) by the tokenizer's chat template (whose
    text holds its special tokens). A sequence longer than ``max_len`` keeps its last
    ``max_len`` tokens (the score is read at the last one), and is counted in :attr:`truncated`.

    Args:
        tokenizer: an :class:`aligner.tokenizers.HFTokenizer` (or any project tokenizer).
        spec: how messages name it (``reward.tokenizer`` or the folder it came from).
        max_len: the reward model's ``max_seq_len``.
        chat_template: format the pair with the tokenizer's chat template.
    """

    def __init__(self, tokenizer, spec: str, max_len: int, chat_template: bool = False) -> None:
        self.tokenizer, self.spec, self.max_len = tokenizer, spec, int(max_len)
        self.chat_template = chat_template
        self.hf = getattr(tokenizer, "hf", None)
        if chat_template and not (self.hf is not None and getattr(self.hf, "chat_template", None)):
            raise ValueError(
                f"reward.chat_template=true, but the reward tokenizer {spec!r} has no chat template "
                "(its tokenizer_config.json sets no chat_template); set reward.chat_template=false"
            )
        self.pad_id = int(tokenizer.pad_id)
        self._count_lock = threading.Lock()
        self.rows = 0
        """Samples tokenized so far."""
        self.truncated = 0
        """Of those, samples longer than ``max_len`` (cut from the left)."""

    def ids(self, prompt: str, response: str) -> list[int]:
        """One sample's ids, before truncation."""
        if self.hf is None:
            return list(self.tokenizer.encode(prompt + response))
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = self.hf.apply_chat_template(messages, tokenize=False)
            return list(self.hf(text, add_special_tokens=False)["input_ids"])
        return list(self.hf(prompt + response, add_special_tokens=True)["input_ids"])

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """tokens ``[b, s]`` int64 (right padded) and lengths ``[b]`` int64 of the samples.

        Raises:
            RewardTextError: a sample the tokenizer makes no token of (the first such).
        """
        rows, cut = [], 0
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = self.ids(p, r)
            if not ids:
                raise RewardTextError(self.spec, "its prompt and response text make no token", sample=i)
            if len(ids) > self.max_len:
                ids = ids[-self.max_len :]
                cut += 1
            rows.append(ids)
        with self._count_lock:
            first = cut and not self.truncated
            self.rows += len(rows)
            self.truncated += cut
        if first:
            log.warning(
                "the reward model's tokenizer %r makes %d sample(s) longer than its max_seq_len=%d: "
                "their first tokens are cut (counted in server_info's reward.text.truncated)",
                self.spec,
                cut,
                self.max_len,
            )
        s = max(len(r) for r in rows)
        tokens = np.full((len(rows), s), self.pad_id, dtype=np.int64)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        return tokens, np.array([len(r) for r in rows], dtype=np.int64)


def checkpoint_folder_problem(path: str, hf: bool | None = False) -> str | None:
    """Why ``path`` is not a model checkpoint folder (with ``hf``, a HF folder; with ``hf=None``,
    either), or None."""
    folder = Path(path)
    if not folder.is_dir():
        return "the folder does not exist"
    if hf is None:
        if (folder / "meta.json").is_file() or (folder / "config.json").is_file():
            return None
        return (
            "neither meta.json nor config.json in it: expected this project's checkpoint folder "
            "(meta.json + model.safetensors) or a Hugging Face folder (config.json + safetensors)"
        )
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
        model, cfg, _ = build_from_checkpoint(model_path, role="reward")
    elif hf_path:
        model, cfg = import_hf(hf_path, role="reward")
    else:
        return None, None
    model.requires_grad_(False)
    model.eval()
    return model, cfg
