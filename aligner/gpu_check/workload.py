"""What the PPO run of the check trains on: the model's shape (a Qwen2.5-0.5B-shaped GPT, or a
tiny one for the reduced check), a synthetic tokenizer of that vocabulary written as a Hugging
Face folder, mixed-length prompts of random token ids, and the reward function the critic scores
them with.

The tokenizer is a word-level one whose every id is a word (``t<id>``), with ``<eos>`` at id 0 and
no pad token of its own (pad is end-of-sequence, as in many causal LMs). With a random policy over
151,936 ids an end-of-sequence is rare, so every response runs to ``max_new_tokens``: each step
generates the same number of tokens, which makes the throughput figures comparable between runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Shape", "QWEN_0_5B", "TINY", "write_tokenizer", "write_prompts", "reward", "REWARD_FN"]

EOS, UNK = "<eos>", "<unk>"
FIRST_WORD = 2
"""Ids below this are special (``<eos>`` 0, ``<unk>`` 1); prompts draw ids from here up."""

REWARD_FN = "aligner.gpu_check.workload:reward"
"""The critic's ``reward.fn``."""


@dataclass(frozen=True)
class Shape:
    """A GPT's architecture as ``model.*`` keys of both roles' configs (:class:`ModelConfig`'s
    field names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-6
    activation: str = "swiglu"
    position_embedding: str = "rope"
    rotary_base: float = 1_000_000.0
    add_qkv_bias: bool = True
    tie_embeddings: bool = True

    def keys(self) -> dict[str, object]:
        """The ``model.*`` keys, by field name."""
        return asdict(self)

    def overrides(self) -> list[str]:
        """Hydra overrides of the actor's ``model`` section."""
        return [f"model.{k}={v}" for k, v in self.keys().items()]


QWEN_0_5B = Shape(
    num_layers=24,
    hidden_size=896,
    num_attention_heads=14,
    num_query_groups=2,
    ffn_hidden_size=4864,
    vocab_size=151_936,
    max_seq_len=512,
)
"""Qwen2.5-0.5B's architecture (its config.json: tied embeddings, qkv bias, RoPE theta 1e6), with a
context of 512, enough for a 256-token prompt and 128 new tokens."""

TINY = Shape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    max_seq_len=64,
)
"""The reduced check's model: the same kinds of layers, small enough for a CPU test."""


def write_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level Hugging Face tokenizer of ``vocab_size`` ids in ``folder`` (``<eos>`` 0,
    ``<unk>`` 1, then ``t2``, ``t3``, ...: one word per id, split on whitespace)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, UNK: 1, **{f"t{i}": i for i in range(FIRST_WORD, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=UNK)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def write_prompts(
    path: Path, count: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0
) -> dict[str, float]:
    """``count`` prompts of random word ids, each of a length drawn uniformly from
    ``[min_len, max_len]`` tokens, as a JSONL prompt file (``{"prompt": "t17 t9023 ..."}``).
    Returns the lengths' min, mean and max."""
    rng = random.Random(seed)
    lengths = []
    with open(path, "w") as f:
        for _ in range(count):
            n = rng.randint(min_len, max_len)
            ids = [rng.randrange(FIRST_WORD, vocab_size) for _ in range(n)]
            f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in ids)}) + "\n")
            lengths.append(n)
    return {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)}


def reward(
    prompts: list[str], responses: list[str], response_ids: list[list[int]], **_: object
) -> list[float]:
    """The synthetic task: the fraction of even token ids in each response (0 for an empty one).
    A random policy scores about 0.5; the score is cheap to compute and moves when the policy
    learns, which is all the check asks of it."""
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0 for ids in response_ids]
