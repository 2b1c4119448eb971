// heuristics.h: the decisions, each with its reason and measurement (H100/H200 runs in
// docs/perf-notes.md; the design in docs/kernels-sm90.md and docs/kernels-sm80-bwd.md).
#include "tuning/heuristics.h"

#include <algorithm>
#include <cmath>

#include "decode/decode_params.h"
#include "dispatch/bwd_dispatch.h"

namespace flash_ext {
namespace {

constexpr int kElementBytes = 2;  // bf16 and fp16

// Tiles of uneven length: a causal/local window, or FlashMask (whose blocks are skipped by the
// data). Such calls are scheduled as causal ones: longest first, claimed from a counter, no
// stream-K (its pieces assume every tile's key blocks are known on the host).
bool masked(const FwdParams& p) { return p.has_window || p.has_flashmask; }

// d = 64 and d = 256 have two tiles each. The larger ones (d = 64: 192 x 128, three consumer
// warpgroups; d = 256: 128 x 80) are 3-14% faster from s = 2k on, but a 192-row tile pads a 1k
// causal row block by 2/3 of its longest tile: auto takes them for seqlen_q >= 2k, and at 1k
// without a mask. d = 256 without a mask keeps 128 x 64 up to 2k (even at 1k-1.5k, +1-3% at 2k
// in three A/B runs, where 80-key blocks compute 2080 columns for 2048).
bool choose_alt_tile(const FwdParams& p, int kd, const TuningOverrides& o) {
  if (!sm90_fwd_has_alt_tile(kd)) return false;
  // Not for FlashMask: the kernel has it on the 128-row base tiles only (sm90/fwd_launch.cuh: the
  // 192-row tile's 160-register consumers spilled), and its summaries are made for the tile's
  // block_n in 32, 64 or 128 columns (api/flashmask.cpp), not d = 256's 80.
  if (p.has_flashmask) return false;
  const bool alt_auto = kd == 256 && !masked(p) ? p.seqlen_q > 2048
                                                 : (p.seqlen_q >= 2048 || (!masked(p) && p.seqlen_q >= 1024));
  return o.sm90_fwd_tile > 0 || (o.sm90_fwd_tile < 0 && alt_auto);
}

// Longest-first order under masks, in sections of (head, batch) pairs whose K/V fit in half the
// L2 (TileScheduler); query heads sharing a K/V head (GQA) count once. Only where the plain
// order would need much HBM bandwidth: it runs the tiles of a wave on min(K/V heads x batch,
// SMs) K/V streams, each read by the CTAs on that head in step (neighbouring query blocks re-read
// a K/V block within a block-time): a CTA reads 2 * sizeof(Element) bytes of K/V per
// 4 * kBlockM FLOPs, so at ~4.5 TFLOP/s per SM the streams need
// streams * 4.5e12 * sizeof(Element) / (2 * kBlockM) bytes/s from HBM. Sections where that
// exceeds a quarter of the device's bandwidth. Under a sustained load the H100 runs at its 700 W
// cap, and HBM traffic costs clock: d = 256 causal 4k (32 streams, ~1.1 TB/s estimated) read
// 655 MB from HBM per call without sections, 208 MB with them, and ran at 1.52 vs 1.67 GHz, +4%
// (d = 128 causal 8k: +4%). Below that (16 streams: d = 256 causal 8k, 16k rows) the plain
// order's HBM traffic is small and its single longest-first order has the shortest tail
// (sections forced there: d = 256 causal 8k 695 -> 573 TFLOP/s). Without sections one section
// holds every pair (sections against none where the rule has them: +6-21% at 1k-2k, H100/H200).
// Sizes are balanced (they differ by one K/V head's query heads): with full sections and a
// smaller last one, the last section's longest tiles were claimed only after every other tile
// and ran on alone (balanced: +2-13% at causal 2k-8k).
void choose_sections(const FwdParams& p, const Sm90FwdTile& tile, const DeviceInfo& dev, Sm90FwdConfig& c) {
  const int heads_batches = p.heads_q * p.batch;
  const int group = p.heads_q / p.heads_kv;
  const int64_t kv_streams = std::min<int64_t>(int64_t(p.heads_kv) * p.batch, dev.sms);
  const double stream_bytes_per_s = 4.5e12 * kElementBytes / (2.0 * tile.block_m);
  const bool bandwidth_bound = dev.dram_bytes_per_s > 0
                                   ? kv_streams * stream_bytes_per_s > 0.25 * dev.dram_bytes_per_s
                                   : 2 * heads_batches >= dev.sms;  // no bandwidth reported: the H200's old threshold
  const int units = heads_batches / group;  // (K/V head, batch) pairs
  int sections = 1;
  if (masked(p) && bandwidth_bound) {
    const int64_t kv_head_bytes = std::max<int64_t>(1, int64_t(p.seqlen_k) * p.head_dim * 2 * int64_t(kElementBytes));
    const int64_t fit = int64_t(dev.l2_bytes / 2) / kv_head_bytes;  // K/V heads in half the L2
    const int max_units = int(std::max<int64_t>(1, std::min<int64_t>(units, fit)));
    sections = (units + max_units - 1) / max_units;
  }
  // Balanced: the first units % sections sections get one K/V head more.
  c.section_hb = units / sections * group;
  c.section_big = units % sections;
  c.section_big_hb = c.section_hb + group;
}

// Stream-K tail (sm90/stream_k.h): without a mask, on the persistent grid, the last partial
// wave's R tiles are cut along the keys over all SMs. Structural bounds: R < G (tiles mod G),
// W = R x key blocks >= G (every CTA's range non-empty), W x G < 2^31 (32-bit index math),
// fixed-length batches (every tile sees the same keys). Auto runs it where the key blocks an SM
// would idle through in the last wave, key_blocks x (G - R) / G, exceed its cost: about 10 key
// blocks' time (the pieces' extra Q loads, pipeline fills, the park and the merge; the call is
// longer by the memset) plus 0.3 per piece merged into a tile (~G / R pieces each; the merge
// reads them one after the other). Fitted to one H100 run: even at 7.8 idle blocks, +1-2% at
// 15, +11% at 19, 2.8x for one tile of 157 key blocks; 1k-token calls with 3-4 idle blocks lost
// 17-49%.
void choose_stream_k(const FwdParams& p, int kd, const DeviceInfo& dev, const TuningOverrides& o, Sm90FwdConfig& c) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int sms = dev.sms;
  const int key_blocks = (p.seqlen_k + c.tile.block_n - 1) / c.tile.block_n;
  const int64_t tail = c.persistent ? c.tiles % sms : 0;
  const int64_t tail_blocks = tail * key_blocks;
  bool stream_k = !masked(p) && c.persistent && !varlen && o.sm90_stream_k != 0 && tail > 0 &&
                  tail_blocks >= sms && tail_blocks * sms < (int64_t(1) << 31);
  if (o.sm90_stream_k < 0 && stream_k) {
    const double idle_blocks = double(key_blocks) * double(sms - tail) / sms;
    stream_k = idle_blocks >= 10.0 + 0.3 * double(sms) / double(tail);
  }
  c.stream_k = stream_k;
  if (stream_k) {
    // Counters (one per tail tile and consumer warpgroup), then the partial states: per CTA two
    // pieces x consumer warpgroups x 128 threads x (O's kHeadDim / 2 floats + 4).
    const int wgs = c.tile.consumer_wgs();
    c.sk_count_bytes = (size_t(tail) * wgs * sizeof(int) + 255) / 256 * 256;
    c.sk_partial_bytes = size_t(sms) * 2 * wgs * 128 * (kd / 2 + 4) * sizeof(float);
  }
  c.dp_tiles = int(stream_k ? c.tiles - tail : c.tiles);
  c.work_end = int(stream_k ? c.tiles - tail + 2 * sms : c.tiles);
}

}  // namespace

