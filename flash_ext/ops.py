"""The compiled ops, their fake (meta) kernels and their autograd registration.

Importing ``flash_ext._C`` registers, in C++ (csrc/flash_api.cpp, TORCH_LIBRARY):

    torch.ops.flash_ext.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap) -> (out, lse)
    torch.ops.flash_ext.fwd_out(q, k, v, out, cu_seqlens_q, ...same...) -> lse   (writes out)
    torch.ops.flash_ext.build_info() -> str

This module adds what torch.compile needs (fake kernels: shapes, dtypes and strides of the
outputs, without running anything) and the autograd formula. There is no backward kernel yet,
so the backward raises NotImplementedError, at backward time, in eager and compiled code
alike; a gradient is never silently wrong or zero.

The ops take inputs already prepared by flash_ext.attn_fwd (head dim a multiple of 8, strides
multiples of 8); call that, not these, unless you know the contract (docs/architecture.md).
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from flash_ext import _C  # noqa: F401  (importing it registers the ops)
except ImportError as _err:  # pragma: no cover - depends on the build
    raise ImportError(
        "flash_ext: the compiled extension flash_ext._C could not be imported, so the package "
        "was not built (or was built for another torch/CUDA). Build it from the repository "
        "root with `pip install .` (or `pip install -e . --no-build-isolation` for development). "
        "If it is installed, check that the source tree's flash_ext/ (which has no _C unless "
        "built in place) is not shadowing it, e.g. when running from the repository root. "
        f"Original error: {_err}") from _err

__all__ = ["_fwd", "_fwd_out", "build_info", "BACKWARD_NOT_IMPLEMENTED"]

BACKWARD_NOT_IMPLEMENTED = (
    "flash_ext: the backward pass is not implemented yet (coming in the next release)")


def _lse_shape(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]):
    if cu_seqlens_q is not None:  # varlen: q (total_q, hq, d) -> lse (hq, total_q)
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])  # q (b, sq, hq, d) -> lse (b, hq, sq)


# ----------------------------------------------------------------------------------------------
# Fake kernels. The real op allocates out contiguous with q's shape and dtype (whatever q's
# strides) and lse contiguous float32; these must describe exactly that.
# ----------------------------------------------------------------------------------------------


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_ext::fwd_out")
def _fwd_out_fake(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap):
    return q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Autograd: the backward raises. It goes through a tiny op whose real kernel raises and whose
# fake kernel returns gradient-shaped tensors, so that AOTAutograd (torch.compile) can trace the
# backward graph at compile time and the error comes when the backward actually runs.
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_ext::_backward_not_implemented", mutates_args=())
def _backward_not_implemented(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError(BACKWARD_NOT_IMPLEMENTED)


@_backward_not_implemented.register_fake
def _(grad_out, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.save_for_backward(q, k, v)


def _fwd_backward(ctx, grad_out, grad_lse):
    q, k, v = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(q)
    dq, dk, dv = torch.ops.flash_ext._backward_not_implemented(grad_out, q, k, v)
    # One gradient slot per op argument (12); the non-tensor ones get None.
    return (dq, dk, dv) + (None,) * 9


torch.library.register_autograd("flash_ext::fwd", _fwd_backward, setup_context=_fwd_setup_context)


# ----------------------------------------------------------------------------------------------
# Thin wrappers
# ----------------------------------------------------------------------------------------------


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
         softmax_scale: float, causal: bool, window_left: int, window_right: int,
         softcap: float):
    """torch.ops.flash_ext.fwd: returns (out, lse)."""
    return torch.ops.flash_ext.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   softmax_scale, causal, window_left, window_right, softcap)


def _fwd_out(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
             softmax_scale: float, causal: bool, window_left: int, window_right: int,
             softcap: float):
    """torch.ops.flash_ext.fwd_out: writes out, returns lse."""
    return torch.ops.flash_ext.fwd_out(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, softmax_scale, causal, window_left,
                                       window_right, softcap)


def build_info() -> str:
    """What the extension was built for, e.g. "archs=80+PTX;90a hdims=... dtypes=fp16,bf16"."""
    return torch.ops.flash_ext.build_info()
