// LayerNorm / RMSNorm CUDA kernels.
//
// Two families:
//  * Register-resident ("row in registers"): a group of TPR threads owns one row at a time and
//    holds it in registers as ITERS vectors of VEC elements per thread, so each element is read
//    from memory once and written once. Used when the row is 16-byte aligned and fits.
//  * Generic: one block per row, re-reading the row from L1/L2 between passes. Any N up to
//    65536 and any alignment; correctness path, not the tuned one.
//
// Backward kernels run on a persistent grid: each block walks rows and accumulates its own
// dweight/dbias partial sums in registers, writes one partial row per block to the workspace,
// and a second small kernel sums the partials over blocks in a fixed order (deterministic).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "norm/norm_params.h"

namespace fusekit::norm::kernels {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// VEC consecutive elements as floats, moved in 16-byte chunks (VEC * sizeof(T) is a multiple of
// 16 on the vector path, 1 element on the scalar path).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
  constexpr int kPerChunk = 16 / sizeof(T);
  if constexpr (VEC % kPerChunk == 0) {
#pragma unroll
    for (int c = 0; c < VEC / kPerChunk; ++c) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + c * kPerChunk);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerChunk; ++i) out[c * kPerChunk + i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(p[i]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
  constexpr int kPerChunk = 16 / sizeof(T);
  if constexpr (VEC % kPerChunk == 0) {
#pragma unroll
    for (int c = 0; c < VEC / kPerChunk; ++c) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerChunk; ++i) e[i] = from_float<T>(in[c * kPerChunk + i]);
      *reinterpret_cast<uint4*>(p + c * kPerChunk) = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = from_float<T>(in[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous global->shared copies (cp.async, sm_80+). Data in flight occupies shared memory,
// not registers, so each thread can keep several rows in flight at any occupancy.
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void copy_async_wait_dynamic(int pending) {
  // wait_group takes an immediate: dispatch the few depths used.
  if (pending >= 2) copy_async_wait<2>();
  else if (pending == 1) copy_async_wait<1>();
  else copy_async_wait<0>();
}

// The launch shape of the row-streaming kernels, decided on the host (norm_cuda.cu).
struct RowGeometry {
  int threads_per_row;  // a multiple of 32
  int rows_per_block;   // row groups per block (> 1 only for rows of one or two warps)
  int stages;           // rows in flight per group in the shared-memory ring (2 or 3)
};

// Sums K values over the `tpr` threads of a row group; every thread gets the total. The shuffle
// butterfly gives all lanes bitwise-identical sums, and the cross-warp step adds warps in index
// order, so the result does not depend on timing. `scratch` holds (tpr / 32) * K floats for this
// row group and must not be reused before the group's next barrier (callers alternate buffers).
// Contains the row group's barrier when tpr > 32: every thread of the group must call it.
// Synchronizes the `threads` threads of one row group only (hardware barrier `id`, 1..15; 0 is
// __syncthreads'). Row groups of one block then never wait on each other's reductions.
__device__ __forceinline__ void row_group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// kGroupBarrier: synchronize only the row group (backward: several groups per block that must not
// wait on each other) or the whole block with __syncthreads (forward: one group per block for
// rows of more than two warps; a block whose kernel names no other barrier keeps full occupancy,
// while a run-time barrier id makes the compiler reserve barriers and caps resident blocks).
template <int K, bool kGroupBarrier>
__device__ __forceinline__ void row_allreduce(float (&v)[K], float* scratch, int tpr) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  if (tpr > 32) {
    const int lane = threadIdx.x % 32, warp_in_row = (threadIdx.x % tpr) / 32;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) scratch[warp_in_row * K + k] = v[k];
    }
    if constexpr (kGroupBarrier) {
      row_group_barrier(1 + static_cast<int>(threadIdx.x) / tpr, tpr);
    } else {
      __syncthreads();
    }
    const int warps = tpr / 32;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
      for (int w = 0; w < warps; ++w) s += scratch[w * K + k];
      v[k] = s;
    }
  }
}

inline constexpr int kMaxWarpsPerBlock = 32;

// Takes the vector by value on purpose: given a reference into shared memory, the compiler reads
// each element with its own narrow, bank-conflicting load instead of one 128-bit load.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) out[i] = to_float(e[i]);
}


