// Bias + activation + dropout CUDA kernels.
//
// One pass each way: the forward reads x (and the bias once per thread) and writes y; the
// backward reads dy and x, writes dx and a per-block dbias partial row. The dropout mask is never
// stored: both regenerate it from (seed, offset, element index) with Philox, one call per group of
// eight consecutive elements, 16 random bits each (see fusekit/dropout.h for the mapping).
//
// Work layout (both directions): blocks of (TX, TY) = 512 threads tile the (M, N) tensor. Each
// thread owns a fixed chunk of 8 consecutive columns (so it loads its bias slice once and
// accumulates its dbias slice in registers) and walks its rows a few at a time; the block rows
// (blockIdx.y) are interleaved, so the grid streams through one window of rows at a time
// (dropout_grid.h).
//  * Vector path (N and the row strides multiples of 8, pointers 16-byte aligned): 16-byte loads
//    and stores; every chunk starts at a linear index that is a multiple of 8, so exactly one
//    Philox call serves it.
//    The cheap activations' forward in 16-bit types instead runs one block per row group
//    (forward_row_group_kernel) where the row length allows.
//  * Generic path (any N, any alignment): element accesses; a chunk can straddle two Philox
//    groups (when N is not a multiple of 8), costing a second call.
// Philox runs from a key schedule precomputed on the host (Scalars::random4), read from the
// parameter bank. Grids are one wave of blocks (the tuning's kBlocksPerSm per SM, bias_act_dropout_config.h). In the backward
// each block sums its threads' dbias over TY in a fixed order and writes one partial row; a
// second small kernel (core/partial_rows.cuh, a programmatic dependent launch) sums the partial
// rows in a fixed order: dbias is bitwise reproducible for a given GPU and shape.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/activation.h"
#include "core/device_vector.cuh"
#include "bias_act_dropout/bias_act_dropout_config.h"
#include "bias_act_dropout/bias_act_dropout_grid.h"
#include "bias_act_dropout/bias_act_dropout_mask.h"
#include "bias_act_dropout/bias_act_dropout_params.h"
#include "fusekit/philox.h"

namespace fusekit::bias_act_dropout::kernels {

using Math = detail::ActivationMath<float>;

// ---- element conversions (core/device_vector.cuh) -------------------------------------------

using detail::device::from_float;
using detail::device::load_floats;
using detail::device::pack16;
using detail::device::prefetch_l2;
using detail::device::to_float;
using detail::device::unpack16;

// ---- activations ---------------------------------------------------------------------------

// The activation fixed at compile time: the switch in ActivationMath folds away.
template <Activation A>
struct StaticActivation {
  static constexpr Activation kAct = A;
  // act(h) / (1 - p), the value of a kept element. For the x * sigmoid(t) activations (gelu_tanh,
  // silu) the dropout scale goes into the reciprocal: x / ((1 + e) (1 - p)) with e = exp(-t),
  // one FMA in place of an add and a multiply. An overflowing e gives 1 / inf = 0, the limit, so
  // the forward needs no cap on the exponent (the derivative does: it also forms e * s).
  static __device__ __forceinline__ float forward_scaled(float h, const Scalars& s) {
#if defined(__CUDA_ARCH__)
    if constexpr (A == Activation::gelu_tanh || A == Activation::silu) {
      const float t = A == Activation::gelu_tanh ? Math::gelu_tanh_exponent(h, h * h)
                                                 : h * static_cast<float>(-Math::kLog2e);
      const float e = detail::ex2_approx(t);
      return h * detail::rcp_approx(fmaf(e, s.keep, s.keep));
    }
#endif
    return Math::forward(A, h, s.slope) * s.scale;
  }
  static __device__ __forceinline__ float forward(float h, const Scalars& s) {
    return Math::forward(A, h, s.slope);
  }
  static __device__ __forceinline__ float derivative(float h, const Scalars& s) {
    return Math::derivative(A, h, s.slope);
  }
};

// ---- chunk access: 8 consecutive columns of one row ---------------------------------------

// Vector path: the chunk as one (16-bit types) or two (f32) 16-byte accesses. Its linear index
// is carried in Philox groups (index / 8).
template <typename T, typename Tn>
struct VectorChunk {
  using Tune = Tn;
  static constexpr int kIndexShift = 3;
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
    load_floats<W, kChunk>(bias + col, out);
  }
  static __device__ __forceinline__ MaskWords mask(const Scalars& s, const PhiloxPrefix& pre,
                                                   std::uint64_t group) {
    return aligned_mask(s, pre, group);
  }
};