Sm90FwdConfig choose_sm90_fwd_config(const FwdParams& p, int kd, const DeviceInfo& dev, const TuningOverrides& o) {
  Sm90FwdConfig c;
  const bool varlen = p.cu_seqlens_q != nullptr;
  c.alt_tile = choose_alt_tile(p, kd, o);
  c.tile = sm90_fwd_tile(kd, c.alt_tile);
  const int block_m = c.tile.block_m;
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  c.tiles = int64_t(m_blocks) * p.heads_q * p.batch;

  // Persistent grid (one CTA per SM): without a mask CTAs walk the tiles with a static stride;
  // under a causal/local mask, whose tiles differ in length, they claim tiles from a zeroed
  // counter (a static round-robin lost 30-40%). Against one CTA per tile: even without a mask,
  // causal +2-21% (most at short rows), local windows +10-12% (H200); and the stream-K tail
  // needs it.
  c.persistent = true;
  c.tile_counter = masked(p);

  // Ping-pong by default except at d = 256 without a mask (FlashAttention-4 has it off at d = 256
  // too): its GEMMs are long and its softmax (80 columns) short, and on an H100 turning it off
  // gained 0-9% there (s = 1k-16k; causal within +-4%: kept on). The turn passes right after the
  // issue (a late hand-over, once S is done, won and lost by 0.3-3% in four H100 runs) and the
  // turns carry on across tiles (re-synchronising at every tile lost 0-13%).
  c.pingpong = o.sm90_pingpong >= 0 ? o.sm90_pingpong : (kd == 256 && !masked(p) ? 0 : 1);

  // O through shared memory and a TMA store (staged in its own buffer, or at d = 256 in Q's:
  // kernel_traits.h): +5-11% without a mask and +9-19% causal at s = 1k (d <= 192), +6-11% at
  // d = 256 2k-4k. Only where the batch is not varlen (a box would cross into the next
  // sequence) and a tensor map can describe out (as tma_compatible checks q, k, v).
  const bool o_tma_ok = p.o_row_stride > 0 && (p.heads_q == 1 || p.o_head_stride > 0) &&
                        (p.batch == 1 || p.o_batch_stride > 0);
  c.tma_store_o = !varlen && o_tma_ok;

  // Lazy rescaling (common/softmax.h): +1-7% at d = 128, +3-5% at d = 64, +4-13% at d = 256
  // against rescaling whenever a row's max grows (H100).
  c.lazy_rescale = true;

  choose_sections(p, c.tile, dev, c);

  // Causal tiles (no left window) aligned to end at seqlen_q: with a seqlen_q that is no multiple
  // of kBlockM (the 192-row tile: 2k = 10 2/3 tiles) the padding rows, which cost a whole
  // warpgroup's GEMMs, then sit in the first tile, which sees the fewest key blocks, instead of
  // the last, which sees them all; and tile ends meet key-block ends more often (the 192 x 128
  // tile's computed / visible scores at s = 2k / 4k: 1.18 / 1.13 from row 0, 1.12 / 1.06 aligned
  // to the end; d = 64 causal +1-4.5% at 2k-16k). A multiple of 64 rows, so Q and O boxes of 64
  // rows stay whole: boxes wholly before row 0 are filled with zeros by the TMA load and not
  // stored (a TMA store with a negative start row faults: illegal instruction). Fixed-length
  // batches only (a varlen box before row 0 would read the previous sequence). Not under FlashMask,
  // whose bounds and block summaries are in rows from 0 (sm90/fwd_mask.h FlashMaskPolicy).
  const bool align_end = p.has_window && !p.has_flashmask && !varlen && p.window_left < 0 && p.window_right >= 0;
  c.row_shift = align_end ? (m_blocks * block_m - p.seqlen_q) / 64 * 64 : 0;

  choose_stream_k(p, kd, dev, o, c);
  c.grid = int(c.stream_k ? dev.sms : c.persistent ? std::min<int64_t>(c.tiles, dev.sms) : c.tiles);
  return c;
}

