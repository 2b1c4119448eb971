// Tuning overrides: the FLASH_EXT_* switches that force a choice the heuristics
// (tuning/heuristics.h) or the dispatch would otherwise make, for tests and A/B runs. Read from the
// environment once per process, on first use; nothing on the per-call path calls getenv. Tests
// and A/B tools change them at runtime through the flash_ext::set_tuning op (set_tuning below).
// Plain C++: the dispatch, the heuristics and the launchers read them without torch.
#pragma once
#include <string>
#include <vector>

namespace flash_ext {

enum class PathChoice { kAuto, kSm80, kSm90 };

struct TuningOverrides {
  // FLASH_EXT_FWD_PATH / FLASH_EXT_BWD_PATH = auto | sm80 | sm90: which implementation runs
  // (sm90 where it cannot run is an error).
  PathChoice fwd_path = PathChoice::kAuto;
  PathChoice bwd_path = PathChoice::kAuto;
  // FLASH_EXT_SM90_PINGPONG = auto | 0 | 1: the Hopper forward's ping-pong (-1 auto).
  int sm90_pingpong = -1;
  // FLASH_EXT_SM90_STREAM_K = auto | 0 | 1: the Hopper forward's stream-K tail; 1 wherever it
  // can run (-1 auto).
  int sm90_stream_k = -1;
  // FLASH_EXT_SM90_FWD_TILE = auto | base | alt: the tile of the Hopper forward's head dims that
  // have two (-1 auto, 0 base, 1 alt).
  int sm90_fwd_tile = -1;
  // FLASH_EXT_BWD_VARIANT = 1 | 2: the sm80 backward's main kernel (default 2).
  int bwd_variant = 2;
  // FLASH_EXT_BWD_SMALL_TILE = 0 | 1: the sm80 backward's 99 KB tiles (sm86/sm89) on any device.
  bool bwd_small_tile = false;
  // FLASH_EXT_DECODE_RING = auto | 2 | 3 | 4: the decode kernel's ring depth (0 auto; a depth
  // that does not fit the device's shared memory runs the deepest that does).
  int decode_ring = 0;
  // FLASH_EXT_SM90_BWD_GQA = auto | expand | loop: the Hopper backward's GQA/MQA schedule, one
  // CTA per query head into expanded dK/dV buffers or one per KV head looping over its group
  // (-1 auto, 0 expand, 1 loop).
  int sm90_bwd_gqa = -1;
  // FLASH_EXT_SM90_BWD_LPT = auto | 0 | 1: the Hopper backward's longest-first CTA order (-1
  // auto: causal fixed-length calls; 1 also without a mask).
  int sm90_bwd_lpt = -1;
  // FLASH_EXT_SM90_FM_FWD_SECTIONS = auto | rule | one: the Hopper FlashMask forward's tile order
  // under L2 sections; auto drops the sections on the GPU when the mask keeps few pairs (kernel
  // A's count), rule keeps the host's sections, one always takes one section (-1 auto, 0, 1).
  int sm90_fm_fwd_sections = -1;
  // FLASH_EXT_SM90_FM_FWD_TILES = auto | scan | table: how the Hopper FlashMask forward (fixed
  // length) finds its tiles' key-block ranges and order: auto and table from the tile table
  // (flashmask/flashmask_fwd_tiles.h: longest walk first), scan from the summaries in the kernel,
  // query blocks in descending order (-1 auto, 0 scan, 1 table).
  int sm90_fm_fwd_tiles = -1;
  // FLASH_EXT_DECODE_PDL = auto | 0 | 1: the decode kernel launched with programmatic dependent
  // launch (common/pdl.h) on sm90+, where its code was compiled from sm90+ PTX (-1 auto: on;
  // elsewhere both values launch without it).
  int decode_pdl = -1;
};

// The overrides in force now (the environment's, as changed by set_tuning). Cheap: a few
// relaxed atomic loads.
TuningOverrides tuning_overrides();

// Sets switch `name` (an environment variable name above, e.g. "FLASH_EXT_SM90_STREAM_K") to
// `value` for the rest of the process; "" restores the value the environment gave at startup.
// Unknown names and values raise an error that lists the allowed ones.
void set_tuning(const std::string& name, const std::string& value);

// The value of switch `name` in force now, spelled as set_tuning takes it ("auto" etc.).
std::string get_tuning(const std::string& name);

// Every switch name, in a fixed order.
std::vector<std::string> tuning_names();

}  // namespace flash_ext
