// dispatch/paths.h: path choice and the head dim / dtype switch, for both directions.
#include "dispatch/paths.h"

#include <string>

#include "dispatch/bwd_dispatch.h"
#include "dispatch/fwd_dispatch.h"
#include "dispatch/kernel_table.h"
#include "error.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

namespace flash_ext {
namespace {

const std::string kBuildInfo = std::string(" (") + FLASH_EXT_BUILD_INFO + ")";

// The sm80-family kernel for head dim d, or an error naming the direction.
int sm80_kernel_head_dim(int d, const char* direction) {
  const int kd = kernel_head_dim<Family::kFwdSm80>(d);  // the sm80 families share their head dims
  if (kd == 0) {
    raise_error(std::string("flash_ext: no ") + direction + " kernel for head dim " + std::to_string(d) +
                " in this build" + kBuildInfo + "; rebuild with FLASH_EXT_HEADDIMS covering it");
  }
  return kd;
}

void require_dtype(bool is_bf16) {
  if (!dtype_built(is_bf16)) {
    raise_error(std::string("flash_ext: this build has no ") + (is_bf16 ? "bf16" : "fp16") + " kernels" + kBuildInfo);
  }
}

// The Hopper backward's kernel for head dim d; 0 = none. Head dims 136..192 keep the sm80
// kernel (its 192 tile) rather than run in the 256 one.
int sm90_bwd_kernel_head_dim(int d) {
  const int kd = kernel_head_dim<Family::kBwdSm90>(d);
  return kd == 256 && d <= 192 ? 0 : kd;
}

KernelPath resolve(PathChoice forced, bool sm90_ok) {
  if (forced == PathChoice::kSm90) return KernelPath::kSm90;
  if (forced == PathChoice::kSm80) return KernelPath::kSm80;
  return sm90_ok ? KernelPath::kSm90 : KernelPath::kSm80;
}

// The error of a forced Hopper path that cannot run a FlashMask call.
void reject_forced_sm90_flashmask(const char* knob) {
  raise_error(std::string("flash_ext: ") + knob + "=sm90 cannot run this FlashMask call (startend_row_indices): "
              "the Hopper kernels have no FlashMask mode for this head dim in this build; unset " + knob +
              " (such calls run the sm80 kernels)");
}

}  // namespace

bool flashmask_on_sm90_fwd(int sm90_kernel_head_dim) { return sm90_kernel_head_dim != 0; }
bool flashmask_on_sm90_bwd(int sm90_kernel_head_dim) { return sm90_kernel_head_dim != 0; }

bool tma_compatible(const FwdParams& p) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool keys = varlen ? (p.total_k > 0 && p.total_q > 0) : p.seqlen_k > 0;
  // seqused_k: a map spans all packed keys, so the last key block of a sequence would load the
  // unused rows after its used keys, and P = 0 times a NaN there is NaN in O (the sm80 kernel
  // zero-fills rows past seqlen_k instead).
  if (p.seqused_k != nullptr) return false;
  const bool batch_strides = varlen || p.batch == 1 ||
                             (p.q_batch_stride > 0 && p.k_batch_stride > 0 && p.v_batch_stride > 0);
  return keys && batch_strides && p.q_row_stride > 0 && p.k_row_stride > 0 && p.v_row_stride > 0 &&
         (p.heads_q == 1 || p.q_head_stride > 0) && (p.heads_kv == 1 || (p.k_head_stride > 0 && p.v_head_stride > 0));
}

KernelChoice choose_fwd_kernel(const FwdParams& p, const DeviceInfo& dev, const TuningOverrides& o) {
  const int sm90_kd = kernel_head_dim<Family::kFwdSm90>(p.head_dim);
  const bool sm90_ok = dev.major == 9 && sm90_kd != 0 && dtype_built(p.is_bf16) && tma_compatible(p) &&
                       !(p.dropout_p > 0.f) && p.alibi_slopes == nullptr &&
                       (!p.has_flashmask || flashmask_on_sm90_fwd(sm90_kd));
  if (o.fwd_path == PathChoice::kSm90 && p.seqused_k != nullptr) {
    raise_error("flash_ext: FLASH_EXT_FWD_PATH=sm90 cannot run seqused_k (or block_table): the Hopper forward's "
                "tensor maps would read the unused keys; unset FLASH_EXT_FWD_PATH (these calls run the sm80 kernel)");
  }
  const KernelPath path = resolve(o.fwd_path, sm90_ok);
  if (path == KernelPath::kSm90) {
    if (p.has_flashmask && !flashmask_on_sm90_fwd(sm90_kd)) reject_forced_sm90_flashmask("FLASH_EXT_FWD_PATH");
    if (!sm90_ok) {
      raise_error("flash_ext: FLASH_EXT_FWD_PATH=sm90 needs an sm90 GPU and a build with 90a in FLASH_EXT_ARCHS "
                  "covering head dim " + std::to_string(p.head_dim) + " and dropout_p = 0 (ALiBi runs on the sm80 kernels)" + kBuildInfo);
    }
    return {path, sm90_kd};
  }
  return {path, sm80_kernel_head_dim(p.head_dim, "forward")};
}