// Generic path: `valid` (1..8) columns inside the row, element by element (GenericTuning).

template <typename T>
struct ScalarChunk {
  using Tune = GenericTuning;
  static constexpr int kIndexShift = 0;
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
  static __device__ __forceinline__ MaskWords mask(const Scalars& s, const PhiloxPrefix& pre,
                                                   std::uint64_t first) {
    return unaligned_mask(s, pre, first);
  }
};

// ---- forward -------------------------------------------------------------------------------

// How far a thread's pointers (in elements) and linear index move from one of its rows to the
// next (TY rows down), computed on the host so the loop only adds; and the launch's Philox
// prefix.
struct RowSteps {
  std::int64_t in0 = 0, in1 = 0, out0 = 0, out1 = 0;
  std::uint64_t index = 0;  // in the chunk's index unit (elements or Philox groups)
  PhiloxPrefix philox;
};

// Whether a thread's rows also store an optional output (forward: h = x + bias; backward: dx),
// fixed at compile time so that the row loop carries no test of it.
enum class OptionalOutput { skip, store };

// A thread's forward rows. Pipelined tunings alternate two row buffers (the loop body is written
// twice, roles swapped) instead of copying the prefetched rows into the current ones after every
// step: the copies were ~12 of the ~166 instructions of a one-row step (SASS, bf16 gelu_tanh;
// bench: bias_act_dropout fwd gelu_tanh (16384, 4096), (8192, 16384), H200).
template <typename T, typename W, typename Chunk, typename Act, OptionalOutput PRE>
__device__ __forceinline__ void forward_rows(const ForwardParams& p, const RowSteps& steps, const ThreadRows rows,
                                             std::int64_t col, int valid, const float (&bias)[kChunk]) {
  using Tn = typename Chunk::Tune;
  constexpr int VEC = kChunk, U = Tn::kRows;
  const Scalars& s = p.s;
  const T* __restrict__ x = static_cast<const T*>(p.x) + rows.first * p.x_row_stride + col;
  T* __restrict__ y = static_cast<T*>(p.y) + rows.first * p.y_row_stride + col;
  constexpr bool KEEP_PRE = PRE == OptionalOutput::store;
  [[maybe_unused]] T* __restrict__ pre =
      KEEP_PRE ? static_cast<T*>(p.pre_activation) + rows.first * p.pre_activation_row_stride + col : nullptr;
  std::uint64_t index = static_cast<std::uint64_t>(rows.first * p.cols + col) >> Chunk::kIndexShift;

  // Loads rows k .. k + U - 1 (those that exist) into `into`.
  auto load = [&](Chunk (&into)[U], int k) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (k + u < rows.count) into[u].load(x + u * steps.in0, valid);
    x += U * steps.in0;
  };
  // L2 prefetch: rows k + U + P .. k + 2U + P - 1 are asked of L2 during step k, P rows ahead of
  // the loads that read them (the first P rows after the initial loads are asked for up front).
  constexpr int P = Tn::kL2PrefetchRows;
  [[maybe_unused]] const T* ahead_of_loads = x + (U + P) * steps.in0;
  if constexpr (P > 0) {
#pragma unroll
    for (int j = U; j < U + P; ++j)
      if (j < rows.count) prefetch_l2(x + j * steps.in0);
  }
  // Rows k .. k + U - 1 from `now` (prefetching rows k + U .. into `ahead` first when
  // pipelined, else reloading `now` after); returns whether rows remain.
  int k = 0;
  auto step = [&](Chunk (&now)[U], Chunk (&ahead)[U]) {
    if constexpr (P > 0) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (k + U + P + u < rows.count) prefetch_l2(ahead_of_loads + u * steps.in0);
      ahead_of_loads += U * steps.in0;
    }
    if constexpr (Tn::kPipelined) {
      if (k + U < rows.count) load(ahead, k + U);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k + u >= rows.count) break;
      float h[VEC], out[VEC];
      now[u].to_floats(h);
      const MaskWords mask = Chunk::mask(s, steps.philox, index + u * steps.index);
