"""Shared by the native engine's tests (tests/generation/test_generation.py, test_ragged.py): the
character tokenizer, a tiny policy's config and model, and an engine over it."""

from __future__ import annotations

import torch

from aligner.generation import NativeEngine
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_policy
from aligner.tokenizers import CharTokenizer

MAX_LEN = 48
TOK = CharTokenizer()  # vocab 14: <pad>=0, <eos>=1, digits, ':' and ','


def tiny_cfg(**kw) -> ModelConfig:
    """A 2-layer policy for TOK, ``kw`` overriding any field."""
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=TOK.vocab_size,
        max_seq_len=MAX_LEN,
        init_method_std=0.2,
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **kw):
    torch.manual_seed(seed)
    return build_policy(tiny_cfg(**kw))


def engine(model, ps, backend="lean", **kw) -> NativeEngine:
    kw.setdefault("pad_id", TOK.pad_id)
    kw.setdefault("eos_id", TOK.eos_id)
    return NativeEngine(model, TOK, max_seq_len=MAX_LEN, parallel_state=ps, backend=backend, **kw)
