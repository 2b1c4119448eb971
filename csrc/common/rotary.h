// Rotary position embedding of one 16-byte chunk of a row (8 columns), in fp32 and rounded back
// to the element type, FlashAttention's two pairings: interleaved (columns 2i, 2i+1 with angle
// i) or half-split (GPT-NeoX: columns i, i + rotary_dim / 2 with angle i). Used by the decode
// kernel's Q load and the KV-cache append kernel.
#pragma once
#include <cuda_runtime.h>

namespace flash_ext {

// The 8 columns [col, col + 8) of `row` after rotation at the position whose cos / sin table
// rows are cos_row / sin_row (rotary_dim / 2 entries each). rotary_dim % 16 == 0, col % 8 == 0;
// columns >= rotary_dim come back unchanged.
template <typename Element>
__device__ __forceinline__ uint4 rotary_chunk(const Element* row, int col, int rotary_dim, bool interleaved,
                                              const Element* cos_row, const Element* sin_row) {
  const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
  if (col >= rotary_dim) return raw;
  const Element* x = reinterpret_cast<const Element*>(&raw);
  uint4 out_raw;
  Element* out = reinterpret_cast<Element*>(&out_raw);
  if (interleaved) {
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const int i = (col + k) / 2;
      const float c = float(cos_row[i]), s = float(sin_row[i]);
      const float x0 = float(x[k]), x1 = float(x[k + 1]);
      out[k] = Element(x0 * c - x1 * s);
      out[k + 1] = Element(x1 * c + x0 * s);
    }
  } else {
    const int half = rotary_dim / 2;
    const bool low = col < half;  // the partner chunk is half columns right (low) or left
    const uint4 partner_raw = *reinterpret_cast<const uint4*>(row + (low ? col + half : col - half));
    const Element* y = reinterpret_cast<const Element*>(&partner_raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = (low ? col : col - half) + k;
      const float c = float(cos_row[i]), s = float(sin_row[i]);
      const float xv = float(x[k]), yv = float(y[k]);
      out[k] = Element(low ? xv * c - yv * s : xv * c + yv * s);
    }
  }
  return out_raw;
}

}  // namespace flash_ext