#pragma unroll
      for (int j = 0; j < VEC / 2; ++j) {
        bool keep_lo, keep_hi;
        mask.kept_pair(j, s.keep_threshold2, keep_lo, keep_hi);
        h[2 * j] += bias[2 * j];
        h[2 * j + 1] += bias[2 * j + 1];
        const float a0 = Act::forward_scaled(h[2 * j], s), a1 = Act::forward_scaled(h[2 * j + 1], s);
        out[2 * j] = keep_lo ? a0 : 0.0f;
        out[2 * j + 1] = keep_hi ? a1 : 0.0f;
      }
      Chunk::store(y + u * steps.out0, valid, out);
      if constexpr (KEEP_PRE) Chunk::store(pre + u * steps.out1, valid, h);
    }
    k += U;
    y += U * steps.out0;
    if constexpr (KEEP_PRE) pre += U * steps.out1;
    index += U * steps.index;
    if constexpr (!Tn::kPipelined) {
      if (k < rows.count) load(now, k);
    }
    return k < rows.count;
  };

  Chunk a[U];
  load(a, 0);  // the first rows' loads go out before the row loop (the kernel loaded the bias slice first)
  if constexpr (Tn::kPipelined) {
    Chunk b[U];
    while (step(a, b) && step(b, a)) {
    }
  } else {
    while (step(a, a)) {
    }
  }
}

template <typename T, typename W, typename Chunk, typename Act>
__global__ void __launch_bounds__(kThreads, Chunk::Tune::kBlocksPerSm)
    forward_kernel(const ForwardParams p, const TileGrid g, const RowSteps steps) {
  constexpr int VEC = kChunk;
  const std::int64_t col = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= p.cols) return;
  const int valid = p.cols - col < VEC ? static_cast<int>(p.cols - col) : VEC;
  const ThreadRows rows = thread_rows(g, blockIdx.y, threadIdx.y);
  if (rows.count == 0) return;
  float bias[VEC];
  if (p.bias) {
    Chunk::template load_bias<W>(static_cast<const W*>(p.bias), col, valid, bias);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) bias[i] = 0.0f;
  }
  if (p.pre_activation != nullptr) forward_rows<T, W, Chunk, Act, OptionalOutput::store>(p, steps, rows, col, valid, bias);
  else forward_rows<T, W, Chunk, Act, OptionalOutput::skip>(p, steps, rows, col, valid, bias);
}

// ---- forward in row groups (cheap activations, 16-bit types) ---------------------------------

// The forward of the activations without special-function work (none, relu, squared_relu,
// leaky_relu) for 16-bit types on the vector path, when a row splits into whole warps of
// kRowGroupVectors 16-byte vectors per thread (row_group_shape, bias_act_dropout_config.h). This
// is the norm forward's launch shape: a row is `tpr` threads, each holding kRowGroupVectors
// vectors strided by tpr vectors (so every warp access is 512 contiguous bytes), all loads in
// flight together; the grid covers every row, one block per `rpb` rows, and each row asks L2 for
// the row of the block that takes its slot in the next wave (`l2_ahead` rows further): without
// that request the row groups lose 7-10% (bench: bias_act_dropout fwd relu (16384, 4096),
// (16384, 5120), (32768, 1024), H200).

