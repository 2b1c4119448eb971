// Programmatic dependent launch (PDL; sm90+): a kernel launched by launch_with_pdl may be
// scheduled while the kernel before it in the stream still runs, so its launch and prologue hide
// under that kernel's last wave (the Hopper backward's preprocess -> main -> dQ convert; the
// decode kernel after whatever came before it). Its threads call pdl_wait() before they touch
// what the kernel before wrote (or read); that kernel calls pdl_launch_dependents() to let the
// next one in (otherwise it is let in as its CTAs exit). A kernel launched without the attribute
// passes pdl_wait() at once.
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <utility>

namespace flash_ext {

// Waits until the grid this one depends on has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// This CTA no longer holds back the next PDL-launched kernel (it is scheduled once every CTA of
// this grid has called this or exited; it still waits for this grid's completion in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether `kernel`'s code on the current device has its pdl_wait(): only code made from sm90+ PTX
// does (below it pdl_wait compiles to nothing). Code from compute_80 PTX on a Hopper or newer GPU
// (a one_ptx family without build_config.py's sm90_pass, or a GPU JIT-compiling the embedded
// compute_80 PTX) has no wait and must not be launched with PDL. Cached per (kernel, device); a
// failed query counts as no wait.
inline bool kernel_has_pdl_wait(const void* kernel) {
  int device = 0;
  cudaGetDevice(&device);
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> with, without;
  const auto key = std::make_pair(kernel, device);
  std::lock_guard<std::mutex> lock(mutex);
  if (with.count(key)) return true;
  if (without.count(key)) return false;
  cudaFuncAttributes attr{};
  const bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess;
  if (!ok) cudaGetLastError();  // not left for the launch check that follows
  const bool wait = ok && attr.ptxVersion >= 90;
  (wait ? with : without).insert(key);
  return wait;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed.
// A launch error is left to the caller's launch check, as with <<<>>>.
template <typename... KernelArgs, typename... Args>
void launch_with_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flash_ext
