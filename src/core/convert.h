// Host-side element conversions for the CPU backend and the tests. They use the CUDA toolkit's
// own conversion routines (host-callable), so that CPU and GPU round identically: round to nearest
// even; fp8 saturates to the finite maximum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "fusekit/tensor.h"

namespace fusekit::detail {

inline double load_as_double(const void* base, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[index];
    case DType::f64: return static_cast<const double*>(base)[index];
    case DType::f16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    case DType::f8e4m3:
      return static_cast<float>(static_cast<const __nv_fp8_e4m3*>(base)[index]);
    case DType::f8e5m2:
      return static_cast<float>(static_cast<const __nv_fp8_e5m2*>(base)[index]);
    case DType::u8: return static_cast<const std::uint8_t*>(base)[index];
    case DType::i32: return static_cast<const std::int32_t*>(base)[index];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(base)[index]);
  }
  return 0.0;
}

// Rounds like the GPU does: double -> float first, then float -> the storage type.
inline void store_from_double(void* base, DType dtype, std::int64_t index, double value) {
  const float f = static_cast<float>(value);
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[index] = f; break;
    case DType::f64: static_cast<double*>(base)[index] = value; break;
    case DType::f16: static_cast<__half*>(base)[index] = __float2half_rn(f); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(f); break;
    case DType::f8e4m3: static_cast<__nv_fp8_e4m3*>(base)[index] = __nv_fp8_e4m3(f); break;
    case DType::f8e5m2: static_cast<__nv_fp8_e5m2*>(base)[index] = __nv_fp8_e5m2(f); break;
    case DType::u8: static_cast<std::uint8_t*>(base)[index] = static_cast<std::uint8_t>(value); break;
    case DType::i32: static_cast<std::int32_t*>(base)[index] = static_cast<std::int32_t>(value); break;
    case DType::i64: static_cast<std::int64_t*>(base)[index] = static_cast<std::int64_t>(value); break;
  }
}

// The value `value` takes after a round trip through `dtype` (for error baselines).
inline double round_to(DType dtype, double value) {
  unsigned char buf[8];
  store_from_double(buf, dtype, 0, value);
  return load_as_double(buf, dtype, 0);
}

}  // namespace fusekit::detail
