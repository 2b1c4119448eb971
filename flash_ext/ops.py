"""The compiled ops, their fake (meta) kernels and their autograd registration.

Importing ``flash_ext._C`` registers, in C++ (csrc/ops_*.cpp):

    torch.ops.flash_ext.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap,
                            dropout_p=0.0, rng_state=None, deterministic=False,
                            startend_row_indices=None, seqused_k=None, alibi_slopes=None) -> (out, lse)
    torch.ops.flash_ext.fwd_out(q, k, v, out, cu_seqlens_q, ...as fwd, without
                            deterministic...) -> lse   (writes out)

``seqused_k`` (varlen only, int32 (batch,) on q's device, no backward): sequence b uses only
its first seqused_k[b] keys, 0 <= seqused_k[b] <= cu_seqlens_k[b+1] - cu_seqlens_k[b]; causal
and local masks align bottom-right to that length (FlashAttention-3's meaning). The autograd
kernel refuses it when a graph would be recorded (no backward reads it); flash_ext's functions
call the op without recording then, and give the output a node whose backward raises
(flash_ext/forward_only.py).
    torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, window_left, window_right,
                            softcap, deterministic, dropout_p=0.0, rng_state=None,
                            startend_row_indices=None, alibi_slopes=None) -> (dq, dk, dv)
    torch.ops.flash_ext.flashmask_summary(startend_row_indices, seqlen_q, seqlen_k,
                            cu_seqlens_k, causal, block_n) -> (nb, kbs)   (FlashMask's kernel A
                            alone, tests only: :data:`_flashmask_summary`)
    torch.ops.flash_ext.dropout_rng_state(q) -> rng_state   (int64 CPU [seed, offset]; draws
                            from the CUDA generator of q's device)
    torch.ops.flash_ext.dropout_mask(q, rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p)
                            -> bool (batch, heads, seqlen_q, seqlen_k) keep mask (tests only)
    torch.ops.flash_ext.build_info() -> str
    torch.ops.flash_ext.kvcache_append(k_cache, v_cache, k, v, ...) -> ()   (writes the caches)
    torch.ops.flash_ext.fwd_kvcache(q, k_cache, v_cache, ...) -> (out, lse)
                            (the two KV-cache ops: their contract is in :data:`_kvcache_append`
                            and :data:`_fwd_kvcache` below)

``startend_row_indices`` (FlashMask's column-wise row bounds, docs/design-flashmask.md; int32
(batch, hm, seqlen_k, C) or varlen (hm, total_k, C)): the op's ``causal`` is FlashMask's causal
flag, the window must be (-1, -1) (or the causal (-1, 0)) and dropout_p 0. The autograd formula
passes the forward's bounds to ``bwd``. The ops check the structure again; the values are
checked by flash_ext's Python layer.

``fwd`` is the one differentiable op. Its ``deterministic`` argument is ignored by the forward
kernel: it is there so that the backward's flag is an argument of the op that the autograd graph
(and a torch.compile graph) records.

Dropout (dropout_p > 0): the mask is a function of rng_state and (batch, head, row, col) only
(csrc/common/dropout.h), so fwd and bwd given the same rng_state agree; rng_state is an input of
the attention ops, drawn beforehand by dropout_rng_state (tagged nondeterministic_seeded, so that
compilers neither merge nor drop it; the attention ops themselves stay pure functions).

This module adds, in Python:

- fake kernels for fwd, fwd_out, bwd and the dropout ops (what torch.compile needs: shapes,
  dtypes and strides of the outputs, without running anything);
- :func:`_no_attention`: the result of a call with no query row or no key (out 0, lse -inf,
  zero gradients), made without a launch and still differentiable.

The autograd formula of ``fwd`` is its Autograd-key kernel in C++ (csrc/ops_autograd.cpp), so
that a training step's backward runs no Python: it saves q, k, v, out, lse (and rng_state); the
backward calls ``bwd`` with the same deterministic, dropout_p and rng_state. ``lse`` is
non-differentiable (like FlashAttention, no gradient flows through it); gradients with respect
to softmax_scale and softcap are not computed (they are plain floats). ``fwd_out`` is not
differentiable (flash_ext.attn_fwd rejects out= with inputs that require grad, with a clear
error). Without the build, the CPU tests' stand-in ops register the same formula in Python
(tests/stand_in_ops.py).

The ops take inputs already prepared by flash_ext.attn_fwd / attn_bwd (head dim a multiple of
8, strides multiples of 8); call those, not these, unless you know the contract
(docs/architecture.md).
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

__all__ = ["_fwd", "_fwd_out", "_no_attention", "_bwd", "_dropout_rng_state",
           "_dropout_mask", "_kvcache_append", "_fwd_kvcache", "_flashmask_summary",
           "build_info"]

# The ops need 16-byte aligned rows: every stride but the last, and the storage offset, a
# multiple of 8 elements (fp16/bf16); and the head dim a multiple of 8.
_ALIGN = 8


def _is_aligned(t: torch.Tensor) -> bool:
    # On every call's path (three or five times per call): a plain loop, no generator.
    strides = t.stride()
    if strides[-1] != 1:
        return False
    # Dynamo cannot trace storage_offset(); under torch.compile the C++ op's own check of the
    # data pointer's alignment is the safety net for (rare) odd offsets.
    if not torch.compiler.is_compiling() and t.storage_offset() % _ALIGN != 0:
        return False
    for s in strides[:-1]:
        if s % _ALIGN != 0:
            return False
    return True


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself if the op can read it in place, else a fresh row-major copy. (clone with
    contiguous_format, not .contiguous(): the latter keeps odd strides of size-1 dims.)"""
    return t if _is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def _lse_shape(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]):
    if cu_seqlens_q is not None:  # varlen: q (total_q, hq, d) -> lse (hq, total_q)
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])  # q (b, sq, hq, d) -> lse (b, hq, sq)