// ---------------------------------------------------------------------------------------------
// Forward, row in registers. A group of threads_per_row threads owns one row at a time: each thread
// loads ITERS 16-byte vectors (all loads in flight together), converts them to float once, and
// makes three passes over its registers (sum, squared deviations, output). Latency is hidden by
// many resident blocks (the grid covers all rows; a block takes further rows only when the grid
// is capped). Sums use one accumulator per vector so the adds are ITERS independent chains.
#ifndef FUSEKIT_NORM_FORWARD_MIN_BLOCKS
#define FUSEKIT_NORM_FORWARD_MIN_BLOCKS 2  // 64 registers: 2 blocks of 512 per SM (measured faster on 6 of 7 shapes)
#endif
template <typename T, typename W, int ITERS>
__global__ void __launch_bounds__(512, FUSEKIT_NORM_FORWARD_MIN_BLOCKS)
    forward_registers_kernel(ForwardParams p, RowGeometry geo) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ float scratch[2][kMaxWarpsPerBlock];
  const int tpr = geo.threads_per_row, rpb = geo.rows_per_block;
  const int group = threadIdx.x / tpr, t = threadIdx.x % tpr;
  auto my_scratch = [&](int phase) { return &scratch[phase][group * (tpr / 32)]; };
  const bool layer_norm = p.kind == Kind::layer_norm;
  const int cols = static_cast<int>(p.cols);
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  // Element offset of this thread's vector `it` within a row (int: N <= 65536).
  auto column = [&](int it) { return (it * tpr + t) * kVec; };

  for (std::int64_t base = std::int64_t(blockIdx.x) * rpb; base < p.rows; base += std::int64_t(gridDim.x) * rpb) {
    const std::int64_t row = base + group;
    const bool valid_row = row < p.rows;
    const T* __restrict__ x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    float v[ITERS][kVec];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (valid_row && column(it) < cols) {
        unpack16<T>(*reinterpret_cast<const uint4*>(x + column(it)), v[it]);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[it][i] = 0.0f;
      }
    }
    float mean = 0.0f;
    if (layer_norm) {
      float partial[ITERS];
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        partial[it] = 0.0f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) partial[it] += v[it][i];
      }
      float s[1] = {0.0f};
