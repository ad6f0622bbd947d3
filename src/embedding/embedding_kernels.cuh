// Embedding kernels. Every lane moves groups of 8 consecutive columns: in 16-byte accesses where
// the pointers, row strides and C allow (kVector), one element at a time otherwise. Math is
// float32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/device_vector.cuh"

namespace fusekit::embedding::kernels {

using detail::device::from_float;
using detail::device::load_floats;
using detail::device::LoadPath;
using detail::device::pack16_from;
using detail::device::to_float;

inline constexpr int kGroup = 8;          // columns per lane and access
inline constexpr int kWarp = 32;
inline constexpr int kChunk = kWarp * kGroup;  // columns one warp covers in the backward
inline constexpr int kThreads = 256;
inline constexpr int kWarpsPerBlock = kThreads / kWarp;

// Columns [c, c + count) of a row into v (count <= kGroup; kVector: count == kGroup and p 16-byte
// aligned). Columns past count read as 0.
template <typename T, bool kVector, LoadPath kPath = LoadPath::plain>
__device__ __forceinline__ void load_group(const T* p, int count, float (&v)[kGroup]) {
  if constexpr (kVector) {
    load_floats<T, kGroup, kPath>(p, v);
  } else {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) v[k] = k < count ? to_float<T>(p[k]) : 0.0f;
  }
}

template <typename T, bool kVector>
__device__ __forceinline__ void store_group(T* p, int count, const float (&v)[kGroup]) {
  if constexpr (kVector) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < kGroup / kPer; ++c)
      reinterpret_cast<uint4*>(p)[c] = pack16_from<T>(v + c * kPer);
  } else {
#pragma unroll
    for (int k = 0; k < kGroup; ++k)
      if (k < count) p[k] = from_float<T>(v[k]);
  }
}

struct ForwardArgs {
  const void* token_ids;
  const void* weight;
  const void* position_weight;  // may be null
  void* out;
  std::int64_t tokens, positions, vocab, dim;
  std::int64_t weight_row_stride, position_row_stride, out_row_stride;
};

// One warp per output row at a time (rows strided over the grid's warps); an out-of-range token's
// row becomes NaN.
template <typename T, typename Index, bool kVector>
__global__ void __launch_bounds__(kThreads) forward_kernel(const ForwardArgs a) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t first_warp =
      (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * blockDim.x / kWarp;
  const auto* ids = static_cast<const Index*>(a.token_ids);
  const auto* weight = static_cast<const T*>(a.weight);
  const auto* position = static_cast<const T*>(a.position_weight);
  auto* out = static_cast<T*>(a.out);
  const float nan = __int_as_float(0x7fffffff);
  for (std::int64_t i = first_warp; i < a.tokens; i += warps) {
    const auto token = static_cast<std::int64_t>(ids[i]);
    const bool valid = token >= 0 && token < a.vocab;
    const T* w = weight + (valid ? token : 0) * a.weight_row_stride;
    const T* pos = position ? position + (i % a.positions) * a.position_row_stride : nullptr;
    T* o = out + i * a.out_row_stride;
    for (std::int64_t c = static_cast<std::int64_t>(lane) * kGroup; c < a.dim; c += kChunk) {
      const int count = a.dim - c < kGroup ? static_cast<int>(a.dim - c) : kGroup;
      float v[kGroup];
      if (valid) {
        load_group<T, kVector, LoadPath::read_only>(w + c, count, v);
      } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) v[k] = nan;
      }
      if (pos) {
        float pv[kGroup];
        load_group<T, kVector, LoadPath::read_only>(pos + c, count, pv);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) v[k] += pv[k];
      }
      store_group<T, kVector>(o + c, count, v);
    }
  }
}

// The radix sort's input: key = the token (V for an out-of-range one, so that it sorts last and
// is skipped), value = its position.
template <typename Index>
__global__ void __launch_bounds__(kThreads) sort_keys_kernel(const Index* ids, std::int64_t tokens,
                                                             std::int64_t vocab, std::uint32_t* keys,
                                                             std::uint32_t* positions) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens) return;
  const auto token = static_cast<std::int64_t>(ids[i]);
  keys[i] = static_cast<std::uint32_t>(token >= 0 && token < vocab ? token : vocab);
  positions[i] = static_cast<std::uint32_t>(i);
}