def _nothing_to_do(q: torch.Tensor, k: torch.Tensor, varlen: bool, max_seqlen_q: int,
                   max_seqlen_k: int) -> bool:
    """No query row, or no key at all (then every row sees nothing: out 0, lse -inf, zero
    gradients). Nothing is launched for such calls."""
    if varlen:
        return q.shape[0] == 0 or max_seqlen_q == 0 or k.shape[0] == 0 or max_seqlen_k == 0
    return q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0


# ----------------------------------------------------------------------------------------------
# Fake kernels. The real fwd allocates out contiguous with q's shape and dtype (whatever q's
# strides) and lse contiguous float32; the real bwd returns new contiguous dq, dk, dv shaped
# like q, k, v in q's dtype. These must describe exactly that (new_empty(shape) is contiguous;
# empty_like would copy the strides of a strided q).
# ----------------------------------------------------------------------------------------------


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_left, window_right, softcap, dropout_p=0.0, rng_state=None,
              deterministic=False, startend_row_indices=None, seqused_k=None, alibi_slopes=None):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_ext::fwd_out")
def _fwd_out_fake(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0,
                  rng_state=None, startend_row_indices=None, seqused_k=None, alibi_slopes=None):
    return q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.register_fake("flash_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, deterministic,
              dropout_p=0.0, rng_state=None, startend_row_indices=None, alibi_slopes=None):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


_FM_CHUNK = 128  # FlashMask: nb's column padding (csrc/common/flashmask.h)


