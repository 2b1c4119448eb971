// The kernels of this build: arch x direction x head dim x dtype, in one table for both
// directions, and the switch from a call's runtime head dim and dtype to the template
// instantiation (csrc/instantiations/, generated from tools/build_config.py's FAMILIES, which
// lists the same head dims per family).
//
// Which head dims and dtypes are built comes from the build's knob macros (FLASH_EXT_HDIM_<d>,
// FLASH_EXT_BF16 / _FP16, FLASH_EXT_SM90A: tools/build_config.py macro_defines), which setup.py
// gives to the host .cpp files only: include this from those, never from a kernel translation
// unit (where every head dim would read as not built).
#pragma once
#ifdef __CUDACC__
#error "dispatch/kernel_table.h is for the host .cpp files (only they get the build's knob macros)"
#endif
#include <type_traits>

namespace flash_ext {

// A family of kernels: one launcher template per (head dim, dtype) (csrc/dispatch/*_dispatch.h).
enum class Family { kFwdSm80, kBwdSm80, kFwdSm90, kBwdSm90, kDecode };

template <int... kDims>
struct HeadDims {};

// The kernel head dims of each family. Other head dims (multiples of 8 up to 256) run in the
// next larger kernel, whose loads zero-fill and whose stores skip the extra columns.
template <Family F>
struct FamilyHeadDims;
template <> struct FamilyHeadDims<Family::kFwdSm80> { using type = HeadDims<32, 64, 96, 128, 192, 256>; };
template <> struct FamilyHeadDims<Family::kBwdSm80> { using type = HeadDims<32, 64, 96, 128, 192, 256>; };
template <> struct FamilyHeadDims<Family::kFwdSm90> { using type = HeadDims<64, 96, 128, 192, 256>; };
template <> struct FamilyHeadDims<Family::kBwdSm90> { using type = HeadDims<64, 128, 256>; };
template <> struct FamilyHeadDims<Family::kDecode> { using type = HeadDims<64, 128, 256>; };

// Whether this build compiled kernels of head dim d / of the dtype / of the Hopper families.
constexpr bool head_dim_built(int d) {
  switch (d) {
#ifdef FLASH_EXT_HDIM_32
    case 32: return true;
#endif
#ifdef FLASH_EXT_HDIM_64
    case 64: return true;
#endif
#ifdef FLASH_EXT_HDIM_96
    case 96: return true;
#endif
#ifdef FLASH_EXT_HDIM_128
    case 128: return true;
#endif
#ifdef FLASH_EXT_HDIM_192
    case 192: return true;
#endif
#ifdef FLASH_EXT_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

constexpr bool dtype_built(bool is_bf16) {
#ifdef FLASH_EXT_BF16
  if (is_bf16) return true;
#endif
#ifdef FLASH_EXT_FP16
  if (!is_bf16) return true;
#endif
  return false;
}

constexpr bool family_built(Family f) {
#ifdef FLASH_EXT_SM90A
  constexpr bool kSm90 = true;
#else
  constexpr bool kSm90 = false;
#endif
  return (f == Family::kFwdSm90 || f == Family::kBwdSm90) ? kSm90 : true;
}

namespace detail {
template <int... kDims>
constexpr int smallest_built(HeadDims<kDims...>, int d) {
  int best = 0;
  ((best == 0 && kDims >= d && head_dim_built(kDims) ? (best = kDims) : 0), ...);
  return best;
}

template <int kD, typename Fn>
bool visit_one(int kd, Fn& fn) {
  if constexpr (head_dim_built(kD)) {
    if (kd == kD) {
      fn(std::integral_constant<int, kD>{});
      return true;
    }
  }
  return false;
}

template <int... kDims, typename Fn>
bool visit_head_dim(HeadDims<kDims...>, int kd, Fn& fn) {
  return (visit_one<kDims>(kd, fn) || ...);
}
}  // namespace detail

// The smallest kernel head dim of family F built here that covers head dim d; 0 = none.
template <Family F>
constexpr int kernel_head_dim(int d) {
  return family_built(F) ? detail::smallest_built(typename FamilyHeadDims<F>::type{}, d) : 0;
}

// Calls fn(std::integral_constant<int, kd>{}) for a built kernel head dim kd of family F;
// false (nothing called) when kd is none of them. Only built head dims are instantiated.
template <Family F, typename Fn>
bool visit_kernel_head_dim(int kd, Fn&& fn) {
  if constexpr (family_built(F)) {
    return detail::visit_head_dim(typename FamilyHeadDims<F>::type{}, kd, fn);
  } else {
    return false;
  }
}

// Calls fn(std::bool_constant<is_bf16>{}) when the dtype is built; false otherwise.
template <typename Fn>
bool visit_dtype(bool is_bf16, Fn&& fn) {
  if (is_bf16) {
    if constexpr (dtype_built(true)) {
      fn(std::true_type{});
      return true;
    }
  } else {
    if constexpr (dtype_built(false)) {
      fn(std::false_type{});
      return true;
    }
  }
  return false;
}

}  // namespace flash_ext
