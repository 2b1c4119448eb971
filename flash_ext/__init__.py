"""flash_ext: fast exact attention for PyTorch on NVIDIA GPUs.

    out, lse = flash_ext.attn_fwd(q, k, v, causal=True)
    dq, dk, dv = flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=True)

q (batch, seqlen_q, nheads_q, headdim), k and v (batch, seqlen_k, nheads_kv, headdim), float16
or bfloat16 CUDA tensors; or varlen q (total_q, nheads_q, headdim) with cu_seqlens_q/k.
attn_fwd and the FlashAttention-2-compatible functions (flash_attn_func,
flash_attn_varlen_func, ...) are differentiable: autograd (eager or torch.compile) runs the
backward kernel; attn_bwd calls it explicitly. flash_attn_with_kvcache (FlashAttention-2's
KV-cache function: append, rotary, paged caches, ALiBi; no gradients) is for decoding.

flashmask_attention / flashmask_attention_varlen: attention with FlashMask's column-wise
sparse masks (int32 row bounds per key column; builders of the common masks in
flash_ext.flashmask_masks; docs/flashmask.md).

Also: scaled_dot_product_attention (torch's SDPA signature and (batch, nheads, seqlen, headdim)
layout, flash_ext.sdpa), unpad_input / pad_input (FlashAttention's bert_padding helpers,
flash_ext.padding, also as flash_ext.bert_padding). Bad input raises a FlashExtError, a
RuntimeError (and a ValueError, TypeError or NotImplementedError as fits: flash_ext.errors).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from flash_ext import _validation
from flash_ext import ops
from flash_ext import forward_only  # after ops: defines an op in the namespace _C defines
from flash_ext import reference
from flash_ext.errors import (DeviceError, FlashExtError, FlashExtNotImplementedError,
                              FlashExtTypeError, FlashExtValueError)
from flash_ext.ops import _ALIGN, _aligned, _is_aligned, build_info  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attn_fwd",
    "attn_bwd",
    "build_info",
    "reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flashmask_attention",
    "flashmask_attention_varlen",
    "flashmask_masks",
    "scaled_dot_product_attention",
    "unpad_input",
    "pad_input",
    "FlashExtError",
    "FlashExtValueError",
    "FlashExtTypeError",
    "FlashExtNotImplementedError",
    "DeviceError",
]


def _scalar_args(d: int, softmax_scale, causal: bool, window_size, softcap):
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    window_left, window_right = _validation.window_pair(window_size)
    if causal:
        window_right = 0
    softcap = float(softcap)
    return (scale, bool(causal), int(window_left), int(window_right),
            softcap if softcap > 0.0 else 0.0)  # softcap <= 0: off


def _padded_head_dim(d: int) -> int:
    return (d + _ALIGN - 1) // _ALIGN * _ALIGN


def _rows_aligned(t: torch.Tensor) -> bool:
    """ops._is_aligned for a 4-D tensor outside torch.compile, in half its host time (the
    fast path's). OR-ing the strides and the offset (all >= 0) before the modulo tests each
    of them for a multiple of _ALIGN, a power of two."""
    s0, s1, s2, s3 = t.stride()
    return s3 == 1 and not (s0 | s1 | s2 | t.storage_offset()) % _ALIGN


# The fast path's device test, widened to CPU tensors by the CPU tests and
# tools/host_python_overhead.py (CPU tensors stand in for CUDA ones there); never set otherwise.
_FAST_PATH_ON_CPU = False


def _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, dropout_p):
    """The common call's arguments, checked with a few inline tests: the op's (softmax_scale,
    causal, window_left, window_right, softcap), or None for anything else.

    Why: attn_fwd's and attn_bwd's full checks (flash_ext._validation) and argument handling
    cost ~10-20 us of host time per call, more than the op's own dispatch (issue 25). Most
    calls are the same simple case, which these tests recognise for a fraction of that.

    What it must keep equal to the full path: it accepts only inputs that the full path
    accepts, and for them returns exactly what the full path passes to the op (the same
    ``_scalar_args``, with no padding, no copy and nothing to skip), so the op call is the
    same; everything else returns None (never raises) and the caller runs the full path,
    which raises its errors or handles the rest (varlen, out=, dropout, padding, copies of
    unaligned tensors, calls with nothing to compute, numpy scalars, tensor window sizes,
    torch.compile tracing). tests/test_fast_path.py checks both against each other.

    The common case: q, k, v plain torch.Tensor on one CUDA device, all float16 or all
    bfloat16, 4-D (b, sq, hq, d) / (b, sk, hkv, d) with b, sq, sk >= 1, hq a multiple of
    hkv, d a multiple of 8 and <= 256, rows aligned (as ops._is_aligned); softmax_scale None
    or a finite float > 0; causal and deterministic bools; window_size a tuple or list of two
    ints >= -1; softcap a finite float; dropout_p a float or int equal to 0."""
    if torch.compiler.is_compiling():
        return None
    tensor = torch.Tensor
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    cpu = _FAST_PATH_ON_CPU
    if not ((q.is_cuda or cpu and q.is_cpu) and (k.is_cuda or cpu and k.is_cpu)
            and (v.is_cuda or cpu and v.is_cpu) and q.get_device() == k.get_device()
            == v.get_device()):
        return None
    dtype = q.dtype
    if (dtype is not torch.bfloat16 and dtype is not torch.float16) or k.dtype is not dtype \
            or v.dtype is not dtype:
        return None
    if q.dim() != 4 or k.dim() != 4:
        return None
    b, sq, hq, d = q.shape
    kshape = k.shape
    bk, sk, hkv, dk = kshape
    if bk != b or dk != d or v.shape != kshape or d % _ALIGN or d > _validation.MAX_HEADDIM \
            or d < 1 or b < 1 or sq < 1 or sk < 1 or hkv < 1 or hq < 1 or hq % hkv:
        return None
    # Plain Python scalars only (numpy scalars, SymInts, ... take the full path).
    if (type(dropout_p) is not float and type(dropout_p) is not int) or dropout_p != 0:
        return None
    if deterministic is not False and deterministic is not True:
        return None
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif type(softmax_scale) is float and 0.0 < softmax_scale < math.inf:
        scale = softmax_scale
    else:
        return None
    if type(softcap) is not float or not -math.inf < softcap < math.inf:
        return None
    if (type(window_size) is not tuple and type(window_size) is not list) \
            or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        return None
    if causal is True:
        right = 0
    elif causal is not False:
        return None
    # Last, as in the full path (which reads strides and offsets after all other checks).
    for t in (q, k, v):
        if not _rows_aligned(t):
            return None
    return scale, causal, left, right, softcap if softcap > 0.0 else 0.0


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             softmax_scale: Optional[float] = None, causal: bool = False,
             window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
             cu_seqlens_q: Optional[torch.Tensor] = None,
             cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             deterministic: bool = False,
             out: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
             rng_state: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
             alibi_slopes: Optional[torch.Tensor] = None):
    """Exact attention forward. Returns ``(out, lse)``, or ``(out, lse, rng_state)`` when
    ``dropout_p > 0``.

    Differentiable: when q, k or v requires grad (and grad mode is on), autograd computes
    dq, dk, dv with the backward kernel (``lse`` is returned non-differentiable: no gradient
    flows through it). Gradients with respect to softmax_scale and softcap are not computed.

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
            Any length-2 sequence of ints (or numpy / torch integer scalars), or a 2-element
            integer tensor (read with one .tolist(): a host sync if it is on the GPU).
        softcap: if > 0, scores become softcap * tanh(scores / softcap); <= 0 is off.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative sequence lengths (varlen).
        max_seqlen_q, max_seqlen_k: longest query / key sequence (varlen only).
        deterministic: make the backward of this call (through autograd) bitwise reproducible
            (no atomics; costs ceil(seqlen_k / 128) fp32 copies of dq of workspace and some
            speed). The forward is deterministic either way.
        out: optional output tensor of q's shape and dtype to write into. Not differentiable:
            raises if q, k or v requires grad.
        dropout_p: attention dropout probability in [0, 1]: each entry of the softmax
            probabilities P is dropped with probability dropout_p and the kept ones are scaled
            by 1 / (1 - dropout_p) (lse stays the plain softmax's). Applied whenever > 0 (pass 0
            for evaluation). Runs the FlashAttention-2 (sm80) kernel on every GPU.
        rng_state: int64 CPU tensor [seed, offset] fixing the dropout mask; default: drawn from
            torch's default CUDA generator (so torch.manual_seed makes runs reproducible, and
            each call gets a fresh mask). The mask depends only on rng_state and the (batch,
            head, query, key) position (csrc/common/dropout.h).
        seqused_k: varlen only, int32 (batch,) on q's device (FlashAttention-3's meaning):
            sequence b uses only its first seqused_k[b] keys of [cu_seqlens_k[b],
            cu_seqlens_k[b+1]), 0 <= seqused_k[b] <= that length; causal and local windows align
            bottom-right to the used length. The other keys are never read into the result (any
            values, NaN included). No backward: when q, k or v requires grad (grad mode on)
            the forward runs and returns the same out, whose backward raises
            FlashExtNotImplementedError (flash_ext/forward_only.py). Such calls run the sm80
            kernel on every GPU
            (the Hopper kernel's tensor maps would read the unused keys). Its values are checked
            under the cu_seqlens policy (flash_ext/_validation.py). Works with dropout.
        alibi_slopes: float32 (nheads_q,) or (batch, nheads_q) on q's device (FlashAttention-2's
            ALiBi): the score of query i and key j gets - slope * |i + sk - sq - j| (per
            sequence for varlen). Differentiable; runs the FlashAttention-2 (sm80) kernels on
            every GPU; not yet together with dropout_p > 0.

    Returns:
        out: q's shape and dtype.
        lse: float32 log-sum-exp of the scaled scores (natural log), (batch, nheads_q, seqlen_q)
            or varlen (nheads_q, total_q). Rows that see no key have out 0 and lse -inf.
        rng_state (only when dropout_p > 0): the int64 CPU [seed, offset] tensor the mask came
            from; pass it to :func:`attn_bwd` (autograd does that itself).
    """
    if cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None \
            and max_seqlen_k is None and out is None and rng_state is None and seqused_k is None \
            and alibi_slopes is None:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)
    _validation.check_fwd_inputs(
        q, k, v, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, out=out, dropout_p=dropout_p, rng_state=rng_state,
        seqused_k=seqused_k, alibi_slopes=alibi_slopes)
    return _attn_fwd_checked(q, k, v, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, deterministic=deterministic, out=out,
                             dropout_p=dropout_p, rng_state=rng_state, seqused_k=seqused_k,
                             alibi_slopes=alibi_slopes)


def _attn_fwd_checked(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, deterministic=False, out=None, dropout_p=0.0,
                      rng_state=None, seqused_k=None, alibi_slopes=None):
    """attn_fwd for arguments its checks (or a caller's own, equivalent ones: the paged varlen
    path of flash_attn_varlen_func) have passed: the same keywords, the same results."""
    varlen = cu_seqlens_q is not None
    dropout_p = float(dropout_p)
    if dropout_p > 0.0:
        if rng_state is None:
            rng_state = ops._dropout_rng_state(q)
        o, lse = _attn_fwd_impl(q, k, v, softmax_scale, causal, window_size, softcap,
                                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                deterministic, out, varlen, dropout_p, rng_state, seqused_k,
                                alibi_slopes)
        return o, lse, rng_state
    return _attn_fwd_impl(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, out, varlen,
                          0.0, None, seqused_k, alibi_slopes)


def _attn_fwd_impl(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, out, varlen: bool,
                   dropout_p: float, rng_state, seqused_k=None, alibi_slopes=None):
    """attn_fwd after the checks: (out, lse). Differentiable through flash_ext::fwd's autograd
    formula, which reads `deterministic` from the op's arguments. seqused_k goes to the ops by
    keyword, and only when given (so that calls without it make the same op call as before).

    seqused_k has no backward: with inputs that require grad, the forward runs without
    recording (this function again, under no_grad) and out gets a node whose backward raises
    (flash_ext/forward_only.py)."""
    if seqused_k is not None and forward_only.needs_node(q, k, v):
        with torch.no_grad():
            o, lse = _attn_fwd_impl(q, k, v, softmax_scale, causal, window_size, softcap,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    deterministic, out, varlen, dropout_p, rng_state, seqused_k,
                                    alibi_slopes)
        return forward_only.attach(o, q, k, v), lse
    d = q.shape[-1]
    args = _scalar_args(d, softmax_scale, causal, window_size, softcap)
    extra = {}
    if varlen:
        cu_seqlens_q = cu_seqlens_q.contiguous()
        cu_seqlens_k = cu_seqlens_k.contiguous()
        mq, mk = int(max_seqlen_q), int(max_seqlen_k)
        if seqused_k is not None:
            extra["seqused_k"] = seqused_k.contiguous()
    else:
        mq = mk = 0
    if alibi_slopes is not None:
        extra["alibi_slopes"] = alibi_slopes

    if ops._nothing_to_do(q, k, varlen, mq, mk):
        # Nothing to launch: no query rows, or no key at all (every row fully masked).
        return ops._no_attention(q, k, v, cu_seqlens_q, out)

    d_pad = _padded_head_dim(d)
    if d_pad != d:
        # Zero columns change neither q k^T nor the kept columns of P V (nor, in the backward,
        # the kept columns of dq, dk, dv); F.pad and the slice below are differentiable.
        q, k, v = (F.pad(t, (0, d_pad - d)) for t in (q, k, v))
    else:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)

    # out= is never differentiable here (check_out_without_grad), so writing in place is safe.
    if out is not None and d_pad == d and _is_aligned(out):
        lse = ops._fwd_out(q, k, v, out, cu_seqlens_q, cu_seqlens_k, mq, mk, *args, dropout_p,
                           rng_state, **extra)
        return out, lse
    o, lse = ops._fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk, *args, dropout_p, rng_state,
                      bool(deterministic), **extra)
    if d_pad != d:
        o = o[..., :d]
    if out is not None:
        out.copy_(o)
        return out, lse
    return o, lse


def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: Optional[float] = None,
             causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
             cu_seqlens_q: Optional[torch.Tensor] = None,
             cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             deterministic: bool = False, dq: Optional[torch.Tensor] = None,
             dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
             dropout_p: float = 0.0, rng_state: Optional[torch.Tensor] = None,
             alibi_slopes: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact attention backward: the gradients of ``out = attn_fwd(q, k, v, ...)`` with respect
    to q, k, v, given dout (the gradient with respect to out). Returns ``(dq, dk, dv)``.

    Args:
        dout: gradient of the loss with respect to out; q's shape and dtype, any strides.
        q, k, v: the forward's inputs (same rules as :func:`attn_fwd`).
        out, lse: what :func:`attn_fwd` returned for them (out: q's shape and dtype; lse: float32
            (batch, nheads_q, seqlen_q) or varlen (nheads_q, total_q)).
        softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k: the same values as in the forward call.
        deterministic: bitwise reproducible gradients (no atomics; costs ceil(seqlen_k / 128)
            fp32 copies of dq of workspace and some speed).
        dq, dk, dv: optional tensors (like q, k, v: shape, dtype, device; any strides) to write
            the gradients into; each one given is returned as is.
        dropout_p, rng_state: the forward's dropout probability and the rng_state it returned
            (required when dropout_p > 0: the backward regenerates the same mask).
        alibi_slopes: the forward's ALiBi slopes (see :func:`attn_fwd`).

    Returns:
        dq, dk, dv: shaped like q, k, v in their dtype: the given tensors, else new ones
            (contiguous, except views of padded buffers when the head dim is not a multiple
            of 8, as attn_fwd's out).
        With GQA/MQA, dk and dv are summed over the query heads sharing each key/value head.
        Query rows that see no key get dq = 0; keys that no row sees get dk = dv = 0.

    Not differentiable itself (no double backward).
    """
    if cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None \
            and max_seqlen_k is None and dq is None and dk is None and dv is None \
            and rng_state is None and alibi_slopes is None:
        grads = _attn_bwd_fast(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                               softcap, deterministic, dropout_p)
        if grads is not None:
            return grads
    varlen = _validation.check_bwd_inputs(
        dout, q, k, v, out, lse, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dq=dq, dk=dk, dv=dv,
        dropout_p=dropout_p, rng_state=rng_state, alibi_slopes=alibi_slopes)
    dropout_p = float(dropout_p)
    if dropout_p == 0.0:
        rng_state = None
    extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    d = q.shape[-1]
    args = _scalar_args(d, softmax_scale, causal, window_size, softcap)
    if varlen:
        cu_seqlens_q = cu_seqlens_q.contiguous()
        cu_seqlens_k = cu_seqlens_k.contiguous()
        mq, mk = int(max_seqlen_q), int(max_seqlen_k)
    else:
        mq = mk = 0

    with torch.no_grad():
        if ops._nothing_to_do(q, k, varlen, mq, mk):
            # Nothing to launch: every gradient is zero.
            grads = tuple(torch.zeros(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v))
        else:
            d_pad = _padded_head_dim(d)
            tensors = (dout, q, k, v, out)
            if d_pad != d:
                # Zero columns of dout and out leave rowsum(dout * out) unchanged.
                tensors = tuple(F.pad(t, (0, d_pad - d)) for t in tensors)
            else:
                tensors = tuple(_aligned(t) for t in tensors)
            grads = ops._bwd(*tensors, lse, cu_seqlens_q, cu_seqlens_k, mq, mk, *args,
                             bool(deterministic), dropout_p, rng_state, **extra)
            if d_pad != d:
                grads = tuple(g[..., :d] for g in grads)
        result = []
        for g, dst in zip(grads, (dq, dk, dv)):
            if dst is None:
                result.append(g)
            else:
                dst.copy_(g)
                result.append(dst)
    return tuple(result)


