"""Pure-PyTorch Philox4x32 and the attention dropout mask of the kernels, bit for bit.

An independent implementation of csrc/common/philox.h and csrc/common/dropout.h for tests:
uint32 arithmetic is emulated in int64 tensors (products split into 16-bit halves so that
nothing overflows), so it runs on CPU or GPU with any torch build.

Mask scheme (documented in csrc/common/dropout.h): element (row, col) of head ``h`` of
sequence ``b`` (``bh = b * heads + h``; rows/cols count from the sequence start) takes word
``((row >> 3) & 1) * 2 + (col & 1)`` of

    philox4x32_10(counter = (col >> 1, (row >> 4) * 8 + (row & 7), bh, offset mod 2^32),
                  key = (seed mod 2^32, (seed >> 32) + (offset >> 32) mod 2^32))

and is dropped iff that word < floor(p * 2^32 + 0.5).
"""

from __future__ import annotations

import math
from typing import Union

import torch

__all__ = ["philox4x32", "dropout_threshold", "dropout_keep_mask", "rng_seed_offset"]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85

IntOrTensor = Union[int, torch.Tensor]


def _mulhilo(a: torch.Tensor, m: int):
    """(hi, lo) 32-bit halves of the 64-bit product a * m, a an int64 tensor in [0, 2^32)."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p_lo = a_lo * m            # < 2^48
    p_hi = a_hi * m            # < 2^48, weight 2^16
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return ((p_hi >> 16) + (t >> 32)) & _MASK32, t & _MASK32


def philox4x32(c0: torch.Tensor, c1: IntOrTensor, c2: IntOrTensor, c3: IntOrTensor,
               k0: IntOrTensor, k1: IntOrTensor, rounds: int = 10):
    """Philox4x32-``rounds`` of Random123 on int64 tensors holding uint32 values (broadcast).
    Returns the four output words as int64 tensors in [0, 2^32)."""
    def as_t(x):
        return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64,
                                                                   device=c0.device)
    c0, c1, c2, c3 = (as_t(x) & _MASK32 for x in (c0, c1, c2, c3))
    k0, k1 = as_t(k0) & _MASK32, as_t(k1) & _MASK32
    for i in range(rounds):
        if i > 0:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """Words below this are dropped: floor(p * 2^32 + 0.5) (2^32 for p = 1: all dropped)."""
    return int(math.floor(float(p) * 4294967296.0 + 0.5))


def rng_seed_offset(rng_state) -> tuple[int, int]:
    """(seed, offset) as unsigned 64-bit Python ints from an int64 [seed, offset] tensor."""
    vals = [int(x) for x in torch.as_tensor(rng_state).reshape(-1).tolist()]
    if len(vals) != 2:
        raise ValueError(f"rng_state must hold 2 values [seed, offset]; got {len(vals)}")
    return vals[0] & 0xFFFFFFFFFFFFFFFF, vals[1] & 0xFFFFFFFFFFFFFFFF


def dropout_keep_mask(rng_state, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float, device=None) -> torch.Tensor:
    """The kernels' keep mask: bool (batch, heads, seqlen_q, seqlen_k), True = kept. For varlen
    batches, sequence b's mask is the [b, :, :seqlen_q_b, :seqlen_k_b] corner."""
    seed, offset = rng_seed_offset(rng_state)
    shape = (batch, heads, seqlen_q, seqlen_k)
    if dropout_p == 0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    bh = torch.arange(batch * heads, **i64).view(batch, heads, 1, 1)
    row = torch.arange(seqlen_q, **i64).view(1, 1, seqlen_q, 1)
    col = torch.arange(seqlen_k, **i64).view(1, 1, 1, seqlen_k)
    c0 = (col >> 1).expand(shape)
    c1 = ((row >> 4) << 3) | (row & 7)
    k0 = seed & _MASK32
    k1 = ((seed >> 32) + (offset >> 32)) & _MASK32
    words = philox4x32(c0, c1, bh, offset & _MASK32, k0, k1)
    which = (((row >> 3) & 1) * 2 + (col & 1)).expand(shape)
    word = torch.stack(words, dim=-1).gather(-1, which.unsqueeze(-1)).squeeze(-1)
    return word >= dropout_threshold(dropout_p)
