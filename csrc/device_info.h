// What the dispatch, the heuristics and the launches need to know of a GPU, queried once per
// device (cudaDeviceGetAttribute on every call cost host time on each forward). Plain C++ and
// the CUDA runtime: usable from the host files and from the kernels' launch code alike.
#pragma once

namespace flash_ext {

struct DeviceInfo {
  int major = 0;                // compute capability
  int sms = 0;                  // multiprocessors
  int l2_bytes = 0;             // L2 cache size
  int smem_optin_bytes = 0;     // shared memory a block may opt in to (sm80 163 KB, sm86/89 99 KB, sm90 227 KB)
  double dram_bytes_per_s = 0;  // peak: 2 transfers per memory clock x bus width (0: not reported)
};

// The facts of device `device` (a CUDA device index), read on the first call for that device.
const DeviceInfo& device_info(int device);

// The facts of the current CUDA device (cudaGetDevice).
const DeviceInfo& current_device_info();

}  // namespace flash_ext
