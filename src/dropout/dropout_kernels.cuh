// Bias + activation + dropout CUDA kernels.
//
// One pass each way: the forward reads x (and the bias once per thread) and writes y; the
// backward reads dy and x, writes dx and a per-block dbias partial row. The dropout mask is never
// stored: both regenerate it from (seed, offset, element index) with Philox, one call per group of
// eight consecutive elements, 16 random bits each (see fusekit/dropout.h for the mapping).
//
// Work layout (both directions): blocks of (TX, TY) = 512 threads tile the (M, N) tensor. Each
// thread owns a fixed chunk of 8 consecutive columns (so it loads its bias slice once and
// accumulates its dbias slice in registers) and walks a contiguous, balanced range of rows given
// to its block row (blockIdx.y), TY rows apart, a few rows at a time (loads first, then math, so
// that several 16-byte loads per thread are in flight).
//  * Vector path (N and the row strides multiples of 8, pointers 16-byte aligned): 16-byte loads
//    and stores; every chunk starts at a linear index that is a multiple of 8, so exactly one
//    Philox call serves it.
//  * Generic path (any N, any alignment): element accesses; a chunk can straddle two Philox
//    groups (when N is not a multiple of 8), costing a second call.
// Philox runs from a key schedule precomputed on the host (Scalars::random4), read from the
// parameter bank. Grids are one wave of blocks (Chunk::kBlocksPerSm per SM). In the backward each block
// sums its threads' dbias over TY in a fixed order and writes one partial row; a second small
// kernel (programmatic dependent launch) sums the partial rows in a fixed order: dbias is bitwise
// reproducible for a given GPU and shape.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/activation.h"
#include "dropout/dropout_grid.h"
#include "dropout/dropout_mask.h"
#include "dropout/dropout_params.h"
#include "fusekit/philox.h"

namespace fusekit::dropout::kernels {

using Math = detail::ActivationMath<float>;

// The occupancy the grids are sized for: 2 blocks per SM (<= 64 registers) on the vector path; the
// generic path's unaligned Philox pairs need more registers and run 1 block per SM.
inline constexpr int kVectorBlocksPerSm = 2;
inline constexpr int kGenericBlocksPerSm = 1;
inline constexpr int kForwardRowsInFlight = 2;   // rows a thread loads before computing
inline constexpr int kBackwardRowsInFlight = 1;  // (each backward row is two 16-byte loads: dy and x)

// ---- element conversions ------------------------------------------------------------------

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

// Two floats into one 32-bit word of 16-bit values (one pack instruction on sm_90).
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

// 16 bytes of T <-> 16 / sizeof(T) floats.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) out[i] = to_float(e[i]);
}

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

// VEC values of W starting at a 16-byte aligned address, as floats.
template <typename W, int VEC>
__device__ __forceinline__ void load_aligned(const W* p, float (&out)[VEC]) {
  constexpr int kPerChunk = 16 / sizeof(W);
  static_assert(VEC % kPerChunk == 0, "whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < VEC / kPerChunk; ++c) {
    float part[kPerChunk];
    unpack16<W>(*reinterpret_cast<const uint4*>(p + c * kPerChunk), part);
#pragma unroll
    for (int i = 0; i < kPerChunk; ++i) out[c * kPerChunk + i] = part[i];
  }
}

// ---- activations ---------------------------------------------------------------------------

// The activation fixed at compile time: the switch in ActivationMath folds away.
template <Activation A>
struct StaticActivation {
  static __device__ __forceinline__ float forward(float h, const Scalars& s) {
    return Math::forward(A, h, s.slope);
  }
  static __device__ __forceinline__ float derivative(float h, const Scalars& s) {
    return Math::derivative(A, h, s.slope);
  }
};

// ---- chunk access: 8 consecutive columns of one row ---------------------------------------

// Vector path: the chunk as one (16-bit types) or two (f32) 16-byte accesses.
template <typename T>
struct VectorChunk {
  static constexpr bool kVectorized = true;
  static constexpr int kBlocksPerSm = kVectorBlocksPerSm;
  static constexpr int kPerAccess = 16 / sizeof(T);
  static constexpr int kAccesses = kChunk / kPerAccess;
  uint4 raw[kAccesses];
  __device__ __forceinline__ void load(const T* at, int /*valid*/) {
#pragma unroll
    for (int a = 0; a < kAccesses; ++a) raw[a] = *reinterpret_cast<const uint4*>(at + a * kPerAccess);
  }
  __device__ __forceinline__ void to_floats(float (&out)[kChunk]) const {
#pragma unroll
    for (int a = 0; a < kAccesses; ++a) {
      float part[kPerAccess];
      unpack16<T>(raw[a], part);
#pragma unroll
      for (int i = 0; i < kPerAccess; ++i) out[a * kPerAccess + i] = part[i];
    }
  }
  static __device__ __forceinline__ void store(T* at, int /*valid*/, const float (&v)[kChunk]) {
#pragma unroll
    for (int a = 0; a < kAccesses; ++a) {
      float part[kPerAccess];
#pragma unroll
      for (int i = 0; i < kPerAccess; ++i) part[i] = v[a * kPerAccess + i];
      *reinterpret_cast<uint4*>(at + a * kPerAccess) = pack16<T>(part);
    }
  }
  template <typename W>
  static __device__ __forceinline__ void load_bias(const W* bias, std::int64_t col, int /*valid*/,
                                                   float (&out)[kChunk]) {
    load_aligned<W, kChunk>(bias + col, out);
  }
  static __device__ __forceinline__ MaskWords mask(const Scalars& s, std::uint64_t first) {
    return aligned_mask(s, first);
  }
};

