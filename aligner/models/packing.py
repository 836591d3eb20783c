"""Packed sequences: the rows of a right-padded batch laid end to end, without their padding.

A batch ``tokens [b, s]`` with real lengths ``lengths [b]`` costs ``b * s`` positions in every
layer when it is run padded; packed, it costs ``T = sum(lengths)``. :func:`pack` lays the rows'
first ``lengths[i]`` tokens one after another in a ``[1, T]`` sequence (:class:`PackedRows`),
with what the forwards need to keep the rows apart: each row's start in ``cu_seqlens`` (the
cumulative lengths, as varlen attention kernels take them) and ``position_ids`` that restart at
0 in every row (RoPE and learned position embeddings read them). The packed forwards of
:mod:`aligner.models.forward` never let attention cross a row boundary, so a row's outputs are
those of the padded forward at its real positions (to the kernels' round-off).

Results come back per position, ``[1, T, ...]``; :meth:`PackedRows.unpack` puts them back into
the padded ``[b, s, ...]`` layout, and :meth:`PackedRows.unpack_shifted` into the ``[b, s-1,
...]`` one of per-token quantities that predict the next token (docs/design.md, "Tensor
conventions": element ``t`` is about token ``t+1``; a row's last position predicts nothing).

:func:`plan_micro_batches` cuts a batch into contiguous runs of rows under a token budget: a
forward's memory and time then follow the tokens it holds, not its longest row times its rows.

Shapes: ``b`` rows (``n`` of them in one packed micro-batch), ``s`` padded length, ``T`` packed
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PackedRows", "pack", "plan_micro_batches"]


@dataclass
class PackedRows:
    """``n`` rows laid end to end (build with :func:`pack`).

    Attributes:
        tokens: ``[1, T]`` the rows' real tokens, concatenated (no padding).
        lengths: ``[n]`` int64 on the CPU: each row's length (>= 1), its share of ``T``.
        cu_seqlens: ``[n+1]`` int32 on the tokens' device: row ``i`` is ``tokens[0,
            cu_seqlens[i]:cu_seqlens[i+1]]``.
        position_ids: ``[1, T]`` int64: each token's position in its own row (0 at each row's
            start).
        max_len: the longest row.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    max_len: int
    # Derived once: which row each packed position belongs to ([T], the tokens' device), and
    # (row, position) of each packed position on the CPU, from which the index tensors of
    # positions_from and the unpacks are built without a device sync.
    row_index: torch.Tensor = field(repr=False)
    host: tuple[torch.Tensor, torch.Tensor] = field(repr=False)

    @property
    def rows(self) -> int:
        """``n``."""
        return int(self.lengths.numel())

    @property
    def total(self) -> int:
        """``T``."""
        return int(self.tokens.shape[1])

    @property
    def bounds(self) -> list[int]:
        """``cu_seqlens`` as Python ints (from the CPU lengths: reading them costs no device
        sync), for slicing row by row."""
        return [0, *torch.cumsum(self.lengths, 0).tolist()]

    def positions_from(self, start: int) -> torch.Tensor | None:
        """``[T']`` int64: the packed positions whose position in their row is ``>= start``, in
        order (what the forwards return with ``start``); None for ``start == 0`` (all ``T``)."""
        if start <= 0:
            return None
        return (self.host[1] >= start).nonzero().squeeze(1).to(self.tokens.device)

    def last_positions(self) -> torch.Tensor:
        """``[n]`` int64: each row's last packed position (where a reward model's score is read)."""
        return self.cu_seqlens[1:].long() - 1

    def next_tokens(self) -> torch.Tensor:
        """``[1, T]``: the token each position predicts (the next one in its row); a row's last
        position gets its own token, a placeholder: it predicts nothing, and
        :meth:`unpack_shifted` drops it."""
        nxt = torch.roll(self.tokens, -1, dims=1)
        last = self.last_positions()
        nxt[0, last] = self.tokens[0, last]
        return nxt

    def padded(self, pad_id: int = 0, s: int | None = None) -> torch.Tensor:
        """The rows right-padded again: ``[n, s]`` (``s`` defaults to ``max_len``)."""
        return self.unpack(self.tokens, s or self.max_len, fill=pad_id)

    def repack(self, x: torch.Tensor) -> torch.Tensor:
        """A padded per-position tensor ``[n, s', *rest]`` (``s' >= max_len``) -> ``[1, T,
        *rest]``, its real positions in packed order (the inverse of :meth:`unpack`)."""
        return x[self.row_index, self.position_ids[0]].unsqueeze(0)

    def unpack(self, x: torch.Tensor, s: int, fill: float = 0.0, start: int = 0) -> torch.Tensor:
        """A per-position tensor ``[1, T, *rest]`` -> padded ``[n, s, *rest]`` (``s >=
        max_len``), each row's positions ``0..length-1`` filled from ``x`` and the rest with
        ``fill``. With ``start``, ``x`` holds only the positions :meth:`positions_from` names
        (``[1, T', *rest]``) and the earlier ones get ``fill`` too. Differentiable in ``x``."""
        if s < self.max_len:
            raise ValueError(f"s={s} is shorter than the longest packed row ({self.max_len})")
        if start > 0:
            rows, pos = self.host
            keep = pos >= start
            rows, pos = rows[keep].to(x.device), pos[keep].to(x.device)
        else:
            rows, pos = self.row_index, self.position_ids[0]
        out = x.new_full((self.rows, s, *x.shape[2:]), fill)
        return out.index_put((rows, pos), x[0])

    def unpack_shifted(self, x: torch.Tensor, s: int, fill: float = 0.0, start: int = 0) -> torch.Tensor:
        """A per-position tensor ``[1, T, *rest]`` whose position ``j`` is about token ``j+1`` of
        its row (a log-probability of :meth:`next_tokens`, say) -> ``[n, s-1, *rest]``, element
        ``t`` of row ``i`` from the row's position ``t`` for ``t < length-1``, ``fill`` elsewhere
        (a row's last position predicts nothing: it is dropped). ``start`` as in
        :meth:`unpack`."""
        if s < self.max_len:
            raise ValueError(f"s={s} is shorter than the longest packed row ({self.max_len})")
        rows, pos = self.host
        if start > 0:  # x holds the positions >= start only
            keep = pos >= start
            rows, pos = rows[keep], pos[keep]
        predicts = pos < self.lengths[rows] - 1  # [T'], on the CPU
        which = predicts.nonzero().squeeze(1).to(x.device)
        out = x.new_full((self.rows, s - 1, *x.shape[2:]), fill)
        return out.index_put((rows[predicts].to(x.device), pos[predicts].to(x.device)), x[0, which])


