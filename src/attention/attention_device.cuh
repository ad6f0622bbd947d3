// Small device helpers of the attention kernels (mma.sync and Hopper): infinities, the fast
// exp2, 16-bit pairs in a 32-bit word, row pointers into (b, s, h, d) operands, ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention_params.h"
#include "core/device_vector.cuh"

namespace fusekit::attention::kernels {

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// 2^x in one MUFU instruction (exp2f adds a denormal-range fix-up the softmax does not need:
// its arguments are <= 0 and results below 2^-126 are negligible against the row sum >= 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ T* row_ptr(const OperandArg& op, int b, std::int64_t token, int h) {
  return static_cast<T*>(op.data) + (static_cast<std::int64_t>(b) * op.b + token * op.s +
                                     static_cast<std::int64_t>(h) * op.h);
}

// Two floats as one 32-bit word of 16-bit values (lo in the low half) and back; the bit copies
// go through memcpy (core/device_vector.cuh's bit_copy), never a pointer cast of a local.
using detail::device::pack2;

template <typename T>
__device__ __forceinline__ float2 unpack2(std::uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<__half>(std::uint32_t w) {
  return __half22float2(detail::device::bit_copy<__half2>(w));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(std::uint32_t w) {
  return __bfloat1622float2(detail::device::bit_copy<__nv_bfloat162>(w));
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

}  // namespace fusekit::attention::kernels
