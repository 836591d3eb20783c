"""What TensorRT-LLM returns, checked and written in the project's tensor conventions (the
package docstring, *Outputs*).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from aligner.generation.engine import GenerationOutput
from aligner.generation.sampling import build_output
from aligner.generation.trtllm.requests import NO_END_ID

__all__ = ["Completion", "read_completion", "completions_to_output"]


class Completion(NamedTuple):
    """One request's response as the engine returned it, checked."""

    token_ids: list[int]
    """Generated tokens only, the stop token (when one ended it) last."""
    logprobs: list[float]
    """The log-probability of each generated token, same length."""
    ended: bool
    """Ended by eos or a stop token (False: ran out of max_tokens)."""


def read_completion(
    request_output: Any, index: int, stop_ids: set[int] | frozenset[int], max_tokens: int
) -> Completion:
    """Check one ``RequestOutput`` and return its :class:`Completion`.

    The stop token must be the last generated token when the engine says it stopped, and no
    stop token may appear before the last; each log-probability is read by the sampled id.
    """
    outs = list(request_output.outputs)
    if len(outs) != 1:
        raise RuntimeError(f"prompt {index}: TensorRT-LLM returned {len(outs)} completions, expected 1 (n=1)")
    c = outs[0]
    ids = [int(t) for t in c.token_ids]
    reason = c.finish_reason
    where = f"prompt {index}: TensorRT-LLM"
    if reason not in ("stop", "length"):
        raise RuntimeError(f"{where} finished with finish_reason={reason!r}, expected 'stop' or 'length'")
    if not ids:
        raise RuntimeError(f"{where} generated no token (finish_reason={reason!r})")
    if len(ids) > max_tokens:
        raise RuntimeError(f"{where} generated {len(ids)} tokens, more than max_tokens={max_tokens}")
    early = [j for j, t in enumerate(ids[:-1]) if t in stop_ids]
    if early:
        j = early[0]
        raise RuntimeError(f"{where} went on after stop token {ids[j]} (position {j} of {len(ids)})")
    ended = ids[-1] in stop_ids
    if reason == "stop" and not ended:
        raise RuntimeError(
            f"{where} stopped (finish_reason='stop') but its last token {ids[-1]} is not a stop token "
            f"{sorted(stop_ids)}: the stop token must stay in the response (end_id={NO_END_ID} with "
            "include_stop_str_in_output=True)"
        )
    lps = c.logprobs
    if lps is None or len(lps) != len(ids):
        got = None if lps is None else len(lps)
        raise RuntimeError(f"{where} returned {got} per-token log-prob entries for {len(ids)} tokens")
    values = []
    for j, (tok, entry) in enumerate(zip(ids, lps)):
        if not isinstance(entry, dict):
            raise RuntimeError(
                f"{where}: log-prob entry {j} is a {type(entry).__name__}, expected a dict of token id "
                "-> Logprob (the default format, logprobs_simple_format=False)"
            )
        lp = entry.get(tok)
        if lp is None:
            raise RuntimeError(
                f"{where}: log-probs of position {j} lack the sampled token {tok}: {sorted(entry)}"
            )
        values.append(float(lp.logprob))
    return Completion(ids, values, ended)


def completions_to_output(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    pad_id: int,
    tokenizer=None,
    stop_strings: Sequence[str] = (),
    device: torch.device | str = "cpu",
) -> GenerationOutput:
    """Prompts and their completions in the project's tensor conventions (engine.py): tokens
    ``[b, s]`` prompt + response right-padded, ``logprobs[i, t]`` for the token at ``t+1``,
    stop strings applied by :func:`~aligner.generation.sampling.build_output`."""
    b = len(prompts)
    if len(completions) != b:
        raise ValueError(f"{len(completions)} completions for {b} prompts")
    plen = [len(p) for p in prompts]
    lengths = [p + len(c.token_ids) for p, c in zip(plen, completions)]
    T = max(lengths)
    tokens = torch.full((b, T), int(pad_id), dtype=torch.int64)
    logprobs = torch.zeros((b, T - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        P, L = plen[i], lengths[i]
        tokens[i, :P] = torch.tensor(list(p), dtype=torch.int64)
        tokens[i, P:L] = torch.tensor(c.token_ids, dtype=torch.int64)
        # logprobs[t] scores tokens[t+1]: the first response token (position P) sits at P-1.
        logprobs[i, P - 1 : L - 1] = torch.tensor(c.logprobs, dtype=torch.float32)
    ended = torch.tensor([c.ended for c in completions], dtype=torch.bool)
    return build_output(
        tokens.to(device),
        torch.tensor(plen, dtype=torch.int64, device=device),
        torch.tensor(lengths, dtype=torch.int64, device=device),
        logprobs.to(device),
        ended.to(device),
        int(pad_id),
        tokenizer,
        stop_strings,
    )
