"""The native engine's forward backends, one object per generation call (a *stepper*).

A stepper is built for a batch of ``b`` rows and ``T`` positions and called as
``step(tokens, start)``: ``tokens`` ``[b, n]`` are the tokens at positions ``[start, start + n)``
(the prompts' common prefix at ``start == 0``, then one position per call), and it returns the
logits of the last of them, ``[b, vocab]``. ``close()`` ends the call.
:class:`~aligner.generation.native.NativeEngine` picks one (module docstring there, *Two forward
backends*):

- :class:`LeanStepper`: :class:`~aligner.generation.decoder.LeanDecoder` (a private cache of
  RoPE'd keys), its decode step eager, static, captured in a CUDA graph or compiled;
- :class:`MegatronStepper`: ``GPTModel.forward`` with Megatron's ``StaticInferenceContext``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from aligner.generation.decoder import CompiledDecodeStep, CudaGraphDecodeStep, LeanDecoder

__all__ = ["LeanStepper", "MegatronStepper", "COMPILED_BUCKET"]

COMPILED_BUCKET = 64  # a compiled step's capacities: this, doubled, and max_len rounded up to it


class LeanStepper:
    """One generation call on :class:`LeanDecoder` (private cache, RoPE'd keys)."""

    def __init__(self, lean: LeanDecoder, b: int, T: int, mode: str) -> None:
        self.lean = lean
        lean.begin(b, T)
        self.step = lean.decode
        self.step_failed = False
        if mode == "static":
            self.pos = torch.zeros(1, dtype=torch.int64, device=lean.device)
            self.step = self._static
        elif mode in ("graph", "compiled"):
            what = "CUDA graph capture" if mode == "graph" else "compiling"
            try:
                self.step = (
                    CudaGraphDecodeStep(lean, b)
                    if mode == "graph"
                    else CompiledDecodeStep(lean, b, bucket=COMPILED_BUCKET)
                )
            except Exception as e:  # unsupported here: decode eagerly from now on
                self.step_failed = True
                warnings.warn(f"{what} of the decode step failed ({e!r}); decoding eagerly", stacklevel=4)

    def _static(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        self.pos.fill_(start)
        return self.lean.decode_static(tokens, self.pos)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        if start == 0:
            return self.lean.prefill(tokens)
        return self.step(tokens, start)

    def close(self) -> None:
        self.lean.end()


class MegatronStepper:
    """One generation call on Megatron's own static-batching inference path."""

    def __init__(self, model: nn.Module, b: int, T: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        # Sized exactly [T, b]: Megatron views the cached keys as [s, b * heads, d], which
        # needs the batch slice to be the whole buffer.
        self.ctx = StaticInferenceContext(max_batch_size=b, max_sequence_length=T)
        self.ctx.materialize_only_last_token_logits = True
        dev = next(model.parameters()).device
        self.positions = torch.arange(T, device=dev).unsqueeze(0).expand(b, T)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        n = tokens.shape[1]
        # The context stays in "prefill" mode: decode mode only switches on flash-decode and
        # CUDA-graph paths, which this engine does not use.
        logits = self.model(
            tokens,
            self.positions[:, start : start + n],
            None,
            inference_context=self.ctx,
            runtime_gather_output=True,
        )
        self.ctx.sequence_len_offset += n
        return logits[:, -1, :]

    def close(self) -> None:
        self.ctx = None
