// The second half of a deterministic column sum. A kernel that sums a tall matrix over its rows
// (a bias gradient) leaves one float32 "partial row" per block slot in a workspace, each slot
// having summed a fixed set of rows in a fixed order; this kernel adds the partial rows, again in
// a fixed order, and rounds once to the output type. Nothing depends on which block ran first,
// so the result is bitwise the same run after run (no atomics).
//
// Used by bias + activation + dropout (dbias), linear (dbias from the dz pass) and FP8 RMSNorm
// (dweight).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/dependent_launch.h"
#include "core/device_vector.cuh"

namespace fusekit::detail::device {

// Block (32, kPartialRowLanes): threadIdx.x picks the column (coalesced), threadIdx.y strides over
// the partial rows with its loads unrolled so that several are in flight (the kernel is a chain
// of L2 latencies, not bandwidth); the per-lane sums are then added by a fixed shared-memory tree.
inline constexpr int kPartialRowLanes = 32;

template <typename D>
__global__ void __launch_bounds__(32 * kPartialRowLanes)
    sum_partial_rows_kernel(const float* __restrict__ partial, int partial_rows, std::int64_t cols,
                            D* __restrict__ out) {
  wait_for_prerequisite_grid();  // the producer's partial rows (a no-op after a plain launch)
  __shared__ float sums[kPartialRowLanes][33];
  const std::int64_t col = std::int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
    const float* at = partial + col;
    int b = threadIdx.y;
    constexpr int kAhead = 4;
    for (; b + (kAhead - 1) * kPartialRowLanes < partial_rows; b += kAhead * kPartialRowLanes) {
      float v[kAhead];
#pragma unroll
      for (int a = 0; a < kAhead; ++a) v[a] = at[std::int64_t(b + a * kPartialRowLanes) * cols];
#pragma unroll
      for (int a = 0; a < kAhead; ++a) s += v[a];
    }
    for (; b < partial_rows; b += kPartialRowLanes) s += at[std::int64_t(b) * cols];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
#pragma unroll
  for (int half = kPartialRowLanes / 2; half > 0; half /= 2) {
    if (threadIdx.y < half) sums[threadIdx.y][threadIdx.x] += sums[threadIdx.y + half][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < cols) out[col] = from_float<D>(sums[0][threadIdx.x]);
}

// out[c] = sum over r < partial_rows of partial[r * cols + c], launched as a programmatic
// dependent of the kernel before it on `stream` (core/dependent_launch.h): its launch overlaps that
// kernel's drain, and the kernel waits for the partial rows inside.
template <typename D>
void launch_sum_partial_rows(const float* partial, int partial_rows, std::int64_t cols, D* out,
                             cudaStream_t stream, const char* op, const char* what) {
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32)), block(32, kPartialRowLanes);
  launch_dependent(sum_partial_rows_kernel<D>, grid, block, 0, stream, partial, partial_rows, cols, out);
  check_launch(op, what);
}

}  // namespace fusekit::detail::device
