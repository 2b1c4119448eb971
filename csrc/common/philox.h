// Philox4x32-10: the counter-based random number generator of Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3" (SC'11), as specified by the Random123 library. A pure function
//     (counter: 4 x uint32, key: 2 x uint32) -> 4 x uint32 uniformly distributed words,
// so any thread can regenerate any word without state: the dropout mask of the forward is
// recomputed bit-exactly by the backward kernels (common/dropout.h).
//
// One round:  (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0,  lo(M1 c2),  hi(M0 c0) ^ c3 ^ k1,  lo(M0 c0))
// with the 64-bit products M0 c0 and M1 c2 split into 32-bit halves; between rounds the key is
// bumped by the Weyl constants (k0 += W0, k1 += W1). 10 rounds, 9 bumps. Checked against the
// Random123 known-answer vectors in tests/test_dropout.py (through the Python twin in
// flash_ext/_philox.py, which the GPU tests compare with this header's output bit for bit).
//
// Host and device: flash_ext's dropout_mask op and the kernels use the device path (__umulhi);
// the host path exists so that C++ host code could use the same function.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_EXT_HD __host__ __device__ __forceinline__
#else
#define FLASH_EXT_HD inline
#endif

namespace flash_ext {

struct Philox4 {
  uint32_t x, y, z, w;
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

FLASH_EXT_HD uint32_t philox_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

FLASH_EXT_HD Philox4 philox_round(Philox4 c, uint32_t k0, uint32_t k1) {
  const uint32_t hi0 = philox_mulhi(kPhiloxM0, c.x), lo0 = kPhiloxM0 * c.x;
  const uint32_t hi1 = philox_mulhi(kPhiloxM1, c.z), lo1 = kPhiloxM1 * c.z;
  return Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
}

// Philox4x32 with `kRounds` rounds (10 is the standard, crush-resistant choice; the template
// parameter exists so that the 7-round known-answer vectors can be checked too).
template <int kRounds = 10>
FLASH_EXT_HD Philox4 philox4x32(Philox4 ctr, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kRounds; ++i) {
    if (i > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    ctr = philox_round(ctr, k0, k1);
  }
  return ctr;
}

}  // namespace flash_ext
