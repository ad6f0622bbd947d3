// Elementwise kernels of the linear family (everything that is not a GEMM):
//   activation_kernel: y = act(z) after an unfused GEMM (or z = bias when K = 0);
//   dz_kernel:         dz = dout * act'(pre), the input of both backward GEMMs;
//   column_sum_kernel: dbias = sum over rows of dout * act'(pre), when no GEMM can fuse it.
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

// T: the storage type; float32 storage keeps the exact gelu_erf (ActivationMath's kFastGeluErf).
template <Activation A, typename T>
__device__ __forceinline__ float act_forward(float x) {
  return detail::ActivationMath<float, !std::is_same_v<T, float>>::forward(A, x, 0.0f);
}
template <Activation A, typename T>
__device__ __forceinline__ float act_derivative(float x) {
  return detail::ActivationMath<float, !std::is_same_v<T, float>>::derivative(A, x, 0.0f);
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

// dz = dout * act'(pre).
template <typename T, Activation A, int VEC>
__global__ void dz_kernel(const T* __restrict__ dout, std::int64_t lddout,
                          const T* __restrict__ pre, std::int64_t ldpre, T* __restrict__ dz,
                          std::int64_t lddz, Rows rows) {
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= rows.n) return;
  for (std::int64_t r = blockIdx.y; r < rows.m; r += gridDim.y) {
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(dout + r * lddout + col);
    const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(pre + r * ldpre + col);
    Pack<T, VEC> out;
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      out.v[i] = from_float<T>(to_float(g.v[i]) * act_derivative<A, T>(to_float(p.v[i])));
    *reinterpret_cast<Pack<T, VEC>*>(dz + r * lddz + col) = out;
  }
}

// dbias[c] = sum over rows of dout * act'(pre) (act none: of dout; pre unused). A block owns 64
// columns (two per lane) and its 8 warps take every 8th row; the 8 partial sums are added in warp
// order, so the result does not depend on scheduling. Only used when the dW GEMM cannot fuse the
// bias gradient (or dW is not wanted).
inline constexpr int kColumnSumWarps = 8;
inline constexpr int kColumnSumCols = 64;

template <typename T, Activation A>
__global__ void column_sum_kernel(const T* __restrict__ dout, std::int64_t lddout,
                                  const T* __restrict__ pre, std::int64_t ldpre,
                                  T* __restrict__ dbias, Rows rows) {
  __shared__ float partial[kColumnSumWarps][kColumnSumCols];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kColumnSumCols + 2 * lane;
  float sum[2] = {0.0f, 0.0f};
  for (std::int64_t r = warp; r < rows.m; r += kColumnSumWarps) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const std::int64_t c = c0 + j;
      if (c < rows.n) {
        float g = to_float(dout[r * lddout + c]);
        if constexpr (A != Activation::none) g *= act_derivative<A, T>(to_float(pre[r * ldpre + c]));
        sum[j] += g;
      }
    }
  }
  partial[warp][2 * lane] = sum[0];
  partial[warp][2 * lane + 1] = sum[1];
  __syncthreads();
  if (threadIdx.x < kColumnSumCols) {
    const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kColumnSumWarps; ++w) total += partial[w][threadIdx.x];
    if (c < rows.n) dbias[c] = from_float<T>(total);
  }
}

}  // namespace fusekit::linear::kernels
