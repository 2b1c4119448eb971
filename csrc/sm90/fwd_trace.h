// A timeline of the Hopper forward: clock64() at a few points of every tile, per CTA and role.
// A diagnostic build only (FLASH_EXT_SM90_TRACE=1 at build time, tools/trace_fwd.py): in every
// other build the marks below expand to nothing and FwdParams has no trace pointer, so the
// kernels are the same instruction for instruction.
//
// Layout of p.sm90_trace (int64 words), CTA c < kTraceCtas at c * kTraceCtaWords:
//   [0, 4): clock64 and %globaltimer (ns) at the CTA's start, then both at its end;
//   then per role (0: the producer thread, 1 + w: consumer warpgroup w's first thread), per tile
//   slot k < kTraceTiles (the k-th tile that role worked on in this CTA), kTraceEvents words:
//   clock64 at the events below, and two values (the tile's key blocks and its index).
#pragma once
#include <cstdint>

namespace flash_ext::sm90::trace {

constexpr int kTraceCtas = 256, kTraceRoles = 4, kTraceTiles = 32, kTraceEvents = 8;
constexpr int kTraceCtaWords = 4 + kTraceRoles * kTraceTiles * kTraceEvents;
constexpr int64_t kTraceWords = int64_t(kTraceCtas) * kTraceCtaWords;

// Consumer events (role 1 + w).
constexpr int kTileTop = 0;    // the tile is decoded and has work
constexpr int kQReady = 1;     // this warpgroup's rows of Q have landed
constexpr int kFirstS = 2;     // S of the first key block is done (wgmma wait)
constexpr int kLoopDone = 3;   // the key-block loop is done: only the last P V is left
constexpr int kLastPV = 4;     // the last P V is done
constexpr int kStored = 5;     // O and lse are written (or handed to the TMA store)
// Producer events (role 0).
constexpr int kProdTop = 0;     // the tile is decoded (the dynamic scheduler's claim included)
constexpr int kProdFirstK = 1;  // K of the first key block is issued
constexpr int kProdQ = 2;       // every warpgroup's Q slab is issued
constexpr int kProdLastV = 3;   // V of the last key block is issued
// Values (both roles).
constexpr int kBlocks = 6;  // key blocks of the tile (n_max - n_min)
constexpr int kTile = 7;    // the tile (for a stream-K piece: the tile it is a piece of)

#if defined(FLASH_EXT_SM90_TRACE) && defined(__CUDACC__)
__device__ __forceinline__ int64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return int64_t(t);
}
__device__ __forceinline__ int64_t* slot(int64_t* buf, int role, int k) {
  return buf + int64_t(blockIdx.x) * kTraceCtaWords + 4 + (role * kTraceTiles + k) * kTraceEvents;
}
__device__ __forceinline__ void value(int64_t* buf, int role, int k, int event, int64_t v) {
  if (buf != nullptr && blockIdx.x < kTraceCtas && k < kTraceTiles) slot(buf, role, k)[event] = v;
}
__device__ __forceinline__ void mark(int64_t* buf, int role, int k, int event) {
  value(buf, role, k, event, clock64());
}
__device__ __forceinline__ void cta_stamp(int64_t* buf, int which) {  // 0: start, 1: end
  if (buf != nullptr && blockIdx.x < kTraceCtas) {
    int64_t* w = buf + int64_t(blockIdx.x) * kTraceCtaWords + 2 * which;
    w[0] = clock64();
    w[1] = global_ns();
  }
}
#define FLASH_EXT_TRACE(...) __VA_ARGS__

// One role's marks over the tiles it works on in turn: begin_tile starts the next slot.
struct Role {
  int64_t* buf;  // nullptr: this thread records nothing
  int role, k = -1;
  template <typename Params>
  __device__ __forceinline__ Role(const Params& p, int r, bool records)
      : buf(records ? p.sm90_trace : nullptr), role(r) {}
  __device__ __forceinline__ void begin_tile(int event, int tile, int blocks) {
    ++k;
    mark(event);
    value(buf, role, k, kBlocks, blocks);
    value(buf, role, k, kTile, tile);
  }
  __device__ __forceinline__ void mark(int event) const { trace::mark(buf, role, k, event); }
};
#else
#define FLASH_EXT_TRACE(...)

#if defined(__CUDACC__)
// Every other build: calls that compile to nothing.
struct Role {
  template <typename Params>
  __device__ __forceinline__ Role(const Params&, int, bool) {}
  __device__ __forceinline__ void begin_tile(int, int, int) {}
  __device__ __forceinline__ void mark(int) const {}
};
#endif
#endif

}  // namespace flash_ext::sm90::trace