#pragma unroll
      for (int it = 0; it < ITERS; ++it) s[0] += partial[it];
      row_allreduce<1, false>(s, my_scratch(0), tpr);
      mean = s[0] * inv_cols;
    }
    // Squared deviations around the mean (padding lanes excluded: their (0 - mean)^2 is not 0).
    float partial[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      partial[it] = 0.0f;
      if (column(it) < cols) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = v[it][i] - mean;
          partial[it] += d * d;
        }
      }
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) q[0] += partial[it];
    row_allreduce<1, false>(q, my_scratch(1), tpr);
    const float rstd = rsqrtf(q[0] * inv_cols + p.eps);
    if (valid_row) {
      T* __restrict__ y = static_cast<T*>(p.y) + row * p.y_row_stride;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int col = column(it);
        if (col >= cols) continue;
        float w[kVec], b[kVec], out[kVec];
        if (weight) load_vec<W, kVec>(weight + col, w);
        if (bias) load_vec<W, kVec>(bias + col, b);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float o = (v[it][i] - mean) * rstd;
          if (weight) o *= w[i];
          if (bias) o += b[i];
          out[i] = o;
        }
        store_vec<T, kVec>(y + col, out);
      }
      if (t == 0) {
        if (p.mean) p.mean[row] = mean;
        if (p.rstd) p.rstd[row] = rstd;
      }
    }
    // LayerNorm's two reductions use buffers 0 then 1, so each buffer is rewritten only after a
    // barrier every reader of it has passed. RMSNorm uses buffer 1 alone and needs this barrier
    // before the next row rewrites it (uniform branch; no barrier exists for one-warp rows).
    if (tpr > 32 && !layer_norm) __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, dy and the input streamed through the same kind of ring (ring[stage][tensor][iter]
// [thread]), with the row's mean/rstd copied beside them (stats[stage][thread][2]). Per-column
// dweight/dbias sums stay in registers for the whole persistent loop; at the end the row groups of
// a block are combined in a fixed order and one partial row per block goes to the workspace.
template <typename T, typename W, int ITERS, bool FROM_OUTPUT, bool BIAS_GRAD>
__global__ void __launch_bounds__(512)
    backward_streaming_kernel(BackwardParams p, RowGeometry geo, float* __restrict__ partial_dw,
                              float* __restrict__ partial_db) {
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ uint4 ring[];
  __shared__ float scratch[2][kMaxWarpsPerBlock * 2];
  const int tpr = geo.threads_per_row, rpb = geo.rows_per_block, stages = geo.stages;
  const int group = threadIdx.x / tpr, t = threadIdx.x % tpr;
  auto my_scratch = [&](int phase) { return &scratch[phase][group * (tpr / 32) * 2]; };
  // Per-thread statistics slots after the data ring.
  float* stats = reinterpret_cast<float*>(ring + std::size_t(stages) * 2 * ITERS * blockDim.x);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool layer_norm = p.kind == Kind::layer_norm;
  constexpr bool from_output = FROM_OUTPUT;
  const bool needs_mean = layer_norm && !from_output;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  const std::int64_t stride_rows = std::int64_t(gridDim.x) * rpb;
  const std::int64_t first_row = std::int64_t(blockIdx.x) * rpb + group;

  auto slot = [&](int stage, int tensor, int it) {
    return &ring[((stage * 2 + tensor) * ITERS + it) * blockDim.x + threadIdx.x];
  };
  auto stat = [&](int stage, int which) { return &stats[(stage * blockDim.x + threadIdx.x) * 2 + which]; };
  auto issue = [&](std::int64_t k) {
    const std::int64_t row = first_row + k * stride_rows;
    if (row < p.rows) {
      const int stage = static_cast<int>(k % stages);
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const std::int64_t col = std::int64_t(it * tpr + t) * kVec;
        if (col < p.cols) {
          copy_async_16(slot(stage, 0, it), dy + row * p.dy_row_stride + col);
          copy_async_16(slot(stage, 1, it), in + row * p.input_row_stride + col);
        }
      }
      copy_async_4(stat(stage, 0), p.rstd + row);
      if (needs_mean) copy_async_4(stat(stage, 1), p.mean + row);
    }
    copy_async_commit();
  };

  // The dbias sums exist only when asked for (never for RMSNorm): they would otherwise cost
  // ITERS * kVec registers per thread and a second partial row per block.
  constexpr int kDbIters = BIAS_GRAD ? ITERS : 1, kDbVec = BIAS_GRAD ? kVec : 1;
  float acc_dw[ITERS][kVec], acc_db[kDbIters][kDbVec];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc_dw[it][i] = 0.0f;
#pragma unroll
  for (int it = 0; it < kDbIters; ++it)
#pragma unroll
    for (int i = 0; i < kDbVec; ++i) acc_db[it][i] = 0.0f;

  // x_hat and g = dy * weight for the chunk `it` of the row in `stage`.
  // From x: x_hat = x * rstd + shift with shift = -mean * rstd (one FMA).
  auto prepare = [&](int stage, int it, std::int64_t col, float shift, float rstd, float (&d)[kVec],
                     float (&xh)[kVec], float (&g)[kVec]) {
    float v[kVec], w[kVec], b[kVec];
    unpack16<T>(*slot(stage, 0, it), d);
    unpack16<T>(*slot(stage, 1, it), v);
    if (weight) load_vec<W, kVec>(weight + col, w);
    if (from_output && bias) load_vec<W, kVec>(bias + col, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if constexpr (from_output) {
        float u = v[i];
        if (bias) u -= b[i];
        xh[i] = weight ? u / w[i] : u;
      } else {
        xh[i] = fmaf(v[i], rstd, shift);
      }
      g[i] = weight ? d[i] * w[i] : d[i];
    }
  };

  for (int k = 0; k < stages - 1; ++k) issue(k);
  int phase = 0;
  for (std::int64_t k = 0; first_row - group + k * stride_rows < p.rows; ++k) {
    issue(k + stages - 1);
    copy_async_wait_dynamic(stages - 1);
    const std::int64_t row = first_row + k * stride_rows;
    const bool valid_row = row < p.rows;
    const int stage = static_cast<int>(k % stages);
    const float rstd = valid_row ? *stat(stage, 0) : 0.0f;
    const float mean = (valid_row && needs_mean) ? *stat(stage, 1) : 0.0f;
    const float shift = -mean * rstd;
    // sum(g) and sum(g * x_hat), one accumulator pair per vector (independent add chains).
    float part_g[ITERS], part_gx[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      part_g[it] = part_gx[it] = 0.0f;
      const std::int64_t col = std::int64_t(it * tpr + t) * kVec;
      if (!valid_row || col >= p.cols) continue;
      float d[kVec], xh[kVec], g[kVec];
      prepare(stage, it, col, shift, rstd, d, xh, g);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        part_g[it] += g[i];
        part_gx[it] = fmaf(g[i], xh[i], part_gx[it]);
        acc_dw[it][i] = fmaf(d[i], xh[i], acc_dw[it][i]);
        if constexpr (BIAS_GRAD) acc_db[it][i] += d[i];
      }
    }
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      sums[0] += part_g[it];
      sums[1] += part_gx[it];
    }
    row_allreduce<2, true>(sums, my_scratch(phase), tpr);
    phase ^= 1;
    if (!valid_row || dx == nullptr) continue;
    // dx = rstd * (g - mean(g) - x_hat * mean(g x_hat)) = g * rstd + (x_hat * a + c).
    const float a = -rstd * sums[1] * inv_cols;
    const float c = layer_norm ? -rstd * sums[0] * inv_cols : 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * tpr + t) * kVec;
      if (col >= p.cols) continue;
      float d[kVec], xh[kVec], g[kVec], out[kVec];
      prepare(stage, it, col, shift, rstd, d, xh, g);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] = fmaf(g[i], rstd, fmaf(xh[i], a, c));
      store_vec<T, kVec>(dx + row * p.dx_row_stride + col, out);
    }
  }
  copy_async_wait<0>();
  if (partial_dw == nullptr) return;

  if (rpb > 1) {
    // Row groups 1.. hand their sums to group 0 through the (now idle) ring, added in group order.
    __syncthreads();
    float* combine = reinterpret_cast<float*>(ring);
    const int cover = ITERS * tpr * kVec;
    if (group > 0) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const int c = (it * tpr + t) * kVec + i;
          combine[((group - 1) * 2 + 0) * cover + c] = acc_dw[it][i];
          if constexpr (BIAS_GRAD) combine[((group - 1) * 2 + 1) * cover + c] = acc_db[it][i];
        }
    }
    __syncthreads();
    if (group > 0) return;
    for (int src = 1; src < rpb; ++src) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const int c = (it * tpr + t) * kVec + i;
          acc_dw[it][i] += combine[((src - 1) * 2 + 0) * cover + c];
          if constexpr (BIAS_GRAD) acc_db[it][i] += combine[((src - 1) * 2 + 1) * cover + c];
        }
    }
  }
  float* out_dw = partial_dw + std::int64_t(blockIdx.x) * p.cols;
  float* out_db = partial_db + std::int64_t(blockIdx.x) * p.cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const std::int64_t col = std::int64_t(it * tpr + t) * kVec;
    if (col >= p.cols) continue;
