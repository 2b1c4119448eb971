#pragma once
// Opting a kernel in to more than 48 KB of dynamic shared memory, once per (kernel, device,
// size): cudaFuncSetAttribute costs ~5 us of host time per call (torch.profiler, H100 machine),
// and the attribute stays set for the process.
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <tuple>

namespace flash_ext {

inline void set_max_dynamic_smem(const void* kernel, int smem_bytes) {
  int device = 0;
  cudaGetDevice(&device);
  static std::mutex mutex;
  static std::set<std::tuple<const void*, int, int>> done;
  const auto key = std::make_tuple(kernel, device, smem_bytes);
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count(key)) return;
  // A failure is not remembered: the launch that follows reports it.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) == cudaSuccess) {
    done.insert(key);
  }
}

}  // namespace flash_ext