template <typename T, typename W, typename Act>
__global__ void __launch_bounds__(512, 2)
    forward_row_group_kernel(const ForwardParams p, const PhiloxPrefix philox, int tpr, int rpb, int l2_ahead) {
  static_assert(sizeof(T) == 2, "16-bit types: one 16-byte vector is one 8-element chunk");
  constexpr int VEC = kChunk, ITERS = kRowGroupVectors;
  const int group = threadIdx.x / tpr, t = threadIdx.x - group * tpr;
  const std::int64_t row = std::int64_t(blockIdx.x) * rpb + group;
  if (row >= p.rows) return;
  const int step = tpr * VEC;  // elements between a thread's vectors
  const int col0 = t * VEC;
  const T* __restrict__ x = static_cast<const T*>(p.x) + row * p.x_row_stride + col0;
  uint4 raw[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) raw[it] = *reinterpret_cast<const uint4*>(x + it * step);
  if (l2_ahead > 0 && row + l2_ahead < p.rows) {
    const T* ahead = x + l2_ahead * p.x_row_stride;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) prefetch_l2(ahead + it * step);
  }
  const Scalars& s = p.s;
  const W* __restrict__ bias = static_cast<const W*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y) + row * p.y_row_stride + col0;
  // Philox group of vector `it`: (row * N + col0 + it * step) / 8, N a multiple of 8.
  const std::uint64_t group0 = static_cast<std::uint64_t>(row * p.cols + col0) >> 3;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    float h[VEC], b[VEC], out[VEC];
    unpack16<T>(raw[it], h);
    if (bias) {
      load_floats<W, VEC>(bias + col0 + it * step, b);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) b[i] = 0.0f;
    }
    const MaskWords mask = aligned_mask(s, philox, group0 + std::uint64_t(it) * tpr);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      bool keep_lo, keep_hi;
      mask.kept_pair(j, s.keep_threshold2, keep_lo, keep_hi);
      const float a0 = Act::forward_scaled(h[2 * j] + b[2 * j], s);
      const float a1 = Act::forward_scaled(h[2 * j + 1] + b[2 * j + 1], s);
      out[2 * j] = keep_lo ? a0 : 0.0f;
      out[2 * j + 1] = keep_hi ? a1 : 0.0f;
    }
    *reinterpret_cast<uint4*>(y + it * step) = pack16<T>(out);
  }
}

// ---- backward ------------------------------------------------------------------------------

// The dependent kernel (the partial-row reduction, launched with programmatic stream
// serialization) may start its launch while this grid drains (allow_dependent_launch).
using detail::device::allow_dependent_launch;