#pragma unroll
    for (int i = 0; i < kVec; i += 4) {
      *reinterpret_cast<float4*>(out_dw + col + i) =
          make_float4(acc_dw[it][i], acc_dw[it][i + 1], acc_dw[it][i + 2], acc_dw[it][i + 3]);
      if constexpr (BIAS_GRAD)
        *reinterpret_cast<float4*>(out_db + col + i) =
            make_float4(acc_db[it][i], acc_db[it][i + 1], acc_db[it][i + 2], acc_db[it][i + 3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Generic kernels: one block per row (grid-stride over rows), any N, any alignment.
inline constexpr int kGenericThreads = 512;

template <typename T, typename W>
__global__ void __launch_bounds__(kGenericThreads) forward_generic_kernel(ForwardParams p) {
  __shared__ float scratch[2][kGenericThreads / 32];
  const T* __restrict__ x = static_cast<const T*>(p.x);
  T* __restrict__ y = static_cast<T*>(p.y);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* xr = x + row * p.x_row_stride;
    float mean = 0.0f;
    if (p.kind == Kind::layer_norm) {
      float s[1] = {0.0f};
      for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) s[0] += to_float(xr[c]);
      row_allreduce<1, false>(s, scratch[0], kGenericThreads);
      mean = s[0] * inv_cols;
    }
    float q[1] = {0.0f};
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      const float d = to_float(xr[c]) - mean;
      q[0] += d * d;
    }
    row_allreduce<1, false>(q, scratch[1], kGenericThreads);
    const float rstd = rsqrtf(q[0] * inv_cols + p.eps);
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      float o = (to_float(xr[c]) - mean) * rstd;
      if (weight) o *= to_float(weight[c]);
      if (bias) o += to_float(bias[c]);
      y[row * p.y_row_stride + c] = from_float<T>(o);
    }
    if (threadIdx.x == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
    __syncthreads();  // scratch is reused by the next row
  }
}

