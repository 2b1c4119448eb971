// tuning/overrides.h: the switch table, the one read of the environment, and set/get by name.
//
// Switches whose question docs/perf-notes.md has answered are gone (their measured defaults are
// now the only behaviour): FLASH_EXT_SM90_TMA_STORE, _PERSISTENT, _LAZY_RESCALE, _ALIGN_END,
// _HEAD_SECTIONS and FLASH_EXT_SM90_PINGPONG=tile. What stays is what tests force to cover both
// sides of a runtime choice, and the A/B questions still open.
#include "tuning/overrides.h"

#include <atomic>
#include <cstdlib>

#include "error.h"

namespace flash_ext {
namespace {

enum Switch {
  kFwdPath,
  kBwdPath,
  kSm90Pingpong,
  kSm90StreamK,
  kSm90FwdTile,
  kBwdVariant,
  kBwdSmallTile,
  kDecodeRing,
  kSm90BwdGqa,
  kSm90BwdLpt,
  kSm90FmFwdSections,
  kSm90FmFwdTiles,
  kDecodePdl,
  kSwitches
};

struct SwitchSpec {
  const char* name;
  const char* values[5];  // allowed spellings, nullptr-terminated; values[0] is the default
};

// Index i of a switch's value is what set_tuning stores; tuning_overrides() maps it to a field.
constexpr SwitchSpec kSpecs[kSwitches] = {
    {"FLASH_EXT_FWD_PATH", {"auto", "sm80", "sm90", nullptr}},
    {"FLASH_EXT_BWD_PATH", {"auto", "sm80", "sm90", nullptr}},
    {"FLASH_EXT_SM90_PINGPONG", {"auto", "0", "1", nullptr}},
    {"FLASH_EXT_SM90_STREAM_K", {"auto", "0", "1", nullptr}},
    {"FLASH_EXT_SM90_FWD_TILE", {"auto", "base", "alt", nullptr}},
    {"FLASH_EXT_BWD_VARIANT", {"2", "1", nullptr, nullptr}},
    {"FLASH_EXT_BWD_SMALL_TILE", {"0", "1", nullptr, nullptr}},
    {"FLASH_EXT_DECODE_RING", {"auto", "2", "3", "4", nullptr}},
    {"FLASH_EXT_SM90_BWD_GQA", {"auto", "expand", "loop", nullptr}},
    {"FLASH_EXT_SM90_BWD_LPT", {"auto", "0", "1", nullptr}},
    {"FLASH_EXT_SM90_FM_FWD_SECTIONS", {"auto", "rule", "one", nullptr}},
    {"FLASH_EXT_SM90_FM_FWD_TILES", {"auto", "scan", "table", nullptr}},
    {"FLASH_EXT_DECODE_PDL", {"auto", "0", "1", nullptr}},
};

// The index of `value` among the switch's spellings ("" = the default); raises on others.
int parse(Switch s, const std::string& value) {
  if (value.empty()) return 0;
  const SwitchSpec& spec = kSpecs[s];
  std::string choices;
  int n = 0;
  while (n < 5 && spec.values[n] != nullptr) ++n;
  for (int i = 0; i < n; ++i) {
    if (value == spec.values[i]) return i;
    choices += i == 0 ? "" : (i + 1 == n ? " or " : ", ");
    choices += spec.values[i];
  }
  raise_error(std::string("flash_ext: ") + spec.name + " must be " + choices + "; got '" + value + "'");
}

Switch find(const std::string& name) {
  for (int s = 0; s < kSwitches; ++s) {
    if (name == kSpecs[s].name) return Switch(s);
  }
  std::string known;
  for (int s = 0; s < kSwitches; ++s) known += std::string(s ? ", " : "") + kSpecs[s].name;
  raise_error("flash_ext: unknown tuning switch '" + name + "'; known: " + known);
}

// The values in force, and the environment's, read once on first use (a function-local static:
// thread-safe; a bad value in the environment raises, and the next use tries again).
struct Store {
  int from_env[kSwitches];
  std::atomic<int> now[kSwitches];
  Store() {
    for (int s = 0; s < kSwitches; ++s) {
      const char* raw = std::getenv(kSpecs[s].name);
      from_env[s] = parse(Switch(s), raw ? raw : "");
      now[s].store(from_env[s], std::memory_order_relaxed);
    }
  }
};

Store& store() {
  static Store s;
  return s;
}

PathChoice path_of(int i) { return i == 1 ? PathChoice::kSm80 : i == 2 ? PathChoice::kSm90 : PathChoice::kAuto; }

// auto | 0 | 1, auto | base | alt, auto | expand | loop, auto | rule | one and auto | scan | table: index 0 is auto (-1), then 0 and 1.
int tristate_of(int i) { return i - 1; }

}  // namespace

TuningOverrides tuning_overrides() {
  const Store& s = store();
  auto at = [&](Switch w) { return s.now[w].load(std::memory_order_relaxed); };
  TuningOverrides o;
  o.fwd_path = path_of(at(kFwdPath));
  o.bwd_path = path_of(at(kBwdPath));
  o.sm90_pingpong = tristate_of(at(kSm90Pingpong));
  o.sm90_stream_k = tristate_of(at(kSm90StreamK));
  o.sm90_fwd_tile = tristate_of(at(kSm90FwdTile));
  o.bwd_variant = at(kBwdVariant) == 1 ? 1 : 2;
  o.bwd_small_tile = at(kBwdSmallTile) == 1;
  constexpr int kRings[] = {0, 2, 3, 4};  // auto, then the spellings' depths
  o.decode_ring = kRings[at(kDecodeRing)];
  o.sm90_bwd_gqa = tristate_of(at(kSm90BwdGqa));
  o.sm90_bwd_lpt = tristate_of(at(kSm90BwdLpt));
  o.sm90_fm_fwd_sections = tristate_of(at(kSm90FmFwdSections));
  o.sm90_fm_fwd_tiles = tristate_of(at(kSm90FmFwdTiles));
  o.decode_pdl = tristate_of(at(kDecodePdl));
  return o;
}

void set_tuning(const std::string& name, const std::string& value) {
  const Switch w = find(name);
  Store& s = store();
  s.now[w].store(value.empty() ? s.from_env[w] : parse(w, value), std::memory_order_relaxed);
}

std::string get_tuning(const std::string& name) {
  const Switch w = find(name);
  return kSpecs[w].values[store().now[w].load(std::memory_order_relaxed)];
}

std::vector<std::string> tuning_names() {
  std::vector<std::string> names;
  for (const SwitchSpec& spec : kSpecs) names.push_back(spec.name);
  return names;
}

}  // namespace flash_ext
