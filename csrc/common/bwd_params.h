// Parameters of the backward pass: the forward's fields (q, k, v, o, lse, strides, seqlens,
// scale, softcap, window) plus the gradients and the fp32 work buffers. Plain struct, no torch
// or CUTLASS types. Filled by csrc/flash_bwd_api.cpp; see docs/kernels-sm80-bwd.md.
#pragma once
#include <cstdint>

#include "params.h"

namespace flash_ext {

struct BwdParams : FwdParams {
  // dO, laid out like o (batch, seqlen_q, heads_q, head_dim) or varlen (total_q, heads_q, head_dim).
  const void* __restrict__ dout;
  int64_t do_batch_stride, do_row_stride, do_head_stride;

  // D = rowsum(dO * O) in fp32, same layout and strides as lse (written by the preprocess kernel).
  float* __restrict__ dsum;

  // fp32 dQ accumulator (batch, seqlen_q, heads_q, head_dim) or varlen (total_q, heads_q, head_dim),
  // zero-initialized by the caller. Atomic mode (dq_split_stride == 0): every key block adds its
  // contribution with fp32 atomics. Deterministic mode: key block n writes its contribution with
  // plain stores into slice n (at dq_accum + n * dq_split_stride); the caller sums the slices.
  // Already multiplied by softmax_scale.
  float* __restrict__ dq_accum;
  int64_t dqa_batch_stride, dqa_row_stride, dqa_head_stride;
  int64_t dq_split_stride;

  // dK and dV in the input dtype, indexed by the *query* head: (batch, seqlen_k, heads_q, head_dim)
  // or varlen (total_k, heads_q, head_dim). With heads_q == heads_kv these are the final gradients;
  // for GQA/MQA they are expanded buffers that the caller sums over each group of query heads.
  void* __restrict__ dk;
  void* __restrict__ dv;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // Hopper backward only: lse * log2(e) and D in (batch, heads_q, seqlen_q_padded) buffers
  // (p.dsum then points at the padded D), written by its preprocess kernel.
  float* __restrict__ lse_log2;
  int seqlen_q_padded;
  // Hopper backward only: dq_accum is instead (batch, heads_q, seqlen_q_padded / kBlockM) tiles of
  // kBlockM x kernel-head-dim floats, each in the consumer threads' fragment order (see
  // dq_accum_slot in sm90/bwd_kernel.cuh), zeroed by the preprocess kernel; the dQ convert kernel
  // writes dq (input dtype, laid out like q) from it.
  void* __restrict__ dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;

  bool deterministic;

  // Main-kernel variant: 1 = bwd_kernel (default), 2 = bwd_kernel_v2 (double-buffered Q/dO; falls
  // back to 1 where it is not compiled or does not fit). Set from FLASH_EXT_BWD_VARIANT per call.
  int variant;
};

}  // namespace flash_ext