// Each block accumulates its partial dweight/dbias directly in its own workspace row (only this
// block touches it, and each thread always touches the same columns: no races, fixed order).
template <typename T, typename W>
__global__ void __launch_bounds__(kGenericThreads)
    backward_generic_kernel(BackwardParams p, float* __restrict__ partial_dw,
                            float* __restrict__ partial_db) {
  __shared__ float scratch[2][kGenericThreads / 32 * 2];
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  float* my_dw = partial_dw ? partial_dw + std::int64_t(blockIdx.x) * p.cols : nullptr;
  float* my_db = partial_db ? partial_db + std::int64_t(blockIdx.x) * p.cols : nullptr;
  if (my_dw) {
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) my_dw[c] = my_db[c] = 0.0f;
  }
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float rstd = p.rstd[row];
    const float mean = (layer_norm && !p.from_output) ? p.mean[row] : 0.0f;
    auto element = [&](std::int64_t c, float* g, float* xh, float* d) {
      *d = to_float(dy[row * p.dy_row_stride + c]);
      const float v = to_float(in[row * p.input_row_stride + c]);
      const float w = weight ? to_float(weight[c]) : 1.0f;
      if (p.from_output) {
        *xh = (v - (bias ? to_float(bias[c]) : 0.0f)) / w;
      } else {
        *xh = (v - mean) * rstd;
      }
      *g = *d * w;
    };
    float sums[2] = {0.0f, 0.0f};
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      float g, xh, d;
      element(c, &g, &xh, &d);
      sums[0] += g;
      sums[1] += g * xh;
    }
    row_allreduce<2, false>(sums, scratch[0], kGenericThreads);
    const float mean_g = layer_norm ? sums[0] * inv_cols : 0.0f;
    const float mean_gx = sums[1] * inv_cols;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      float g, xh, d;
      element(c, &g, &xh, &d);
      if (dx) dx[row * p.dx_row_stride + c] = from_float<T>(rstd * (g - mean_g - xh * mean_gx));
      if (my_dw) {
        my_dw[c] += d * xh;
        my_db[c] += d;
      }
    }
    __syncthreads();  // scratch is reused by the next row
  }
}

// Sums partials[slots][cols] over slots, in a fixed order, into out[cols]. Block (32, 32):
// threadIdx.x picks the column (coalesced), threadIdx.y strides over slots; the 32 per-column
// partial sums are then added in y order. blockIdx.y selects dweight (0) or dbias (1).
template <typename W>
__global__ void __launch_bounds__(1024)
    reduce_partials_kernel(const float* __restrict__ partial_dw, const float* __restrict__ partial_db,
                           int slots, std::int64_t cols, W* __restrict__ dweight,
                           W* __restrict__ dbias) {
  __shared__ float sums[32][33];
  const float* partial = blockIdx.y == 0 ? partial_dw : partial_db;
  W* out = blockIdx.y == 0 ? dweight : dbias;
  // Launched with programmatic stream serialization: the launch overlaps the producer's tail and
  // this waits until the producer grid's partial sums are complete and visible.
  cudaGridDependencySynchronize();
  if (out == nullptr) return;  // uniform over the block: that gradient was not asked for
  const std::int64_t col = std::int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (int slot = threadIdx.y; slot < slots; slot += 32) s += partial[std::int64_t(slot) * cols + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; ++k) total += sums[k][threadIdx.x];
    out[col] = from_float<W>(total);
  }
}

}  // namespace fusekit::norm::kernels