// Sorted positions per segment: a run of equal tokens is summed in segments, the intersections of
// the run with the windows [w S, (w + 1) S) of sorted positions, one warp each, so that a frequent
// token (a space in byte-level text: thousands of rows) is not one warp's serial sum. A run inside
// one window is written by its warp; a longer run's segments leave float32 partial sums that
// combine_segments_kernel adds in window order.
inline constexpr std::int64_t kSegment = 64;

struct WeightGradArgs {
  const void* dout;
  void* dweight;
  const std::uint32_t* keys;       // sorted tokens
  const std::uint32_t* positions;  // their positions, in index order within a token (stable)
  float* partials;                 // (2 windows, dim): a window's segment at its start, then its last
  std::int64_t tokens, vocab, dim;
  std::int64_t dout_row_stride, dweight_row_stride;
  bool accumulate;
};

// Where the partial sum of the segment starting at sorted position s goes: window s / S holds at
// most two segments of runs longer than it: one starting at the window's first position, and the
// run crossing its end starting later.
__device__ __forceinline__ std::int64_t partial_slot(std::int64_t s) {
  return 2 * (s / kSegment) + (s % kSegment == 0 ? 0 : 1);
}

template <typename Out, bool kVector>
__device__ __forceinline__ void write_row(const WeightGradArgs& a, std::uint32_t key, std::int64_t c, int count,
                                          float (&acc)[kGroup]) {
  Out* dw = static_cast<Out*>(a.dweight) + static_cast<std::int64_t>(key) * a.dweight_row_stride + c;
  if (a.accumulate) {
    float old[kGroup];
    load_group<Out, kVector>(dw, count, old);
#pragma unroll
    for (int k = 0; k < kGroup; ++k) acc[k] += old[k];
  }
  store_group<Out, kVector>(dw, count, acc);
}

