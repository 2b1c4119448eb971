"""Padded batches to varlen and back: ``unpad_input`` and ``pad_input``, with the signatures and
return values of FlashAttention-2's ``flash_attn.bert_padding`` (>= 2.7; also importable as
``flash_ext.bert_padding``).

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = flash_ext.unpad_input(x, attention_mask)
    out_unpad = flash_ext.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens,
                                                 cu_seqlens, max_seqlen, max_seqlen, causal=True)
    out = flash_ext.pad_input(out_unpad, indices, batch, seqlen)

A token is kept where attention_mask (bool or integer, (batch, seqlen)) is nonzero, or, when
``unused_mask`` is given, where either mask is nonzero (a position marked in both counts once);
kept tokens keep their order (row-major over (batch, seqlen)), so left padding, right padding
and holes all work. A float mask is refused: transformers' additive masks are 0 where a token
is attended, the opposite of this convention. Both functions are
differentiable (index_select / index_copy, whose gradients autograd knows: a gather one way, a
scatter the other, padding positions get zero gradient), with no Python loop over the batch.
unpad_input synchronises with the device once for the indices (their number depends on the mask)
and once for max_seqlen_in_batch (a Python int); pad_input does not synchronise.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_ext import _validation

__all__ = ["unpad_input", "pad_input"]


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """The tokens of a padded batch, packed.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or integer: nonzero = a valid token, 0 = padding.
        unused_mask: optional (batch, seqlen), bool or integer: nonzero = a token that is
            allocated (kept in the packed tensor and counted in cu_seqlens) but not used
            (not counted in seqused).

    Returns:
        hidden_states: (total_nnz, ...), the kept tokens in order; total_nnz = number of
            positions where attention_mask or unused_mask is nonzero.
        indices: int64 (total_nnz,), each kept token's position in the flattened (batch *
            seqlen) input (what pad_input takes).
        cu_seqlens: int32 (batch + 1,), cumulative kept tokens per sequence, starting at 0.
        max_seqlen_in_batch: Python int, the most kept tokens of one sequence (0 for batch 0).
        seqused: int32 (batch,), the valid tokens (attention_mask only) of each sequence.
    """
    _validation.check_unpad_inputs(hidden_states, attention_mask, unused_mask)
    valid = _nonzero(attention_mask)
    kept = valid if unused_mask is None else valid | _nonzero(unused_mask)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices = kept.flatten().nonzero().flatten()
    cu_seqlens = seqlens.new_zeros(seqlens.shape[0] + 1)
    cu_seqlens[1:] = seqlens.cumsum(0, dtype=torch.int32)
    max_seqlen_in_batch = int(seqlens.max()) if seqlens.numel() else 0
    tokens = hidden_states.flatten(0, 1).index_select(0, indices)
    return tokens, indices, cu_seqlens, max_seqlen_in_batch, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: scatter packed tokens back into a zero-padded batch.

    Args:
        hidden_states: (total_nnz, ...), e.g. the output of a varlen call on unpad_input's
            tokens.
        indices: (total_nnz,) int64 (or int32) positions in the flattened (batch * seqlen)
            output, as unpad_input returns them.
        batch, seqlen: the padded batch's size.

    Returns:
        (batch, seqlen, ...) in hidden_states' dtype: the tokens at their positions, zeros at
        every other one.
    """
    _validation.check_pad_inputs(hidden_states, indices, batch, seqlen)
    if indices.dtype != torch.int64:
        indices = indices.long()  # index_copy takes int64 only
    padded = hidden_states.new_zeros((batch * seqlen,) + tuple(hidden_states.shape[1:]))
    padded = padded.index_copy(0, indices, hidden_states)
    return padded.unflatten(0, (batch, seqlen))
