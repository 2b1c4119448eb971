"""The compiled extension's op schemas, registered from Python, for CPU test runs on a checkout
where flash_ext._C is not built.

Importing flash_ext needs the ``flash_ext::*`` ops that ``flash_ext._C`` registers in C++
(csrc/ops_*.cpp). Without a build, tests/conftest.py calls
:func:`install` before any test imports flash_ext: it defines the same schemas under the same
namespace, with no kernel behind them (flash_ext/ops.py adds the fake kernels as it does for the
real ops), registers fwd's autograd formula (in the build a C++ kernel, csrc/ops_autograd.cpp;
here the same formula in Python, :func:`_fwd_setup_context` and :func:`_fwd_backward`), and puts
an empty module in ``sys.modules`` as ``flash_ext._C``. The CPU tests (fake and meta tensors, torch.compile tracing, the wiring of the
Python layer) then run against these schemas; whatever needs the kernels is skipped
(conftest's ``requires_ext`` and ``requires_cuda``). With a build, none of this is used.

Keep the schemas equal to the C++ ones: test_ops.py and test_autograd.py check the important
parts of the real schemas when the extension is built.
"""

from __future__ import annotations

import sys
import types

import torch

BUILD_INFO = "stand-in: flash_ext._C is not built (tests/stand_in_ops.py)"

SCHEMAS = (
    ("fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
     "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, "
     "int window_right, float softcap, float dropout_p=0.0, Tensor? rng_state=None, "
     "bool deterministic=False, Tensor? startend_row_indices=None, Tensor? seqused_k=None, "
     "Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)", ()),
    ("fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? cu_seqlens_q, "
     "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
     "bool causal, int window_left, int window_right, float softcap, float dropout_p=0.0, "
     "Tensor? rng_state=None, Tensor? startend_row_indices=None, Tensor? seqused_k=None, "
     "Tensor? alibi_slopes=None) -> Tensor", ()),
    ("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
     "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
     "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
     "bool deterministic, float dropout_p=0.0, Tensor? rng_state=None, "
     "Tensor? startend_row_indices=None, Tensor? alibi_slopes=None) "
     "-> (Tensor dq, Tensor dk, Tensor dv)", ()),
    ("flashmask_summary(Tensor startend_row_indices, int seqlen_q, int seqlen_k, "
     "Tensor? cu_seqlens_k, bool causal, int block_n) -> (Tensor nb, Tensor kbs)", ()),
    ("flashmask_kept_pairs(Tensor startend_row_indices, int seqlen_q, int seqlen_k, "
     "bool causal) -> (Tensor pairs, Tensor sum_sq, Tensor longest_first)", ()),
    ("flashmask_fwd_tiles(Tensor startend_row_indices, int seqlen_q, int seqlen_k, bool causal, "
     "int block_m, int block_n) -> (Tensor range, Tensor order)", ()),
    ("dropout_rng_state(Tensor q) -> Tensor", (torch.Tag.nondeterministic_seeded,)),
    ("dropout_mask(Tensor q, Tensor rng_state, int batch, int heads, int seqlen_q, "
     "int seqlen_k, float dropout_p) -> Tensor", ()),
    ("build_info() -> str", ()),
    ("kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
     "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, "
     "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
     "bool rotary_interleaved) -> ()", ()),
    ("fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rotary_cos, "
     "Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, int seqlen_new, "
     "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
     "Tensor? alibi_slopes, float softmax_scale, bool causal, int window_left, "
     "int window_right, float softcap, bool rotary_interleaved, int num_splits) "
     "-> (Tensor out, Tensor lse)", ()),
)

_lib = None

# ----------------------------------------------------------------------------------------------
# fwd's autograd formula: csrc/ops_autograd.cpp in Python, rule for rule
# ----------------------------------------------------------------------------------------------

_ALIGN = 8  # elements: the ops read rows of 16 bytes


def _rows_aligned(t: torch.Tensor) -> bool:
    if t.stride(-1) != 1:
        return False
    if not torch.compiler.is_compiling() and t.storage_offset() % _ALIGN != 0:
        return False
    return all(s % _ALIGN == 0 for s in t.stride()[:-1])


def _nothing_to_do(q, k, varlen: bool, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    if varlen:
        return q.shape[0] == 0 or max_seqlen_q == 0 or k.shape[0] == 0 or max_seqlen_k == 0
    return q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
     window_left, window_right, softcap, dropout_p, rng_state, deterministic,
     startend_row_indices) = inputs[:16]
    if inputs[16] is not None:  # seqused_k: forward only (the C++ formula refuses it too)
        raise RuntimeError("flash_ext: seqused_k / block_table: forward only (no backward); q, k "
                           "or v requires grad. Call it under torch.no_grad() or with inputs "
                           "that do not require grad")
    alibi_slopes = inputs[17]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                          startend_row_indices, alibi_slopes)
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                softcap, bool(deterministic), float(dropout_p))


def _fwd_backward(ctx, grad_out, grad_lse):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, startend_row_indices,
     alibi_slopes) = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
     deterministic, dropout_p) = ctx.args
    if _nothing_to_do(q, k, cu_seqlens_q is not None, max_seqlen_q, max_seqlen_k):
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)) + (None,) * 15
    if grad_out is None:  # out does not reach the loss
        grad_out = torch.zeros_like(out, memory_format=torch.contiguous_format)
    elif not _rows_aligned(grad_out):
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    grads = torch.ops.flash_ext.bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                    window_left, window_right, softcap, deterministic, dropout_p,
                                    rng_state, startend_row_indices, alibi_slopes)
    return tuple(grads) + (None,) * 15  # one slot per argument of fwd (18)


def install(autograd: bool = True) -> None:
    """Define the schemas under ``flash_ext``, register fwd's autograd formula (unless
    ``autograd`` is False: for a run that loads csrc/ops_autograd.cpp built on its own) and
    stand an empty module in for flash_ext._C."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("flash_ext", "DEF")
    for schema, tags in SCHEMAS:
        _lib.define(schema, tags=tags)
    _lib.impl("build_info", lambda: BUILD_INFO, "CompositeExplicitAutograd")
    if autograd:
        torch.library.register_autograd("flash_ext::fwd", _fwd_backward,
                                        setup_context=_fwd_setup_context, lib=_lib)
    stub = types.ModuleType("flash_ext._C", "Stand-in for the compiled extension "
                            "(tests/stand_in_ops.py): the op schemas only, no kernels.")
    sys.modules["flash_ext._C"] = stub
