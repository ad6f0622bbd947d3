// LayerNorm / RMSNorm on rows that the 16-byte vectors cannot take (a row stride or pointer off
// the vector: N odd, say, in a contiguous tensor), rows of up to 4096 elements held in registers
// one element at a time. The generic kernels they replace there (one block of 512 threads a row,
// the row read three times, dweight summed in global memory row by row) reached 3-24% of copy
// bandwidth (scripts/norm_sweep.py, H200, bf16, N % 8 != 0 below 4096, medians by range); these
// reach 26-31% forward and 21-26% backward, still far from the vector kernels' 85-100%.
//
// A team of `tpr` threads (a power of two, 32..512) owns a row: thread t holds the row's columns
// t, t + tpr, ..., ELEMS of them, so that each load of a warp reads 32 consecutive elements.
// Those columns are the same in every row the team takes, so the weight (and, from y, the bias)
// sits in registers for the kernel's life, and so do the backward's dweight / dbias sums: a block's
// teams add theirs into the block's workspace row one team after the other at the end (a fixed
// order, as the reduction of the partial rows that follows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "norm/norm_element_kernels.h"
#include "norm/norm_kernels.cuh"

namespace fusekit::norm {
namespace {

using detail::device::from_float;
using detail::device::to_float;
using kernels::row_allreduce;
using kernels::RowTeam;

// Block of the element kernels: kElementBlockThreads / tpr teams, each a row at a time.
constexpr int kMaxTeams = kElementBlockThreads / 32;

// Asks L2 for the 128-byte lines of a row of `cols` elements at `row`, spread over the team's
// threads; every address asked is one of the row's elements.
template <typename T>
__device__ __forceinline__ void request_row_l2(const T* row, int cols, int t, int tpr) {
  constexpr int kLine = 128 / sizeof(T);
  for (int c = t * kLine; c < cols; c += tpr * kLine) detail::device::prefetch_l2(row + c);
  if (t == 0) detail::device::prefetch_l2(row + cols - 1);  // a line the row reaches into unaligned
}

template <typename T, typename W, int ELEMS>
__global__ void __launch_bounds__(kElementBlockThreads) forward_elements_kernel(ForwardParams p, int tpr) {
  __shared__ float scratch[2][kMaxTeams * 2];
  const int team_index = threadIdx.x / tpr, t = threadIdx.x - team_index * tpr;
  const RowTeam team(tpr, team_index, t);
  float* my_scratch[2] = {scratch[0] + team_index * (tpr / 32) * 2, scratch[1] + team_index * (tpr / 32) * 2};
  const int teams = kElementBlockThreads / tpr;
  const int cols = static_cast<int>(p.cols);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ residual = static_cast<const T*>(p.residual);
  T* __restrict__ y = static_cast<T*>(p.y);
  T* __restrict__ sum = static_cast<T*>(p.sum);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  float w[ELEMS], b[ELEMS];
#pragma unroll
  for (int k = 0; k < ELEMS; ++k) {
    const int c = t + k * tpr;
    w[k] = weight && c < cols ? to_float(weight[c]) : 1.0f;
    b[k] = bias && c < cols ? to_float(bias[c]) : 0.0f;
  }
  const std::int64_t first = std::int64_t(blockIdx.x) * teams + team_index;
  const std::int64_t stride = std::int64_t(gridDim.x) * teams;
  // fetch(row) loads the row into registers and asks L2 for the team's row after it, so that those
  // loads find L2 (registers for a row in flight ahead cost occupancy: slower).
  float next_x[ELEMS], next_r[ELEMS], next_shift = 0.0f;
  auto fetch = [&](std::int64_t row) {
    if (row >= p.rows) return;
    if (row + stride < p.rows) {
      request_row_l2(x + (row + stride) * p.x_row_stride, cols, t, tpr);
      if (residual) request_row_l2(residual + (row + stride) * p.residual_row_stride, cols, t, tpr);
    }
    const T* xr = x + row * p.x_row_stride;
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int c = t + k * tpr;
      next_x[k] = c < cols ? to_float(xr[c]) : 0.0f;
    }
    if (residual) {
      const T* rr = residual + row * p.residual_row_stride;
#pragma unroll
      for (int k = 0; k < ELEMS; ++k) {
        const int c = t + k * tpr;
        next_r[k] = c < cols ? to_float(rr[c]) : 0.0f;
      }
    }
    // LayerNorm's statistics are sums of d = v - K with K the row's first element (one reduction
    // for both; the row kernels' form, norm_kernels.cuh).
    if (layer_norm)
      next_shift = residual
                       ? to_float(from_float<T>(to_float(xr[0]) + to_float(residual[row * p.residual_row_stride])))
                       : to_float(xr[0]);
  };
  int parity = 0;  // reductions alternate scratch buffers: a team's next one may start while a
                   // slower warp still reads the last one's
  fetch(first);
  for (std::int64_t row = first; row < p.rows; row += stride) {
    float v[ELEMS];
#pragma unroll
    for (int k = 0; k < ELEMS; ++k)  // round(x + residual) in T, as the CPU reference forms the sum
      v[k] = residual ? to_float(from_float<T>(next_x[k] + next_r[k])) : next_x[k];
    const float shift = next_shift;
    float s[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const float d = t + k * tpr < cols ? v[k] - shift : 0.0f;
      s[0] += d;
      s[1] += d * d;
    }
    float mean = 0.0f, rstd;
    if (layer_norm) {
      row_allreduce<2, true>(s, my_scratch[parity], team);
      const float mean_d = s[0] * inv_cols;
      mean = shift + mean_d;
      rstd = rsqrtf(fmaxf(s[1] * inv_cols - mean_d * mean_d, 0.0f) + p.eps);
    } else {
      float q[1] = {s[1]};
      row_allreduce<1, true>(q, my_scratch[parity], team);
      rstd = rsqrtf(q[0] * inv_cols + p.eps);
    }
    parity ^= 1;
    T* yr = y + row * p.y_row_stride;
    T* sr = sum ? sum + row * p.sum_row_stride : nullptr;
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int c = t + k * tpr;
      if (c < cols) {
        if (sr) sr[c] = from_float<T>(v[k]);
        yr[c] = from_float<T>((v[k] - mean) * rstd * w[k] + b[k]);
      }
    }
    fetch(row + stride);
    if (t == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
  }
}

template <typename T, typename W, int ELEMS>
__global__ void __launch_bounds__(kElementBlockThreads)
    backward_elements_kernel(BackwardParams p, int tpr, float* __restrict__ partial_dw,
                             float* __restrict__ partial_db) {
  __shared__ float scratch[2][kMaxTeams * 2];
  const int team_index = threadIdx.x / tpr, t = threadIdx.x - team_index * tpr;
  const RowTeam team(tpr, team_index, t);
  float* my_scratch[2] = {scratch[0] + team_index * (tpr / 32) * 2, scratch[1] + team_index * (tpr / 32) * 2};
  const int teams = kElementBlockThreads / tpr;
  const int cols = static_cast<int>(p.cols);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  T* dx = static_cast<T*>(p.dx);  // not __restrict__: dsum may be dx
  const T* dsum = static_cast<const T*>(p.dsum);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  float w[ELEMS], b[ELEMS], acc_dw[ELEMS], acc_db[ELEMS];
#pragma unroll
  for (int k = 0; k < ELEMS; ++k) {
    const int c = t + k * tpr;
    w[k] = weight && c < cols ? to_float(weight[c]) : 1.0f;
    b[k] = p.from_output && bias && c < cols ? to_float(bias[c]) : 0.0f;
    acc_dw[k] = acc_db[k] = 0.0f;
  }
  const std::int64_t first = std::int64_t(blockIdx.x) * teams + team_index;
  const std::int64_t stride = std::int64_t(gridDim.x) * teams;
  // fetch(row): the forward's.
  float next_dy[ELEMS], next_in[ELEMS], next_dsum[ELEMS], next_rstd = 0.0f, next_mean = 0.0f;
  auto fetch = [&](std::int64_t row) {
    if (row >= p.rows) return;
    if (row + stride < p.rows) {
      request_row_l2(dy + (row + stride) * p.dy_row_stride, cols, t, tpr);
      request_row_l2(in + (row + stride) * p.input_row_stride, cols, t, tpr);
      if (dsum && dx) request_row_l2(dsum + (row + stride) * p.dsum_row_stride, cols, t, tpr);
    }
    const T* dyr = dy + row * p.dy_row_stride;
    const T* ir = in + row * p.input_row_stride;
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int c = t + k * tpr;
      next_dy[k] = c < cols ? to_float(dyr[c]) : 0.0f;
      next_in[k] = c < cols ? to_float(ir[c]) : 0.0f;
    }
    if (dsum && dx) {  // read before this row's dx is written (dsum may be dx)
      const T* dsr = dsum + row * p.dsum_row_stride;
#pragma unroll
      for (int k = 0; k < ELEMS; ++k) {
        const int c = t + k * tpr;
        next_dsum[k] = c < cols ? to_float(dsr[c]) : 0.0f;
      }
    }
    next_rstd = p.rstd[row];
    next_mean = (layer_norm && !p.from_output) ? p.mean[row] : 0.0f;
  };
  int parity = 0;
  fetch(first);
  for (std::int64_t row = first; row < p.rows; row += stride, parity ^= 1) {
    float d[ELEMS], xh[ELEMS], ds[ELEMS];
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      d[k] = next_dy[k];
      xh[k] = next_in[k];
      ds[k] = next_dsum[k];
    }
    const float rstd = next_rstd, mean = next_mean;
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      xh[k] = p.from_output ? (xh[k] - b[k]) / w[k] : (xh[k] - mean) * rstd;
      if (t + k * tpr >= cols) xh[k] = 0.0f;  // d is 0 there: g and g * xh add nothing
      const float g = d[k] * w[k];
      sums[0] += g;
      sums[1] += g * xh[k];
    }
    row_allreduce<2, true>(sums, my_scratch[parity], team);
    const float mean_g = layer_norm ? sums[0] * inv_cols : 0.0f;
    const float mean_gx = sums[1] * inv_cols;
    T* dxr = dx ? dx + row * p.dx_row_stride : nullptr;
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int c = t + k * tpr;
      if (c < cols && dxr) {
        float out = rstd * (d[k] * w[k] - mean_g - xh[k] * mean_gx);
        if (dsum) out += ds[k];
        dxr[c] = from_float<T>(out);
      }
      acc_dw[k] += d[k] * xh[k];
      acc_db[k] += d[k];
    }
    fetch(row + stride);
  }
  if (partial_dw == nullptr) return;  // uniform over the grid
  // The block's workspace row: its teams' sums added in team order.
  float* my_dw = partial_dw + std::int64_t(blockIdx.x) * partial_pitch(p.cols);
  float* my_db = partial_db + std::int64_t(blockIdx.x) * partial_pitch(p.cols);
  for (int turn = 0; turn < teams; ++turn) {
    __syncthreads();
    if (turn == team_index) {
#pragma unroll
      for (int k = 0; k < ELEMS; ++k) {
        const int c = t + k * tpr;
        if (c < cols) {
          my_dw[c] = turn == 0 ? acc_dw[k] : my_dw[c] + acc_dw[k];
          my_db[c] = turn == 0 ? acc_db[k] : my_db[c] + acc_db[k];
        }
      }
    }
  }
}

}  // namespace

