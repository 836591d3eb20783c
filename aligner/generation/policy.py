"""The policy module as the generation paths read it: eval mode for the length of a call, and the
real vocabulary size (logit columns beyond it, Megatron's padding, are never sampled). Shared by :class:`~aligner.generation.native.NativeEngine` and the
reference :func:`~aligner.generation.no_cache.generate_no_cache`.
"""

from __future__ import annotations

from torch import nn

__all__ = ["EvalMode", "model_vocab"]


class EvalMode:
    """Put every submodule in eval mode and restore each one's own flag afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.saved = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc) -> None:
        for m, mode in self.saved:
            m.training = mode


def model_vocab(model: nn.Module, vocab_size: int | None, tokenizer) -> int | None:
    if vocab_size is not None:
        return int(vocab_size)
    cfg = getattr(model, "aligner_config", None)
    if cfg is not None:
        return int(cfg.vocab_size)
    if tokenizer is not None:
        return int(tokenizer.vocab_size)
    return None
