"""Paged K/V caches read by the varlen forward: flash_attn_varlen_func(..., block_table=...).

A paged cache k (num_pages, page_size, nheads_k, headdim) holds sequence b's key j in page
``block_table[b, j // page_size]``, row ``j % page_size`` (FlashAttention-2's meaning). Version 1
does not read the pages inside the kernel: it gathers each sequence's first ``max_seqlen_k``
slots into a padded contiguous (batch * max_seqlen_k, nheads_k, headdim) K and V with one
vectorized index per tensor, then runs the varlen forward with
``cu_seqlens_k = arange(batch + 1) * max_seqlen_k`` and ``seqused_k`` = each sequence's key
count, so the padding slots are never attended. Everything stays on the device: no host sync,
so the gather runs under torch.compile and CUDA graph capture. Cost: O(batch * max_seqlen_k *
nheads_k * headdim) extra memory and one read + write of it per tensor.

Slots past a sequence's count (and so possibly past what its block_table row holds) still get
an address: page indices are clamped into [0, num_pages) and table columns into range, so a
garbage entry can never index out of bounds; the values read there are masked out by
seqused_k (the sm80 kernel, which runs every seqused_k call, zero-fills key rows past it).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["paged_gather_index", "gather_paged_kv", "used_key_counts", "padded_cu_seqlens"]


def paged_gather_index(block_table: torch.Tensor, page_size: int, num_pages: int,
                       max_seqlen_k: int) -> tuple:
    """(page, row) int64 tensors of shape (batch, max_seqlen_k): slot j of sequence b lives in
    ``cache[page[b, j], row[b, j]]``. Columns past the table and page indices outside [0,
    num_pages) are clamped (only slots a sequence does not use can meet either, for valid
    input)."""
    device = block_table.device
    slots = torch.arange(max_seqlen_k, device=device)
    column = (slots // page_size).clamp_(max=max(block_table.shape[1] - 1, 0))
    page = block_table.index_select(1, column).to(torch.int64).clamp_(0, max(num_pages - 1, 0))
    row = (slots % page_size).unsqueeze(0).expand_as(page)
    return page, row


def gather_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    max_seqlen_k: int) -> tuple:
    """k and v as padded varlen tensors (batch * max_seqlen_k, nheads_k, headdim), new and
    contiguous, sequence b at rows [b * max_seqlen_k, (b + 1) * max_seqlen_k). The caches are
    indexed in place (any strides), never copied whole."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    page, row = paged_gather_index(block_table, page_size, num_pages, max_seqlen_k)
    k = k_cache[page, row].flatten(0, 1)
    v = v_cache[page, row].flatten(0, 1)
    return k, v


def used_key_counts(cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor]) -> torch.Tensor:
    """Each sequence's key count, int32 (batch,) on the device: seqused_k if given, else the
    steps of cu_seqlens_k (FlashAttention-2's paged varlen reads only those)."""
    if seqused_k is not None:
        return seqused_k.to(torch.int32).contiguous()
    return (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32).contiguous()


def padded_cu_seqlens(batch: int, max_seqlen_k: int, device) -> torch.Tensor:
    """cu_seqlens_k of the gathered layout: arange(batch + 1) * max_seqlen_k, int32."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * max_seqlen_k