def _attn_bwd_fast(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                   deterministic, dropout_p):
    """attn_bwd's common call (no varlen, no dq/dk/dv, no dropout) as :func:`_fast_args`
    recognises it, plus dout and out like q and aligned, lse float32 of the forward's shape: the
    op's (dq, dk, dv), with the same arguments as the full path passes; None otherwise (the
    caller then runs the full path)."""
    args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                      dropout_p)
    if args is None:
        return None
    tensor = torch.Tensor
    if type(dout) is not tensor or type(out) is not tensor or type(lse) is not tensor:
        return None
    cpu, device = _FAST_PATH_ON_CPU, q.get_device()
    if not ((dout.is_cuda or cpu and dout.is_cpu) and (out.is_cuda or cpu and out.is_cpu)
            and (lse.is_cuda or cpu and lse.is_cpu) and dout.get_device() == device
            and out.get_device() == device and lse.get_device() == device):
        return None
    dtype, shape = q.dtype, q.shape
    if dout.dtype is not dtype or out.dtype is not dtype or lse.dtype is not torch.float32 \
            or dout.shape != shape or out.shape != shape \
            or lse.shape != (shape[0], shape[2], shape[1]):
        return None
    if not (_rows_aligned(dout) and _rows_aligned(out)):
        return None
    if not torch.is_grad_enabled():
        return ops._bwd(dout, q, k, v, out, lse, None, None, 0, 0, *args, deterministic,
                        float(dropout_p), None)
    torch._C._set_grad_enabled(False)  # torch.no_grad(), as the full path, for less host time
    try:
        return ops._bwd(dout, q, k, v, out, lse, None, None, 0, 0, *args, deterministic,
                        float(dropout_p), None)
    finally:
        torch._C._set_grad_enabled(True)


# Imported last: interface.py calls attn_fwd.
from flash_ext.interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_ext.padding import pad_input, unpad_input  # noqa: E402
from flash_ext.sdpa import scaled_dot_product_attention  # noqa: E402
from flash_ext import bert_padding  # noqa: E402,F401  (FlashAttention's module name)
from flash_ext.flashmask import flashmask_attention, flashmask_attention_varlen  # noqa: E402
from flash_ext import flashmask_masks  # noqa: E402,F401