void write_sm90_fwd_schedule(const Sm90FwdConfig& c, FwdParams& p) {
  p.sm90_pingpong = c.pingpong;
  p.sm90_tma_store_o = c.tma_store_o;
  p.sm90_lazy_rescale = c.lazy_rescale;
  p.sm90_section_hb = c.section_hb;
  p.sm90_section_big = c.section_big;
  p.sm90_section_big_hb = c.section_big_hb;
  p.sm90_row_shift = c.row_shift;
  p.sm90_dp_tiles = c.dp_tiles;
  p.sm90_work_end = c.work_end;
}

BwdTile choose_bwd_sm80_tile(int kernel_head_dim, const DeviceInfo& dev, const TuningOverrides& o) {
  if (o.bwd_small_tile) return bwd_sm80_tile(kernel_head_dim, false);
  const BwdTile big = bwd_sm80_tile(kernel_head_dim, true);
  const bool fits = dev.smem_optin_bytes >= bwd_sm80_smem_bytes(kernel_head_dim, big);
  return fits ? big : bwd_sm80_tile(kernel_head_dim, false);
}

BwdTile bwd_sm80_pick_tile(int kernel_head_dim) {
  return choose_bwd_sm80_tile(kernel_head_dim, current_device_info(), tuning_overrides());
}

