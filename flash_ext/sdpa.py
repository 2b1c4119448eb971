"""``flash_ext.scaled_dot_product_attention``: torch.nn.functional.scaled_dot_product_attention's
signature and semantics on flash_ext's kernels.

    out = flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True)   # (b, h, s, d)

Layout. SDPA's tensors are (batch, nheads, seqlen, headdim); flash_ext's are (batch, seqlen,
nheads, headdim). The transposes between them are views: the kernels read any strides whose
last one is 1 and whose others are multiples of 8 elements, so a query made as
``(b, h, s, d)``, or one transposed from ``(b, s, h, d)`` (a linear layer's output), is read in
place. The output is flash_ext's contiguous (batch, seqlen, nheads, headdim) buffer returned as a
(batch, nheads, seqlen, headdim) view, as torch's FlashAttention backend returns it. (A head dim
that is not a multiple of 8 is padded, which copies, as in attn_fwd.)

Causal alignment. SDPA's ``is_causal`` is aligned to the top-left corner: query row i sees keys
0..i, whatever seqlen_q and seqlen_k. flash_ext's ``causal`` is aligned to the bottom-right
corner (row i sees keys up to i + seqlen_k - seqlen_q), and its local window is too: row i sees
keys j with i + sk - sq - left <= j <= i + sk - sq + right. So:

- sq == sk: the two agree; causal=True.
- sq > sk: window (left, right) = (-1, sq - sk) reaches exactly key i on row i. Every row sees
  key 0, so no row is empty (as in torch).
- sq < sk: no row sees a key at or after sq, so those keys are dropped (a slice, no copy; their
  gradients are zero) and the remaining square is plain causal.

The rest as torch: ``scale`` defaults to 1/sqrt(headdim); ``dropout_p`` is applied whenever it
is > 0 (pass 0.0 for evaluation; torch's functional SDPA does not look at a module's training
flag either), with flash_ext's dropout (its own random stream, not torch's); with
``enable_gqa=True`` the key/value heads are shared by groups of hq / hkv query heads (query
head h uses key/value head h // (hq / hkv)); a single key/value head is broadcast to every
query head, as torch's SDPA broadcasts it. ``attn_mask`` is not supported: a clear error names
the alternatives (is_causal, unpad_input + the varlen functions, window_size, FlashMask
planned). Inputs: float16 or bfloat16 CUDA tensors, head dim up to 256, value's head dim equal
to the query's.

Differentiable through attn_fwd (the gradients of query, key and value come from flash_ext's
backward kernel).
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_ext import _validation, attn_fwd

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """softmax(query key^T * scale) value, in torch.nn.functional.scaled_dot_product_attention's
    (batch, nheads, seqlen, headdim) layout. See the module docstring.

    Args:
        query: (batch, nheads_q, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k,
            headdim). float16 or bfloat16, on one CUDA device.
        attn_mask: must be None (FlashExtNotImplementedError otherwise).
        dropout_p: attention dropout probability in [0, 1], applied whenever > 0.
        is_causal: causal mask aligned to the top-left corner (row i sees keys 0..i).
        scale: scale of query key^T; default 1/sqrt(headdim).
        enable_gqa: allow nheads_kv to divide nheads_q (grouped-query attention).

    Returns:
        (batch, nheads_q, seqlen_q, headdim) in query's dtype: a transposed view of a
        contiguous (batch, seqlen_q, nheads_q, headdim) tensor.
    """
    _validation.check_sdpa_inputs(query, key, value, attn_mask, scale, enable_gqa)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal, window = bool(is_causal), (-1, -1)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        if sq < sk:
            k, v = k[:, :sq], v[:, :sq]
        elif sq > sk:
            causal, window = False, (-1, sq - sk)
    res = attn_fwd(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                   dropout_p=dropout_p)
    return res[0].transpose(1, 2)