// Generic path: `valid` (1..8) columns inside the row, element by element.
template <typename T>
struct ScalarChunk {
  static constexpr bool kVectorized = false;  // and one row in flight
  static constexpr int kBlocksPerSm = kGenericBlocksPerSm;
  T v[kChunk];
  __device__ __forceinline__ void load(const T* at, int valid) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = i < valid ? at[i] : from_float<T>(0.0f);
  }
  __device__ __forceinline__ void to_floats(float (&out)[kChunk]) const {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[i] = to_float(v[i]);
  }
  static __device__ __forceinline__ void store(T* at, int valid, const float (&out)[kChunk]) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < valid) at[i] = from_float<T>(out[i]);
  }
  template <typename W>
  static __device__ __forceinline__ void load_bias(const W* bias, std::int64_t col, int valid,
                                                   float (&out)[kChunk]) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[i] = i < valid ? to_float(bias[col + i]) : 0.0f;
  }
  static __device__ __forceinline__ MaskWords mask(const Scalars& s, std::uint64_t first) {
    return unaligned_mask(s, first);
  }
};

// ---- forward -------------------------------------------------------------------------------

// How far a thread's pointers (in elements) and linear index move from one of its rows to the
// next (TY rows down), computed on the host so the loop only adds.
struct RowSteps {
  std::int64_t in0 = 0, in1 = 0, out0 = 0, out1 = 0;
  std::uint64_t index = 0;
};

// An optional output: its base pointer and the thread's running element offset, so that a null
// output advances like the others without pointer arithmetic on null (and a present one is
// still stored through a global pointer).
template <typename T>
struct OptionalOut {
  T* base;
  std::int64_t offset;
  __device__ __forceinline__ T* at(std::int64_t delta) const { return base + (offset + delta); }
};

// Forward steps: in0 = x, out0 = y, out1 = pre_activation.
template <typename T, typename W, typename Chunk, typename Act>
__global__ void __launch_bounds__(kThreads, Chunk::kBlocksPerSm)
    forward_kernel(const ForwardParams p, const TileGrid g, const RowSteps steps) {
  constexpr int VEC = kChunk, U = Chunk::kVectorized ? kForwardRowsInFlight : 1;
  const Scalars& s = p.s;
  const std::int64_t col = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= p.cols) return;
  const int valid = p.cols - col < VEC ? static_cast<int>(p.cols - col) : VEC;
  const ThreadRows rows = thread_rows(g, blockIdx.y, threadIdx.y);

  float bias[VEC];
  if (p.bias) {
    Chunk::template load_bias<W>(static_cast<const W*>(p.bias), col, valid, bias);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) bias[i] = 0.0f;
  }
  const bool keep_pre = p.pre_activation != nullptr;
  const T* __restrict__ x = static_cast<const T*>(p.x) + rows.first * p.x_row_stride + col;
  T* __restrict__ y = static_cast<T*>(p.y) + rows.first * p.y_row_stride + col;
  OptionalOut<T> pre{static_cast<T*>(p.pre_activation), rows.first * p.pre_activation_row_stride + col};
  std::uint64_t index = static_cast<std::uint64_t>(rows.first * p.cols + col);

  for (int k = 0; k < rows.count; k += U) {
    Chunk in[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (k + u < rows.count) in[u].load(x + u * steps.in0, valid);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k + u >= rows.count) break;
      float h[VEC], out[VEC];
      in[u].to_floats(h);
      const MaskWords mask = Chunk::mask(s, index + u * steps.index);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        h[i] += bias[i];
        const float a = Act::forward(h[i], s);
        out[i] = mask.kept(i, s) ? a * s.scale : 0.0f;
      }
      Chunk::store(y + u * steps.out0, valid, out);
      if (keep_pre) Chunk::store(pre.at(u * steps.out1), valid, h);
    }
    x += U * steps.in0;
    y += U * steps.out0;
    pre.offset += U * steps.out1;
    index += U * steps.index;
  }
}

