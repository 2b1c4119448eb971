// Helpers shared by the torch-facing files (flash_api.cpp, flash_bwd_api.cpp): which head dims
// this build has kernels for, the 16-byte row alignment the kernels' vector loads need, and what
// the TMA (Hopper) kernels need of the strides.
#pragma once
#include <ATen/ATen.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <optional>

#include "params.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

namespace flash_ext {

// Error messages. FLASH_EXT_CHECK(cond, parts...) is TORCH_CHECK with the message concatenated
// here (std::string, std::to_string) and handed over as one C string. On the GPU machine's
// toolchain (g++ 13 extension, torch 2.11 wheel), TORCH_CHECK with several message arguments,
// which c10::str formats with a std::ostringstream inside the extension, crashed the process
// (SIGSEGV) instead of raising; a single C-string message raises normally.
namespace detail {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
}  // namespace detail

template <typename... Args>
std::string error_message(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

#define FLASH_EXT_CHECK(cond, ...) TORCH_CHECK(cond, ::flash_ext::error_message(__VA_ARGS__).c_str())

// Smallest sm80-family kernel head dim >= d in this build (FLASH_EXT_HEADDIMS); other sizes run
// in the next larger kernel, whose loads zero-fill and whose stores skip the extra columns.
inline int sm80_kernel_head_dim(int d, const char* direction) {
  constexpr int kDims[] = {
#ifdef FLASH_EXT_HDIM_32
      32,
#endif
#ifdef FLASH_EXT_HDIM_64
      64,
#endif
#ifdef FLASH_EXT_HDIM_96
      96,
#endif
#ifdef FLASH_EXT_HDIM_128
      128,
#endif
#ifdef FLASH_EXT_HDIM_192
      192,
#endif
#ifdef FLASH_EXT_HDIM_256
      256,
#endif
      0};  // sentinel
  for (int kd : kDims) {
    if (kd >= d) return kd;
  }
  FLASH_EXT_CHECK(false, "flash_ext: no ", direction, " kernel for head dim ", d, " in this build (",
              FLASH_EXT_BUILD_INFO, "); rebuild with FLASH_EXT_HEADDIMS covering it");
  return 0;
}

// An environment switch (FLASH_EXT_*), read at every call (tests and A/B runs change them
// between calls), checked against its allowed values: "" when unset or empty, else one of them.
inline std::string env_choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* raw = std::getenv(name);
  const std::string value = raw ? raw : "";
  if (value.empty()) return value;
  std::string choices;
  size_t i = 0;
  for (const char* a : allowed) {
    if (value == a) return value;
    choices += i == 0 ? "" : (i + 1 == allowed.size() ? " or " : ", ");
    choices += a;
    ++i;
  }
  FLASH_EXT_CHECK(false, "flash_ext: ", name, " must be ", choices, "; got '", value, "'");
  return value;
}

// What the dispatch and the launches need to know of a device, queried once per device
// (cudaDeviceGetAttribute on every call cost host time on each forward).
struct DeviceInfo {
  int major = 0;     // compute capability
  int sms = 0;       // multiprocessors
  int l2_bytes = 0;  // L2 cache size
  double dram_bytes_per_s = 0;  // peak: 2 transfers per memory clock x bus width (0: not reported)
};

inline const DeviceInfo& device_info(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo infos[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  FLASH_EXT_CHECK(device >= 0 && device < kMaxDevices, "flash_ext: device index ", device, " out of range");
  std::call_once(once[device], [device] {
    DeviceInfo& d = infos[device];
    cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device);
    int clock_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
    d.dram_bytes_per_s = 2.0 * clock_khz * 1e3 * bus_bits / 8;
    cudaGetLastError();  // an attribute this device does not report leaves 0, not a sticky error
  });
  return infos[device];
}

inline void check_rows_aligned(const at::Tensor& t, const char* name) {
  FLASH_EXT_CHECK(t.stride(-1) == 1, "flash_ext: ", name, " must have a contiguous last dimension");
  for (int i = 0; i < t.dim() - 1; ++i) {
    FLASH_EXT_CHECK(t.stride(i) % 8 == 0, "flash_ext: ", name,
                " strides must be multiples of 8 elements (16-byte aligned rows); got ", t.strides());
  }
  FLASH_EXT_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_ext: ", name,
              " must be 16-byte aligned");
}

// TMA tensor maps need non-empty extents and non-zero strides (broadcast tensors with stride 0
// and calls without keys go to the sm80 kernel, which handles both).
inline bool tma_compatible(const FwdParams& p) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool keys = varlen ? (p.total_k > 0 && p.total_q > 0) : p.seqlen_k > 0;
  const bool batch_strides = varlen || p.batch == 1 ||
                             (p.q_batch_stride > 0 && p.k_batch_stride > 0 && p.v_batch_stride > 0);
  return keys && batch_strides && p.q_row_stride > 0 && p.k_row_stride > 0 && p.v_row_stride > 0 &&
         (p.heads_q == 1 || p.q_head_stride > 0) && (p.heads_kv == 1 || (p.k_head_stride > 0 && p.v_head_stride > 0));
}

// Dropout fields of the parameters (common/dropout.h) from the op arguments. rng_state: the
// int64 CPU tensor [seed, offset] that flash_ext::dropout_rng_state returned (read on the host:
// no device sync). dropout_p == 0 leaves dropout off (rng_state is then ignored).
inline void set_dropout_params(FwdParams& p, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  FLASH_EXT_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "flash_ext: dropout_p must be in [0, 1]; got ", dropout_p);
  p.dropout_p = 0.f;
  p.dropout_scale = 1.f;
  p.dropout_threshold = 0;
  p.dropout_seed = p.dropout_offset = 0;
  if (dropout_p == 0.0) return;
  FLASH_EXT_CHECK(rng_state.has_value(), "flash_ext: dropout_p > 0 needs rng_state (from flash_ext::dropout_rng_state)");
  const at::Tensor& rs = *rng_state;
  FLASH_EXT_CHECK(rs.device().is_cpu() && rs.scalar_type() == at::kLong && rs.numel() == 2,
              "flash_ext: rng_state must be an int64 CPU tensor of 2 elements [seed, offset]; got ",
              rs.scalar_type(), " ", rs.sizes(), " on ", rs.device());
  const at::Tensor c = rs.contiguous();
  p.dropout_seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
  p.dropout_offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
  p.dropout_p = float(dropout_p);
  // Dropped iff word < floor(p * 2^32 + 0.5) (exact in double). p = 1: threshold 2^32 does not
  // fit; 2^32 - 1 with a keep scale of 0 gives the same result (nothing survives).
  const double t = std::floor(dropout_p * 4294967296.0 + 0.5);
  p.dropout_threshold = t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
  p.dropout_scale = dropout_p >= 1.0 ? 0.f : float(1.0 / (1.0 - dropout_p));
}

}  // namespace flash_ext
