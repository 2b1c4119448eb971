"""Where the sequences of a transformers batch start and end, in the varlen form flash_ext takes
(int32 ``cu_seqlens`` and a host-side ``max_seqlen``), from a 2-D padding mask or from
``position_ids`` that restart inside a row (packed, padding-free batches).

Finding the boundaries needs the mask's or the positions' values on the host (a device sync).
Every layer of one forward receives the same mask / position_ids tensor object, so the result is
kept per tensor object (a weak reference plus the tensor's version counter): one sync per forward
instead of one per layer. Nothing is kept while torch.compile traces.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch


class PaddingLayout(NamedTuple):
    """The valid tokens of a (batch, seqlen) padding mask, flattened row-major."""
    indices: torch.Tensor      # int64 (total,): positions of the valid tokens in batch * seqlen
    cu_seqlens: torch.Tensor   # int32 (batch + 1,)
    max_seqlen: int
    all_valid: bool            # no padding at all


class PackedLayout(NamedTuple):
    """Sequences packed along the rows of a (batch, seqlen) batch, flattened row-major."""
    cu_seqlens: torch.Tensor   # int32 (num_sequences + 1,)
    max_seqlen: int


class _PerTensorCache:
    """A few results keyed by tensor object (weakly) and its in-place version counter."""

    def __init__(self, size: int = 8):
        self._size = size
        self._entries: dict = {}

    def get_or_compute(self, t: torch.Tensor, key, compute: Callable):
        if torch.compiler.is_compiling():
            return compute()
        slot = (id(t), key)
        hit = self._entries.get(slot)
        if hit is not None:
            ref, version, value = hit
            if ref() is t and t._version == version:
                return value
        value = compute()
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[slot] = (weakref.ref(t), t._version, value)
        return value

    def clear(self):
        self._entries.clear()


_CACHE = _PerTensorCache()


def padding_layout(attention_mask: torch.Tensor, unpad_input: Callable) -> PaddingLayout:
    """The valid tokens of a (batch, seqlen) mask (nonzero = valid), through ``unpad_input`` with
    FlashAttention-2's bert_padding signature (flash_ext.unpad_input)."""
    def compute():
        b, s = attention_mask.shape
        # A one-column stand-in for the hidden states: only the layout is wanted here.
        probe = attention_mask.new_zeros((b, s, 1), dtype=torch.uint8)
        _, indices, cu_seqlens, max_seqlen = unpad_input(probe, attention_mask)[:4]
        return PaddingLayout(indices, cu_seqlens.to(torch.int32), int(max_seqlen),
                             indices.numel() == b * s)
    return _CACHE.get_or_compute(attention_mask, "padding", compute)


def packed_layout(position_ids: torch.Tensor, batch: int, seqlen: int) -> Optional[PackedLayout]:
    """Sequences packed in rows of ``position_ids`` (batch or 1, seqlen): a new sequence starts at
    each row start and wherever the position does not grow by exactly one (the rule transformers'
    own masks use for packed batches). None when every row is one sequence.

    Positions shared by all rows of a batch of several ((1, seqlen) for batch > 1) are taken as
    one sequence per row without reading them: that is what transformers makes when the caller
    passes none (cache_position), and reading them would cost a host sync on every forward of an
    ordinary batch (a 4 x 2048 Llama training step ran 7-11% slower with it). Packed batches come
    as one row (DataCollatorWithFlattening) or with positions for every row."""
    if batch > 1 and position_ids.shape[0] == 1:
        return None

    def compute():
        pos = position_ids.expand(batch, seqlen)
        starts = torch.ones((batch, seqlen), dtype=torch.bool, device=pos.device)
        starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
        first = starts.reshape(-1).nonzero().reshape(-1)  # sync: the number of sequences
        if first.numel() == batch:
            return None
        end = torch.tensor([batch * seqlen], dtype=first.dtype, device=first.device)
        cu_seqlens = torch.cat([first, end]).to(torch.int32)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return PackedLayout(cu_seqlens, max_seqlen)
    return _CACHE.get_or_compute(position_ids, ("packed", batch, seqlen), compute)


def gather_tokens(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of t (batch, seqlen, ...) flattened to (batch * seqlen, ...)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, indices)