// Group loop against expanded buffers, in units of one step (a kBlockM x kBlockN block of one
// query head; both schedules run the same steps). The kernel's time is estimated as its CTAs'
// makespan on one CTA per SM: CTAs of one length (no mask) run in whole waves; uneven ones take
// the longest CTA when the grid is one wave, else the steps spread over the SMs plus half a
// longest CTA of tail. Looping multiplies every CTA's length by the
// group and divides their number by it, so it loses where the grid is short of waves and the CTAs
// uneven: causal 4 x 2048, 8 / 2 heads, d = 128 has 128 looped CTAs of 8 to 128 steps, against
// 512 expanded ones that spread 8704 steps over 132 SMs (~66 each). Expanded pays the bytes: the
// kernel writes dK, dV per query head, the sum reads them back and writes the result (a step:
// 10 kBlockM x kBlockN x d FLOPs at ~2.5 TFLOP/s per SM; the bytes at 70% of the DRAM peak).
bool choose_sm90_bwd_gqa_loop(const FwdParams& p, int kd, const DeviceInfo& dev, const TuningOverrides& o) {
  if (p.heads_kv <= 0 || p.heads_q == p.heads_kv) return false;
  if (p.cu_seqlens_q != nullptr) return false;  // varlen: the kernel has no group loop (expand)
  if (o.sm90_bwd_gqa >= 0) return o.sm90_bwd_gqa == 1;
  const int group = p.heads_q / p.heads_kv;
  const int block_m = sm90_bwd_block_m(kd), block_n = sm90_bwd_block_n(kd);
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  const int n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  // Query blocks per key block: the kernel's range (common/mask.h BlockMask::query_block_range).
  // FlashMask may skip more; the estimate keeps the window's.
  int64_t head_steps = 0;
  int longest = 0, shortest = m_blocks;
  const int shift = p.seqlen_k - p.seqlen_q;
  for (int n = 0; n < n_blocks; ++n) {
    int m_min = 0, m_max = m_blocks;
    if (p.has_window && p.window_right >= 0) m_min = std::max(0, (n * block_n - shift - p.window_right) / block_m);
    if (p.has_window && p.window_left >= 0) {
      const int last_row = std::min((n + 1) * block_n, p.seqlen_k) - 1 - shift + p.window_left;
      m_max = std::min(m_max, last_row < 0 ? 0 : last_row / block_m + 1);
    }
    const int len = std::max(0, m_max - m_min);
    head_steps += len;
    longest = std::max(longest, len);
    shortest = std::min(shortest, len);
  }
  const int64_t units = int64_t(p.batch) * p.heads_kv;  // (KV head, batch) pairs
  const double sms = dev.sms > 0 ? dev.sms : 132;
  const double total = double(head_steps) * double(units) * group;
  auto makespan = [&](int64_t ctas, double longest_cta) {
    if (shortest == longest) return std::ceil(double(ctas) / sms) * longest_cta;
    return ctas <= sms ? longest_cta : std::max(longest_cta, total / sms + longest_cta / 2);
  };
  const double loop = makespan(n_blocks * units, double(group) * longest);
  const double step_s = 10.0 * block_m * block_n * p.head_dim / 2.5e12;
  const double kv_bytes = 2.0 * units * p.seqlen_k * p.head_dim * kElementBytes;  // dK and dV, heads_kv
  const double extra_bytes = kv_bytes * (2.0 * group - 1);  // group - 1 more written, group read back
  const double dram = dev.dram_bytes_per_s > 0 ? dev.dram_bytes_per_s : 3.35e12;
  const double expand = makespan(n_blocks * units * group, longest) + extra_bytes / (0.7 * dram) / step_s;
  return loop <= expand;
}

bool choose_sm90_bwd_fm_order_by_count(const FwdParams& p, int kd, const TuningOverrides& o) {
  return p.has_flashmask && p.cu_seqlens_q == nullptr && o.sm90_bwd_lpt < 0 && kd <= 128 && p.seqlen_k <= 16384 &&
         p.seqlen_q < (1 << 26);
}

int choose_sm90_bwd_lpt_section(const FwdParams& p, int kd, bool group_loop, const DeviceInfo& dev,
                                const TuningOverrides& o) {
  if (p.cu_seqlens_q != nullptr || o.sm90_bwd_lpt == 0) return 0;
  if (choose_sm90_bwd_fm_order_by_count(p, kd, o)) {
    return int(std::max<int64_t>(int64_t(group_loop ? p.heads_kv : p.heads_q) * p.batch, 1));
  }
  const bool causal = p.has_window && p.window_right == 0 && p.window_left < 0 && !p.has_flashmask;
  // d = 256 (64 x 64 tiles, twice the key blocks) measured 1.9% slower in this order on an H200
  // (4 x 2048, 8 heads, causal), d = 64 and 128 7-13% faster at 2k: auto keeps d = 256 on the 3-D grid.
  if ((!causal || kd > 128) && o.sm90_bwd_lpt != 1) return 0;
  const int group = group_loop ? p.heads_q / p.heads_kv : 1;
  const int64_t units = int64_t(group_loop ? p.heads_kv : p.heads_q) * p.batch;
  const int64_t rows = (int64_t(p.seqlen_q) + 127) / 128 * 128;
  // A unit's bytes read or added by its CTAs: Q and dO, dq_accum (fp32, kernel head dim), lse and D.
  const int64_t unit_bytes = group * rows * (2 * int64_t(p.head_dim) * kElementBytes + int64_t(kd) * 4 + 8);
  const int64_t budget = int64_t(0.4 * (dev.l2_bytes > 0 ? dev.l2_bytes : 50 << 20));
  const int64_t section = std::clamp<int64_t>(budget / std::max<int64_t>(unit_bytes, 1), 1, std::max<int64_t>(units, 1));
  return int(section);
}

