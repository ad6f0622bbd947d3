// Device-side conversions between the storage types the kernels read and write (f32, f16, bf16)
// and float32, and 16-byte vector packing. Shared by every op family's kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusekit::detail {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of T -> 16 / sizeof(T) floats. Takes the vector by value on purpose: given a
// reference into shared memory, the compiler reads each element with its own narrow,
// bank-conflicting load instead of one 128-bit load.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) out[i] = to_float(e[i]);
}

// Two floats -> two T in one 32-bit word (one conversion instruction for the pair).
template <typename T>
__device__ __forceinline__ std::uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// 16 / sizeof(T) floats -> 16 bytes of T, rounded to nearest even.
template <typename T>
__device__ __forceinline__ uint4 pack16(const float (&in)[16 / sizeof(T)]) {
  uint4 raw;
  if constexpr (sizeof(T) == 4) {
    raw = make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                     __float_as_uint(in[3]));
  } else {
    raw = make_uint4(pack2<T>(in[0], in[1]), pack2<T>(in[2], in[3]), pack2<T>(in[4], in[5]),
                     pack2<T>(in[6], in[7]));
  }
  return raw;
}

}  // namespace fusekit::detail
