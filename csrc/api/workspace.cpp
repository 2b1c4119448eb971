// api/workspace.h.
#include "api/workspace.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "api/errors.h"

namespace flash_ext {
namespace {

// The eager calls' tile counters: per device a slab of kSlots zeroed ints (cudaMalloc: held for
// the life of the process, outside PyTorch's allocator and its statistics), one slot per stream
// that has needed one. Past kSlots streams on a device, calls fall back to a counter per call.
constexpr int kMaxDevices = 64;
constexpr int kSlots = 1024;

struct StreamCounters {
  std::mutex mutex;
  int* slab[kMaxDevices] = {};
  int used[kMaxDevices] = {};
  std::unordered_map<cudaStream_t, int*> of_stream[kMaxDevices];
};

// The counter of (device, stream), zeroed on that stream when first handed out; nullptr when the
// device's slab is full.
int* stream_tile_counter(int device, cudaStream_t stream) {
  // Most calls ask for the counter they asked for last: no lock then.
  thread_local int last_device = -1;
  thread_local cudaStream_t last_stream = nullptr;
  thread_local int* last_counter = nullptr;
  if (last_counter != nullptr && device == last_device && stream == last_stream) return last_counter;

  FLASH_EXT_CHECK(device >= 0 && device < kMaxDevices, "flash_ext: device index ", device, " out of range");
  static StreamCounters counters;
  const std::lock_guard<std::mutex> lock(counters.mutex);
  auto& of_stream = counters.of_stream[device];
  int* counter = nullptr;
  if (const auto it = of_stream.find(stream); it != of_stream.end()) {
    counter = it->second;
  } else {
    int*& slab = counters.slab[device];
    if (slab == nullptr) C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slab), kSlots * sizeof(int)));
    if (counters.used[device] == kSlots) return nullptr;
    counter = slab + counters.used[device]++;
    C10_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(int), stream));
    of_stream.emplace(stream, counter);
  }
  last_device = device, last_stream = stream, last_counter = counter;
  return counter;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Eager calls' arrival-counter buffers, per (device, stream); a buffer that grows is replaced
// and the old one kept (work queued before may still use it; cudaFree would synchronise).
struct CounterBuffer {
  int* ints = nullptr;
  int64_t count = 0;
};

int* stream_counters(int device, cudaStream_t stream, int64_t count) {
  FLASH_EXT_CHECK(device >= 0 && device < kMaxDevices, "flash_ext: device index ", device, " out of range");
  static std::mutex mutex;
  static std::unordered_map<cudaStream_t, CounterBuffer> of_stream[kMaxDevices];
  const std::lock_guard<std::mutex> lock(mutex);
  CounterBuffer& b = of_stream[device][stream];
  if (b.count < count) {
    const int64_t grown = std::max<int64_t>(count, 2 * b.count);
    C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.ints), grown * sizeof(int)));
    C10_CUDA_CHECK(cudaMemsetAsync(b.ints, 0, grown * sizeof(int), stream));
    b.count = grown;
  }
  return b.ints;
}

}  // namespace

int* zeroed_counters(int64_t count, const at::TensorOptions& options, int device, cudaStream_t stream,
                     at::Tensor& holder) {
  if (!capturing(stream)) return stream_counters(device, stream, count);
  holder = at::empty({count}, options.dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(holder.data_ptr<int>(), 0, count * sizeof(int), stream));
  return holder.data_ptr<int>();
}

Sm90FwdBuffers allocate_sm90_fwd_buffers(const Sm90FwdConfig& c, FwdParams& p, const at::TensorOptions& options,
                                         int device, cudaStream_t stream) {
  Sm90FwdBuffers b;
  p.tile_counter = nullptr;
  p.sm90_sk_count = nullptr;
  p.sm90_sk_partial = nullptr;
  if (c.tile_counter) {
    p.tile_counter = capturing(stream) ? nullptr : stream_tile_counter(device, stream);
    if (p.tile_counter == nullptr) {
      b.tile_counter = at::empty({1}, options.dtype(at::kInt));
      p.tile_counter = b.tile_counter.data_ptr<int>();
      C10_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream));
    }
  }
  if (c.stream_k) {
    b.workspace = at::empty({int64_t(c.sk_count_bytes + c.sk_partial_bytes)}, options.dtype(at::kByte));
    char* ws = static_cast<char*>(b.workspace.data_ptr());
    p.sm90_sk_count = reinterpret_cast<int*>(ws);
    p.sm90_sk_partial = reinterpret_cast<float*>(ws + c.sk_count_bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(p.sm90_sk_count, 0, c.sk_count_bytes, stream));
  }
  return b;
}

}  // namespace flash_ext
