"""The reference decoder: generation by full recompute, with no KV cache (for tests and
benchmarks; the engines are :mod:`aligner.generation.native` and :mod:`aligner.generation.trtllm`)."""

from __future__ import annotations

import torch
from torch import nn

from aligner.generation.engine import GenerationOutput, SamplingParams
from aligner.generation.policy import EvalMode, model_vocab
from aligner.generation.sampling import build_output, check_prompts, rank_generator, row_uniforms, sample_next
from aligner.models.gpt import unwrap

__all__ = ["generate_no_cache"]


@torch.inference_mode()
def _full_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, None, runtime_gather_output=True)


def generate_no_cache(
    model: nn.Module,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    pad_id: int,
    eos_id: int,
    max_seq_len: int,
    tokenizer=None,
    vocab_size: int | None = None,
    parallel_state=None,
) -> GenerationOutput:
    """Reference generation by full recompute: every step runs the whole right-padded batch
    from position 0 without a cache and reads each row's logits at its own last position.

    Deliberately simple and independent of :class:`~aligner.generation.native.NativeEngine`'s bookkeeping (per-row
    Python lists, no cache, no compaction); for tests and benchmarks only. Sampling uses the
    same :func:`sample_next`, per-rank seeding and per-row random numbers
    (:func:`~aligner.generation.sampling.row_uniforms`: prompt ``i``'s response token ``k`` is
    drawn with element ``[k, i]``), so sampled outputs are comparable token for token too (up
    to a round-off difference in the logits that moves a draw across a token boundary).
    """
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("sampling.stop_strings needs a tokenizer")
    model = unwrap(model)
    vocab = model_vocab(model, vocab_size, tokenizer)
    prompts = check_prompts(prompts, max_seq_len, vocab)
    prompt_lens = [len(p) for p in prompts]
    dev = next(model.parameters()).device
    generator = None
    if not sampling.greedy:
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        generator = rank_generator(seed, parallel_state.dp_rank if parallel_state is not None else 0, dev)
    uniforms = row_uniforms(generator, len(prompts), sampling.max_new_tokens, dev)
    stops = {eos_id, *sampling.stop_token_ids}
    seqs = [list(p) for p in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    ended = [False] * len(prompts)
    with EvalMode(model):
        for _ in range(sampling.max_new_tokens):
            live = [i for i, s in enumerate(seqs) if not done[i] and len(s) < max_seq_len]
            if not live:
                break
            width = max(len(seqs[i]) for i in live)
            batch = torch.tensor([seqs[i] + [pad_id] * (width - len(seqs[i])) for i in live], device=dev)
            logits = _full_logits(model, batch)
            last = torch.tensor([len(seqs[i]) - 1 for i in live], device=dev)
            z = logits[torch.arange(len(live), device=dev), last]
            if vocab is not None:
                z = z[:, :vocab]
            u = None
            if uniforms is not None:
                k = torch.tensor([len(seqs[i]) - prompt_lens[i] for i in live], device=dev)
                u = uniforms[k, torch.tensor(live, device=dev)]
            tok, lp = sample_next(z.float(), sampling, None, u)
            for k, i in enumerate(live):
                t = int(tok[k])
                seqs[i].append(t)
                lps[i].append(float(lp[k]))
                if t in stops:
                    done[i] = ended[i] = True
    b = len(prompts)
    T = max(len(s) for s in seqs)
    tokens = torch.full((b, T), pad_id, dtype=torch.int64)
    logprobs = torch.zeros(b, max(T - 1, 0), dtype=torch.float32)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        tokens[i, : len(s)] = torch.tensor(s)
        if len(s) > p:
            logprobs[i, p - 1 : len(s) - 1] = torch.tensor(lps[i])
    return build_output(
        tokens.to(dev),
        torch.tensor(prompt_lens, device=dev),
        torch.tensor([len(s) for s in seqs], device=dev),
        logprobs.to(dev),
        torch.tensor(ended, device=dev),
        pad_id,
        tokenizer,
        sampling.stop_strings,
    )