DecodeConfig choose_decode_config(int requested, int64_t units, int sms, int64_t shallow_slots, int deepest_ring,
                                  bool paged, int64_t key_blocks, int ring_override, double dram_bytes_per_s) {
  DecodeConfig c;
  if (units <= 0) return c;
  const int64_t max_splits = std::clamp<int64_t>(key_blocks / 4, 1, kDecodeMaxSplits);
  const int64_t deep_splits = std::clamp<int64_t>(sms / units, 1, max_splits);  // one wave of one CTA per SM
  auto filled = [](int64_t ctas, int64_t slots) {  // the busy share of the grid's last wave
    return double(ctas) / double((ctas + slots - 1) / slots * slots);
  };
  int ring = kDecodeStagesShallow;
  int64_t splits = 1;
  if (units <= sms / 8 && key_blocks <= 8 * deep_splits) {
    // Few sequences x KV heads and short splits: per-CTA latency bound; the deep ring keeps more
    // blocks in flight per SM (1 x 8k keys: 1265 vs 1134 GB/s), where it fits.
    ring = deepest_ring, splits = deep_splits;
  } else if (units < sms && !(dram_bytes_per_s > kDecodeFillAllSlotsBytesPerS)) {
    // Fewer (sequence, KV head) tiles than SMs, long splits: one ring-3 CTA per SM beat two ring-2
    // ones at every such shape of the H100 sweep (1 x 128k: 2822 vs 2770 GB/s; 8 x 64k: 3102 vs
    // 3064; 16 x 8k: 2859 vs 2801). Paged caches too, since a row's page lookup is off the copies'
    // path (decode/kv_block_loader.h; H100, pages of 16: 1 x 128k 2702-2710 vs 2656-2661 GB/s on
    // every shallow slot, 8 x 64k 2955 vs 2940).
    ring = kDecodeStagesMid, splits = std::clamp<int64_t>(sms / units, 1, max_splits);
  } else if (units < sms) {
    // GPUs of more DRAM bandwidth than an H100's need more blocks in flight per SM: every shallow
    // slot filled in one wave (H200: 3616 GB/s at 1 x 128k and 4152 at 8 x 64k, against 3030 and
    // 3223 on one ring-3 CTA per SM).
    splits = std::clamp<int64_t>(shallow_slots / units, 1, max_splits);
  } else if (units < 2 * int64_t(sms)) {
    splits = std::clamp<int64_t>((2 * sms + units / 2) / units, 1, max_splits);  // ~two CTAs per SM
    // Paged, on GPUs of more DRAM bandwidth than an H100's: two ring-3 CTAs per SM keep 2 blocks
    // in flight each (H200, 32 x 16k, pages of 16: 3616 GB/s vs 3284 on ring 2; contiguous 4327 vs
    // 4385, so contiguous caches keep ring 2).
    if (paged && dram_bytes_per_s > kDecodeFillAllSlotsBytesPerS) ring = kDecodeStagesMid;
  } else if (filled(units, shallow_slots) < 0.75 && filled(units, sms) > filled(units, shallow_slots) + 0.1) {
    // The shallow ring's last wave is short where one or two CTAs per SM fill theirs: ring 3 (two
    // per SM) beat ring 4 (one) and ring 2 (three) at 64 x 4k: 2921 vs 2886 vs 2833 GB/s; pages
    // of 16: 2847 vs 1997 vs 2741.
    ring = kDecodeStagesMid;
  } else if (max_splits >= 8 && filled(2 * units, shallow_slots) > filled(units, shallow_slots) + 0.1) {
    splits = 2;  // a second split evens out the last wave
  }
  if (ring_override != 0) ring = ring_override;
  if (requested > 0) splits = std::min(requested, kDecodeMaxSplits);
  c.splits = int(splits);
  c.ring_stages = std::min(ring, deepest_ring);  // both are compiled depths
  return c;
}

}  // namespace flash_ext