template <typename T, typename W>
void launch_forward_elements(const ForwardParams& p, const ElementShape& shape, int grid, cudaStream_t stream) {
  switch (shape.elements_per_thread) {
    case 4:
      forward_elements_kernel<T, W, 4><<<grid, kElementBlockThreads, 0, stream>>>(p, shape.threads_per_row);
      break;
    default:
      forward_elements_kernel<T, W, 8><<<grid, kElementBlockThreads, 0, stream>>>(p, shape.threads_per_row);
      break;
  }
}

template <typename T, typename W>
void launch_backward_elements(const BackwardParams& p, const ElementShape& shape, int grid, float* partial_dw,
                              float* partial_db, cudaStream_t stream) {
  const int tpr = shape.threads_per_row;
  switch (shape.elements_per_thread) {
    case 4:
      backward_elements_kernel<T, W, 4><<<grid, kElementBlockThreads, 0, stream>>>(p, tpr, partial_dw, partial_db);
      break;
    default:
      backward_elements_kernel<T, W, 8><<<grid, kElementBlockThreads, 0, stream>>>(p, tpr, partial_dw, partial_db);
      break;
  }
}


#define FUSEKIT_NORM_ELEMENTS(T, W)                                                                            \
  template void launch_forward_elements<T, W>(const ForwardParams&, const ElementShape&, int, cudaStream_t); \
  template void launch_backward_elements<T, W>(const BackwardParams&, const ElementShape&, int, float*, float*, \
                                               cudaStream_t);
FUSEKIT_NORM_ELEMENTS(float, float)
FUSEKIT_NORM_ELEMENTS(__half, __half)
FUSEKIT_NORM_ELEMENTS(__half, float)
FUSEKIT_NORM_ELEMENTS(__nv_bfloat16, __nv_bfloat16)
FUSEKIT_NORM_ELEMENTS(__nv_bfloat16, float)
#undef FUSEKIT_NORM_ELEMENTS

}  // namespace fusekit::norm