// A thread's backward rows; dx's running sums go to `acc`.
template <typename T, typename W, typename Chunk, typename Act, OptionalOutput DX>
__device__ __forceinline__ void backward_rows(const BackwardParams& p, const RowSteps& steps, const ThreadRows rows,
                                              std::int64_t col, int valid, float (&acc)[kChunk]) {
  constexpr bool STORE_DX = DX == OptionalOutput::store;
  using Tn = typename Chunk::Tune;
  constexpr int VEC = kChunk, U = Tn::kRows;
  const Scalars& s = p.s;
  struct Rows {
    Chunk dy[U], x[U];
  };
  const T* __restrict__ dy = static_cast<const T*>(p.dy) + rows.first * p.dy_row_stride + col;
  const T* __restrict__ x = static_cast<const T*>(p.x) + rows.first * p.x_row_stride + col;
  auto load = [&](Rows& into, int k) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k + u < rows.count) {
        into.dy[u].load(dy + u * steps.in0, valid);
        into.x[u].load(x + u * steps.in1, valid);
      }
    }
    dy += U * steps.in0;
    x += U * steps.in1;
  };
  Rows a;
  load(a, 0);

  float bias[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) bias[i] = 0.0f;
  if (p.bias) Chunk::template load_bias<W>(static_cast<const W*>(p.bias), col, valid, bias);
  [[maybe_unused]] T* __restrict__ dx =
      STORE_DX ? static_cast<T*>(p.dx) + rows.first * p.dx_row_stride + col : nullptr;
  std::uint64_t index = static_cast<std::uint64_t>(rows.first * p.cols + col) >> Chunk::kIndexShift;

  int k = 0;
  auto step = [&](Rows& now, Rows& ahead) {
    if constexpr (Tn::kPipelined) {
      if (k + U < rows.count) load(ahead, k + U);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k + u >= rows.count) break;
      float h[VEC], d[VEC], out[VEC];
      now.x[u].to_floats(h);
      now.dy[u].to_floats(d);
      const MaskWords mask = Chunk::mask(s, steps.philox, index + u * steps.index);
#pragma unroll
      for (int j = 0; j < VEC / 2; ++j) {
        bool keep_lo, keep_hi;
        mask.kept_pair(j, s.keep_threshold2, keep_lo, keep_hi);
        const float g0 = d[2 * j] * s.scale * Act::derivative(h[2 * j] + bias[2 * j], s);
        const float g1 = d[2 * j + 1] * s.scale * Act::derivative(h[2 * j + 1] + bias[2 * j + 1], s);
        out[2 * j] = keep_lo ? g0 : 0.0f;
        out[2 * j + 1] = keep_hi ? g1 : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += out[i];
      if constexpr (STORE_DX) Chunk::store(dx + u * steps.out0, valid, out);
    }
    k += U;
    if constexpr (STORE_DX) dx += U * steps.out0;
    index += U * steps.index;
    if constexpr (!Tn::kPipelined) {
      if (k < rows.count) load(now, k);
    }
    return k < rows.count;
  };
  if constexpr (Tn::kPipelined) {
    Rows b;
    // Alternating the buffers as forward_rows does is no faster here and spills in the f16 / f32
    // instantiations: the copy stays.
    while (step(a, b)) a = b;
  } else {
    while (step(a, a)) {
    }
  }
}

// Backward steps: in0 = dy, in1 = x, out0 = dx.
template <typename T, typename W, typename Chunk, typename Act>
__global__ void __launch_bounds__(kThreads, Chunk::Tune::kBlocksPerSm)
    backward_kernel(const BackwardParams p, const TileGrid g, const RowSteps steps,
                    float* __restrict__ partial) {
  constexpr int VEC = kChunk;
  // Threads ty > 0 hand their dbias sums to ty = 0 through here (added in ty order).
  __shared__ float4 handoff[kThreads * VEC / 4];
  const std::int64_t col = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = col < p.cols;  // no early return: every thread reaches the barrier
  const int valid = !active ? 0 : (p.cols - col < VEC ? static_cast<int>(p.cols - col) : VEC);
  const ThreadRows rows = thread_rows(g, blockIdx.y, threadIdx.y);

  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;

  if (active && rows.count > 0) {
    if (p.dx != nullptr) backward_rows<T, W, Chunk, Act, OptionalOutput::store>(p, steps, rows, col, valid, acc);
    else backward_rows<T, W, Chunk, Act, OptionalOutput::skip>(p, steps, rows, col, valid, acc);
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
  if (valid == VEC && p.cols % 4 == 0) {
    // Whole chunk, 16-byte aligned (the workspace is 256-byte aligned and col, N are multiples of 4).
#pragma unroll
    for (int q = 0; q < kQuads; ++q)
      reinterpret_cast<float4*>(out)[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (i < valid) out[i] = acc[i];
  }
}

}  // namespace fusekit::bias_act_dropout::kernels