def pack(tokens: torch.Tensor, lengths: torch.Tensor) -> PackedRows:
    """Right-padded ``tokens [b, s]`` with real ``lengths [b]`` (each in ``[1, s]``; any device,
    or a list) -> :class:`PackedRows` on the tokens' device, rows in the given order.

    The index of the real positions is built on the CPU from the lengths and moved once: no
    boolean indexing on the device, so no device sync.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}: expected [b, s]")
    b, s = tokens.shape
    lengths = torch.as_tensor(lengths).to("cpu", torch.int64).reshape(-1)
    if lengths.numel() != b:
        raise ValueError(f"lengths has {lengths.numel()} entries: expected {b}, one per row of tokens")
    if b == 0:
        raise ValueError("nothing to pack: tokens has no rows")
    if int(lengths.min()) < 1 or int(lengths.max()) > s:
        raise ValueError(f"lengths must lie in [1, {s}] (the padded length), got {lengths.tolist()}")
    dev = tokens.device
    rows = torch.repeat_interleave(torch.arange(b), lengths)  # [T]
    starts = torch.cumsum(lengths, 0) - lengths  # [b]
    pos = torch.arange(rows.numel()) - starts[rows]  # [T]
    flat = (rows * s + pos).to(dev)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return PackedRows(
        tokens=tokens.reshape(-1)[flat].unsqueeze(0),
        lengths=lengths,
        cu_seqlens=cu.to(dev),
        position_ids=pos.to(dev).unsqueeze(0),
        max_len=int(lengths.max()),
        row_index=rows.to(dev),
        host=(rows, pos),
    )


def plan_micro_batches(lengths, max_tokens: int, max_rows: int | None = None) -> list[torch.Tensor]:
    """Cut rows of ``lengths [b]`` (a tensor, array or list) into micro-batches: a list of
    int64 index tensors, contiguous runs of rows in the given order (so the plan, and what is
    summed in which order, is a function of the lengths alone: the same on every rank).

    Each run holds at most ``max_tokens`` real tokens, except a row longer than that, which
    runs alone; and at most ``max_rows`` rows when given. Greedy: a run takes rows until the
    next one would not fit.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: expected >= 1")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: expected >= 1 or None")
    sizes = [int(n) for n in torch.as_tensor(lengths).reshape(-1).tolist()]
    plan: list[torch.Tensor] = []
    first, tokens = 0, 0
    for i, n in enumerate(sizes):
        full = i > first and (tokens + n > max_tokens or (max_rows is not None and i - first >= max_rows))
        if full:
            plan.append(torch.arange(first, i))
            first, tokens = i, 0
        tokens += n
    if sizes:
        plan.append(torch.arange(first, len(sizes)))
    return plan