def _flashmask_summary_shapes(startend_row_indices, seqlen_k: int, cu_seqlens_k, block_n: int):
    """Shapes of flashmask_summary's (nb, kbs): (hm, cols, 4) and (hm, blocks, 2, 4), in the
    layout of csrc/common/flashmask.h."""
    hm = startend_row_indices.shape[-3]
    if cu_seqlens_k is not None:
        batch = cu_seqlens_k.shape[0] - 1
        total_k = startend_row_indices.shape[1]
        cols = total_k + _FM_CHUNK * batch
        blocks = total_k // block_n + batch + 1
    else:
        batch = startend_row_indices.shape[0]
        sk_pad = (seqlen_k + _FM_CHUNK - 1) // _FM_CHUNK * _FM_CHUNK
        cols = batch * sk_pad
        blocks = batch * (sk_pad // block_n)
    return (hm, cols, 4), (hm, blocks, 2, 4)


_HAS_FLASHMASK_SUMMARY = hasattr(torch.ops.flash_ext, "flashmask_summary")

if _HAS_FLASHMASK_SUMMARY:
    @torch.library.register_fake("flash_ext::flashmask_summary")
    def _flashmask_summary_fake(startend_row_indices, seqlen_q, seqlen_k, cu_seqlens_k, causal,
                                block_n):
        nb_shape, kbs_shape = _flashmask_summary_shapes(startend_row_indices, seqlen_k,
                                                        cu_seqlens_k, block_n)
        return (startend_row_indices.new_empty(nb_shape, dtype=torch.int32),
                startend_row_indices.new_empty(kbs_shape, dtype=torch.int32))


@torch.library.register_fake("flash_ext::dropout_rng_state")
def _dropout_rng_state_fake(q):
    return torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.register_fake("flash_ext::dropout_mask")
def _dropout_mask_fake(q, rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
    return q.new_empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool)


# The KV-cache ops (docs/design-flash-decoding.md 3.2). A build older than them has neither:
# then flash_attn_with_kvcache raises a clear error (:func:`_kvcache_ops_missing`) instead of
# the import failing.
_HAS_KVCACHE_OPS = hasattr(torch.ops.flash_ext, "kvcache_append") and \
    hasattr(torch.ops.flash_ext, "fwd_kvcache")

if _HAS_KVCACHE_OPS:
    @torch.library.register_fake("flash_ext::kvcache_append")
    def _kvcache_append_fake(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                             cache_seqlen, cache_batch_idx, cache_leftpad, block_table,
                             rotary_interleaved):
        return None

    @torch.library.register_fake("flash_ext::fwd_kvcache")
    def _fwd_kvcache_fake(q, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens,
                          cache_seqlen, seqlen_new, cache_batch_idx, cache_leftpad, block_table,
                          alibi_slopes, softmax_scale, causal, window_left, window_right,
                          softcap, rotary_interleaved, num_splits):
        b, sq, hq, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Calls with nothing to compute
# ----------------------------------------------------------------------------------------------


def _no_attention(q, k, v, cu_seqlens_q, out=None):
    """(out, lse) of a call for which :func:`_nothing_to_do` holds, made without a launch: out 0
    (q's shape and dtype, contiguous; or ``out`` zeroed), lse -inf (float32).

    Differentiable, with zero gradients, when q, k or v requires grad: out is then a broadcast
    of the sum of an empty slice of each input, which is exactly 0 whatever their values and has
    zero gradients; plain tensor ops, so that autograd and torch.compile need nothing more (an
    autograd.Function would break torch.compile's graph when k and v are one tensor)."""
    lse = torch.full(_lse_shape(q, cu_seqlens_q), float("-inf"), dtype=torch.float32,
                     device=q.device)
    if out is not None:  # never differentiable (attn_fwd's checks)
        return out.zero_(), lse
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        zero = q.narrow(-1, 0, 0).sum() + k.narrow(-1, 0, 0).sum() + v.narrow(-1, 0, 0).sum()
        return zero.expand(q.shape).clone(memory_format=torch.contiguous_format), lse
    return torch.zeros(q.shape, dtype=q.dtype, device=q.device), lse


# ----------------------------------------------------------------------------------------------
# Thin wrappers
# ----------------------------------------------------------------------------------------------


# The ops' overloads themselves, not Python functions that forward to them: one Python frame
# less on every call's path (each costs about a microsecond of host time).

_fwd = torch.ops.flash_ext.fwd.default
"""torch.ops.flash_ext.fwd (differentiable): (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0,
rng_state=None, deterministic=False, seqused_k=None) -> (out, lse). Callers pass seqused_k by
keyword."""

_fwd_out = torch.ops.flash_ext.fwd_out.default
"""torch.ops.flash_ext.fwd_out: as _fwd with out after v (written) and without deterministic;
returns lse."""

_bwd = torch.ops.flash_ext.bwd.default
"""torch.ops.flash_ext.bwd: (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic,
dropout_p=0.0, rng_state=None, startend_row_indices=None, alibi_slopes=None) -> (dq, dk, dv), new contiguous
tensors."""


def _flashmask_summary_missing(*args, **kwargs):
    raise RuntimeError(
        "flash_ext: this build of flash_ext._C has no flash_ext::flashmask_summary op: it "
        "predates FlashMask. Rebuild the extension (pip install .) from this source tree.")


_flashmask_summary = (torch.ops.flash_ext.flashmask_summary.default if _HAS_FLASHMASK_SUMMARY
                      else _flashmask_summary_missing)
"""torch.ops.flash_ext.flashmask_summary: (startend_row_indices, seqlen_q, seqlen_k,
cu_seqlens_k, causal, block_n) -> (nb, kbs). FlashMask's kernel A alone (tests): nb int32
(hm, cols, 4) holds (ls, le - ls, us, ue - us) per column and kbs int32 (hm, blocks, 2, 4) the
key-block summaries (skip half, full half), laid out as csrc/common/flashmask.h says (cols =
varlen ? total_k + 128 * batch : batch * round_up(seqlen_k, 128); blocks = varlen ?
total_k // block_n + batch + 1 : batch * round_up(seqlen_k, 128) // block_n). seqlen_q: the
query rows (varlen: the longest sequence's); seqlen_k: the key columns (varlen: the longest
sequence's); block_n: 32, 64 or 128. Slots the layout leaves unused are not written."""


def _kvcache_ops_missing(*args, **kwargs):
    raise RuntimeError(
        "flash_ext: this build of flash_ext._C has no KV-cache ops (flash_ext::kvcache_append, "
        "flash_ext::fwd_kvcache): it predates flash_attn_with_kvcache. Rebuild the extension "
        "(pip install .) from this source tree.")


_kvcache_append = (torch.ops.flash_ext.kvcache_append.default if _HAS_KVCACHE_OPS
                   else _kvcache_ops_missing)
"""torch.ops.flash_ext.kvcache_append: (k_cache, v_cache, k, v, rotary_cos, rotary_sin,
cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_interleaved)
-> None. Writes the new tokens into the caches in place (the op's only effect).

The contract (flash_ext.flash_attn_with_kvcache checks every rule below before the call; the C++
op checks its own contract again; b = batch, P = page size):

- k_cache, v_cache: contiguous caches (b_cache, s_cache, hkv, d), or paged (num_pages, P, hkv, d)
  when block_table is given; one shape, strides of their own, last dim contiguous, rows 16-byte
  aligned, q's dtype. Capacity per sequence: s_cache, or block_table.size(1) * P.
- k, v: (b, s_new, hkv, d), s_new >= 1, last dim contiguous, rows 16-byte aligned.
- Where sequence b's new token t goes: slot n = L0[b] + t, where L0[b] (the tokens already in
  the cache) is cache_seqlens[b] when that int32 (b,) tensor is given (then cache_seqlen is -1),
  else cache_seqlen (an int >= 0, the same for every sequence; never -1 here: an append needs
  the lengths). Slot n of sequence b is row n of k_cache[cache_batch_idx[b]] (or
  k_cache[b] without cache_batch_idx), or with block_table row n % P of page
  block_table[b, n // P]. L0[b] + s_new <= capacity.
- rotary_cos, rotary_sin (both or neither): (seqlen_ro, rd / 2) in q's dtype, rows contiguous
  (the row stride is honoured), rd = 2 * rotary_cos.size(1), rd % 16 == 0, rd <= d, seqlen_ro
  >= capacity. Then the first rd columns of k's token t are rotated at position L0[b] + t in
  fp32 and rounded to the cache dtype; rotary_interleaved pairs columns (2i, 2i+1), else (i, i +
  rd / 2), both with cos/sin column i. v is copied as is.
- cache_leftpad (int32 (b,) or None): not needed by the append (slots and rotary positions are
  absolute); passed so that the op sees the call's whole layout.
- cache_batch_idx is never given together with block_table.
"""

_fwd_kvcache = (torch.ops.flash_ext.fwd_kvcache.default if _HAS_KVCACHE_OPS
                else _kvcache_ops_missing)
"""torch.ops.flash_ext.fwd_kvcache: (q, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens,
cache_seqlen, seqlen_new, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits) ->
(out, lse). Reads the caches (after kvcache_append, when there was one); no autograd.

The contract, as for :data:`_kvcache_append` (layouts of the caches, cache_batch_idx,
block_table, rotary tables), plus:

- q: (b, sq, hq, d), b >= 1, sq >= 1, hq a multiple of hkv, d a multiple of 8 and <= 256, last
  dim contiguous, rows 16-byte aligned.
- Keys of sequence b: L[b] = L0[b] + seqlen_new slots, with L0[b] = cache_seqlens[b] (int32
  (b,) tensor given; then cache_seqlen is -1), or cache_seqlen (>= 0) when the tensor is None,
  or the capacity when cache_seqlens is None and cache_seqlen is -1 (then seqlen_new is 0).
  seqlen_new is the number of tokens kvcache_append has just written (0 if none): the
  cache_seqlens tensor holds the lengths before the append and is not updated by either op.
  Visible are the slots [cache_leftpad[b], L[b]) (cache_leftpad None: from 0). Key slot j is
  addressed as in the append.
- rotary_cos, rotary_sin given: the first rd columns of q are rotated (fp32, rounded to q's
  dtype, pairing by rotary_interleaved) at position L0[b] + t for query token t when causal
  or window_left >= 0 or window_right >= 0, else at L0[b] for every token. Positions are
  absolute slot indices (cache_leftpad does not shift them); L0[b] + sq <= seqlen_ro then.
- Scores of query token t (head h) and key slot j: s = softmax_scale * q.k; then, if softcap >
  0, s = softcap * tanh(s / softcap); then, with alibi_slopes (fp32 (hq,) or (b, hq)),
  s -= slope[b, h] * |t + L[b] - sq - j|; then the mask: with window_left >= 0 keep
  j >= t + L[b] - sq - window_left, with window_right >= 0 keep j <= t + L[b] - sq +
  window_right (bottom-right aligned to L[b]; causal comes with window_right = 0, already
  set by the caller).
- softmax_scale: the final scale (the caller resolves None to 1 / sqrt(d)); softcap <= 0 is
  off (the caller passes 0.0).
- num_splits: 0 = chosen by the op's heuristic, N >= 1 = N splits (capped at 128); the
  results agree within rounding for every value.
- Returns out (b, sq, hq, d) in q's dtype and lse (b, hq, sq) float32 (natural log), both new
  and contiguous. A query row with no visible key gets out 0 and lse -inf (never NaN).
"""


def _dropout_rng_state(q) -> torch.Tensor:
    """A fresh dropout rng state, int64 CPU [seed, offset], from the default CUDA generator of
    q's device (advances it: each call gives a different mask; torch.manual_seed reproduces)."""
    return torch.ops.flash_ext.dropout_rng_state(q)


def _dropout_mask(q, rng_state, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                  dropout_p: float) -> torch.Tensor:
    """The kernels' keep mask, bool (batch, heads, seqlen_q, seqlen_k) on q's device."""
    return torch.ops.flash_ext.dropout_mask(q, rng_state, batch, heads, seqlen_q, seqlen_k,
                                            dropout_p)


def build_info() -> str:
    """What the extension was built for, e.g. "archs=80+PTX;90a hdims=... dtypes=fp16,bf16"."""
    return torch.ops.flash_ext.build_info()
