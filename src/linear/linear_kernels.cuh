// Elementwise kernels of the linear family (everything that is not a GEMM):
//   activation_kernel: y = act(z) after an unfused GEMM (or z = bias when K = 0);
//   dz_kernel:         dz = dout * act'(pre), the input of both backward GEMMs, and/or its
//                      per-block column sums (dbias, finished by core/partial_rows.cuh).
// All math in float32 via the shared activation definitions (core/activation.h); one rounding to
// the storage type per output element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/activation.h"

namespace fusekit::linear::kernels {

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return __float2bfloat16_rn(v);
}

// VEC elements moved as one 16-byte (or smaller) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// T: the storage type; float32 storage keeps the exact gelu_erf, 16-bit storage (dz and dbias both
// 16-bit) the degree-5 fit (ActivationMath's GeluErfMath).
template <typename T>
inline constexpr detail::GeluErfMath kGeluErfFor =
    std::is_same_v<T, float> ? detail::GeluErfMath::exact : detail::GeluErfMath::fit_16bit;

template <Activation A, typename T>
__device__ __forceinline__ float act_forward(float x) {
  return detail::ActivationMath<float, kGeluErfFor<T>>::forward(A, x, 0.0f);
}
template <Activation A, typename T>
__device__ __forceinline__ float act_derivative(float x) {
  return detail::ActivationMath<float, kGeluErfFor<T>>::derivative(A, x, 0.0f);
}

// Rows go to blockIdx.y (grid-stride), VEC-element chunks of a row to blockIdx.x * blockDim.x +
// threadIdx.x: no integer division anywhere.
struct Rows {
  std::int64_t m = 0, n = 0;
};

// y = act(z). z == nullptr: z = bias[n] (or 0 without bias), and `pre` (if any) receives z
// (the K = 0 case, where there is no GEMM to write it).
template <typename T, Activation A, int VEC>
__global__ void activation_kernel(const T* z, std::int64_t ldz,  // may be y itself (in place)
                                  const T* __restrict__ bias, T* __restrict__ pre,
                                  std::int64_t ldpre, T* y, std::int64_t ldy, Rows rows) {
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= rows.n) return;
  for (std::int64_t r = blockIdx.y; r < rows.m; r += gridDim.y) {
    Pack<T, VEC> in, out;
    if (z) {
      in = *reinterpret_cast<const Pack<T, VEC>*>(z + r * ldz + col);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) in.v[i] = bias ? bias[col + i] : from_float<T>(0.0f);
      if (pre) *reinterpret_cast<Pack<T, VEC>*>(pre + r * ldpre + col) = in;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = from_float<T>(act_forward<A, T>(to_float(in.v[i])));
    *reinterpret_cast<Pack<T, VEC>*>(y + r * ldy + col) = out;
  }
}

// dz = dout * act'(pre), and/or the column sums of dz that make dbias.
// What the dz pass writes: dz (the input of both backward GEMMs), the column sums of dz, or both.
// A == none only sums (dout itself: the bias gradient of a linear layer without activation).
enum class DzOutputs { dz, dz_and_sums, sums };

// Storing dz: OUT is dz or dz_and_sums.
// Sums (OUT is sums or dz_and_sums): each thread also adds up its VEC columns of dz over the rows it walks (blockIdx.y, then
// every gridDim.y-th row) and writes them to partial row blockIdx.y of `partial` (gridDim.y rows
// of rows.n floats); sum_partial_rows_kernel then adds the partial rows in a fixed order. The sums
// are of dz as stored (rounded to T), the values the GEMMs read, and cost no extra memory pass:
// cuBLASLt's BGRADB epilogue, which sums them inside the dW GEMM instead, makes that GEMM ~3%
// slower (bench: linear bwd (8192, 4096, 16384), H200).
// ROWS: rows loaded before any is computed, so that each thread has ROWS x 2 loads in flight
// while the derivative's math runs (kDzRowsInFlight in linear_cuda.cu).
template <typename T, Activation A, int VEC, DzOutputs OUT, int ROWS>
__global__ void dz_kernel(const T* __restrict__ dout, std::int64_t lddout,
                          const T* __restrict__ pre, std::int64_t ldpre, T* __restrict__ dz,
                          std::int64_t lddz, float* __restrict__ partial, Rows rows) {
  constexpr bool WRITE_DZ = OUT != DzOutputs::sums;
  constexpr bool SUMS = OUT != DzOutputs::dz;
  static_assert(WRITE_DZ || SUMS, "nothing to do");
  static_assert(A != Activation::none || !WRITE_DZ, "dz is dout itself without an activation");
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= rows.n) return;
  float sum[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) sum[i] = 0.0f;
  const std::int64_t step = gridDim.y;
  for (std::int64_t r0 = blockIdx.y; r0 < rows.m; r0 += ROWS * step) {
    Pack<T, VEC> g[ROWS], p[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const std::int64_t r = r0 + j * step;
      if (j == 0 || r < rows.m) {
        g[j] = *reinterpret_cast<const Pack<T, VEC>*>(dout + r * lddout + col);
        if constexpr (A != Activation::none) p[j] = *reinterpret_cast<const Pack<T, VEC>*>(pre + r * ldpre + col);
      }
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const std::int64_t r = r0 + j * step;
      if (j > 0 && r >= rows.m) break;
      Pack<T, VEC> out = g[j];
      if constexpr (A != Activation::none) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          out.v[i] = from_float<T>(to_float(g[j].v[i]) * act_derivative<A, T>(to_float(p[j].v[i])));
      }
      if constexpr (WRITE_DZ) *reinterpret_cast<Pack<T, VEC>*>(dz + r * lddz + col) = out;
      if constexpr (SUMS) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum[i] += to_float(out.v[i]);
      }
    }
  }
  if constexpr (SUMS) {
    float* row = partial + static_cast<std::int64_t>(blockIdx.y) * rows.n + col;
#pragma unroll
    for (int i = 0; i < VEC; ++i) row[i] = sum[i];
  }
}

}  // namespace fusekit::linear::kernels
