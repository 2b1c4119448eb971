// cutlass::call_cuTensorMapEncodeTiled for make_tma_copy's argument types (declared in
// sm90/tensor_map_encode.h): the driver's entry point, looked up once per process.
#include "sm90/tensor_map_encode.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace cutlass {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 lookup_encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

}  // namespace

template <>
CUresult call_cuTensorMapEncodeTiled<CUtensorMap*, CUtensorMapDataType, int, void*, uint64_t*, uint64_t*, uint32_t*,
                                     uint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill>(
    CUtensorMap* map, CUtensorMapDataType dtype, int rank, void* address, uint64_t* dims, uint64_t* strides,
    uint32_t* box, uint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = lookup_encode_tiled();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, dtype, static_cast<cuuint32_t>(rank), address, dims, strides, box, element_strides, interleave,
                swizzle, l2_promotion, oob_fill);
}

}  // namespace cutlass
