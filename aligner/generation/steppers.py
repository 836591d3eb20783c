"""The native engine's forward backends, one object per generation call (a *stepper*).

:class:`~aligner.generation.native.NativeEngine` picks one (module docstring there, *Two forward
backends*):

- :class:`LeanStepper`: :class:`~aligner.generation.decoder.LeanDecoder` on a *ragged* batch
  (each row at its own position): :meth:`LeanStepper.prefill` encodes every prompt in one
  packed forward, then each call ``step(tokens)`` feeds one token per row (``[b, 1]``) and
  returns the logits ``[b, vocab]``; :meth:`LeanStepper.compact` drops the rows that stopped.
  Its decode step runs eager, static, captured in a CUDA graph or compiled
  (:mod:`aligner.generation.decode_steps`). :func:`aligner.generation.ragged.ragged_decode`
  drives it.
- :class:`MegatronStepper`: ``GPTModel.forward`` with Megatron's ``StaticInferenceContext``,
  teacher-forced: ``step(tokens, start)`` with ``tokens`` ``[b, n]`` at positions ``[start,
  start + n)`` (the prompts' common prefix at ``start == 0``, then one position per call), the
  logits of the last of them ``[b, vocab]``.

``close()`` ends the call.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from aligner.generation.decode_steps import CompiledDecodeStep, CudaGraphDecodeStep
from aligner.generation.decoder import LeanDecoder, attention_spans
from aligner.generation.engine import SamplingParams
from aligner.generation.sampling import sample_next

__all__ = ["LeanStepper", "MegatronStepper", "teacher_forced_decode", "COMPILED_BUCKET", "PREFILL_TOKENS"]

COMPILED_BUCKET = 64  # a compiled step's capacities: this, doubled, and max_len rounded up to it
#: Most prompt tokens in one prefill forward: a larger batch is prefilled in several forwards
#: of whole rows (the activations of a forward over N tokens are N x the MLP's width).
PREFILL_TOKENS = 32768


class LeanStepper:
    """One generation call on :class:`LeanDecoder`, every row at its own position.

    Rows keep the order they are given in (the caller sorts them, longest prompt first, so that
    the eager step's attention spans are few). ``mode``: ``"eager"`` (:meth:`LeanDecoder.decode`,
    attention span by span over the filled positions), ``"static"``
    (:meth:`LeanDecoder.decode_static` run eagerly: what a graph replays), ``"graph"`` (captured
    in a CUDA graph, re-captured when the batch shrinks) or ``"compiled"``. A capture or
    compile that fails warns and decodes eagerly from then on (``step_failed``).

    The cache is laid out for all ``T`` positions at once (one zeroing, no growth copies: the
    eager step reads each span's range only, whatever the capacity), except for a compiled
    step, which attends over the whole capacity and so grows it in buckets.

    Shrinking the batch (:meth:`rows_after`, :meth:`compact`): the eager step just leaves the
    stopped rows out, every time one stops. Their cache rows stay where they are, unread (a
    row's new key goes to its own cache row, :meth:`LeanDecoder.decode`'s ``rows``), and the
    live rows are gathered together only when the gaps alone would cut the batch into more than
    16 attention spans (:func:`~aligner.generation.decoder.attention_spans`). Fixed-shape steps
    (static, graph, compiled) need the rows together: they run at power-of-two batch sizes (or
    the call's batch) and halve, gathering the live rows' cache, when the live rows fit in half,
    so a call captures or compiles at most ``log2(b)`` more steps.
    """

    def __init__(self, lean: LeanDecoder, b: int, T: int, mode: str) -> None:
        self.lean = lean
        lean.begin(b, T)
        self.T = T
        self.mode = mode
        self.step_failed = False
        self.lens: list[int] = []  # prompt length of each row
        self.k = 0  # tokens fed per row since the prefill
        self.pos: torch.Tensor | None = None  # [b] int64: each row's next slot (its position)
        # Eager: the cache row of each row ([b] on the device and on the host); None: row i.
        self.cache_rows: list[int] | None = None
        self._rows: torch.Tensor | None = None
        self._graph: CudaGraphDecodeStep | None = None
        self._pool = None
        self._compiled: CompiledDecodeStep | None = None
        if mode == "compiled":
            try:
                self._compiled = CompiledDecodeStep(lean, b, bucket=COMPILED_BUCKET)
            except Exception as e:  # unsupported here: decode eagerly from now on
                self._fail("compiling", e)
        else:
            lean.reserve(T)

    @property
    def rows(self) -> int:
        """Rows the steps run on now."""
        return len(self.lens)

    def _fail(self, what: str, e: Exception) -> None:
        self.step_failed = True
        self.mode = "eager"
        self._graph = self._compiled = None
        warnings.warn(f"{what} of the decode step failed ({e!r}); decoding eagerly", stacklevel=4)

    def prefill(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Every row's prompt (``tokens`` ``[b, n]`` right-padded, row ``i`` the first
        ``lengths[i]``) into the cache; the logits ``[b, v]`` after each prompt. One packed
        forward (several for more than :data:`PREFILL_TOKENS` tokens)."""
        b = tokens.shape[0]
        out, r0 = [], 0
        while r0 < b:
            r1, total = r0 + 1, lengths[r0]
            while r1 < b and total + lengths[r1] <= PREFILL_TOKENS:
                total += lengths[r1]
                r1 += 1
            n = max(lengths[r0:r1])
            out.append(self.lean.prefill(tokens[r0:r1, :n], lengths[r0:r1], first_row=r0))
            r0 = r1
        self.lens, self.k = list(lengths), 0
        self.pos = torch.tensor(lengths, dtype=torch.int64, device=tokens.device)
        return out[0] if len(out) == 1 else torch.cat(out)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s token ``tokens[i]`` (``[b, 1]``) at its next position; the logits
        ``[b, v]``. A row past the call's last position (it stopped and awaits compaction)
        re-writes the last slot of its own cache row."""
        last = self.T - 1
        if self.mode == "eager":
            ends = [min(p + self.k, last) + 1 for p in self.lens]
            spans = attention_spans(ends, self.cache_rows)
            if spans is None:  # too many gaps: gather the rows together (a copy)
                self.lean.compact(self._rows)
                self.cache_rows = self._rows = None
                spans = attention_spans(ends)
            logits = self.lean.decode(tokens, self.pos, spans, self._rows)
        elif self.mode == "static":
            logits = self.lean.decode_static(tokens, self.pos)
        elif self.mode == "graph":
            if self._graph is None or self._graph.batch != self.rows:
                try:
                    if self._pool is None:
                        self._pool = torch.cuda.graph_pool_handle()
                    self._graph = None  # the previous graph's memory goes back to the pool
                    self._graph = CudaGraphDecodeStep(self.lean, self.pos, self._pool)
                except Exception as e:
                    self._fail("CUDA graph capture", e)
                    return self(tokens)
            logits = self._graph(tokens, self.pos)
        else:
            logits = self._compiled(tokens, self.pos, min(max(self.lens) + self.k, last) + 1)
        self.pos.add_(1).clamp_(max=last)
        self.k += 1
        return logits

    def rows_after(self, live: int) -> int | None:
        """The row count to compact to with ``live`` rows still generating, or None to keep
        the batch as it is (see the class docstring)."""
        rows = self.rows
        if self.mode == "eager":
            return live if live < rows else None
        size = 1 << max(0, live - 1).bit_length()  # the power of two >= live
        return size if size <= rows // 2 else None

    def compact(self, index: torch.Tensor, keep: list[int]) -> None:
        """Keep rows ``keep`` (host, in order; a row may repeat to fill a batch size), ``index``
        the same on the device (``[b']`` int64), as the batch."""
        if self.mode == "eager":
            # Leave the other rows out; the cache stays as it is.
            self.cache_rows = keep if self.cache_rows is None else [self.cache_rows[i] for i in keep]
            self._rows = index if self._rows is None else self._rows.index_select(0, index)
        else:
            self.lean.compact(index)
            self._graph = None  # it read the old cache's addresses
        self.pos = self.pos.index_select(0, index)
        self.lens = [self.lens[i] for i in keep]

    def close(self) -> None:
        self._graph = None
        self._pool = None
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


def teacher_forced_decode(
    step: MegatronStepper,
    prompts: list[list[int]],
    sampling: SamplingParams,
    uniforms: torch.Tensor | None,
    *,
    T: int,
    vocab_size: int | None,
    pad_id: int,
    stop_ids: torch.Tensor,
    check_every: int,
    tokenizer=None,
):
    """The megatron backend's loop (teacher forcing; :mod:`aligner.generation.native`, *Design*):
    prefill up to the shortest prompt (``T`` positions in all), then one position ``j`` per
    step for the whole batch, row ``i`` fed its own prompt token while ``j < prompt_len[i]``
    and its sampled token after. Its response token ``k`` is sampled with ``uniforms[k, i]``
    (``[max_new_tokens, b]``; None: greedy), as in the ragged loop, so both sample the same
    tokens. Returns what :func:`~aligner.generation.ragged.ragged_decode` does (``tokens`` and
    ``logprobs`` ``T`` and ``T - 1`` wide)."""
    dev = stop_ids.device
    b = len(prompts)
    plen_l = [len(p) for p in prompts]
    min_p = min(plen_l)
    buf = torch.tensor(
        [p + [pad_id] * (T - len(p)) for p in prompts], dtype=torch.int64, device=dev
    )  # [b, T]
    plen = torch.tensor(plen_l, dtype=torch.int64, device=dev)
    positions = torch.arange(T, device=dev).unsqueeze(0).expand(b, T)
    # gen[i, j]: row i samples its token j (prompt_len <= j < prompt_len + max_new).
    gen = (positions >= plen.unsqueeze(1)) & (positions < (plen + sampling.max_new_tokens).unsqueeze(1))
    gen_t = gen.t().contiguous()  # [T, b]: one contiguous row per step
    row_last = (plen + sampling.max_new_tokens).clamp(max=T) - 1  # last position each row can fill
    logprobs = torch.zeros(b, T - 1, dtype=torch.float32, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)  # stopped by eos / stop token / stop string
    n_gen = torch.zeros(b, dtype=torch.int64, device=dev)
    last_j = int(row_last.max())
    stop_every = max(check_every, 4)
    logits = step(buf[:, :min_p], 0)
    for j in range(min_p, last_j + 1):
        # Sample token j of every row from the logits of position j-1.
        z = (logits[:, :vocab_size] if vocab_size is not None else logits).float()
        u = None
        if uniforms is not None:
            u = uniforms.gather(0, (j - plen).clamp(0, uniforms.shape[0] - 1).unsqueeze(0)).squeeze(0)
        tok, lp = sample_next(z, sampling, None, u)
        active = gen_t[j] & ~done
        buf[:, j] = torch.where(active, tok, buf[:, j])
        logprobs[:, j - 1] = torch.where(active, lp, 0.0)
        n_gen += active
        done |= active & torch.isin(tok, stop_ids)
        if j == last_j:
            break
        k = j - min_p + 1  # steps taken
        if sampling.stop_strings and k % stop_every == 0:
            # Decoding on the host is costly: look every few steps. Rows found here stop
            # generating; build_output cuts each exactly after its stop string.
            rows = buf.tolist()
            for i, (row, p, n, d) in enumerate(zip(rows, plen_l, n_gen.tolist(), done.tolist())):
                if not d and n and any(s in tokenizer.decode(row[p : p + n]) for s in sampling.stop_strings):
                    done[i] = True
        if k % check_every == 0 and bool((done | (row_last <= j)).all()):
            break  # every row stopped or at its last position
        logits = step(buf[:, j : j + 1], j)
    # Rows that stopped hold pad after their end already; build_output pads and trims (and
    # cuts after stop strings: a row stopped by one here is cut and marked ended there).
    return buf, plen + n_gen, logprobs, done, plen