// ---- backward ------------------------------------------------------------------------------

// Lets the dependent kernel (the partial-row reduction, launched with programmatic stream
// serialization) start its launch while this grid drains; it still waits for this grid's
// results in griddepcontrol.wait.
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Backward steps: in0 = dy, in1 = x, out0 = dx.
template <typename T, typename W, typename Chunk, typename Act>
__global__ void __launch_bounds__(kThreads, Chunk::kBlocksPerSm)
    backward_kernel(const BackwardParams p, const TileGrid g, const RowSteps steps,
                    float* __restrict__ partial) {
  constexpr int VEC = kChunk, U = kBackwardRowsInFlight;
  // Threads ty > 0 hand their dbias sums to ty = 0 through here (added in ty order).
  __shared__ float4 handoff[kThreads * VEC / 4];
  const Scalars& s = p.s;
  const std::int64_t col = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = col < p.cols;  // no early return: every thread reaches the barrier
  const int valid = !active ? 0 : (p.cols - col < VEC ? static_cast<int>(p.cols - col) : VEC);
  const ThreadRows rows = thread_rows(g, blockIdx.y, threadIdx.y);

  float bias[VEC], acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) bias[i] = acc[i] = 0.0f;
  if (active && p.bias) Chunk::template load_bias<W>(static_cast<const W*>(p.bias), col, valid, bias);

  if (active) {
    const bool store_dx = p.dx != nullptr;
    const T* __restrict__ dy = static_cast<const T*>(p.dy) + rows.first * p.dy_row_stride + col;
    const T* __restrict__ x = static_cast<const T*>(p.x) + rows.first * p.x_row_stride + col;
    OptionalOut<T> dx{static_cast<T*>(p.dx), rows.first * p.dx_row_stride + col};
    std::uint64_t index = static_cast<std::uint64_t>(rows.first * p.cols + col);

    for (int k = 0; k < rows.count; k += U) {
      Chunk in_dy[U], in_x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k + u < rows.count) {
          in_dy[u].load(dy + u * steps.in0, valid);
          in_x[u].load(x + u * steps.in1, valid);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k + u >= rows.count) break;
        float h[VEC], d[VEC], out[VEC];
        in_x[u].to_floats(h);
        in_dy[u].to_floats(d);
        const MaskWords mask = Chunk::mask(s, index + u * steps.index);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float grad = d[i] * s.scale * Act::derivative(h[i] + bias[i], s);
          out[i] = mask.kept(i, s) ? grad : 0.0f;
          acc[i] += out[i];
        }
        if (store_dx) Chunk::store(dx.at(u * steps.out0), valid, out);
      }
      dy += U * steps.in0;
      x += U * steps.in1;
      dx.offset += U * steps.out0;
      index += U * steps.index;
    }
  }
  allow_dependent_launch();
  if (partial == nullptr) return;  // no dbias wanted (uniform over the grid)

  // Fixed-order sum over the block's TY threads of each column chunk, then one partial row.
  const int ty = threadIdx.y, tx = threadIdx.x;
  constexpr int kQuads = VEC / 4;
  if (ty > 0) {
#pragma unroll
    for (int q = 0; q < kQuads; ++q)
      handoff[((ty - 1) * blockDim.x + tx) * kQuads + q] =
          make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
  }
  __syncthreads();
  if (ty > 0 || !active) return;
  for (int src = 1; src < static_cast<int>(blockDim.y); ++src) {
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
      const float4 v = handoff[((src - 1) * blockDim.x + tx) * kQuads + q];
      acc[4 * q] += v.x;
      acc[4 * q + 1] += v.y;
      acc[4 * q + 2] += v.z;
      acc[4 * q + 3] += v.w;
    }
  }
  float* out = partial + std::int64_t(blockIdx.y) * p.cols + col;
#pragma unroll
  for (int i = 0; i < VEC; ++i)
    if (i < valid) out[i] = acc[i];
}

// dbias[c] = sum over b of partial[b][c], b in increasing order. Block (32, 16): threadIdx.x picks
// the column (coalesced), threadIdx.y strides over the partial rows; the 16 per-column sums are
// then added in y order.
template <typename D>
__global__ void __launch_bounds__(512)
    reduce_partials_kernel(const float* __restrict__ partial, int partial_rows, std::int64_t cols,
                           D* __restrict__ dbias) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the backward kernel's partial rows
  __shared__ float sums[16][33];
  const std::int64_t col = std::int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols) {
    for (int b = threadIdx.y; b < partial_rows; b += 16) s += partial[std::int64_t(b) * cols + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) total += sums[k][threadIdx.x];
    dbias[col] = from_float<D>(total);
  }
}

}  // namespace fusekit::dropout::kernels
