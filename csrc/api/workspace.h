// The device buffers a Hopper forward config asks for (tuning/heuristics.h Sm90FwdConfig): the
// tile counter of the dynamic scheduler and the stream-K workspace. Kernels never allocate;
// nothing here synchronises, so calls can be captured in CUDA graphs.
//
// Tile counter: the kernel leaves it at 0 when it ends (sm90/tile_scheduler.h: the last claim
// resets it), so eager calls use one counter per (device, stream), zeroed once when the stream
// first needs it: no allocation and no memset per call (SDPA's flash forward has neither).
// Calls on one stream run in order; calls on other streams have their own counters. A call
// captured into a CUDA graph gets a counter of its own from the graph's memory with a captured
// memset instead (a graph may be replayed on any stream, beside eager calls on the capture
// stream's counter).
//
// Stream-K workspace: allocated per call from PyTorch's caching allocator on the current stream
// (freed when the returned holder goes out of scope after the launch: the allocator hands the
// memory out again only to work ordered after it on the same stream); its arrival counters are
// zeroed with cudaMemsetAsync.
#pragma once
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include "tuning/heuristics.h"
#include "params.h"

namespace flash_ext {

struct Sm90FwdBuffers {
  at::Tensor tile_counter;  // int32, zeroed: only for a call captured in a CUDA graph
  at::Tensor workspace;     // stream-K: arrival counters (zeroed), then partial states
};

// Points p.tile_counter, p.sm90_sk_count and p.sm90_sk_partial at what `c` asks for (nullptr
// where it asks for nothing), allocating what is per call. `device` is current.
Sm90FwdBuffers allocate_sm90_fwd_buffers(const Sm90FwdConfig& c, FwdParams& p, const at::TensorOptions& options,
                                         int device, cudaStream_t stream);

// Arrival counters that kernels leave at 0 (Flash-Decoding's split merge): `count` zeroed ints
// for a call on `stream`. Eager calls share one buffer per (device, stream), zeroed once when
// it is made or grown (held for the life of the process, like the tile counters); a call
// captured in a CUDA graph gets its own from the graph's memory, with a captured memset, held by
// `holder` until the launch is queued. `device` is current.
int* zeroed_counters(int64_t count, const at::TensorOptions& options, int device, cudaStream_t stream,
                     at::Tensor& holder);

}  // namespace flash_ext
