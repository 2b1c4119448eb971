"""Every check on user input, run by the Python layer before anything is launched. Each check
lives here once; the entry points (flash_ext.attn_fwd, attn_bwd and the FlashAttention-compatible
functions of flash_ext.interface) only call them.

Every check raises a clear Python error naming the offending argument, one of the classes of
flash_ext/errors.py, all of them ``RuntimeError`` subclasses (FlashAttention's convention):

- :class:`FlashExtTypeError` (a ``TypeError``) for a wrong dtype or a wrong argument type (a
  non-tensor, a missing tensor),
- :class:`FlashExtValueError` (a ``ValueError``) for bad values and shapes,
- :class:`DeviceError` (a ``FlashExtValueError``) for tensors that are not on CUDA or not on
  one device,
- :class:`FlashExtNotImplementedError` for features flash_ext does not have,
- :class:`FlashExtError` for ``out=`` with inputs that require grad.

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
- once per tensor (its values and in-place version), so a model that hands one cu_seqlens to
  each of its layers syncs once per forward, not once per layer;
- for CUDA tensors only in eager mode: they are skipped while ``torch.compile`` traces
  (``torch.compiler.is_compiling()``), while a CUDA graph is being captured, and when the
  environment variable ``FLASH_EXT_CHECK_CU_SEQLENS=0`` is set (or
  ``flash_ext._validation.CHECK_CU_SEQLENS_VALUES = False``), e.g. in latency-critical loops.

seqused_k (0 <= seqused_k[b] <= the sequence's keys) and flash_attn_varlen_func's paged form
(key counts at most max_seqlen_k, block_table entries of used pages in range) follow the
cu_seqlens policy (:func:`check_seqused_k_values`, :func:`check_paged_varlen_values`).

flash_attn_with_kvcache's index tensors (cache_seqlens, cache_leftpad, cache_batch_idx,
block_table) follow the same policy (:func:`check_kvcache_values`, once per set of tensors and
their versions), switched off with ``FLASH_EXT_CHECK_KVCACHE=0`` (``CHECK_KVCACHE_VALUES``).
Every one of its checks runs before the first op call, so a rejected call writes nothing into
the caches.

flashmask_attention's bounds (startend_row_indices: ``0 <= bound <= seqlen_q``, LTS <= LTE,
UTS <= UTE) follow it too (:func:`check_flashmask_inputs`), switched off with
``FLASH_EXT_CHECK_FLASHMASK=0`` (``CHECK_FLASHMASK_VALUES``). A skipped check can give a wrong
mask, never a memory error: the kernels only compare the bounds, after clamping them.
"""

from __future__ import annotations

import math
import operator
import os
import weakref
from typing import Optional, Sequence

import torch

from flash_ext.errors import (DeviceError, FlashExtError, FlashExtNotImplementedError,
                              FlashExtTypeError, FlashExtValueError)

__all__ = [
    "DeviceError",
    "MAX_HEADDIM",
    "SUPPORTED_DTYPES",
    "CHECK_CU_SEQLENS_VALUES",
    "CHECK_KVCACHE_VALUES",
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
    "window_pair",
    "check_dropout",
    "check_like",
    "check_out_without_grad",
    "check_lse",
    "check_fwd_inputs",
    "check_bwd_inputs",
    "check_packed",
    "check_sdpa_inputs",
    "check_unpad_inputs",
    "check_pad_inputs",
    "check_kvcache_inputs",
    "check_kvcache_values",
    "check_block_table",
    "check_seqused_k",
    "check_seqused_k_values",
    "check_paged_varlen_inputs",
    "check_paged_varlen_values",
    "CHECK_FLASHMASK_VALUES",
    "check_flashmask_inputs",
]

MAX_HEADDIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Value checks of cu_seqlens on CUDA tensors (one host sync per call); see the module docstring.
CHECK_CU_SEQLENS_VALUES = os.environ.get("FLASH_EXT_CHECK_CU_SEQLENS", "1").strip().lower() not in (
    "0", "false", "no", "off")
# Value checks of flash_attn_with_kvcache's cache_seqlens, cache_leftpad, cache_batch_idx and
# block_table on CUDA tensors (one host sync per new set of tensors); the same policy.
CHECK_KVCACHE_VALUES = os.environ.get("FLASH_EXT_CHECK_KVCACHE", "1").strip().lower() not in (
    "0", "false", "no", "off")
