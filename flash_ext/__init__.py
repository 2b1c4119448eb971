"""flash_ext: fast exact attention for PyTorch on NVIDIA GPUs.

    out, lse = flash_ext.attn_fwd(q, k, v, causal=True)

q (batch, seqlen_q, nheads_q, headdim), k and v (batch, seqlen_k, nheads_kv, headdim), float16
or bfloat16 CUDA tensors; or varlen q (total_q, nheads_q, headdim) with cu_seqlens_q/k.
FlashAttention-2-compatible functions (flash_attn_func, flash_attn_varlen_func, ...) are here too.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from flash_ext import _validation
from flash_ext import ops
from flash_ext import reference
from flash_ext.ops import build_info

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attn_fwd",
    "build_info",
    "reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]

# The op needs 16-byte aligned rows: every stride but the last, and the storage offset, a
# multiple of 8 elements (fp16/bf16); and the head dim a multiple of 8.
_ALIGN = 8


def _is_aligned(t: torch.Tensor) -> bool:
    if t.stride(-1) != 1:
        return False
    # Dynamo cannot trace storage_offset(); under torch.compile the C++ op's own check of the
    # data pointer's alignment is the safety net for (rare) odd offsets.
    if not torch.compiler.is_compiling() and t.storage_offset() % _ALIGN != 0:
        return False
    return all(s % _ALIGN == 0 for s in t.stride()[:-1])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself if the op can read it in place, else a fresh row-major copy. (clone with
    contiguous_format, not .contiguous(): the latter keeps odd strides of size-1 dims.)"""
    return t if _is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             softmax_scale: Optional[float] = None, causal: bool = False,
             window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
             cu_seqlens_q: Optional[torch.Tensor] = None,
             cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention forward. Returns ``(out, lse)``.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim), or varlen (total_q, nheads_q, headdim).
        k, v: (batch, seqlen_k, nheads_kv, headdim), or varlen (total_k, nheads_kv, headdim).
            float16 or bfloat16, on one CUDA device, last dim contiguous; other strides are
            honoured. nheads_q must be a multiple of nheads_kv (MQA/GQA); 1 <= headdim <= 256.
        softmax_scale: scale of q k^T; default 1/sqrt(headdim).
        causal: mask keys after the query's position, aligned to the bottom-right corner when
            seqlen_q != seqlen_k. Same as window_size=(window_left, 0).
        window_size: (left, right) local attention window, bottom-right aligned: query row i
            sees keys j with i + sk - sq - left <= j <= i + sk - sq + right; -1 = unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative sequence lengths (varlen).
        max_seqlen_q, max_seqlen_k: longest query / key sequence (varlen only).
        out: optional output tensor of q's shape and dtype to write into.

    Returns:
        out: q's shape and dtype.
        lse: float32 log-sum-exp of the scaled scores (natural log), (batch, nheads_q, seqlen_q)
            or varlen (nheads_q, total_q). Rows that see no key have out 0 and lse -inf.
    """
    varlen = _validation.check_fwd_inputs(
        q, k, v, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, out=out)
    if out is not None and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "flash_ext.attn_fwd: out= does not support automatic differentiation (one of q, k, "
            "v requires grad); call it without out=")

    d = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if causal:
        window_right = 0
    softcap = float(softcap)

    if varlen:
        cu_seqlens_q = cu_seqlens_q.contiguous()
        cu_seqlens_k = cu_seqlens_k.contiguous()
        mq, mk = int(max_seqlen_q), int(max_seqlen_k)
        lse_shape = (q.shape[1], q.shape[0])
        no_rows = q.shape[0] == 0 or mq == 0
        no_keys = k.shape[0] == 0 or mk == 0
    else:
        mq = mk = 0
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        no_rows = q.shape[0] == 0 or q.shape[1] == 0
        no_keys = k.shape[1] == 0
    if no_rows or no_keys:
        # Nothing to launch: no query rows, or no key at all (every row fully masked).
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        if out is None:
            return torch.zeros_like(q, memory_format=torch.contiguous_format), lse
        return out.zero_(), lse

    d_pad = (d + _ALIGN - 1) // _ALIGN * _ALIGN
    if d_pad != d:
        # Zero columns change neither q k^T nor the kept columns of P V.
        q, k, v = (F.pad(t, (0, d_pad - d)) for t in (q, k, v))
    else:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)

    args = (cu_seqlens_q, cu_seqlens_k, mq, mk, scale, bool(causal), window_left, window_right,
            softcap)
    if out is not None and d_pad == d and _is_aligned(out):
        lse = ops._fwd_out(q, k, v, out, *args)
        return out, lse
    o, lse = ops._fwd(q, k, v, *args)
    if d_pad != d:
        o = o[..., :d]
    if out is not None:
        out.copy_(o)
        return out, lse
    return o, lse


# Imported last: interface.py calls attn_fwd.
from flash_ext.interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
