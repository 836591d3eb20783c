"""The native engine's decode loop on a ragged batch (the lean backend): one prefill of every
prompt, whatever their lengths, then every row generates from the first step, and rows that
stop leave the batch.

The rows are sorted by prompt length, longest first, for the whole call (the eager step's
attention spans, :func:`~aligner.generation.decoder.attention_spans`, are then contiguous and
few); outputs go back to the caller's order through each row's original index. A row's
``k``-th response token is sampled with ``uniforms[k, i]``
(:func:`~aligner.generation.sampling.row_uniforms`), so neither the sorting nor the compaction
changes what a row samples.

Per step, on the device: sample every row, write each live row's token and log-prob at
``[k, row]`` of the outputs (a stopped row's writes go to a spare row ``b`` that is dropped),
and mark the rows that just stopped (a stop token, or their last allowed token). Every
``check_every`` steps (every step on a CPU) the host reads which rows are live: the loop ends
when none is, and otherwise the stepper says whether to shrink the batch
(:meth:`~aligner.generation.steppers.LeanStepper.rows_after`), in which case the live rows'
state is gathered to the front and the stepper drops the others
(:meth:`~aligner.generation.steppers.LeanStepper.compact`: the eager step leaves their cache
rows unread, a fixed-shape step gathers the live rows' cache). Stop strings are looked for on the host every few
steps (decoding is costly) to stop rows early; ``build_output`` applies them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from aligner.generation.engine import SamplingParams
from aligner.generation.sampling import sample_next
from aligner.generation.steppers import LeanStepper

__all__ = ["ragged_length", "ragged_decode"]


def ragged_length(prompt_lens: Sequence[int], max_new_tokens: int, max_seq_len: int) -> int:
    """Positions a ragged call needs: the longest prompt + response any row can reach."""
    return max(p + min(max_new_tokens, max_seq_len - p) for p in prompt_lens)


def ragged_decode(
    step: LeanStepper,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    uniforms: torch.Tensor | None,
    *,
    vocab_size: int | None,
    pad_id: int,
    stop_ids: torch.Tensor,
    max_seq_len: int,
    check_every: int,
    tokenizer=None,
    between_steps: Callable[[int], None] | None = None,
):
    """Generate for ``prompts`` on ``step`` (a :class:`LeanStepper` begun for ``len(prompts)``
    rows and :func:`ragged_length` positions).

    ``uniforms``: ``[max_new_tokens, b]`` (:func:`~aligner.generation.sampling.row_uniforms`),
    None when greedy; ``stop_ids``: ``[n]`` int64, the token ids that end a sample.

    Returns ``(tokens [b, T], lengths [b], logprobs [b, T-1], ended [b], prompt_lengths [b])``
    in the order of ``prompts``: prompt and response right-padded with ``pad_id``, log-probs at
    ``[i, prompt_len - 1 + k]``, for :func:`~aligner.generation.sampling.build_output`.
    ``between_steps(k)``, when given, runs before the step that computes response token ``k``
    of every row (all rows draw token ``k`` at the same iteration), for k = 1 .. K - 1.
    """
    dev = stop_ids.device
    b = len(prompts)
    plen = [len(p) for p in prompts]
    nmax = [min(sampling.max_new_tokens, max_seq_len - p) for p in plen]
    K, T = max(nmax), max(p + n for p, n in zip(plen, nmax))
    order = sorted(range(b), key=lambda i: -plen[i])  # longest first, ties in input order
    lens = [plen[i] for i in order]
    rows = torch.tensor(order, dtype=torch.int64, device=dev)
    padded = torch.tensor([list(prompts[i]) + [pad_id] * (lens[0] - plen[i]) for i in order], device=dev)

    # State per row of the stepper's batch (its order), gathered along at every compaction.
    spare = b  # output row that takes the writes of rows no longer generating
    slot = rows.clone()  # output row of each stepper row, `spare` once it stopped
    live = torch.ones(b, dtype=torch.bool, device=dev)
    last_k = torch.tensor([nmax[i] - 1 for i in order], dtype=torch.int64, device=dev)
    origin = list(order)  # host: output row of each stepper row
    row_of = rows.clone()  # the same on the device

    # Outputs, one row per step (contiguous writes), one column per prompt plus the spare.
    gen_tok = torch.full((K, b + 1), pad_id, dtype=torch.int64, device=dev)
    gen_lp = torch.zeros(K, b + 1, dtype=torch.float32, device=dev)
    n_gen = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    ended = torch.zeros(b + 1, dtype=torch.bool, device=dev)
    V = vocab_size
    stop_every = max(check_every, 4)

    logits = step.prefill(padded, lens)
    for k in range(K):
        z = (logits[:, :V] if V is not None else logits).float()
        tok, lp = sample_next(
            z, sampling, None, None if uniforms is None else uniforms[k].index_select(0, row_of)
        )
        gen_tok[k].index_put_((slot,), tok)
        gen_lp[k].index_put_((slot,), lp)
        hit = torch.isin(tok, stop_ids)
        ended.index_put_((slot,), hit)
        n_gen.index_fill_(0, slot, k + 1)
        live &= ~hit & (last_k > k)
        slot = torch.where(live, slot, spare)
        if k + 1 == K:
            break
        done = k + 1
        if sampling.stop_strings and done % stop_every == 0:
            hits = _stop_string_hits(tokenizer, sampling.stop_strings, gen_tok[:done], origin, live)
            if hits is not None:
                live &= ~hits.to(dev)
                slot = torch.where(live, slot, spare)
        if done % check_every == 0:
            alive = live.tolist()
            n_live = sum(alive)
            if n_live == 0:
                break  # every row stopped
            size = step.rows_after(n_live)
            if size is not None:
                keep = [i for i, a in enumerate(alive) if a]
                keep += [keep[-1]] * (size - n_live)  # a fixed batch size: repeat a row
                index = torch.tensor(keep, dtype=torch.int64, device=dev)
                step.compact(index, keep)
                origin = [origin[i] for i in keep]
                tok, slot, live, last_k, row_of = (
                    t.index_select(0, index) for t in (tok, slot, live, last_k, row_of)
                )
                if size > n_live:  # the repeats only fill the batch: never live
                    live[n_live:] = False
                    slot[n_live:] = spare
        if between_steps is not None:
            between_steps(done)
        logits = step(tok.view(-1, 1))

    # Prompt then response per row, in the caller's order.
    plen_t = torch.tensor(plen, dtype=torch.int64, device=dev)
    width = T + K  # room for any row's K response slots past its prompt
    tokens = torch.full((b, width), pad_id, dtype=torch.int64, device=dev)
    tokens.index_copy_(0, rows, torch.nn.functional.pad(padded, (0, width - lens[0]), value=pad_id))
    at = plen_t.unsqueeze(1) + torch.arange(K, device=dev)  # [b, K]: where response token k goes
    tokens.scatter_(1, at, gen_tok[:, :b].t())
    logprobs = torch.zeros(b, width, dtype=torch.float32, device=dev)
    logprobs.scatter_(1, at - 1, gen_lp[:, :b].t())
    return tokens[:, :T], plen_t + n_gen[:b], logprobs[:, : T - 1], ended[:b], plen_t


def _stop_string_hits(tokenizer, stop_strings, gen_tok: torch.Tensor, origin: list[int], live: torch.Tensor):
    """``[rows]`` bool: the live stepper rows whose response so far (``gen_tok`` ``[k, b + 1]``
    by output row) contains a stop string; None when none does."""
    alive = live.tolist()
    cols = gen_tok.t().tolist()
    hits = [a and any(s in tokenizer.decode(cols[o]) for s in stop_strings) for a, o in zip(alive, origin)]
    return torch.tensor(hits) if any(hits) else None
