// Tuning resolved once per call on the host: from the problem (FwdParams: shape, mask, dtype),
// the kernel head dim, the device (DeviceInfo: SMs, L2, bandwidth, shared memory) and the
// tuning overrides, the heuristics choose a config (tile, ping-pong, grid, head sections,
// alignment, stream-K, workspace); the launch only carries it out. The reasons, with their
// measurements, are next to each decision in heuristics.cpp. Plain C++ (no torch, no CUTLASS):
// the launchers include this for the tile tables.
#pragma once
#include <cstddef>
#include <cstdint>

#include "device_info.h"
#include "params.h"
#include "tuning/overrides.h"

namespace flash_ext {

// ---------------------------------------------------------------------------------------------
// Hopper forward
// ---------------------------------------------------------------------------------------------

// One tile of the Hopper forward: query rows x key rows per CTA, K/V ring stages; one consumer
// warpgroup per 64 query rows (sm90/kernel_traits.h FwdTraits).
struct Sm90FwdTile {
  int block_m, block_n, stages;
  constexpr int consumer_wgs() const { return block_m / 64; }
};

// The tiles per kernel head dim (docs/kernels-sm90.md "Tiles and budgets"). Head dims 64 and 256
// have two: base and alt (the larger one; when: heuristics.cpp). At d = 128, 128 x 176
// (FlashAttention-3's tile) and Q as a register operand were measured too: no win.
constexpr bool sm90_fwd_has_alt_tile(int kernel_head_dim) { return kernel_head_dim <= 64 || kernel_head_dim == 256; }

constexpr Sm90FwdTile sm90_fwd_tile(int kernel_head_dim, bool alt) {
  if (kernel_head_dim <= 64) return alt ? Sm90FwdTile{192, 128, 2} : Sm90FwdTile{128, 128, 2};
  if (kernel_head_dim <= 128) return {128, 128, 2};
  if (kernel_head_dim == 256) return alt ? Sm90FwdTile{128, 80, 2} : Sm90FwdTile{128, 64, 2};
  return {128, 64, 2};  // 192
}

// How one Hopper forward call runs. The fields under "kernel schedule" are copied into FwdParams'
// resolved launch schedule (write_sm90_fwd_schedule); the rest tell the host what to allocate
// and the launch which kernel and grid to run.
struct Sm90FwdConfig {
  bool alt_tile = false;  // sm90_fwd_tile(kernel head dim, alt_tile)
  Sm90FwdTile tile{};
  int64_t tiles = 0;      // query blocks x heads x batch
  int grid = 0;           // CTAs launched
  bool persistent = true;
  // Kernel schedule (FwdParams' fields of the same meaning).
  int pingpong = 1;
  bool tma_store_o = false;
  bool lazy_rescale = true;
  int section_hb = 0, section_big = 0, section_big_hb = 0;
  int row_shift = 0;
  bool stream_k = false;
  int dp_tiles = 0, work_end = 0;
  // Device buffers (api/workspace.h): a zeroed int32 tile counter (dynamic scheduling under a
  // mask; one per stream, which the kernel leaves at 0), and the stream-K workspace per call:
  // arrival counters (sk_count_bytes, zeroed), then partial states.
  bool tile_counter = false;
  size_t sk_count_bytes = 0, sk_partial_bytes = 0;
};

Sm90FwdConfig choose_sm90_fwd_config(const FwdParams& p, int kernel_head_dim, const DeviceInfo& dev,
                                     const TuningOverrides& o);

// FwdParams' resolved launch schedule from the config; the buffer pointers (tile_counter,
// sm90_sk_count, sm90_sk_partial) are set by whoever allocates them.
void write_sm90_fwd_schedule(const Sm90FwdConfig& c, FwdParams& p);

// ---------------------------------------------------------------------------------------------
// sm80 backward
// ---------------------------------------------------------------------------------------------

// Tile of the main backward kernel: query rows x key rows per CTA, and warps.
struct BwdTile {
  int block_m, block_n, warps;
};

// big_smem: the device allows more than the 99 KB per block of sm86/sm89 (sm80: 163 KB,
// sm90: 227 KB). The reasoning per row is in docs/kernels-sm80-bwd.md.
constexpr BwdTile bwd_sm80_tile(int kernel_head_dim, bool big_smem) {
  switch (kernel_head_dim) {
    case 32: return {64, 128, 8};
    case 64: return {64, 128, 8};
    case 96: return big_smem ? BwdTile{64, 128, 8} : BwdTile{64, 64, 8};
    case 128: return big_smem ? BwdTile{64, 128, 8} : BwdTile{64, 64, 8};
    case 192: return big_smem ? BwdTile{64, 64, 8} : BwdTile{32, 64, 4};
    default: return big_smem ? BwdTile{64, 64, 8} : BwdTile{32, 32, 4};  // 256
  }
}

// Shared memory of the main kernel: Q, dO (block_m x d), K, V (block_n x d), P, dS
// (block_m x block_n), all in the 2-byte input dtype.
constexpr int bwd_sm80_smem_bytes(int kernel_head_dim, BwdTile t) {
  return (2 * t.block_m * kernel_head_dim + 2 * t.block_n * kernel_head_dim + 2 * t.block_m * t.block_n) * 2;
}

// The tile for a device: the big one where its shared memory fits, else the 99 KB one
// (FLASH_EXT_BWD_SMALL_TILE=1 forces the latter, so that tests cover it on an A100 / H100).
BwdTile choose_bwd_sm80_tile(int kernel_head_dim, const DeviceInfo& dev, const TuningOverrides& o);

// The same on the current device with the overrides in force (the launcher's entry point).
BwdTile bwd_sm80_pick_tile(int kernel_head_dim);

// ---------------------------------------------------------------------------------------------
// Hopper backward
// ---------------------------------------------------------------------------------------------

// GQA/MQA (heads_q > heads_kv): true for one CTA per (key block, KV head, batch) that walks its
// group's query heads, summing dK and dV in registers and writing them once (BwdParams::
// sm90_gqa_loop); false for one CTA per query head into expanded buffers summed afterwards.
// The estimate (heuristics.cpp) weighs the loop's longer CTAs against the expanded buffers' bytes.
// Varlen calls: always false (the Hopper backward's varlen kernels expand).
bool choose_sm90_bwd_gqa_loop(const FwdParams& p, int kernel_head_dim, const DeviceInfo& dev,
                              const TuningOverrides& o);

// The Hopper backward's CTA order for fixed-length calls (sm90/bwd_tile_order.h): the (head,
// batch) units per section of the longest-first 1-D grid, or 0 for the 3-D grid. Longest first
// where key blocks differ in length (a causal mask: block 0 has the most query blocks), in
// sections whose Q, dO, lse, D and dq_accum fill at most 40% of L2; head dims <= 128 (d = 256
// lost 1.9% in this order).
// FlashMask calls that choose_sm90_bwd_fm_order_by_count takes: one section of every unit, and
// the kernel falls back to the 3-D grid's order where kernel A's counts say so.
// FLASH_EXT_SM90_BWD_LPT = 0 | 1 forces it off or on (on: also without a causal mask; FlashMask in
// L2 sections, whatever the counts).
int choose_sm90_bwd_lpt_section(const FwdParams& p, int kernel_head_dim, bool group_loop, const DeviceInfo& dev,
                                const TuningOverrides& o);

// Whether a fixed-length FlashMask backward's CTA order is left to kernel A's counts on the GPU
// (longest first in one section, or the 3-D grid's order: sm90/bwd_tile_order.h): auto, head
// dims <= 128, up to 16k keys (at 32k one section lost 1% where it won 3-5% at 8k-16k: the
// tail is shorter there and the L2 holds less of the units in flight).
bool choose_sm90_bwd_fm_order_by_count(const FwdParams& p, int kernel_head_dim, const TuningOverrides& o);

// Flash-Decoding's launch (docs/design-flash-decoding.md 2.1): how many splits of the keys, and
// the ring's depth (decode/decode_params.h).
struct DecodeConfig {
  int splits = 1;
  int ring_stages = 2;
};

// units: the CTAs without splitting (batch x KV heads x row blocks); shallow_slots: CTAs of the
// shallow ring the GPU holds at once (SMs x CTAs per SM); deepest_ring: the deepest compiled ring
// that fits one SM's shared memory (decode_deepest_ring); paged: a block table; key_blocks: key
// blocks of the cache's capacity (never device values: no sync, and a captured graph stays valid
// as the cache fills). requested > 0 forces that many splits (at most kDecodeMaxSplits);
// ring_override 2, 3 or 4 forces the depth (0: chosen; never deeper than deepest_ring). H100
// sweeps (docs/perf-notes.md: the ring x splits sweeps): one ring-4 CTA per SM where splits are short, one
// ring-3 CTA per SM for fewer tiles than SMs (contiguous caches), else about two ring-2 CTAs per
// SM; ring 3 where whole waves of one CTA per SM fill the GPU better; at two waves or more, a
// second split only where it evens out the last wave.
// dram_bytes_per_s: the device's peak (DeviceInfo; 0 if not reported). Above
// kDecodeFillAllSlotsBytesPerS (an H200's 4.8 TB/s, not an H100's 3.35) contiguous caches with
// fewer tiles than SMs fill every shallow slot, as paged ones do, and paged caches with one to two
// tiles per SM run two ring-3 CTAs per SM.
constexpr double kDecodeFillAllSlotsBytesPerS = 4.0e12;
DecodeConfig choose_decode_config(int requested, int64_t units, int sms, int64_t shallow_slots, int deepest_ring,
                                  bool paged, int64_t key_blocks, int ring_override, double dram_bytes_per_s);

}  // namespace flash_ext