// Warp w (blockIdx.x, warp in block) owns sorted position w; blockIdx.y picks kChunk columns. The
// warp at the first position of a segment sums the segment's dout rows over its columns in sorted
// order, i.e. in increasing position. It reads the positions 32 at a time (one per lane) and
// issues the loads of kUnroll rows before adding them in order.
template <typename In, typename Out, bool kVector>
__global__ void __launch_bounds__(kThreads) weight_grad_kernel(const WeightGradArgs a) {
  constexpr int kUnroll = 4;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t start =
      static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (start >= a.tokens) return;
  const std::uint32_t key = a.keys[start];
  const bool run_head = start == 0 || a.keys[start - 1] != key;
  // Warp-uniform exits: an out-of-range token, or not the first position of a segment.
  if (key >= a.vocab || !(run_head || start % kSegment == 0)) return;
  const std::int64_t window_end = min(a.tokens, (start / kSegment + 1) * kSegment);
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kChunk + lane * kGroup;
  const int count = c < a.dim ? (a.dim - c < kGroup ? static_cast<int>(a.dim - c) : kGroup) : 0;
  const auto* dout = static_cast<const In*>(a.dout);

  float acc[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = 0.0f;
  for (std::int64_t base = start; base < window_end; base += kWarp) {
    const std::int64_t r = base + lane;
    const bool in_segment = r < window_end && a.keys[r] == key;
    const std::uint32_t row = in_segment ? a.positions[r] : 0u;
    // The segment is contiguous from `start` (the keys are sorted): its lanes are a prefix.
    const int rows = __popc(__ballot_sync(0xffffffffu, in_segment));
    for (int k0 = 0; k0 < rows; k0 += kUnroll) {
      float v[kUnroll][kGroup];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const std::uint32_t row_u = __shfl_sync(0xffffffffu, row, (k0 + u) % kWarp);
        if (k0 + u < rows && count > 0) {
          load_group<In, kVector>(dout + static_cast<std::int64_t>(row_u) * a.dout_row_stride + c,
                                  count, v[u]);
        } else {
#pragma unroll
          for (int k = 0; k < kGroup; ++k) v[u][k] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (k0 + u < rows) {
#pragma unroll
          for (int k = 0; k < kGroup; ++k) acc[k] += v[u][k];
        }
    }
    if (rows < kWarp) break;
  }
  if (count == 0) return;
  const bool run_continues = window_end < a.tokens && a.keys[window_end] == key;
  if (run_head && !run_continues) {  // the whole run: the gradient row itself
    write_row<Out, kVector>(a, key, c, count, acc);
    return;
  }
  float* partial = a.partials + partial_slot(start) * a.dim + c;
#pragma unroll
  for (int k = 0; k < kGroup; ++k)
    if (k < count) partial[k] = acc[k];
}

// The runs longer than their first window: the warp at the run's first position adds its
// segments' partial sums in window order.
template <typename Out, bool kVector>
__global__ void __launch_bounds__(kThreads) combine_segments_kernel(const WeightGradArgs a) {
  constexpr int kUnroll = 4;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t start =
      static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (start >= a.tokens) return;
  const std::uint32_t key = a.keys[start];
  if (key >= a.vocab || (start > 0 && a.keys[start - 1] == key)) return;
  std::int64_t next = (start / kSegment + 1) * kSegment;  // the next window's first position
  if (next >= a.tokens || a.keys[next] != key) return;     // the run fits its window: written
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kChunk + lane * kGroup;
  if (c >= a.dim) return;
  const int count = a.dim - c < kGroup ? static_cast<int>(a.dim - c) : kGroup;

  float acc[kGroup];
  const float* first = a.partials + partial_slot(start) * a.dim + c;
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = k < count ? first[k] : 0.0f;
  // Windows next, next + S, ... while the run covers their first position: kUnroll at a time.
  bool more = true;
  while (more) {
    float v[kUnroll][kGroup];
    bool take[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t w = next + u * kSegment;
      take[u] = more && w < a.tokens && a.keys[w] == key;
      more = take[u];
      const float* p = a.partials + partial_slot(w) * a.dim + c;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) v[u][k] = take[u] && k < count ? p[k] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (take[u]) {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) acc[k] += v[u][k];
      }
    next += kUnroll * kSegment;
  }
  write_row<Out, kVector>(a, key, c, count, acc);
}

struct PositionGradArgs {
  const void* dout;
  void* dposition_weight;
  std::int64_t sequences, positions, dim;  // B, T, C
  std::int64_t dout_row_stride, dposition_row_stride;
  bool accumulate;
};

// One thread per (position t, group of kGroup columns): the sum over the B sequences in order.
template <typename In, typename Out, bool kVector>
__global__ void __launch_bounds__(kThreads) position_grad_kernel(const PositionGradArgs a) {
  const std::int64_t groups = (a.dim + kGroup - 1) / kGroup;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= a.positions * groups) return;
  const std::int64_t t = item / groups;
  const std::int64_t c = (item % groups) * kGroup;
  const int count = a.dim - c < kGroup ? static_cast<int>(a.dim - c) : kGroup;
  const auto* dout = static_cast<const In*>(a.dout);
  float acc[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = 0.0f;
  const std::int64_t step = a.positions * a.dout_row_stride;
  const In* p = dout + t * a.dout_row_stride + c;
#pragma unroll 4
  for (std::int64_t b = 0; b < a.sequences; ++b) {
    float v[kGroup];
    load_group<In, kVector>(p + b * step, count, v);
#pragma unroll
    for (int k = 0; k < kGroup; ++k) acc[k] += v[k];
  }
  Out* dp = static_cast<Out*>(a.dposition_weight) + t * a.dposition_row_stride + c;
  if (a.accumulate) {
    float old[kGroup];
    load_group<Out, kVector>(dp, count, old);
#pragma unroll
    for (int k = 0; k < kGroup; ++k) acc[k] += old[k];
  }
  store_group<Out, kVector>(dp, count, acc);
}

}  // namespace fusekit::embedding::kernels
