"""Pieces every engine shares: prompt validation, per-rank generators, next-token sampling,
stop strings, and building a :class:`GenerationOutput`.

Pure tensor code plus the tokenizer; no process groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from aligner.generation.engine import GenerationOutput, SamplingParams

__all__ = [
    "check_prompts",
    "rank_generator",
    "row_uniforms",
    "sample_next",
    "stop_string_cut",
]


def check_prompts(
    prompts: Sequence[Sequence[int]], max_seq_len: int, vocab_size: int | None
) -> list[list[int]]:
    """Validate a batch of prompts and return them as lists of Python ints.

    Each prompt (a list/tuple of ints or a 1-D tensor) needs at least one token, ids in
    ``[0, vocab_size)``, and at least one free position before ``max_seq_len`` for the
    response.
    """
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: expected at least one prompt (a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"prompt {i}: expected a list of token ids, got {type(p).__name__}")
        p = [int(t) for t in p]
        n = len(p)
        if n == 0:
            raise ValueError(f"prompt {i} is empty: expected at least one token to condition on")
        if n >= max_seq_len:
            raise ValueError(
                f"prompt {i} has {n} tokens but max_seq_len is {max_seq_len}: a prompt must be shorter "
                f"than max_seq_len (at most {max_seq_len - 1} tokens) to leave room for a response"
            )
        lo, hi = min(p), max(p)
        if vocab_size is not None and (lo < 0 or hi >= vocab_size):
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} contains token id {bad}, outside the vocabulary [0, {vocab_size})")
        out.append(p)
    return out


def rank_seed(seed: int, dp_rank: int) -> int:
    """A 63-bit seed for data-parallel rank ``dp_rank`` of a call seeded with ``seed``.

    Hashing keeps the streams of (seed, rank) and (seed + 1, rank - 1) unrelated.
    """
    digest = hashlib.blake2b(f"aligner.generation:{seed}:{dp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rank_generator(seed: int, dp_rank: int, device: torch.device) -> torch.Generator:
    """A torch.Generator on ``device`` for this data-parallel rank (same on every TP rank)."""
    g = torch.Generator(device=device)
    g.manual_seed(rank_seed(seed, dp_rank))
    return g


def row_uniforms(
    generator: torch.Generator | None, rows: int, max_new_tokens: int, device: torch.device
) -> torch.Tensor | None:
    """The random numbers of a generation call: ``[max_new_tokens, rows]`` float64 uniforms in
    ``[0, 1)``, element ``[k, i]`` the one that picks prompt ``i``'s response token ``k`` (None
    without a generator: greedy).

    Drawn once, up front, so that what a row samples depends only on the seed, the data-parallel
    rank, its index and the batch size, never on the other prompts' lengths or contents nor on
    when the engine steps it: every engine and backend that takes its numbers from here (the
    native engine's ragged and teacher-forced loops, the no-cache reference) samples the same
    tokens from the same logits. Step-major, as a draw of ``rows`` numbers per step would take
    them: a batch of equally long prompts samples what it did when each step drew its own.
    """
    if generator is None:
        return None
    return torch.rand(max_new_tokens, rows, dtype=torch.float64, device=device, generator=generator)


def sample_next(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and return its log-probability.

    Args:
        logits: ``[b, v]`` float32 next-token logits over the real vocabulary.
        sampling: temperature / top-k / top-p / greedy.
        generator: the random stream (unused when greedy or when ``uniforms`` is given).
        uniforms: ``[b]`` float64 in ``[0, 1)``, one per row (:func:`row_uniforms`); None:
            drawn from ``generator``.

    Returns:
        ``(tokens [b] int64, logprobs [b] float32)``; the log-probability is under
        ``log_softmax(logits / temperature)``, the full tempered distribution (no top-k/top-p
        renormalisation), which is what the training forward recomputes.

    Sampling is by inverse CDF: one uniform number per row against the cumulative
    probabilities (float64), which on a CPU costs a small fraction of ``torch.multinomial`` or
    an exponential race (both draw one random number per vocabulary entry). Top-k and top-p
    work on the sorted candidates (``topk`` returns them sorted; top-p alone sorts the row).
    """
    z = logits if sampling.temperature == 1.0 else logits / sampling.temperature
    logp = torch.log_softmax(z, dim=-1)
    if sampling.greedy:
        tok = z.argmax(dim=-1)
    else:
        v = z.shape[-1]
        k = sampling.top_k if 0 < sampling.top_k < v else 0
        if k or sampling.top_p < 1.0:
            # Candidates in descending order of probability, with their vocabulary ids.
            cand, ids = torch.topk(logp, k, dim=-1) if k else torch.sort(logp, dim=-1, descending=True)
            probs = torch.softmax(cand, dim=-1)  # renormalised over the candidates
            if sampling.top_p < 1.0:
                # Nucleus: keep a candidate while the mass ranked above it is < top_p.
                mass_before = torch.cumsum(probs, dim=-1) - probs
                probs = probs.masked_fill(mass_before >= sampling.top_p, 0.0)
            pick = _inverse_cdf(probs, generator, uniforms)
            tok = ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
        else:
            tok = _inverse_cdf(logp.exp(), generator, uniforms)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return tok, lp


def _inverse_cdf(
    probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """``[b, v]`` non-negative weights (need not sum to 1) -> ``[b]`` int64 index drawn in
    proportion to them, with ``uniforms`` ``[b]`` (None: drawn from ``generator``); zero-weight
    entries are never drawn."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    if uniforms is None:
        u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)
    else:
        u = uniforms.to(torch.float64).view(-1, 1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def stop_string_cut(tokenizer, response: list[int], stop_strings: Sequence[str]) -> int | None:
    """The number of response tokens up to and including the one that completes the first stop
    string in the decoded response, or None when the response contains none."""
    if not stop_strings or not response:
        return None
    if not any(s in tokenizer.decode(response) for s in stop_strings):
        return None
    # Containment is monotone in the prefix length: binary search the shortest prefix.
    lo, hi = 1, len(response)
    while lo < hi:
        mid = (lo + hi) // 2
        text = tokenizer.decode(response[:mid])
        if any(s in text for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def build_output(
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    logprobs: torch.Tensor,
    ended: torch.Tensor,
    pad_id: int,
    tokenizer=None,
    stop_strings: Sequence[str] = (),
) -> GenerationOutput:
    """Apply stop strings, pad after each sample's end, trim to ``s = max(lengths)``.

    ``tokens`` ``[b, T]`` holds prompt + response (anything after a sample's length is
    overwritten with ``pad_id``); ``logprobs`` ``[b, T-1]``. All inputs on one device; the
    result is on the same device, as ordinary (non-inference) tensors.
    """
    tokens = tokens.clone()
    logprobs = logprobs.clone()
    lengths = lengths.clone().long()
    ended = ended.clone().bool()
    prompt_lengths = prompt_lengths.clone().long()
    if stop_strings:
        rows = tokens.tolist()
        for i, (row, p, n) in enumerate(zip(rows, prompt_lengths.tolist(), lengths.tolist())):
            cut = stop_string_cut(tokenizer, row[p:n], stop_strings)
            if cut is not None and p + cut <= n:
                lengths[i] = p + cut
                ended[i] = True
    T = tokens.shape[1]
    pos = torch.arange(T, device=tokens.device).unsqueeze(0)
    tokens.masked_fill_(pos >= lengths.unsqueeze(1), pad_id)
    t = pos[:, : T - 1]
    in_response = (t >= (prompt_lengths - 1).unsqueeze(1)) & (t < (lengths - 1).unsqueeze(1))
    logprobs = torch.where(
        in_response, logprobs.float(), torch.zeros((), dtype=torch.float32, device=logprobs.device)
    )
    s = int(lengths.max())
    return GenerationOutput(
        tokens=tokens[:, :s].contiguous(),
        lengths=lengths,
        prompt_lengths=prompt_lengths,
        logprobs=logprobs[:, : s - 1].contiguous(),
        ended=ended,
    )