void run_fwd(const KernelChoice& k, FwdParams& p, const Sm90FwdConfig& sm90_config, cudaStream_t stream) {
  require_dtype(p.is_bf16);
  visit_dtype(p.is_bf16, [&](auto bf16) {
    constexpr bool kIsBf16 = decltype(bf16)::value;
    if (k.path == KernelPath::kSm90) {
      visit_kernel_head_dim<Family::kFwdSm90>(k.kernel_head_dim, [&](auto kd) {
        run_fwd_sm90<decltype(kd)::value, kIsBf16>(p, sm90_config, stream);
      });
    } else {
      visit_kernel_head_dim<Family::kFwdSm80>(k.kernel_head_dim, [&](auto kd) {
        run_fwd_sm80<decltype(kd)::value, kIsBf16>(p, stream);
      });
    }
  });
}

int sm80_bwd_kernel_head_dim(int head_dim) { return sm80_kernel_head_dim(head_dim, "backward"); }

KernelChoice choose_bwd_kernel(const BwdParams& p, const DeviceInfo& dev, const TuningOverrides& o) {
  const int sm90_kd = sm90_bwd_kernel_head_dim(p.head_dim);
  const bool varlen = p.cu_seqlens_q != nullptr;  // packed dout: no batch stride
  const bool dout_strides = p.do_row_stride > 0 && (p.heads_q == 1 || p.do_head_stride > 0) &&
                            (varlen || p.batch == 1 || p.do_batch_stride > 0);
  // Varlen runs too (the kernels' kVarlen instantiations); tma_compatible excludes seqused_k.
  // Deterministic: fixed length without FlashMask (sm90/bwd_dq_order.h).
  const bool sm90_ok = dev.major == 9 && sm90_kd != 0 && dtype_built(p.is_bf16) &&
                       !(p.deterministic && (varlen || p.has_flashmask)) && !(p.dropout_p > 0.f) && tma_compatible(p) && dout_strides &&
                       p.alibi_slopes == nullptr && (!p.has_flashmask || flashmask_on_sm90_bwd(sm90_kd));
  const KernelPath path = resolve(o.bwd_path, sm90_ok);
  if (path == KernelPath::kSm90) {
    if (p.has_flashmask && !flashmask_on_sm90_bwd(sm90_kd)) reject_forced_sm90_flashmask("FLASH_EXT_BWD_PATH");
    if (!sm90_ok) {
      raise_error("flash_ext: FLASH_EXT_BWD_PATH=sm90 needs an sm90 GPU, a build with 90a in FLASH_EXT_ARCHS "
                  "covering head dim " + std::to_string(p.head_dim) +
                  " (the Hopper backward has head dims <= 128 and 193-256), deterministic=False for varlen "
                  "or FlashMask calls, dropout_p = 0 and no ALiBi" + kBuildInfo);
    }
    return {path, sm90_kd};
  }
  return {path, sm80_kernel_head_dim(p.head_dim, "backward")};
}

void run_bwd(const KernelChoice& k, BwdParams& p, cudaStream_t stream) {
  require_dtype(p.is_bf16);
  visit_dtype(p.is_bf16, [&](auto bf16) {
    constexpr bool kIsBf16 = decltype(bf16)::value;
    if (k.path == KernelPath::kSm90) {
      visit_kernel_head_dim<Family::kBwdSm90>(k.kernel_head_dim, [&](auto kd) {
        run_bwd_sm90<decltype(kd)::value, kIsBf16>(p, stream);
      });
    } else {
      visit_kernel_head_dim<Family::kBwdSm80>(k.kernel_head_dim, [&](auto kd) {
        run_bwd_sm80<decltype(kd)::value, kIsBf16>(p, stream);
      });
    }
  });
}

}  // namespace flash_ext
