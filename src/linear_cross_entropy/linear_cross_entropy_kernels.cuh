// The two small kernels of linear_cross_entropy besides the GEMMs and the cross-entropy kernels:
//  * column_sums_kernel: db (+)= the column sums of one chunk's gradient, in a fixed order: a block
//    covers kSumColumns columns with kSumRowGroups row groups; group g adds rows g, g + groups, ...
//    in order, then the groups are added in order. The same chunk gives bitwise the same sums.
//  * store_rows_kernel: a float32 accumulator (contiguous rows) rounded once into the output's
//    dtype and row stride (dW, db where they are not float32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/device_vector.cuh"

namespace fusekit::lxent::kernels {

using detail::device::from_float;
using detail::device::to_float;

inline constexpr int kSumColumns = 32;
inline constexpr int kSumRowGroups = 8;
inline constexpr int kStoreThreads = 256;

// grid.x = ceil(cols / kSumColumns); block (kSumColumns, kSumRowGroups).
template <typename T>
__global__ void __launch_bounds__(kSumColumns * kSumRowGroups)
    column_sums_kernel(const T* __restrict__ x, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                       float* __restrict__ sums, bool accumulate) {
  __shared__ float partial[kSumRowGroups][kSumColumns];
  const std::int64_t col = std::int64_t(blockIdx.x) * kSumColumns + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (std::int64_t r = threadIdx.y; r < rows; r += kSumRowGroups) s += to_float(x[r * ld + col]);
  }
  partial[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = partial[0][threadIdx.x];
#pragma unroll
    for (int g = 1; g < kSumRowGroups; ++g) total += partial[g][threadIdx.x];
    sums[col] = accumulate ? sums[col] + total : total;
  }
}

// dst[r * ld + c] = src[r * cols + c], rounded to T; a grid-stride loop over rows x cols.
template <typename T>
__global__ void __launch_bounds__(kStoreThreads)
    store_rows_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, T* __restrict__ dst,
                      std::int64_t ld) {
  const std::int64_t total = rows * cols;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / cols, c = i - r * cols;
    dst[r * ld + c] = from_float<T>(src[i]);
  }
}

}  // namespace fusekit::lxent::kernels
