// The one driver call the Hopper kernels' host side makes: cuTensorMapEncodeTiled, once per TMA
// descriptor (3-4 per forward, 4 per backward, every call).
//
// CUTLASS's make_tma_copy reaches it through cutlass::call_cuTensorMapEncodeTiled<Args...>, which
// looks the driver entry point up by name (cudaGetDriverEntryPointByVersion) on every call. This
// declares an explicit specialization of that template for the argument types make_tma_copy
// passes; its definition (tensor_map_encode.cu) looks the entry point up once per process.
// Nothing links libcuda. Include it after CUTLASS's headers and before a launcher is
// instantiated; if CUTLASS's argument types ever change, the specialization no longer matches and
// CUTLASS's own per-call lookup runs again (correct, a little slower).
#pragma once
#include <cuda.h>
#include <cstdint>

#include <cutlass/cuda_host_adapter.hpp>

namespace cutlass {

template <>
CUresult call_cuTensorMapEncodeTiled<CUtensorMap*, CUtensorMapDataType, int, void*, uint64_t*, uint64_t*, uint32_t*,
                                     uint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill>(
    CUtensorMap* map, CUtensorMapDataType dtype, int rank, void* address, uint64_t* dims, uint64_t* strides,
    uint32_t* box, uint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill);

}  // namespace cutlass
