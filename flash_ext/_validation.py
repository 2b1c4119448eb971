"""Every check on user input, run by the Python layer before anything is launched. Each check
lives here once; the entry points (flash_ext.attn_fwd, attn_bwd and the FlashAttention-compatible
functions of flash_ext.interface) only call them.

Every check raises a clear Python error naming the offending argument:

- ``TypeError`` for a wrong dtype or a wrong argument type (a non-tensor, a missing tensor),
- ``ValueError`` for bad values and shapes,
- :class:`DeviceError` (a subclass of both ``ValueError`` and ``RuntimeError``) for tensors
  that are not on CUDA or not on one device,
- ``NotImplementedError`` for FlashAttention features flash_ext does not have,
- ``RuntimeError`` for ``out=`` with inputs that require grad.

Each check is a small function that can be tested on its own (tests pass
``require_cuda=False`` to reach the checks behind the device check on a CPU-only machine).
:func:`check_devices` is the only one that looks at what kind of object a tensor argument is and
where it lives; the others take its word for it. :func:`check_fwd_inputs` runs them all:
dropout_p and rng_state first (plain arguments, so a bad value is reported whatever the
tensors), then the devices, so a call with CPU tensors raises the device error before anything
touches CUDA, then the rest. :func:`check_bwd_inputs` does the same for the backward (the
forward's checks plus dout, out, lse and the optional dq/dk/dv outputs).

Host synchronisation. The op path must not synchronise with the GPU (CUDA graphs capture it,
and syncs cost latency). The only checks that need tensor *values* are those on
``cu_seqlens`` (starts at 0, non-decreasing, ends at the token count, longest sequence no
longer than ``max_seqlen``). They read the values back with one small device op and one
``.tolist()``, and only when that is safe and cheap enough:

- always when ``cu_seqlens`` is on the CPU (no GPU sync needed);
- for CUDA tensors only in eager mode: they are skipped while ``torch.compile`` traces
  (``torch.compiler.is_compiling()``), while a CUDA graph is being captured, and when the
  environment variable ``FLASH_EXT_CHECK_CU_SEQLENS=0`` is set (or
  ``flash_ext._validation.CHECK_CU_SEQLENS_VALUES = False``), e.g. in latency-critical loops.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

__all__ = [
    "DeviceError",
    "MAX_HEADDIM",
    "SUPPORTED_DTYPES",
    "CHECK_CU_SEQLENS_VALUES",
    "check_devices",
    "check_dtypes",
    "check_qkv_shapes",
    "check_cu_seqlens",
    "check_cu_seqlens_values",
    "should_check_values",
    "check_max_seqlen",
    "check_softmax_scale",
    "check_softcap",
    "check_window_size",
    "check_dropout",
    "check_like",
    "check_out_without_grad",
    "check_lse",
    "check_fwd_inputs",
    "check_bwd_inputs",
    "check_unsupported",
    "check_packed",
]

MAX_HEADDIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Value checks of cu_seqlens on CUDA tensors (one host sync per call); see the module docstring.
CHECK_CU_SEQLENS_VALUES = os.environ.get("FLASH_EXT_CHECK_CU_SEQLENS", "1").strip().lower() not in (
    "0", "false", "no", "off")


class DeviceError(ValueError, RuntimeError):
    """A tensor is not a CUDA tensor, or the tensors of one call are on different devices.

    Subclasses both ValueError and RuntimeError, so either ``except`` clause catches it."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)


# ----------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------