# Value checks of flashmask_attention's startend_row_indices on CUDA tensors; the same policy.
CHECK_FLASHMASK_VALUES = os.environ.get("FLASH_EXT_CHECK_FLASHMASK", "1").strip().lower() not in (
    "0", "false", "no", "off")


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
                raise FlashExtTypeError(f"flash_ext: {name} must be a torch.Tensor, got None")
            continue
        if not isinstance(t, torch.Tensor):
            raise FlashExtTypeError(f"flash_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
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
            raise FlashExtTypeError(
                f"flash_ext supports float16 and bfloat16 only; got {name} of dtype "
                f"{_dtype_name(t.dtype)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FlashExtTypeError(
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
            raise FlashExtValueError(
                f"flash_ext: {name} must be {ndim}-D {layout}{' for varlen' if varlen else ''}; "
                f"got {name} of shape {_shape(t)}{extra}")
    if k.shape != v.shape:
        raise FlashExtValueError(
            f"flash_ext: k and v must have the same shape; got k {_shape(k)} and v {_shape(v)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise FlashExtValueError(
            f"flash_ext: q and k must have the same batch size; got q {_shape(q)} and k {_shape(k)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise FlashExtValueError(
            f"flash_ext: q, k and v must have the same head dim; got q {_shape(q)}, k {_shape(k)}, "
            f"v {_shape(v)}")
    if d < 1 or d > MAX_HEADDIM:
        raise FlashExtValueError(f"flash_ext: head dim must be between 1 and {MAX_HEADDIM}; got {d}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq < 1:
        raise FlashExtValueError(f"flash_ext: the number of heads must be >= 1; got q {hq}, k/v {hkv}")
    if hq % hkv != 0:
        raise FlashExtValueError(
            f"flash_ext: the number of query heads ({hq}) must be a multiple of the number of "
            f"key/value heads ({hkv})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise FlashExtValueError(
                f"flash_ext: the last dimension of {name} must be contiguous (stride 1); got "
                f"strides {tuple(t.stride())}. Call .contiguous() on it first.")


def check_cu_seqlens(cu_seqlens_q: Optional[torch.Tensor],
                     cu_seqlens_k: Optional[torch.Tensor]) -> bool:
    """Metadata checks of cu_seqlens (no values read). Returns True for a varlen call.

    Both or neither must be given; each int32, 1-D, with at least 2 entries (batch >= 1),
    the same length. (That they are tensors on q's device is :func:`check_devices`'s part.)"""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given = "cu_seqlens_q" if cu_seqlens_q is not None else "cu_seqlens_k"
        raise FlashExtValueError(
            f"flash_ext: cu_seqlens_q and cu_seqlens_k must be given together (varlen) or not at "
            f"all; only {given} was given")
    if cu_seqlens_q is None:
        return False
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise FlashExtTypeError(f"flash_ext: {name} must be int32; got {_dtype_name(cu.dtype)}")
        if cu.dim() != 1:
            raise FlashExtValueError(f"flash_ext: {name} must be 1-D (batch + 1,); got shape {_shape(cu)}")
        if cu.shape[0] < 2:
            raise FlashExtValueError(
                f"flash_ext: {name} must have batch + 1 >= 2 entries; got shape {_shape(cu)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise FlashExtValueError(
            f"flash_ext: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return True


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover
        return False
    return is_fake(t)


def should_check_values(t: torch.Tensor, enabled: Optional[bool] = None) -> bool:
    """Whether the value checks of cu_seqlens (or, with ``enabled`` =
    :data:`CHECK_KVCACHE_VALUES`, of the KV-cache index tensors) run for tensor ``t`` (see the
    module docstring). ``enabled`` None: :data:`CHECK_CU_SEQLENS_VALUES`."""
    if torch.compiler.is_compiling():
        return False  # tracing: no values, and no host sync in a compiled graph
    if _is_fake(t) or t.device.type == "meta":
        return False  # no values (tracing with fake tensors, torch.export, meta tensors)
    if t.device.type == "cpu":
        return True
    if not (CHECK_CU_SEQLENS_VALUES if enabled is None else enabled):
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
        raise FlashExtValueError(f"flash_ext: {name} must start at 0; got {name}[0] = {first}")
    if min_len < 0:
        raise FlashExtValueError(f"flash_ext: {name} must be non-decreasing; got {cu_seqlens.tolist()}")
    if last != total:
        raise FlashExtValueError(
            f"flash_ext: {name}[-1] must equal the number of tokens ({total}); got {last}")
    if max_len > max_seqlen:
        which = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k" if name.endswith("_k") \
            else "max_seqlen"
        raise FlashExtValueError(
            f"flash_ext: {which} ({max_seqlen}) is smaller than the longest sequence in {name} "
            f"({max_len})")


def check_max_seqlen(max_seqlen_q, max_seqlen_k, varlen: bool) -> None:
    """Varlen needs max_seqlen_q and max_seqlen_k as ints >= 0; batched calls must not pass them."""
    if not varlen:
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None:
                raise FlashExtValueError(
                    f"flash_ext: {name} is only used with varlen inputs (cu_seqlens_q/cu_seqlens_k)")
        return
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is None:
            raise FlashExtValueError(f"flash_ext: varlen inputs need {name} (the longest sequence length)")
        if not _is_int(m):
            raise FlashExtTypeError(f"flash_ext: {name} must be an int; got {type(m).__name__}")
        if m < 0:
            raise FlashExtValueError(f"flash_ext: {name} must be >= 0; got {m}")


def check_seqused_k(seqused_k: torch.Tensor, varlen: bool, cu_seqlens_k) -> None:
    """seqused_k (FlashAttention-3's meaning: sequence b uses only its first seqused_k[b] keys):
    varlen only, int32, shape (batch,). (Its device is :func:`check_devices`'s part; its values
    :func:`check_seqused_k_values`'.)"""
    if not varlen:
        raise FlashExtValueError(
            "flash_ext: seqused_k needs varlen inputs (cu_seqlens_q, cu_seqlens_k and "
            "max_seqlen_q/k)")
    if seqused_k.dtype != torch.int32:
        raise FlashExtTypeError(
            f"flash_ext: seqused_k must be int32; got {_dtype_name(seqused_k.dtype)}")
    batch = cu_seqlens_k.shape[0] - 1
    if seqused_k.dim() != 1 or seqused_k.shape[0] != batch:
        raise FlashExtValueError(
            f"flash_ext: seqused_k must have shape (batch,) = ({batch},); got {_shape(seqused_k)}")


def check_seqused_k_values(seqused_k: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """0 <= seqused_k[b] <= cu_seqlens_k[b + 1] - cu_seqlens_k[b] (one device op and one
    transfer; callers decide with :func:`should_check_values` whether that is allowed)."""
    used = seqused_k.to(torch.int64)
    cu = cu_seqlens_k.to(used.device, torch.int64)
    over = used - (cu[1:] - cu[:-1])
    low, high = torch.stack([used.min(), over.max()]).tolist()
    if low < 0:
        raise FlashExtValueError(
            f"flash_ext: seqused_k must be >= 0; got {_first_bad('seqused_k', seqused_k, used < 0)}")
    if high > 0:
        raise FlashExtValueError(
            f"flash_ext: seqused_k[b] must be at most the keys of sequence b (cu_seqlens_k[b + 1] - "
            f"cu_seqlens_k[b]); got {_first_bad('seqused_k', seqused_k, over > 0)} with "
            f"cu_seqlens_k {cu_seqlens_k.tolist()}")


# ----------------------------------------------------------------------------------------------
# Scalars
# ----------------------------------------------------------------------------------------------


def check_softmax_scale(softmax_scale, name: str = "softmax_scale") -> None:
    """None (default 1/sqrt(head dim)) or a finite number > 0 (the kernels take the row max of
    the unscaled scores, which is the max of the scaled ones only for a positive scale)."""
    if softmax_scale is None:
        return
    if not _is_number(softmax_scale):
        raise FlashExtTypeError(
            f"flash_ext: {name} must be a float or None; got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (int, float)) and not math.isfinite(softmax_scale):
        raise FlashExtValueError(f"flash_ext: {name} must be finite; got {softmax_scale}")
    if softmax_scale <= 0:
        raise FlashExtValueError(f"flash_ext: {name} must be > 0; got {softmax_scale}")


def check_softcap(softcap) -> None:
    """A finite number; > 0 caps the scores, <= 0 means off (FlashAttention's convention)."""
    if not _is_number(softcap):
        raise FlashExtTypeError(f"flash_ext: softcap must be a float; got {type(softcap).__name__}")
    if isinstance(softcap, (int, float)) and not math.isfinite(softcap):
        raise FlashExtValueError(f"flash_ext: softcap must be finite; got {softcap}")


def check_dropout(dropout_p, rng_state=None, *, need_rng_state: bool = False) -> None:
    """dropout_p a number in [0, 1]; rng_state None or an int64 CPU tensor of 2 elements
    [seed, offset] (what attn_fwd returns with dropout). need_rng_state: the backward, which
    must regenerate the forward's mask, needs it when dropout_p > 0."""
    if not _is_number(dropout_p):
        raise FlashExtTypeError(f"flash_ext: dropout_p must be a float; got {type(dropout_p).__name__}")
    if isinstance(dropout_p, (int, float)) and not (0.0 <= dropout_p <= 1.0):
        raise FlashExtValueError(f"flash_ext: dropout_p must be a number in [0, 1]; got {dropout_p!r}")
    if rng_state is None:
        if need_rng_state and dropout_p > 0:
            raise FlashExtValueError(
                "flash_ext: dropout_p > 0 in the backward needs the forward's rng_state (the "
                "third value attn_fwd returns with dropout)")
        return
    if not isinstance(rng_state, torch.Tensor):
        raise FlashExtTypeError(
            f"flash_ext: rng_state must be a torch.Tensor or None; got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or rng_state.numel() != 2 or rng_state.device.type != "cpu":
        raise FlashExtValueError(
            f"flash_ext: rng_state must be an int64 CPU tensor of 2 elements [seed, offset]; got "
            f"{_dtype_name(rng_state.dtype)} {_shape(rng_state)} on {rng_state.device}")


def check_window_size(window_size) -> None:
    """window_size as :func:`window_pair` takes it. A CUDA tensor's values are not read here
    (that would be a second host sync): :func:`window_pair`, which the entry points call before
    any launch, reads and checks them once."""
    if isinstance(window_size, torch.Tensor) and window_size.device.type != "cpu":
        _check_window_tensor(window_size)
        return
    window_pair(window_size)


def window_pair(window_size) -> tuple:
    """window_size as a pair (left, right) of Python ints, each >= -1 (-1 = unbounded).

    Takes what FlashAttention's callers pass: any length-2 sequence (tuple, list, 1-D numpy
    array, ...) of ints, numpy integer scalars or one-element integer tensors, or a 2-element
    1-D integer tensor (its values are read with one ``.tolist()``: a host sync for a CUDA
    tensor). Raises FlashExtValueError / FlashExtTypeError otherwise."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, kept cheap
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return window_size
    if isinstance(window_size, torch.Tensor):
        _check_window_tensor(window_size)
        left, right = window_size.tolist()
    else:
        left, right = _window_items(window_size)
    return _window_bound("left", left), _window_bound("right", right)


def _check_window_tensor(window_size: torch.Tensor) -> None:
    if window_size.dim() != 1 or window_size.shape[0] != 2:
        raise FlashExtValueError(
            f"flash_ext: window_size must be a pair (left, right); got a tensor of shape "
            f"{_shape(window_size)}")
    if window_size.dtype == torch.bool or window_size.dtype.is_floating_point \
            or window_size.dtype.is_complex:
        raise FlashExtTypeError(
            f"flash_ext: window_size must hold integers; got a tensor of dtype "
            f"{_dtype_name(window_size.dtype)}")


def _window_items(window_size):
    """The two items of a length-2 sequence; FlashExtValueError for anything else."""
    n = None
    if not isinstance(window_size, (str, bytes, dict)) and hasattr(window_size, "__getitem__"):
        try:
            n = len(window_size)
        except TypeError:  # e.g. a 0-d numpy array
            pass
    if n != 2:
        raise FlashExtValueError(
            f"flash_ext: window_size must be a pair (left, right) of ints; got {window_size!r}")
    return window_size[0], window_size[1]


def _window_bound(side: str, w):
    """One side of window_size as an int (SymInts pass through for torch.compile)."""
    if not _is_int(w):
        if isinstance(w, bool) or (isinstance(w, torch.Tensor) and w.dtype == torch.bool):
            raise FlashExtTypeError(f"flash_ext: window_size {side} must be an int; got a bool")
        try:
            w = operator.index(w)  # numpy integer scalars, one-element integer tensors
        except TypeError:
            raise FlashExtTypeError(
                f"flash_ext: window_size {side} must be an int; got {type(w).__name__}") from None
    if w < -1:
        raise FlashExtValueError(
            f"flash_ext: window_size {side} must be >= -1 (-1 = unbounded); got {w}")
    return w


def check_like(t: Optional[torch.Tensor], ref: torch.Tensor, name: str, ref_name: str) -> None:
    """``t`` (skipped when None) must have ``ref``'s shape and dtype, e.g. out= and dout like q,
    or dk= like k (any strides are accepted; :func:`check_devices` has checked the device)."""
    if t is None:
        return
    if t.dtype != ref.dtype:
        raise FlashExtTypeError(
            f"flash_ext: {name} must have {ref_name}'s dtype ({_dtype_name(ref.dtype)}); got "
            f"{_dtype_name(t.dtype)}")
    if t.shape != ref.shape:
        raise FlashExtValueError(
            f"flash_ext: {name} must have {ref_name}'s shape {_shape(ref)}; got {_shape(t)}")


def check_out_without_grad(out: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> None:
    """``out=`` is not differentiable (the op that writes it has no autograd formula): refuse it
    when a gradient may be needed (RuntimeError)."""
    if out is not None and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        raise FlashExtError(
            "flash_ext.attn_fwd: out= does not support automatic differentiation (one of q, k, "
            "v requires grad); call it without out=")


def check_lse(lse: torch.Tensor, q: torch.Tensor, varlen: bool) -> None:
    """``lse`` as the forward returned it: float32, (batch, nheads_q, seqlen_q) or varlen
    (nheads_q, total_q)."""
    if lse.dtype != torch.float32:
        raise FlashExtTypeError(
            f"flash_ext: lse must be float32 (as the forward returns it); got "
            f"{_dtype_name(lse.dtype)}")
    if varlen:
        expected, layout = (q.shape[1], q.shape[0]), "(nheads_q, total_q)"
    else:
        expected, layout = (q.shape[0], q.shape[2], q.shape[1]), "(batch, nheads_q, seqlen_q)"
    if tuple(lse.shape) != tuple(expected):
        raise FlashExtValueError(
            f"flash_ext: lse must have shape {layout} = ({', '.join(str(s) for s in expected)}), "
            f"as the forward returns it; got {_shape(lse)}")


# ----------------------------------------------------------------------------------------------
# Everything, in order
# ----------------------------------------------------------------------------------------------


def check_alibi_slopes(name: str, alibi_slopes, q, batch: int, heads_q: int,
                       dropout_p: float = 0.0) -> None:
    """alibi_slopes of the prefill functions: float32 (nheads_q,) or (batch, nheads_q) on q's
    device, last dim contiguous; not together with dropout_p > 0 (no kernel has both yet)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise FlashExtTypeError(
            f"{name}: alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise FlashExtTypeError(
            f"{name}: alibi_slopes must be float32; got {_dtype_name(alibi_slopes.dtype)}")
    if alibi_slopes.device != q.device:
        raise DeviceError(
            f"{name}: alibi_slopes must be on q's device ({q.device}); got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise FlashExtValueError(
            f"{name}: alibi_slopes must have shape (nheads,) = ({heads_q},) or (batch, nheads) = "
            f"({batch}, {heads_q}); got {_shape(alibi_slopes)}")
    if alibi_slopes.stride(-1) != 1:
        raise FlashExtValueError(f"{name}: alibi_slopes must be contiguous in its last dim")
    if dropout_p is not None and float(dropout_p) > 0:
        raise FlashExtNotImplementedError(
            f"{name}: alibi_slopes together with dropout_p > 0 is not supported")


def check_attn_probs_alibi(alibi_slopes) -> None:
    """return_attn_probs with dropout rebuilds P without the bias: not with alibi_slopes."""
    if alibi_slopes is not None:
        raise FlashExtNotImplementedError(
            "flash_ext: return_attn_probs=True with dropout_p > 0 and alibi_slopes is not supported")


def check_fwd_inputs(q, k, v, *, softmax_scale=None, window_size: Sequence[int] = (-1, -1),
                     softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, out=None, dropout_p=0.0,
                     rng_state=None, seqused_k=None, alibi_slopes=None,
                     require_cuda: bool = True) -> bool:
    """All checks of one forward call (attn_fwd), in the order of the module docstring.
    Returns True for a varlen call."""
    check_dropout(dropout_p, rng_state)
    check_devices({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                   "cu_seqlens_k": cu_seqlens_k, "out": out, "seqused_k": seqused_k},
                  require_cuda=require_cuda, required=("q", "k", "v"))
    varlen = _check_attention_inputs(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_like(out, q, "out", "q")
    check_out_without_grad(out, q, k, v)
    if alibi_slopes is not None:
        batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        check_alibi_slopes("flash_ext", alibi_slopes, q, batch, q.shape[-2], dropout_p)
    if seqused_k is not None:
        check_seqused_k(seqused_k, varlen, cu_seqlens_k)
        if should_check_values(seqused_k) and not _values_checked_before(
                "seqused_k", (seqused_k, cu_seqlens_k), ()):
            check_seqused_k_values(seqused_k, cu_seqlens_k)
            _remember_values_checked("seqused_k", (seqused_k, cu_seqlens_k), ())
    return varlen


def check_bwd_inputs(dout, q, k, v, out, lse, *, softmax_scale=None,
                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                     cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     dq=None, dk=None, dv=None, dropout_p=0.0, rng_state=None,
                     alibi_slopes=None, require_cuda: bool = True) -> bool:
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
    if alibi_slopes is not None:
        batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        check_alibi_slopes("flash_ext", alibi_slopes, q, batch, q.shape[-2], dropout_p)
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
            if should_check_values(cu) and not _checked_before(cu, total, m):
                check_cu_seqlens_values(cu, total, m, name)
                _remember_checked(cu, total, m)
    return varlen


# Tensors whose values passed a value check, by kind and id: a model passes one cu_seqlens to
# each of its layers (and as both cu_seqlens_q and cu_seqlens_k), and one cache_seqlens /
# block_table to each layer of a decode step, so the host sync of the value check is paid once
# per tensor (set), not once per call. An entry holds weak references (a new tensor at a reused
# id is not taken for the old one), the tensors' version counters (an in-place write, such as a
# decode loop's cache_seqlens += 1, invalidates it) and the other arguments the check depended
# on; it goes when one of its tensors does.
_CHECKED: dict = {}


def _checked_before(cu: torch.Tensor, total: int, max_seqlen: int) -> bool:
    return _values_checked_before("cu_seqlens", (cu,), (total, max_seqlen))


def _remember_checked(cu: torch.Tensor, total: int, max_seqlen: int) -> None:
    _remember_values_checked("cu_seqlens", (cu,), (total, max_seqlen))


def _values_checked_before(kind: str, tensors: tuple, params: tuple) -> bool:
    entry = _CHECKED.get((kind,) + tuple(id(t) for t in tensors))
    if entry is None:
        return False
    refs, versions, old_params = entry
    if any(r() is not t for r, t in zip(refs, tensors)):
        return False
    try:
        return versions == tuple(t._version for t in tensors) and old_params == params
    except RuntimeError:  # inference tensors have no version counter
        return False


def _remember_values_checked(kind: str, tensors: tuple, params: tuple) -> None:
    key = (kind,) + tuple(id(t) for t in tensors)
    try:
        versions = tuple(t._version for t in tensors)
        refs = tuple(weakref.ref(t, lambda _, key=key: _CHECKED.pop(key, None)) for t in tensors)
    except (RuntimeError, TypeError):
        return
    _CHECKED[key] = (refs, versions, params)


# ----------------------------------------------------------------------------------------------
# The FlashAttention-compatible functions (flash_ext.interface): their own arguments, checked
# before attn_fwd's checks
# ----------------------------------------------------------------------------------------------


def check_packed(fn: str, name: str, t, dim: int, n: int, ndim: int, layout: str) -> None:
    """A packed kv / qkv argument: an ``ndim``-D tensor with ``n`` entries along ``dim``
    (ValueError naming the expected ``layout`` otherwise)."""
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.shape[dim] != n:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise FlashExtValueError(f"flash_ext.{fn}: {name} must have shape {layout}; got {shape}")


# ----------------------------------------------------------------------------------------------
# flash_ext.scaled_dot_product_attention: its own arguments, in its (batch, nheads, seqlen,
# headdim) layout, checked before attn_fwd's checks (devices, dtypes, head dim, dropout)
# ----------------------------------------------------------------------------------------------

ATTN_MASK_ALTERNATIVES = (
    "flash_ext.scaled_dot_product_attention does not take attn_mask: flash_ext's kernels never "
    "read an O(seqlen_q * seqlen_k) mask. Instead: is_causal=True for a causal mask; for a "
    "padding mask, flash_ext.unpad_input, then flash_ext.flash_attn_varlen_func (cu_seqlens), "
    "then flash_ext.pad_input; window_size= of flash_ext.flash_attn_func / attn_fwd for a "
    "sliding window. Column-wise sparse masks (FlashMask) are planned.")


def check_sdpa_inputs(query, key, value, attn_mask, scale, enable_gqa) -> None:
    """attn_mask (unsupported: FlashExtNotImplementedError naming the alternatives), the three
    tensors 4-D (batch, nheads, seqlen, headdim) with one batch size, key and value of one shape,
    one head dim, and the head counts as torch's SDPA takes them: equal, or a key/value head
    count that divides the query's with enable_gqa=True, or one key/value head (broadcast)."""
    if attn_mask is not None:
        raise FlashExtNotImplementedError(ATTN_MASK_ALTERNATIVES)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise FlashExtTypeError(
                f"flash_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise FlashExtValueError(
                f"flash_ext.scaled_dot_product_attention: {name} must be 4-D (batch, nheads, "
                f"seqlen, headdim); got shape {_shape(t)}")
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise FlashExtValueError(
            f"flash_ext.scaled_dot_product_attention: query, key and value must have the same "
            f"batch size (no broadcasting); got query {_shape(query)}, key {_shape(key)}, "
            f"value {_shape(value)}")
    if key.shape[:3] != value.shape[:3]:
        raise FlashExtValueError(
            f"flash_ext.scaled_dot_product_attention: key and value must have the same batch, "
            f"nheads and seqlen; got key {_shape(key)} and value {_shape(value)}")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
        raise FlashExtValueError(
            f"flash_ext.scaled_dot_product_attention: query, key and value must have the same "
            f"head dim (a value head dim other than the query's is not supported); got query "
            f"{_shape(query)}, key {_shape(key)}, value {_shape(value)}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and hkv != 1:
        if not enable_gqa:
            raise FlashExtValueError(
                f"flash_ext.scaled_dot_product_attention: query has {hq} heads and key/value "
                f"{hkv}; pass enable_gqa=True for grouped-query attention")
        if hkv == 0 or hq % hkv != 0:
            raise FlashExtValueError(
                f"flash_ext.scaled_dot_product_attention: the number of key/value heads ({hkv}) "
                f"must divide the number of query heads ({hq})")
    check_softmax_scale(scale, "scale")


# ----------------------------------------------------------------------------------------------
# flash_ext.padding (unpad_input / pad_input)
# ----------------------------------------------------------------------------------------------


def _check_token_mask(mask, name: str, hidden_states: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise FlashExtTypeError(f"flash_ext: {name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise FlashExtTypeError(
            f"flash_ext: {name} must be bool or integer (nonzero = a token, 0 = padding); got "
            f"{_dtype_name(mask.dtype)}. (An additive float mask, 0 where attended, converts "
            f"with mask == 0.)")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise FlashExtValueError(
            f"flash_ext: {name} must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, the "
            f"first two dims of hidden_states {_shape(hidden_states)}; got {_shape(mask)}")
    if mask.device != hidden_states.device:
        raise DeviceError(
            f"flash_ext: {name} must be on hidden_states' device ({hidden_states.device}); got "
            f"{mask.device}")


def check_unpad_inputs(hidden_states, attention_mask, unused_mask) -> None:
    """hidden_states a tensor (batch, seqlen, ...); attention_mask and unused_mask (optional)
    bool or integer (batch, seqlen) on its device."""
    if not isinstance(hidden_states, torch.Tensor):
        raise FlashExtTypeError(
            f"flash_ext: hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() < 2:
        raise FlashExtValueError(
            f"flash_ext: hidden_states must be (batch, seqlen, ...); got shape "
            f"{_shape(hidden_states)}")
    _check_token_mask(attention_mask, "attention_mask", hidden_states)
    if unused_mask is not None:
        _check_token_mask(unused_mask, "unused_mask", hidden_states)


def check_pad_inputs(hidden_states, indices, batch, seqlen) -> None:
    """hidden_states (total, ...), indices 1-D integer (total,) on its device, batch and seqlen
    ints >= 0. The values of indices (each in [0, batch * seqlen)) are checked when they are on
    the CPU (no host sync); on CUDA an index out of range is a device-side error."""
    if not isinstance(hidden_states, torch.Tensor):
        raise FlashExtTypeError(
            f"flash_ext: hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if not isinstance(indices, torch.Tensor):
        raise FlashExtTypeError(
            f"flash_ext: indices must be a torch.Tensor, got {type(indices).__name__}")
    for name, n in (("batch", batch), ("seqlen", seqlen)):
        if not _is_int(n):
            raise FlashExtTypeError(f"flash_ext: {name} must be an int; got {type(n).__name__}")
        if n < 0:
            raise FlashExtValueError(f"flash_ext: {name} must be >= 0; got {n}")
    if hidden_states.dim() < 1:
        raise FlashExtValueError("flash_ext: hidden_states must be (total_tokens, ...); got a 0-d "
                                 "tensor")
    if indices.dtype not in (torch.int64, torch.int32):
        raise FlashExtTypeError(
            f"flash_ext: indices must be int64 or int32 (as unpad_input returns them); got "
            f"{_dtype_name(indices.dtype)}")
    if indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise FlashExtValueError(
            f"flash_ext: indices must be 1-D with one entry per row of hidden_states "
            f"({hidden_states.shape[0]}); got shape {_shape(indices)}")
    if indices.device != hidden_states.device:
        raise DeviceError(
            f"flash_ext: indices must be on hidden_states' device ({hidden_states.device}); got "
            f"{indices.device}")
    if indices.device.type == "cpu" and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= batch * seqlen:
            raise FlashExtValueError(
                f"flash_ext: indices must lie in [0, batch * seqlen) = [0, {batch * seqlen}); "
                f"got values from {lo} to {hi}")


# ----------------------------------------------------------------------------------------------
# flash_ext.flash_attn_with_kvcache (docs/design-flash-decoding.md 3.4)
# ----------------------------------------------------------------------------------------------

KVCACHE_PAGE_MULTIPLE = 16  # page sizes of a paged cache: multiples of this many tokens
# Head dims the KV-cache ops take (16-byte rows); flash_attn_with_kvcache pads the others.
KVCACHE_HEADDIM_MULTIPLE = 8
MAX_NUM_SPLITS = 128  # num_splits above this are capped by the op


def _kv_name(fn: str) -> str:
    return f"flash_ext.{fn}"


def _check_index_tensor(fn: str, name: str, t, shape: tuple, layout: str) -> None:
    """An int32 index tensor of the given shape (FlashExtTypeError / FlashExtValueError)."""
    if t is None:
        return
    if t.dtype != torch.int32:
        raise FlashExtTypeError(
            f"{_kv_name(fn)}: {name} must be int32; got {_dtype_name(t.dtype)}")
    if tuple(t.shape) != tuple(shape):
        raise FlashExtValueError(
            f"{_kv_name(fn)}: {name} must have shape {layout} = "
            f"({', '.join(str(s) for s in shape)}{',' if len(shape) == 1 else ''}); got "
            f"{_shape(t)}")


def _check_cache_rows_aligned(fn: str, name: str, t: torch.Tensor) -> None:
    """A cache is used in place, never copied: its last dim contiguous and its rows 16-byte
    aligned (every other stride and the storage offset a multiple of 8 elements)."""
    strides = t.stride()
    if strides[-1] != 1:
        raise FlashExtValueError(
            f"{_kv_name(fn)}: the last dimension of {name} must be contiguous (stride 1); got "
            f"strides {tuple(strides)}. The caches are written and read in place, never copied.")
    bad = [s for s in strides[:-1] if s % 8 != 0]
    offset_ok = torch.compiler.is_compiling() or t.storage_offset() % 8 == 0
    if bad or not offset_ok:
        raise FlashExtValueError(
            f"{_kv_name(fn)}: {name} must have 16-byte aligned rows (every stride but the last "
            f"and the storage offset a multiple of 8 elements); got strides {tuple(strides)} "
            f"and storage offset {t.storage_offset()}. The caches are used in place, never "
            f"copied: allocate them with such strides.")


def check_block_table(fn: str, block_table: torch.Tensor, batch: int, k_cache: torch.Tensor,
                      page_multiple: int) -> int:
    """block_table of a paged cache k_cache (num_pages, page_size, nheads_k, headdim): int32,
    (batch, max_pages_per_seq), page_size a positive multiple of ``page_multiple``. Returns the
    capacity of one sequence, max_pages_per_seq * page_size. (Shared by flash_attn_with_kvcache
    and flash_attn_varlen_func.)"""
    name = _kv_name(fn)
    if block_table.dtype != torch.int32:
        raise FlashExtTypeError(
            f"{name}: block_table must be int32; got {_dtype_name(block_table.dtype)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise FlashExtValueError(
            f"{name}: block_table must have shape (batch, max_pages_per_seq) with batch = "
            f"{batch}; got {_shape(block_table)}")
    page_size = k_cache.shape[1]
    if page_size < 1 or page_size % page_multiple != 0:
        rule = f"a multiple of {page_multiple}" if page_multiple > 1 else ">= 1"
        raise FlashExtValueError(
            f"{name}: page size must be {rule}, got {page_size} (k_cache.shape[1] of a paged "
            f"cache, with block_table)")
    return block_table.shape[1] * page_size


def check_kvcache_inputs(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                         cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                         block_table=None, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0,
                         require_cuda: bool = True) -> tuple:
    """The structural checks of one flash_attn_with_kvcache call (no tensor values read, so no
    host sync; design 3.4), in order: devices, dtypes, shapes of q and the caches, paging, new
    k/v, cache_seqlens (an int's value included), the index tensors, rotary, ALiBi, scalars,
    the caches' alignment (only for a head dim that is a multiple of 8: any other head dim up
    to 256 is accepted, and the caller then works on padded copies of the caches). Returns
    ``(capacity, seqlen_new)``: the tokens a sequence's cache can hold (``s_cache``, or
    ``max_pages * page_size``) and the new tokens per sequence (0 without k/v). The value checks
    are :func:`check_kvcache_values`. Every check reads the caller's tensors as given, so a
    head-dim mismatch is caught before any padding could hide it."""
    fn = "flash_attn_with_kvcache"
    name = _kv_name(fn)
    seqlens_is_tensor = isinstance(cache_seqlens, torch.Tensor)
    if cache_seqlens is not None and not seqlens_is_tensor and not _is_int(cache_seqlens):
        raise FlashExtTypeError(
            f"{name}: cache_seqlens must be an int, an int32 tensor (batch,) or None; got "
            f"{type(cache_seqlens).__name__}")
    check_devices({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
                   "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
                   "cache_seqlens": cache_seqlens if seqlens_is_tensor else None,
                   "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
                   "block_table": block_table, "alibi_slopes": alibi_slopes},
                  require_cuda=require_cuda, required=("q", "k_cache", "v_cache"))

    # dtypes
    if q.dtype not in SUPPORTED_DTYPES:
        raise FlashExtTypeError(
            f"{name} supports float16 and bfloat16 only; got q of dtype {_dtype_name(q.dtype)}")
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                   ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None and t.dtype != q.dtype:
            raise FlashExtTypeError(
                f"{name}: {arg} must have q's dtype ({_dtype_name(q.dtype)}); got "
                f"{_dtype_name(t.dtype)}")
    if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
        raise FlashExtTypeError(
            f"{name}: alibi_slopes must be float32; got {_dtype_name(alibi_slopes.dtype)}")

    # q and the caches
    for arg, t, layout in (("q", q, "(batch, seqlen_q, nheads, headdim)"),
                           ("k_cache", k_cache, "(batch_cache, seqlen_cache, nheads_k, headdim) "
                            "or, with block_table, (num_pages, page_size, nheads_k, headdim)"),
                           ("v_cache", v_cache, "k_cache's")):
        if t.dim() != 4:
            raise FlashExtValueError(f"{name}: {arg} must be 4-D {layout}; got shape {_shape(t)}")
    if k_cache.shape != v_cache.shape:
        raise FlashExtValueError(
            f"{name}: k_cache and v_cache must have the same shape; got k_cache "
            f"{_shape(k_cache)} and v_cache {_shape(v_cache)}")
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    if b < 1 or sq < 1:
        raise FlashExtValueError(
            f"{name}: q must have batch >= 1 and seqlen_q >= 1; got q {_shape(q)}")
    if k_cache.shape[3] != d:
        raise FlashExtValueError(
            f"{name}: q and k_cache must have the same head dim; got q {_shape(q)} and k_cache "
            f"{_shape(k_cache)}")
    if d < 1 or d > MAX_HEADDIM:
        raise FlashExtValueError(f"{name}: head dim must be between 1 and {MAX_HEADDIM}; got {d}")
    if hq < 1 or hkv < 1 or hq % hkv != 0:
        raise FlashExtValueError(
            f"{name}: the number of query heads ({hq}) must be a positive multiple of the "
            f"number of key/value heads of the cache ({hkv})")

    # Paged or contiguous: the capacity of one sequence
    if block_table is not None:
        if cache_batch_idx is not None:
            raise FlashExtValueError(
                f"{name}: cache_batch_idx cannot be used with block_table (a paged cache maps "
                f"each sequence to its pages through block_table)")
        capacity = check_block_table(fn, block_table, b, k_cache, KVCACHE_PAGE_MULTIPLE)
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < b:
            raise FlashExtValueError(
                f"{name}: k_cache has {k_cache.shape[0]} rows (batch_cache) for a batch of {b}; "
                f"it needs at least one row per sequence (or pass cache_batch_idx)")

    # New k and v
    if (k is None) != (v is None):
        given = "k" if k is not None else "v"
        raise FlashExtValueError(
            f"{name}: k and v (the new tokens to append) must be given together; only {given} "
            f"was given")
    seqlen_new = 0
    if k is not None:
        for arg, t in (("k", k), ("v", v)):
            if t.dim() != 4 or t.shape[0] != b or t.shape[2] != hkv or t.shape[3] != d:
                raise FlashExtValueError(
                    f"{name}: {arg} must have shape (batch, seqlen_new, nheads_k, headdim) = "
                    f"({b}, seqlen_new, {hkv}, {d}); got {_shape(t)}")
        if k.shape != v.shape:
            raise FlashExtValueError(
                f"{name}: k and v must have the same shape; got k {_shape(k)} and v {_shape(v)}")
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise FlashExtValueError(
                f"{name}: appending k and v needs cache_seqlens (where each sequence's new "
                f"tokens go)")
        if sq > capacity or seqlen_new > capacity:
            raise FlashExtValueError(
                f"{name}: with k and v, seqlen_q ({sq}) and seqlen_new ({seqlen_new}) must be at "
                f"most the cache capacity ({capacity})")
        for arg, t in (("k", k), ("v", v)):
            if t.stride(-1) != 1 and t.shape[-1] != 1:
                raise FlashExtValueError(
                    f"{name}: the last dimension of {arg} must be contiguous (stride 1); got "
                    f"strides {tuple(t.stride())}")

    # cache_seqlens
    if seqlens_is_tensor:
        _check_index_tensor(fn, "cache_seqlens", cache_seqlens, (b,), "(batch,)")
    elif cache_seqlens is not None:
        if cache_seqlens < 0 or cache_seqlens + seqlen_new > capacity:
            raise FlashExtValueError(
                f"{name}: cache_seqlens + seqlen_new must lie in [0, capacity = {capacity}]; got "
                f"cache_seqlens = {cache_seqlens} and seqlen_new = {seqlen_new}")
    _check_index_tensor(fn, "cache_batch_idx", cache_batch_idx, (b,), "(batch,)")
    _check_index_tensor(fn, "cache_leftpad", cache_leftpad, (b,), "(batch,)")

    # Rotary
    if (rotary_cos is None) != (rotary_sin is None):
        given = "rotary_cos" if rotary_cos is not None else "rotary_sin"
        raise FlashExtValueError(
            f"{name}: rotary_cos and rotary_sin must be given together; only {given} was given")
    if rotary_cos is not None:
        if k is None:
            raise FlashExtValueError(
                f"{name}: rotary_cos/rotary_sin need the new k and v (rotary embedding is "
                f"applied to q and to the appended k)")
        for arg, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t.dim() != 2:
                raise FlashExtValueError(
                    f"{name}: {arg} must be 2-D (seqlen_ro, rotary_dim / 2); got {_shape(t)}")
        if rotary_cos.shape != rotary_sin.shape:
            raise FlashExtValueError(
                f"{name}: rotary_cos and rotary_sin must have the same shape; got "
                f"{_shape(rotary_cos)} and {_shape(rotary_sin)}")
        seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
        if rotary_dim < 16 or rotary_dim % 16 != 0 or rotary_dim > d:
            raise FlashExtValueError(
                f"{name}: the rotary dim (2 * rotary_cos.shape[1]) must be a multiple of 16 and "
                f"at most the head dim ({d}); got {rotary_dim}")
        if seqlen_ro < capacity:
            raise FlashExtValueError(
                f"{name}: rotary_cos/rotary_sin must have a row per cache position "
                f"(seqlen_ro >= capacity = {capacity}); got seqlen_ro = {seqlen_ro}")
        if _is_int(cache_seqlens) and cache_seqlens + sq > seqlen_ro \
                and _per_token_positions(causal, window_size):
            raise FlashExtValueError(
                f"{name}: with causal or local attention, query token t is rotated at position "
                f"cache_seqlens + t, so cache_seqlens + seqlen_q must be at most "
                f"rotary_cos.shape[0] ({seqlen_ro}); got {cache_seqlens} + {sq}")

    # ALiBi
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
        raise FlashExtValueError(
            f"{name}: alibi_slopes must have shape (nheads,) = ({hq},) or (batch, nheads) = "
            f"({b}, {hq}); got {_shape(alibi_slopes)}")

    # Scalars
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    check_window_size(window_size)
    if not _is_int(num_splits):
        raise FlashExtTypeError(
            f"{name}: num_splits must be an int; got {type(num_splits).__name__}")
    if num_splits < 0:
        raise FlashExtValueError(
            f"{name}: num_splits must be >= 0 (0 = automatic, 1 = no split, N = N splits); got "
            f"{num_splits}")

    # Last (reads strides and offsets): the caches are used in place, unless the head dim is
    # not a multiple of 8: then flash_attn_with_kvcache works on padded copies of them.
    if d % KVCACHE_HEADDIM_MULTIPLE == 0:
        _check_cache_rows_aligned(fn, "k_cache", k_cache)
        _check_cache_rows_aligned(fn, "v_cache", v_cache)
    return capacity, seqlen_new


def _per_token_positions(causal, window_size) -> bool:
    """Whether q's rotary positions are cache_seqlens + t (causal or local) rather than
    cache_seqlens for every query token (FlashAttention-2's rule)."""
    if causal:
        return True
    if isinstance(window_size, torch.Tensor) and window_size.device.type != "cpu":
        return True  # values not read here; the stricter bound
    left, right = window_pair(window_size)
    return left >= 0 or right >= 0


def check_kvcache_values(q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                         capacity: int, seqlen_new: int, rotary_rows: Optional[int] = None,
                         per_token_positions: bool = False) -> None:
    """The value checks of flash_attn_with_kvcache (design 3.4), after
    :func:`check_kvcache_inputs`: each sequence's ``cache_seqlens + seqlen_new <= capacity``
    (and >= 0), ``0 <= cache_leftpad <= cache_seqlens``, ``cache_batch_idx`` in ``[0,
    batch_cache)``, the block_table entries of the pages that hold a visible key in ``[0,
    num_pages)``, and with rotary whose q positions are per token (causal or local), the last
    position ``cache_seqlens + seqlen_q - 1`` inside the tables (``rotary_rows``).

    Runs as one small device computation and one ``.tolist()``, under the policy of the
    cu_seqlens checks: always for CPU tensors; for CUDA tensors only in eager mode, never while
    a CUDA graph is captured or torch.compile traces, once per set of tensors (and their
    in-place versions), and not at all with ``FLASH_EXT_CHECK_KVCACHE=0``
    (:data:`CHECK_KVCACHE_VALUES`). Nothing to do when every one of these is None or an int."""
    name = _kv_name("flash_attn_with_kvcache")
    seqlens_t = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    tensors = tuple(t for t in (seqlens_t, cache_leftpad, cache_batch_idx, block_table)
                    if t is not None)
    if not tensors or not should_check_values(tensors[0], CHECK_KVCACHE_VALUES):
        return
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    num_pages = k_cache.shape[0] if paged else 0
    b_cache = k_cache.shape[0]
    sq = q.shape[1]
    per_token = rotary_rows is not None and per_token_positions
    key = tuple(None if t is None else True for t in (seqlens_t, cache_leftpad, cache_batch_idx,
                                                       block_table))
    params = (key, None if seqlens_t is not None else cache_seqlens, capacity, seqlen_new,
              page_size, num_pages, b_cache, sq, rotary_rows if per_token else None)
    if _values_checked_before("kvcache", tensors, params):
        return

    b = q.shape[0]
    device = tensors[0].device
    i64 = torch.int64
    if seqlens_t is not None:
        before = seqlens_t.to(i64)
    else:  # an int, or None: every cache full (no append then)
        before = torch.full((b,), capacity if cache_seqlens is None else int(cache_seqlens),
                            dtype=i64, device=device)
    total = before + seqlen_new
    leftpad = cache_leftpad.to(i64) if cache_leftpad is not None else torch.zeros_like(before)
    stats = [before.min(), total.max(), leftpad.min(), (leftpad - before).max()]
    if cache_batch_idx is not None:
        idx = cache_batch_idx.to(i64)
        stats += [idx.min(), idx.max()]
    if paged and block_table.shape[1] > 0:
        # Pages that hold a visible key of sequence b: [leftpad // P, ceil(total / P)).
        page = torch.arange(block_table.shape[1], device=device).unsqueeze(0)
        used = (page >= (leftpad // page_size).unsqueeze(1)) & \
            (page < ((total + page_size - 1) // page_size).unsqueeze(1))
        entries = block_table.to(i64)
        bad = used & ((entries < 0) | (entries >= num_pages))
        stats.append(bad.sum())
    values = torch.stack([s.to(i64) for s in stats]).tolist()

    min_before, max_total, min_leftpad, max_over = values[:4]
    rest = values[4:]
    if min_before < 0:
        raise FlashExtValueError(
            f"{name}: cache_seqlens must be >= 0; got "
            f"{_first_bad('cache_seqlens', seqlens_t, before < 0)}")
    if max_total > capacity:
        raise FlashExtValueError(
            f"{name}: cache_seqlens + seqlen_new must be at most the cache capacity "
            f"({capacity}); with seqlen_new = {seqlen_new}, got "
            f"{_first_bad('cache_seqlens', seqlens_t, total > capacity)}. Nothing was written.")
    if min_leftpad < 0:
        raise FlashExtValueError(
            f"{name}: cache_leftpad must be >= 0; got "
            f"{_first_bad('cache_leftpad', cache_leftpad, leftpad < 0)}")
    if max_over > 0:
        raise FlashExtValueError(
            f"{name}: cache_leftpad must be at most cache_seqlens (the first valid slot cannot "
            f"lie past the last); got "
            f"{_first_bad('cache_leftpad', cache_leftpad, leftpad > before)} with cache_seqlens "
            f"{before.tolist()}")
    if cache_batch_idx is not None:
        idx_min, idx_max = rest[:2]
        rest = rest[2:]
        if idx_min < 0 or idx_max >= b_cache:
            raise FlashExtValueError(
                f"{name}: cache_batch_idx must lie in [0, batch_cache = {b_cache}); got "
                f"{_first_bad('cache_batch_idx', cache_batch_idx, (idx < 0) | (idx >= b_cache))}")
    if rest and rest[0] > 0:
        where = bad.nonzero()[0].tolist()
        raise FlashExtValueError(
            f"{name}: block_table entries of the pages in use must lie in [0, num_pages = "
            f"{num_pages}); got block_table[{where[0]}, {where[1]}] = "
            f"{int(block_table[where[0], where[1]])} ({rest[0]} bad entries)")
    if per_token and max(before.tolist()) + sq > rotary_rows:
        raise FlashExtValueError(
            f"{name}: with causal or local attention, query token t is rotated at position "
            f"cache_seqlens + t, so cache_seqlens + seqlen_q ({sq}) must be at most "
            f"rotary_cos.shape[0] ({rotary_rows}); got cache_seqlens {before.tolist()}")
    _remember_values_checked("kvcache", tensors, params)


def _first_bad(arg: str, t: torch.Tensor, bad: torch.Tensor) -> str:
    """'arg[i] = value' for the first offending entry (an error path: syncs freely)."""
    i = int(bad.nonzero()[0, 0])
    return f"{arg}[{i}] = {int(t[i])}"


# ----------------------------------------------------------------------------------------------
# flash_ext.flash_attn_varlen_func with block_table (prefill against a paged cache)
# ----------------------------------------------------------------------------------------------


def check_paged_varlen_inputs(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, block_table, seqused_k=None, softmax_scale=None,
                              window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                              require_cuda: bool = True) -> None:
    """The checks of a varlen call whose k and v are paged caches (num_pages, page_size,
    nheads_k, headdim) read through block_table (batch, max_pages_per_seq): attn_fwd's checks
    as they apply to q, the caches and the scalars; block_table as flash_attn_with_kvcache checks
    it, but with any page size >= 1; seqused_k int32 (batch,); max_seqlen_k at most the capacity
    max_pages_per_seq * page_size. Then the value checks, under the cu_seqlens
    policy (module docstring): cu_seqlens_q as attn_fwd checks it, and
    :func:`check_paged_varlen_values`."""
    name = _kv_name(fn)
    check_dropout(dropout_p)
    check_devices({"q": q, "k": k_cache, "v": v_cache, "cu_seqlens_q": cu_seqlens_q,
                   "cu_seqlens_k": cu_seqlens_k, "block_table": block_table,
                   "seqused_k": seqused_k}, require_cuda=require_cuda,
                  required=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "block_table"))
    check_dtypes(q, k_cache, v_cache)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    if q.dim() != 3:
        raise FlashExtValueError(
            f"{name}: q must be 3-D (total_q, nheads, headdim); got shape {_shape(q)}")
    for arg, t in (("k", k_cache), ("v", v_cache)):
        if t.dim() != 4:
            raise FlashExtValueError(
                f"{name}: with block_table, {arg} must be a paged cache, 4-D (num_pages, "
                f"page_size, nheads_k, headdim); got shape {_shape(t)}")
    if k_cache.shape != v_cache.shape:
        raise FlashExtValueError(
            f"{name}: k and v must have the same shape; got k {_shape(k_cache)} and v "
            f"{_shape(v_cache)}")
    batch = cu_seqlens_q.shape[0] - 1
    capacity = check_block_table(fn, block_table, batch, k_cache, 1)
    # q against the caches' rows (num_pages, nheads_k, headdim): attn_fwd's rules (head dim,
    # heads, contiguous last dim). page_size >= 1 here.
    check_qkv_shapes(q, k_cache[:, 0], v_cache[:, 0], varlen=True)
    if seqused_k is not None:
        check_seqused_k(seqused_k, True, cu_seqlens_k)
    check_max_seqlen(max_seqlen_q, max_seqlen_k, True)
    if max_seqlen_k > capacity:
        raise FlashExtValueError(
            f"{name}: max_seqlen_k ({max_seqlen_k}) must be at most what block_table can "
            f"address: max_pages_per_seq * page_size = {block_table.shape[1]} * "
            f"{k_cache.shape[1]} = {capacity}")
    check_softmax_scale(softmax_scale)
    check_softcap(softcap)
    check_window_size(window_size)
    total_q = q.shape[0]
    if should_check_values(cu_seqlens_q) and not _checked_before(cu_seqlens_q, total_q,
                                                                  max_seqlen_q):
        check_cu_seqlens_values(cu_seqlens_q, total_q, max_seqlen_q, "cu_seqlens_q")
        _remember_checked(cu_seqlens_q, total_q, max_seqlen_q)
    tensors = (cu_seqlens_k, block_table) + ((seqused_k,) if seqused_k is not None else ())
    params = (int(max_seqlen_k), k_cache.shape[0], k_cache.shape[1])
    if should_check_values(cu_seqlens_k) and not _values_checked_before("paged_varlen", tensors,
                                                                        params):
        check_paged_varlen_values(fn, cu_seqlens_k, block_table, seqused_k, max_seqlen_k,
                                  k_cache.shape[0], k_cache.shape[1])
        _remember_values_checked("paged_varlen", tensors, params)


def check_paged_varlen_values(fn, cu_seqlens_k, block_table, seqused_k, max_seqlen_k: int,
                              num_pages: int, page_size: int) -> None:
    """Each sequence's key count (seqused_k[b] if given, else cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]) in [0, max_seqlen_k], and the block_table entries of the pages that hold
    those keys in [0, num_pages). One device computation and one ``.tolist()``."""
    name = _kv_name(fn)
    i64 = torch.int64
    device = block_table.device
    cu = cu_seqlens_k.to(device, i64)
    steps = cu[1:] - cu[:-1]
    counts = seqused_k.to(device, i64) if seqused_k is not None else steps
    pages_used = (counts.clamp(min=0) + page_size - 1) // page_size
    column = torch.arange(block_table.shape[1], device=device).unsqueeze(0)
    entries = block_table.to(i64)
    bad = (column < pages_used.unsqueeze(1)) & ((entries < 0) | (entries >= num_pages))
    min_step, min_count, max_count, n_bad = torch.stack(
        [steps.min(), counts.min(), counts.max(), bad.sum()]).tolist()
    if min_step < 0:
        raise FlashExtValueError(
            f"{name}: cu_seqlens_k must be non-decreasing; got {cu_seqlens_k.tolist()}")
    what = "seqused_k" if seqused_k is not None else "the key count of a sequence"
    if min_count < 0:
        raise FlashExtValueError(f"{name}: seqused_k must be >= 0; got {seqused_k.tolist()}")
    if max_count > max_seqlen_k:
        raise FlashExtValueError(
            f"{name}: max_seqlen_k ({max_seqlen_k}) is smaller than {what} ({max_count})")
    if n_bad > 0:
        where = bad.nonzero()[0].tolist()
        raise FlashExtValueError(
            f"{name}: block_table entries of the pages in use must lie in [0, num_pages = "
            f"{num_pages}); got block_table[{where[0]}, {where[1]}] = "
            f"{int(block_table[where[0], where[1]])} ({n_bad} bad entries)")


# ----------------------------------------------------------------------------------------------
# flashmask_attention (flash_ext/flashmask.py; docs/design-flashmask.md 9.3)
# ----------------------------------------------------------------------------------------------

_FM_NAMES = {(True, 1): ("LTS",), (True, 2): ("LTS", "LTE"), (False, 2): ("LTS", "UTE"),
             (False, 4): ("LTS", "LTE", "UTS", "UTE")}


def check_flashmask_inputs(fn: str, startend_row_indices, q: torch.Tensor, k: torch.Tensor,
                           causal, varlen: bool, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """The bounds of a FlashMask call, after the checks of q, k, v (and cu_seqlens): int32;
    (batch, hm, seqlen_k, C), or varlen (hm, total_k, C), with batch and seqlen_k (total_k)
    those of k and hm 1 or k's heads; C 1 or 2 with causal=True, 2 or 4 with causal=False; on
    q's device; last dim contiguous. Then, where :func:`should_check_values` allows (policy of
    the module docstring, switch ``FLASH_EXT_CHECK_FLASHMASK``), once per (tensor, version):
    every bound in [0, seqlen_q] (varlen: the column's sequence's seqlen_q), LTS <= LTE and
    UTS <= UTE."""
    name = "startend_row_indices"
    if not isinstance(causal, bool):
        raise FlashExtTypeError(f"flash_ext.{fn}: causal must be a bool; got "
                                f"{type(causal).__name__}")
    t = startend_row_indices
    if not isinstance(t, torch.Tensor):
        raise FlashExtTypeError(f"flash_ext.{fn}: {name} must be a torch.Tensor; got "
                                f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise FlashExtTypeError(f"flash_ext.{fn}: {name} must be int32; got "
                                f"{_dtype_name(t.dtype)}")
    hkv = k.shape[-2]
    if varlen:
        layout, expect = "(nheads_mask, total_k, C)", (None, k.shape[0])
    else:
        layout, expect = "(batch, nheads_mask, seqlen_k, C)", (k.shape[0], None, k.shape[1])
    if t.dim() != len(expect) + 1:
        raise FlashExtValueError(
            f"flash_ext.{fn}: {name} must be {len(expect) + 1}-D {layout}; got shape {_shape(t)}")
    if not varlen and t.shape[0] != k.shape[0]:
        raise FlashExtValueError(
            f"flash_ext.{fn}: {name} must have k's batch size ({k.shape[0]}); got shape "
            f"{_shape(t)}")
    cols, what = (k.shape[0], "total_k") if varlen else (k.shape[1], "seqlen_k")
    if t.shape[-2] != cols:
        raise FlashExtValueError(
            f"flash_ext.{fn}: {name} must have one row per key column ({what} = {cols}); got "
            f"shape {_shape(t)}")
    hm = t.shape[-3]
    if hm not in (1, hkv):
        raise FlashExtValueError(
            f"flash_ext.{fn}: {name} must have 1 or nheads_kv ({hkv}) mask heads; got {hm} "
            f"(shape {_shape(t)})")
    c = t.shape[-1]
    if (causal, c) not in _FM_NAMES:
        if c in (1, 2, 4):
            need = "causal=False" if causal else "causal=True"
            raise FlashExtValueError(
                f"flash_ext.{fn}: {name} has C = {c}, which needs {need} (causal: C = 1 (LTS) "
                f"or 2 (LTS, LTE); non-causal: C = 2 (LTS, UTE) or 4 (LTS, LTE, UTS, UTE))")
        raise FlashExtValueError(
            f"flash_ext.{fn}: {name} must have C = 1 or 2 (causal) or 2 or 4 (non-causal) "
            f"bounds per column; got C = {c} (shape {_shape(t)})")
    if t.device != q.device:
        raise DeviceError(f"flash_ext.{fn}: {name} must be on q's device ({q.device}); got "
                          f"{t.device}")
    if t.stride(-1) != 1 and c != 1:
        raise FlashExtValueError(
            f"flash_ext.{fn}: the last dimension of {name} must be contiguous (stride 1); got "
            f"strides {tuple(t.stride())}")
    if t.numel() == 0 or not should_check_values(t, CHECK_FLASHMASK_VALUES):
        return
    if varlen:  # the per-sequence limits come from cu_seqlens (tensors: identity + version)
        tensors, params = (t, cu_seqlens_q, cu_seqlens_k), (causal,)
    else:
        tensors, params = (t,), (causal, q.shape[1])
    if _values_checked_before("flashmask", tensors, params):
        return
    _check_flashmask_values(fn, t, q, causal, varlen, cu_seqlens_q, cu_seqlens_k)
    _remember_values_checked("flashmask", tensors, params)


def _check_flashmask_values(fn, t, q, causal, varlen, cu_seqlens_q, cu_seqlens_k) -> None:
    """One small device computation and one .tolist(): the value rules of
    :func:`check_flashmask_inputs`."""
    names = _FM_NAMES[(causal, t.shape[-1])]
    v = t.to(torch.int64)
    if varlen:  # each column's own sequence's seqlen_q
        cu_k = cu_seqlens_k.to(v.device, torch.int64)
        cu_q = cu_seqlens_q.to(v.device, torch.int64)
        col = torch.arange(t.shape[1], device=v.device)
        seq = torch.searchsorted(cu_k[1:], col, right=True).clamp(max=cu_q.numel() - 2)
        sq = (cu_q[1:] - cu_q[:-1])[seq].view(1, -1, 1)
    else:
        sq = torch.tensor(q.shape[1], device=v.device)
    bad_range = (v < 0) | (v > sq)
    stats = [bad_range.sum()]
    pairs = [(0, 1)] if len(names) == 2 and names[1] == "LTE" else []
    if len(names) == 4:
        pairs = [(0, 1), (2, 3)]
    for s, e in pairs:
        stats.append((v[..., s] > v[..., e]).sum())
    counts = torch.stack(stats).tolist()
    if counts[0]:
        where = bad_range.nonzero()[0].tolist()
        value = int(t[tuple(where)])
        limit = f"seqlen_q = {q.shape[1]}" if not varlen else \
            f"its sequence's seqlen_q = {int(sq.reshape(-1)[where[1]])}"
        raise FlashExtValueError(
            f"flash_ext.{fn}: startend_row_indices must lie in [0, seqlen_q]; got "
            f"{names[where[-1]]} = {value} at {tuple(where[:-1])} ({limit}; {counts[0]} bad "
            f"values)")
    for (s, e), n in zip(pairs, counts[1:]):
        if n:
            where = (v[..., s] > v[..., e]).nonzero()[0].tolist()
            idx = tuple(where)
            raise FlashExtValueError(
                f"flash_ext.{fn}: startend_row_indices must have {names[s]} <= {names[e]}; got "
                f"{names[s]} = {int(t[idx + (s,)])} > {names[e]} = {int(t[idx + (e,)])} at "
                f"{idx} ({n} columns)")
