// device_info.h: one query per device, kept for the life of the process.
#include "device_info.h"

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "error.h"

namespace flash_ext {

const DeviceInfo& device_info(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo infos[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    raise_error("flash_ext: device index " + std::to_string(device) + " out of range");
  }
  std::call_once(once[device], [device] {
    DeviceInfo& d = infos[device];
    cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device);
    cudaDeviceGetAttribute(&d.smem_optin_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    int clock_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
    d.dram_bytes_per_s = 2.0 * clock_khz * 1e3 * bus_bits / 8;
    cudaGetLastError();  // an attribute this device does not report leaves 0, not a sticky error
  });
  return infos[device];
}

const DeviceInfo& current_device_info() {
  int device = 0;
  cudaGetDevice(&device);
  return device_info(device);
}

}  // namespace flash_ext
