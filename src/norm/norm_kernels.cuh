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

// Block size for a row group of TPR threads: small groups are packed 4 warps to a block.
__host__ __device__ constexpr int block_threads(int tpr) { return tpr >= 128 ? tpr : 128; }

// Sums K values over the TPR threads of a row group; every thread gets the total. The shuffle
// butterfly gives all lanes bitwise-identical sums, and the cross-warp step adds warps in index
// order, so the result does not depend on timing. `scratch` holds (TPR / 32) * K floats for this
// row group; it must not be reused before the next __syncthreads() (callers alternate buffers).
// Contains __syncthreads() when TPR > 32: every thread of the block must call it.
template <int TPR, int K>
__device__ __forceinline__ void row_allreduce(float (&v)[K], float* scratch) {
  constexpr int kWidth = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  if constexpr (TPR > 32) {
    constexpr int kWarps = TPR / 32;
    const int lane = threadIdx.x % 32, warp_in_row = (threadIdx.x % TPR) / 32;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) scratch[warp_in_row * K + k] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += scratch[w * K + k];
      v[k] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, row in registers.
template <typename T, typename W, int VEC, int ITERS, int TPR>
__global__ void __launch_bounds__(block_threads(TPR))
    forward_registers_kernel(ForwardParams p) {
  constexpr int kBlock = block_threads(TPR), kRowsPerBlock = kBlock / TPR;
  constexpr int kWarpsPerRow = TPR >= 32 ? TPR / 32 : 1;
  __shared__ float scratch[2][kRowsPerBlock][kWarpsPerRow];
  const int group = threadIdx.x / TPR, t = threadIdx.x % TPR;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  T* __restrict__ y = static_cast<T*>(p.y);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  // Consecutive reductions alternate scratch buffers: a buffer is rewritten only after the
  // barrier inside the other buffer's reduction, which every reader of it has passed.
  int phase = 0;

  for (std::int64_t base = std::int64_t(blockIdx.x) * kRowsPerBlock; base < p.rows;
       base += std::int64_t(gridDim.x) * kRowsPerBlock) {
    const std::int64_t row = base + group;
    const bool valid_row = row < p.rows;
    float v[ITERS][VEC];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (valid_row && col < p.cols) {
        load_vec<T, VEC>(x + row * p.x_row_stride + col, v[it]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[it][i] = 0.0f;
      }
    }
    float mean = 0.0f;
    if (layer_norm) {
      float s[1] = {0.0f};
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[0] += v[it][i];
      row_allreduce<TPR, 1>(s, scratch[phase][group]);
      phase ^= 1;
      mean = s[0] * inv_cols;
    }
    // Second pass over the registers: the variance around the mean (no cancellation).
    float q[1] = {0.0f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (col < p.cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = v[it][i] - mean;
          q[0] += d * d;
        }
      }
    }
    row_allreduce<TPR, 1>(q, scratch[phase][group]);
    phase ^= 1;
    const float rstd = rsqrtf(q[0] * inv_cols + p.eps);
    if (!valid_row) continue;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (col >= p.cols) continue;
      float w[VEC], b[VEC], out[VEC];
      if (weight) load_vec<W, VEC>(weight + col, w);
      if (bias) load_vec<W, VEC>(bias + col, b);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float o = (v[it][i] - mean) * rstd;
        if (weight) o *= w[i];
        if (bias) o += b[i];
        out[i] = o;
      }
      store_vec<T, VEC>(y + row * p.y_row_stride + col, out);
    }
    if (t == 0) {
      if (p.mean) p.mean[row] = mean;
      if (p.rstd) p.rstd[row] = rstd;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, row in registers, persistent grid; writes per-block dweight/dbias partials.
// The row's dy and input stay in registers in their storage type (16 bytes per VEC elements) and
// are unpacked twice, which costs ALU but keeps register pressure at ~3 floats per element.
template <typename T, int VEC>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[VEC]) {
  static_assert(VEC * sizeof(T) == 16, "register path moves 16-byte vectors");
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(e[i]);
}

