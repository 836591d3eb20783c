"""The generation-engine protocol shared by every engine (native Megatron, TensorRT-LLM).

Output convention (see docs/design.md, "Tensor conventions"):

- ``tokens[i, :lengths[i]]`` is prompt ``i`` followed by its response, right-padded with the
  engine's ``pad_id`` to the batch's ``s = max(lengths)``.
- The response occupies ``[prompt_lengths[i], lengths[i])``. The end-of-sequence token (or a
  stop token), when emitted, is part of the response: it is the action that ends the episode
  and it counts in the length. With stop strings the response is cut right after the last
  token of the first stop string it contains; what follows is padding.
- ``logprobs[i, t]`` is the log-probability of ``tokens[i, t+1]`` given ``tokens[i, :t+1]`` for
  ``t`` in ``[prompt_lengths[i]-1, lengths[i]-1)`` (the response mask), and 0 elsewhere.

Log-probabilities are those of the *tempered full distribution*:
``log_softmax(logits / temperature)`` at the emitted token, with no top-k/top-p
renormalisation (and for greedy decoding, the same tempered distribution at the argmax).
This is exactly what the training forward computes with the same temperature
(``aligner.rl.gather_logprobs``), so the first PPO ratio of a fresh rollout is 1. When
top-k/top-p truncation is on, the tokens are drawn from the truncated distribution, so these
log-probabilities are not the behaviour policy's exact ones; that is the usual convention
(vLLM, NeMo-RL, OpenRLHF) and it is what the trainer can recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from aligner.config_checks import Problems

__all__ = [
    "SamplingParams",
    "GenerationOutput",
    "GenerationEngine",
    "DECODE_STEPS",
    "sampling_problems",
    "engine_stop_ids",
]

#: The native engine's decode-step modes (``NativeEngine(decode_step=...)``, ``generation.decode_step``).
DECODE_STEPS = ("auto", "eager", "static", "graph", "compiled")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sampling_problems(values: Mapping[str, Any], prefix: str = "") -> Problems:
    """What is wrong with these :class:`SamplingParams` field values (any subset of the fields,
    by name), each problem under ``<prefix><name>``; a config that holds some of the fields
    checks them here too."""
    p, v = Problems(), dict(values)

    def check(name: str, ok: Callable[[Any], bool], expected: str) -> None:
        if name in v:
            p.expect(ok(v[name]), prefix + name, v[name], expected)

    check("max_new_tokens", lambda x: _is_int(x) and x >= 1, "an integer >= 1")
    check("temperature", lambda x: _is_real(x) and math.isfinite(x) and x > 0, "a finite number > 0")
    check("top_k", lambda x: _is_int(x) and x >= 0, "an integer >= 0 (0 = off)")
    check("top_p", lambda x: _is_real(x) and 0.0 < x <= 1.0, "a number in (0, 1] (1.0 = off)")
    check("greedy", lambda x: isinstance(x, bool), "a bool")
    check(
        "stop_token_ids",
        lambda x: isinstance(x, (list, tuple)) and all(_is_int(t) and t >= 0 for t in x),
        "a tuple of token ids >= 0",
    )
    check(
        "stop_strings",
        lambda x: isinstance(x, (list, tuple)) and all(isinstance(t, str) and t for t in x),
        "a tuple of non-empty strings",
    )
    check("seed", lambda x: x is None or _is_int(x), "an integer or None")
    return p


def engine_stop_ids(
    eos_id: int, tokenizer: Any = None, stop_ids: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The ids that end every sample of an engine, ``eos_id`` first: then ``stop_ids``, or
    (None) the tokenizer's ``stop_ids`` when ``eos_id`` is the tokenizer's eos (an instruct
    model's several end ids: :class:`~aligner.tokenizers.HFTokenizer`); an ``eos_id`` other
    than the tokenizer's stands alone. A call's ``SamplingParams.stop_token_ids`` add to them."""
    if stop_ids is None:
        same = tokenizer is not None and getattr(tokenizer, "eos_id", None) == eos_id
        stop_ids = getattr(tokenizer, "stop_ids", ()) if same else ()
    ids = [int(eos_id), *(int(t) for t in stop_ids)]
    bad = [t for t in ids if t < 0]
    if bad:
        raise ValueError(f"stop ids {bad}: expected token ids >= 0")
    return tuple(dict.fromkeys(ids))


@dataclass
class SamplingParams:
    """How to pick each next token. Every field is checked on construction
    (:func:`sampling_problems`); lists of stop tokens or strings become tuples."""

    max_new_tokens: int = 16
    """Most response tokens per sample (eos included); also bounded by the engine's max_seq_len."""
    temperature: float = 1.0
    """Logits are divided by this before sampling and before computing log-probs (> 0)."""
    top_k: int = 0
    """Sample only among the k most likely tokens; 0 turns it off."""
    top_p: float = 1.0
    """Sample only from the smallest set of tokens whose probability reaches p (nucleus); 1.0 is off."""
    greedy: bool = False
    """Take the most likely token at each step (temperature/top-k/top-p then only affect log-probs)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample, in addition to the engine's eos; the stop token is kept."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a sample once the decoded response contains one (needs a tokenizer)."""
    seed: int | None = None
    """Per-call seed; the engine combines it with its data-parallel rank. None: drawn from torch."""

    def __post_init__(self) -> None:
        sampling_problems(vars(self)).raise_if_any("SamplingParams")
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop_strings = tuple(self.stop_strings)


@dataclass
class GenerationOutput:
    """A batch of prompts with their responses, in the project's tensor conventions."""

    tokens: torch.Tensor
    """[b, s] int64: prompt + response, right-padded with pad_id (s = max(lengths))."""
    lengths: torch.Tensor
    """[b] int64: real length (prompt + response) of each sample."""
    prompt_lengths: torch.Tensor
    """[b] int64: where each response starts."""
    logprobs: torch.Tensor
    """[b, s-1] float32: element t = log p(token t+1 | tokens 0..t) under log_softmax(logits/T)
    (no top-k/top-p renormalisation), for t in [prompt_len-1, length-1); 0 elsewhere."""
    ended: torch.Tensor
    """[b] bool: the sample stopped by eos / a stop token / a stop string (False: ran out of
    max_new_tokens or max_seq_len)."""

    @property
    def response_lengths(self) -> torch.Tensor:
        """[b] int64: tokens in each response."""
        return self.lengths - self.prompt_lengths

    def response_mask(self) -> torch.Tensor:
        """[b, s-1] float32: 1 for t in [prompt_len-1, length-1), the transitions that emit a response token."""
        s = self.tokens.shape[1]
        t = torch.arange(s - 1, device=self.tokens.device).unsqueeze(0)
        lo = (self.prompt_lengths - 1).unsqueeze(1)
        hi = (self.lengths - 1).unsqueeze(1)
        return ((t >= lo) & (t < hi)).float()

    def responses(self) -> list[list[int]]:
        """Each sample's response tokens as a Python list."""
        out = []
        for row, p, n in zip(self.tokens.tolist(), self.prompt_lengths.tolist(), self.lengths.tolist()):
            out.append(row[p:n])
        return out


@runtime_checkable
class GenerationEngine(Protocol):
    """What the trainer needs from a generation engine."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Generate one response per prompt (token-id lists of possibly different lengths)."""
        ...

    def refit(self, policy) -> None:
        """Take the current policy weights; called after every policy update."""
        ...