def check_devices(tensors: dict, *, require_cuda: bool = True, required=()) -> None:
    """``tensors`` maps argument names to tensors; None entries are skipped (optional
    arguments), except those named in ``required``.

    Raises TypeError for a non-tensor or a missing required one, DeviceError for a non-CUDA
    tensor (when ``require_cuda``) or for tensors on different devices."""
    first_name, first_dev = None, None
    for name, t in tensors.items():
        if t is None:
            if name in required:
                raise TypeError(f"flash_ext: {name} must be a torch.Tensor, got None")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        if require_cuda and t.device.type != "cuda":
            raise DeviceError(f"flash_ext needs CUDA tensors; got {name} on {t.device}")
        if first_dev is None:
            first_name, first_dev = name, t.device
        elif t.device != first_dev:
            raise DeviceError(
                f"flash_ext: all tensors must be on the same device; got {first_name} on "
                f"{first_dev} and {name} on {t.device}")


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v must all be float16 or all bfloat16 (TypeError otherwise)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"flash_ext supports float16 and bfloat16 only; got {name} of dtype "
                f"{_dtype_name(t.dtype)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"flash_ext: q, k and v must have the same dtype; got q {_dtype_name(q.dtype)}, "
            f"k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}")


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> None:
    """Shapes, head counts, head dim and last-dim contiguity of q, k, v (ValueError).

    Batched: q (b, sq, hq, d), k and v (b, sk, hkv, d). Varlen: q (total_q, hq, d),
    k and v (total_k, hkv, d). hq must be a multiple of hkv; 1 <= d <= 256; stride(-1) == 1."""
    ndim = 3 if varlen else 4
    layout = "(total_tokens, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            extra = ""
            if not varlen and t.dim() == 3:
                extra = "; 3-D inputs are varlen: pass cu_seqlens_q, cu_seqlens_k and max_seqlen_q/k"
            raise ValueError(
                f"flash_ext: {name} must be {ndim}-D {layout}{' for varlen' if varlen else ''}; "
                f"got {name} of shape {_shape(t)}{extra}")
    if k.shape != v.shape:
        raise ValueError(
            f"flash_ext: k and v must have the same shape; got k {_shape(k)} and v {_shape(v)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"flash_ext: q and k must have the same batch size; got q {_shape(q)} and k {_shape(k)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(
            f"flash_ext: q, k and v must have the same head dim; got q {_shape(q)}, k {_shape(k)}, "
            f"v {_shape(v)}")
    if d < 1 or d > MAX_HEADDIM:
        raise ValueError(f"flash_ext: head dim must be between 1 and {MAX_HEADDIM}; got {d}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq < 1:
        raise ValueError(f"flash_ext: the number of heads must be >= 1; got q {hq}, k/v {hkv}")
    if hq % hkv != 0:
        raise ValueError(
            f"flash_ext: the number of query heads ({hq}) must be a multiple of the number of "
            f"key/value heads ({hkv})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(
                f"flash_ext: the last dimension of {name} must be contiguous (stride 1); got "
                f"strides {tuple(t.stride())}. Call .contiguous() on it first.")


def check_cu_seqlens(cu_seqlens_q: Optional[torch.Tensor],
                     cu_seqlens_k: Optional[torch.Tensor]) -> bool:
    """Metadata checks of cu_seqlens (no values read). Returns True for a varlen call.

    Both or neither must be given; each int32, 1-D, with at least 2 entries (batch >= 1),
    the same length. (That they are tensors on q's device is :func:`check_devices`'s part.)"""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given = "cu_seqlens_q" if cu_seqlens_q is not None else "cu_seqlens_k"
        raise ValueError(
            f"flash_ext: cu_seqlens_q and cu_seqlens_k must be given together (varlen) or not at "
            f"all; only {given} was given")
    if cu_seqlens_q is None:
        return False
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"flash_ext: {name} must be int32; got {_dtype_name(cu.dtype)}")
        if cu.dim() != 1:
            raise ValueError(f"flash_ext: {name} must be 1-D (batch + 1,); got shape {_shape(cu)}")
        if cu.shape[0] < 2:
            raise ValueError(
                f"flash_ext: {name} must have batch + 1 >= 2 entries; got shape {_shape(cu)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"flash_ext: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return True


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover
        return False
    return is_fake(t)


def should_check_values(t: torch.Tensor) -> bool:
    """Whether the value checks of cu_seqlens run for tensor ``t`` (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False  # tracing: no values, and no host sync in a compiled graph
    if _is_fake(t) or t.device.type == "meta":
        return False  # no values (tracing with fake tensors, torch.export, meta tensors)
    if t.device.type == "cpu":
        return True
    if not CHECK_CU_SEQLENS_VALUES:
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int, max_seqlen: int,
                            name: str = "cu_seqlens") -> None:
    """Value checks of one cu_seqlens: starts at 0, non-decreasing, ends at ``total`` (the
    number of tokens of the matching tensor), and no sequence longer than ``max_seqlen``.

    Reads the values back with one device op and one transfer; callers decide with
    :func:`should_check_values` whether that is allowed."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    # One small tensor, one transfer: [first, last, min length, max length].
    first, last, min_len, max_len = torch.stack([cu[0], cu[-1], lens.min(), lens.max()]).tolist()
    if first != 0:
        raise ValueError(f"flash_ext: {name} must start at 0; got {name}[0] = {first}")
    if min_len < 0:
        raise ValueError(f"flash_ext: {name} must be non-decreasing; got {cu_seqlens.tolist()}")
    if last != total:
        raise ValueError(
            f"flash_ext: {name}[-1] must equal the number of tokens ({total}); got {last}")
    if max_len > max_seqlen:
        which = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k" if name.endswith("_k") \
            else "max_seqlen"
        raise ValueError(
            f"flash_ext: {which} ({max_seqlen}) is smaller than the longest sequence in {name} "
            f"({max_len})")


def check_max_seqlen(max_seqlen_q, max_seqlen_k, varlen: bool) -> None:
    """Varlen needs max_seqlen_q and max_seqlen_k as ints >= 0; batched calls must not pass them."""
    if not varlen:
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None:
                raise ValueError(
                    f"flash_ext: {name} is only used with varlen inputs (cu_seqlens_q/cu_seqlens_k)")
        return
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is None:
            raise ValueError(f"flash_ext: varlen inputs need {name} (the longest sequence length)")
        if not _is_int(m):
            raise TypeError(f"flash_ext: {name} must be an int; got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"flash_ext: {name} must be >= 0; got {m}")


# ----------------------------------------------------------------------------------------------
# Scalars
# ----------------------------------------------------------------------------------------------


def check_softmax_scale(softmax_scale) -> None:
    """None (default 1/sqrt(head dim)) or a finite number > 0 (the kernels take the row max of
    the unscaled scores, which is the max of the scaled ones only for a positive scale)."""
    if softmax_scale is None:
        return
    if not _is_number(softmax_scale):
        raise TypeError(
            f"flash_ext: softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (int, float)) and not math.isfinite(softmax_scale):
        raise ValueError(f"flash_ext: softmax_scale must be finite; got {softmax_scale}")
    if softmax_scale <= 0:
        raise ValueError(f"flash_ext: softmax_scale must be > 0; got {softmax_scale}")


def check_softcap(softcap) -> None:
    """A finite number >= 0 (0 = off)."""
    if not _is_number(softcap):
        raise TypeError(f"flash_ext: softcap must be a float; got {type(softcap).__name__}")
    if isinstance(softcap, (int, float)) and not math.isfinite(softcap):
        raise ValueError(f"flash_ext: softcap must be finite; got {softcap}")
    if softcap < 0:
        raise ValueError(f"flash_ext: softcap must be >= 0 (0 disables it); got {softcap}")


def check_dropout(dropout_p, rng_state=None, *, need_rng_state: bool = False) -> None:
    """dropout_p a number in [0, 1]; rng_state None or an int64 CPU tensor of 2 elements
    [seed, offset] (what attn_fwd returns with dropout). need_rng_state: the backward, which
    must regenerate the forward's mask, needs it when dropout_p > 0."""
    if not _is_number(dropout_p):
        raise TypeError(f"flash_ext: dropout_p must be a float; got {type(dropout_p).__name__}")
    if isinstance(dropout_p, (int, float)) and not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"flash_ext: dropout_p must be a number in [0, 1]; got {dropout_p!r}")
    if rng_state is None:
        if need_rng_state and dropout_p > 0:
            raise ValueError(
                "flash_ext: dropout_p > 0 in the backward needs the forward's rng_state (the "
                "third value attn_fwd returns with dropout)")
        return
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(
            f"flash_ext: rng_state must be a torch.Tensor or None; got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or rng_state.numel() != 2 or rng_state.device.type != "cpu":
        raise ValueError(
            f"flash_ext: rng_state must be an int64 CPU tensor of 2 elements [seed, offset]; got "
            f"{_dtype_name(rng_state.dtype)} {_shape(rng_state)} on {rng_state.device}")


def check_window_size(window_size) -> None:
    """A pair (left, right) of ints, each >= -1 (-1 = unbounded)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(
            f"flash_ext: window_size must be a pair (left, right); got {window_size!r}")
    for side, w in zip(("left", "right"), window_size):
        if not _is_int(w):
            raise TypeError(
                f"flash_ext: window_size {side} must be an int; got {type(w).__name__}")
        if w < -1:
            raise ValueError(
                f"flash_ext: window_size {side} must be >= -1 (-1 = unbounded); got {w}")


def check_like(t: Optional[torch.Tensor], ref: torch.Tensor, name: str, ref_name: str) -> None:
    """``t`` (skipped when None) must have ``ref``'s shape and dtype, e.g. out= and dout like q,
    or dk= like k (any strides are accepted; :func:`check_devices` has checked the device)."""
    if t is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(
            f"flash_ext: {name} must have {ref_name}'s dtype ({_dtype_name(ref.dtype)}); got "
            f"{_dtype_name(t.dtype)}")
    if t.shape != ref.shape:
        raise ValueError(
            f"flash_ext: {name} must have {ref_name}'s shape {_shape(ref)}; got {_shape(t)}")


def check_out_without_grad(out: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> None:
    """``out=`` is not differentiable (the op that writes it has no autograd formula): refuse it
    when a gradient may be needed (RuntimeError)."""
    if out is not None and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(
            "flash_ext.attn_fwd: out= does not support automatic differentiation (one of q, k, "
            "v requires grad); call it without out=")


def check_lse(lse: torch.Tensor, q: torch.Tensor, varlen: bool) -> None:
    """``lse`` as the forward returned it: float32, (batch, nheads_q, seqlen_q) or varlen
    (nheads_q, total_q)."""
    if lse.dtype != torch.float32:
        raise TypeError(
            f"flash_ext: lse must be float32 (as the forward returns it); got "
            f"{_dtype_name(lse.dtype)}")
    if varlen:
        expected, layout = (q.shape[1], q.shape[0]), "(nheads_q, total_q)"
    else:
        expected, layout = (q.shape[0], q.shape[2], q.shape[1]), "(batch, nheads_q, seqlen_q)"
    if tuple(lse.shape) != tuple(expected):
        raise ValueError(
            f"flash_ext: lse must have shape {layout} = ({', '.join(str(s) for s in expected)}), "
            f"as the forward returns it; got {_shape(lse)}")


# ----------------------------------------------------------------------------------------------
# Everything, in order
# ----------------------------------------------------------------------------------------------


def check_fwd_inputs(q, k, v, *, softmax_scale=None, window_size: Sequence[int] = (-1, -1),
                     softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, out=None, dropout_p=0.0,
                     rng_state=None, require_cuda: bool = True) -> bool:
    """All checks of one forward call (attn_fwd), in the order of the module docstring.
    Returns True for a varlen call."""
    check_dropout(dropout_p, rng_state)
    check_devices({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                   "cu_seqlens_k": cu_seqlens_k, "out": out}, require_cuda=require_cuda,
                  required=("q", "k", "v"))
    varlen = _check_attention_inputs(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_like(out, q, "out", "q")
    check_out_without_grad(out, q, k, v)
    return varlen


def check_bwd_inputs(dout, q, k, v, out, lse, *, softmax_scale=None,
                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     dq=None, dk=None, dv=None, dropout_p=0.0, rng_state=None,
                     require_cuda: bool = True) -> bool:
    """All checks of one backward call (attn_bwd), in the forward's order: dropout (with the
    forward's rng_state required when dropout_p > 0), devices, the forward's checks on q, k, v
    and the arguments, then dout and out (q's shape and dtype), lse (float32, the forward's lse
    shape) and the optional dq, dk, dv outputs (like q, k, v). dout, out, dq, dk, dv may have
    any strides. Returns True for a varlen call."""
    check_dropout(dropout_p, rng_state, need_rng_state=True)
    check_devices({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                   "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "dq": dq,
                   "dk": dk, "dv": dv}, require_cuda=require_cuda,
                  required=("dout", "q", "k", "v", "out", "lse"))
    varlen = _check_attention_inputs(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_like(dout, q, "dout", "q")
    check_like(out, q, "out", "q")
    check_lse(lse, q, varlen)
    check_like(dq, q, "dq", "q")
    check_like(dk, k, "dk", "k")
    check_like(dv, v, "dv", "v")
    return varlen


def _check_attention_inputs(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """The checks both directions share, after check_devices: q, k, v, cu_seqlens (metadata,
    then values where allowed), max_seqlen and the scalars. Returns True for a varlen call."""
    check_dtypes(q, k, v)
    varlen = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    check_qkv_shapes(q, k, v, varlen)
    check_max_seqlen(max_seqlen_q, max_seqlen_k, varlen)
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    check_window_size(window_size)
    if varlen:
        for name, cu, total, m in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                   ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            if should_check_values(cu):
                check_cu_seqlens_values(cu, total, m, name)
    return varlen


# ----------------------------------------------------------------------------------------------
# The FlashAttention-compatible functions (flash_ext.interface): their own arguments, checked
# before attn_fwd's checks
# ----------------------------------------------------------------------------------------------


def check_unsupported(fn: str, alibi_slopes, block_table=None) -> None:
    """FlashAttention arguments flash_ext does not implement (NotImplementedError)."""
    if alibi_slopes is not None:
        raise NotImplementedError(f"flash_ext.{fn}: alibi_slopes are not supported yet")
    if block_table is not None:
        raise NotImplementedError(
            f"flash_ext.{fn}: block_table (paged KV cache) is not supported yet")


def check_packed(fn: str, name: str, t, dim: int, n: int, ndim: int, layout: str) -> None:
    """A packed kv / qkv argument: an ``ndim``-D tensor with ``n`` entries along ``dim``
    (ValueError naming the expected ``layout`` otherwise)."""
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.shape[dim] != n:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"flash_ext.{fn}: {name} must have shape {layout}; got {shape}")
