"""The lean decoder's fixed-shape decode step, captured in a CUDA graph or compiled.

Both run :meth:`~aligner.generation.decoder.LeanDecoder.decode_static` (every row at its own
position, attention over the cache's capacity under a per-row mask): nothing in it depends on a
host value, so one capture or one compile serves every position of a batch size.
:class:`~aligner.generation.steppers.LeanStepper` builds them and decides when the batch
shrinks (power-of-two batch sizes, so that few captures or compiles are needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aligner.generation.decoder import LeanDecoder

__all__ = ["CudaGraphDecodeStep", "CompiledDecodeStep"]


class CudaGraphDecodeStep:
    """:meth:`LeanDecoder.decode_static` for ``pos.numel()`` rows, captured once in a CUDA
    graph and replayed per step.

    A decode step of a small model on a GPU is a few hundred kernel launches whose launch cost
    exceeds their work; a replayed graph launches them all at once. Inputs are copied into
    static buffers (the token column ``[b, 1]``, the positions ``[b]``) and the logits come back
    in a static buffer, valid until the next replay. The warm-up runs before the capture write
    each row's key and value at its slot ``pos`` (the positions given here): build it before
    the prefill (which overwrites them) or with the positions the next step writes (which
    overwrites them too). ``pool``: a graph memory pool shared with the call's other graphs
    (one is replayed at a time, the previous one never again).
    """

    def __init__(self, lean: LeanDecoder, pos: torch.Tensor, pool=None) -> None:
        dev = lean.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {dev}")
        lean.reserve(lean.max_len)  # the graph reads the cache's final addresses
        self.batch = int(pos.numel())
        self.tokens = torch.zeros(self.batch, 1, dtype=torch.int64, device=dev)
        self.pos = pos.clone()
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel selection)
            for _ in range(2):
                lean.decode_static(self.tokens, self.pos)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = lean.decode_static(self.tokens, self.pos)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor | int) -> torch.Tensor:
        """``tokens`` ``[b, 1]`` at positions ``pos`` (``[b]``, or an int for every row) ->
        logits ``[b, v]`` (the graph's buffer)."""
        self.tokens.copy_(tokens)
        if isinstance(pos, int):
            self.pos.fill_(pos)
        else:
            self.pos.copy_(pos)
        self.graph.replay()
        return self.logits


_COMPILED_STEP = None
_RECOMPILE_LIMIT = 64


def _static_step(lean: LeanDecoder, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return lean.decode_static(tokens, pos, reduced=True, grow=False)


class CompiledDecodeStep:
    """:meth:`LeanDecoder.decode_static` under ``torch.compile(fullgraph=True)``.

    On a CPU a decode step of a small model is a few hundred small kernels whose dispatch and
    memory passes outweigh their arithmetic; inductor fuses the norms, RoPE, cache writes,
    attention and SwiGLU into a few loops around the matrix products. One compiled function
    per process serves every decoder: the decoder is an argument, so its weights, cache and
    tables are guarded by shape and dtype only, and a new batch size or cache capacity is one
    more compile (seconds, cached on disk between processes). TP=1 only.

    Attention reads the whole cache at every step, so the cache grows as the sequence does:
    its capacity doubles from ``bucket`` positions (64, 128, 256, ... up to ``max_len``), and a
    step attends over the capacity that covers its furthest row. At 208 positions a step over
    all of them took 2.5-2.8 ms and one over 64 took 1.5-1.7 ms (64 rows, bf16, two threads),
    and a whole 192-token generation 0.45 s instead of 0.50-0.61 s. Doubling keeps the compiles
    to a few per batch size; past the first bucket no step reads more than twice the positions
    it needs.

    The first call compiles, so it is made here for ``batch`` rows, before the prefill: it
    writes position 0 of the cache, which the prefill then overwrites. Logits are a fresh
    tensor per call.
    """

    def __init__(self, lean: LeanDecoder, batch: int, bucket: int = 64) -> None:
        global _COMPILED_STEP
        if lean.tp_size > 1:
            raise ValueError("a compiled decode step needs tensor_parallel_size 1")
        if not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"bucket={bucket!r}: expected an integer >= 1")
        if _COMPILED_STEP is None:
            _COMPILED_STEP = torch.compile(_static_step, fullgraph=True, dynamic=False)
            # Every (batch size, capacity, architecture) is one more compiled entry of this one
            # function; dynamo's default of 8 would send the rest back to eager, silently.
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, _RECOMPILE_LIMIT)
        # Plain linears: inductor chooses the fp32 GEMM itself (it cannot lower the direct
        # oneDNN call the eager path makes).
        lean.linear = F.linear
        self.lean = lean
        self.bucket = bucket
        self.fn = _COMPILED_STEP
        self.pos = torch.zeros(batch, dtype=torch.int64, device=lean.device)
        self(torch.zeros(batch, 1, dtype=torch.int64, device=lean.device), 0)

    def capacity_for(self, start: int) -> int:
        """The capacity a step whose furthest row is at position ``start`` attends over:
        ``bucket`` doubled until it covers ``start``, at most ``max_len``."""
        c = self.bucket
        while c <= start:
            c *= 2
        return min(c, self.lean.max_len)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor | int, end: int | None = None) -> torch.Tensor:
        """``tokens`` ``[b, 1]`` at positions ``pos`` (``[b]`` int64, or an int for every row);
        ``end``: one past the furthest position (a host value; needed with a tensor ``pos``)
        -> logits ``[b, v]``."""
        lean = self.lean
        if isinstance(pos, int):
            end = pos + 1
            if self.pos.numel() != tokens.shape[0]:
                self.pos = torch.empty(tokens.shape[0], dtype=torch.int64, device=lean.device)
            pos = self.pos.fill_(pos)
        elif end is None:
            raise ValueError("a position tensor needs end= (one past the furthest position)")
        need = self.capacity_for(end - 1)
        if lean.capacity < need:
            # reserve() rounds up to its chunk; a bucket boundary is reached exactly when the
            # chunk divides it (a capacity that overshoots just compiles once more).
            lean.reserve(need)
        return self.fn(lean, tokens, pos)