template <typename T, typename W, int VEC, int ITERS, int TPR>
__global__ void __launch_bounds__(block_threads(TPR))
    backward_registers_kernel(BackwardParams p, float* __restrict__ partial_dw,
                              float* __restrict__ partial_db) {
  constexpr int kBlock = block_threads(TPR), kRowsPerBlock = kBlock / TPR;
  constexpr int kWarpsPerRow = TPR >= 32 ? TPR / 32 : 1;
  constexpr int kCover = ITERS * TPR * VEC;  // columns one row group covers
  __shared__ float scratch[2][kRowsPerBlock][kWarpsPerRow * 2];
  // Row groups 1.. hand their partial sums to group 0 through here (fixed order).
  __shared__ float combine[kRowsPerBlock > 1 ? (kRowsPerBlock - 1) * 2 * kCover : 1];

  const int group = threadIdx.x / TPR, t = threadIdx.x % TPR;
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ in = static_cast<const T*>(p.input);
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  const bool layer_norm = p.kind == Kind::layer_norm;
  const bool from_output = p.from_output;
  const bool want_partials = partial_dw != nullptr;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  int phase = 0;

  float acc_dw[ITERS][VEC], acc_db[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc_dw[it][i] = acc_db[it][i] = 0.0f;

  // x_hat and g = dy * weight for VEC elements at `col`.
  auto prepare = [&](const uint4& raw_dy, const uint4& raw_in, std::int64_t col, float mean,
                     float rstd, float (&d)[VEC], float (&xh)[VEC], float (&g)[VEC]) {
    float v[VEC], w[VEC], b[VEC];
    unpack<T, VEC>(raw_dy, d);
    unpack<T, VEC>(raw_in, v);
    if (weight) load_vec<W, VEC>(weight + col, w);
    if (from_output && bias) load_vec<W, VEC>(bias + col, b);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (from_output) {
        float u = v[i];
        if (bias) u -= b[i];
        xh[i] = weight ? u / w[i] : u;
      } else {
        xh[i] = (v[i] - mean) * rstd;
      }
      g[i] = weight ? d[i] * w[i] : d[i];
    }
  };

  for (std::int64_t base = std::int64_t(blockIdx.x) * kRowsPerBlock; base < p.rows;
       base += std::int64_t(gridDim.x) * kRowsPerBlock) {
    const std::int64_t row = base + group;
    const bool valid_row = row < p.rows;
    uint4 raw_dy[ITERS], raw_in[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (valid_row && col < p.cols) {
        raw_dy[it] = *reinterpret_cast<const uint4*>(dy + row * p.dy_row_stride + col);
        raw_in[it] = *reinterpret_cast<const uint4*>(in + row * p.input_row_stride + col);
      }
    }
    const float rstd = valid_row ? p.rstd[row] : 0.0f;
    const float mean = (valid_row && layer_norm && !from_output) ? p.mean[row] : 0.0f;
    float sums[2] = {0.0f, 0.0f};  // sum(g), sum(g * x_hat)
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (!valid_row || col >= p.cols) continue;
      float d[VEC], xh[VEC], g[VEC];
      prepare(raw_dy[it], raw_in[it], col, mean, rstd, d, xh, g);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        sums[0] += g[i];
        sums[1] += g[i] * xh[i];
        acc_dw[it][i] += d[i] * xh[i];
        acc_db[it][i] += d[i];
      }
    }
    row_allreduce<TPR, 2>(sums, scratch[phase][group]);
    phase ^= 1;
    if (!valid_row || dx == nullptr) continue;
    const float mean_g = layer_norm ? sums[0] * inv_cols : 0.0f;
    const float mean_gx = sums[1] * inv_cols;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
      if (col >= p.cols) continue;
      float d[VEC], xh[VEC], g[VEC], out[VEC];
      prepare(raw_dy[it], raw_in[it], col, mean, rstd, d, xh, g);
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = rstd * (g[i] - mean_g - xh[i] * mean_gx);
      store_vec<T, VEC>(dx + row * p.dx_row_stride + col, out);
    }
  }
  if (!want_partials) return;

  if constexpr (kRowsPerBlock > 1) {
    if (group > 0) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int c = (it * TPR + t) * VEC + i;
          combine[((group - 1) * 2 + 0) * kCover + c] = acc_dw[it][i];
          combine[((group - 1) * 2 + 1) * kCover + c] = acc_db[it][i];
        }
    }
    __syncthreads();
    if (group > 0) return;
#pragma unroll 1
    for (int gsrc = 1; gsrc < kRowsPerBlock; ++gsrc) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int c = (it * TPR + t) * VEC + i;
          acc_dw[it][i] += combine[((gsrc - 1) * 2 + 0) * kCover + c];
          acc_db[it][i] += combine[((gsrc - 1) * 2 + 1) * kCover + c];
        }
    }
  }
  float* out_dw = partial_dw + std::int64_t(blockIdx.x) * p.cols;
  float* out_db = partial_db + std::int64_t(blockIdx.x) * p.cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const std::int64_t col = std::int64_t(it * TPR + t) * VEC;
    if (col >= p.cols) continue;
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      *reinterpret_cast<float4*>(out_dw + col + i) =
          make_float4(acc_dw[it][i], acc_dw[it][i + 1], acc_dw[it][i + 2], acc_dw[it][i + 3]);
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
      row_allreduce<kGenericThreads, 1>(s, scratch[0]);
      mean = s[0] * inv_cols;
    }
    float q[1] = {0.0f};
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericThreads) {
      const float d = to_float(xr[c]) - mean;
      q[0] += d * d;
    }
    row_allreduce<kGenericThreads, 1>(q, scratch[1]);
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
    row_allreduce<kGenericThreads, 2>(sums, scratch[0]);
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
  if (out == nullptr) return;  // uniform over the block
  const std::int64_t col = std::int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
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
