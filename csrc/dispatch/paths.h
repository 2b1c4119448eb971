// Which implementation runs a call (the FlashAttention-2 kernels, which run on sm80 and newer,
// or the Hopper ones) and the jump from its runtime head dim and dtype to the launcher's
// instantiation (dispatch/kernel_table.h). Plain C++: errors go through raise_error.
#pragma once
#include <cuda_runtime.h>

#include "device_info.h"
#include "tuning/heuristics.h"
#include "params.h"
#include "tuning/overrides.h"

namespace flash_ext {

enum class KernelPath { kSm80, kSm90 };

struct KernelChoice {
  KernelPath path;
  int kernel_head_dim;  // of the chosen path's kernel
};

// TMA tensor maps need non-empty extents and non-zero strides (broadcast tensors with stride 0
// and calls without keys go to the sm80 kernel, which handles both); nor can they bound a
// sequence's used keys (seqused_k: those calls run the sm80 kernel too).
bool tma_compatible(const FwdParams& p);

// FlashMask (p.has_flashmask) on the Hopper kernels: the forward has a FlashMask mask policy
// (sm90/fwd_mask.h; at d = 256 its low-register form) for every head dim it has; the backward
// has a FlashMask mode in its windowed variant for every head dim it has (sm90/bwd_flashmask.h).
// Where these say false, FlashMask calls run the sm80 kernels, and
// FLASH_EXT_FWD_PATH / BWD_PATH=sm90 with bounds is an error.
bool flashmask_on_sm90_fwd(int sm90_kernel_head_dim);
bool flashmask_on_sm90_bwd(int sm90_kernel_head_dim);

// Forward: the Hopper kernel on sm90 devices where this build has it for the head dim and dtype,
// the tensor maps can describe the inputs and there is no dropout (which only the sm80 kernel
// implements); else the sm80 kernel. FLASH_EXT_FWD_PATH forces one (an error where sm90 cannot
// run). Raises when no kernel of the chosen path covers the head dim or dtype.
KernelChoice choose_fwd_kernel(const FwdParams& p, const DeviceInfo& dev, const TuningOverrides& o);
void run_fwd(const KernelChoice& k, FwdParams& p, const Sm90FwdConfig& sm90_config, cudaStream_t stream);

// Backward: the Hopper kernel on sm90 devices where it applies (head dims <= 128 and 193-256,
// fixed-length batches, deterministic=False, no dropout; docs/kernels-sm90-bwd.md), else the
// sm80 kernel. FLASH_EXT_BWD_PATH forces one. sm80_bwd_kernel_head_dim: the sm80 kernel's head
// dim (the host sizes its dQ buffer by that kernel's tile); raises when there is none.
int sm80_bwd_kernel_head_dim(int head_dim);
KernelChoice choose_bwd_kernel(const BwdParams& p, const DeviceInfo& dev, const TuningOverrides& o);
void run_bwd(const KernelChoice& k, BwdParams& p, cudaStream_t stream);

}  // namespace flash_ext
