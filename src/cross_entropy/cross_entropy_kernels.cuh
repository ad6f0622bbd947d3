// Cross-entropy CUDA kernels.
//
//  * row_kernel<T, Index, GRADIENT>: the forward (GRADIENT = false) and the fused forward +
//    backward. One row per `parts` blocks (a thread-block cluster when parts > 1), each block a
//    slice of the row. Sweep 1 reads the slice once, keeping per thread a running max, the sum of
//    exp(x - max) and (label smoothing) the sum of the logits; the block combines its threads'
//    statistics in a fixed order, the cluster its blocks' in rank order through distributed
//    shared memory, so every block holds the row's statistics bitwise alike. Block 0 writes the
//    row's loss and lse. The fused kernel then writes the gradient: from the registers that still
//    hold its slice where the slice is one sweep (the logits read once), else by sweeping the
//    slice again (from L2: it was just read).
//  * staged_row_kernel<T, Index, GRADIENT>: the same on one block per row, the row's vectors
//    brought into shared memory by bulk copies (TMA) and read from there for the statistics and
//    the gradient: the logits are read once, whatever the row's length up to what fits. The
//    vectors of a longer row past that stream through registers and are read again for the
//    gradient, from L2.
//  * backward_kernel<T, Index>: the gradient from the saved lse; a row's columns split over
//    independent blocks (grid.y) where the batch is small.
//  * mean_scale_kernel: the mean's gradient scale dloss / N, N the rows not ignored (one block,
//    before the row or backward kernel, which waits for it only before it reads the scale:
//    programmatic dependent launch).
//  * reduce_losses_kernel: the mean or sum of the row losses (one block, fixed order).
//
// A row is accessed as a scalar head up to the first 16-byte boundary, aligned 16-byte vectors,
// and a scalar tail, so that any V and any row stride take the vector path (dlogits' rows sit at
// the same offset from a 16-byte boundary as the logits' rows, or every element is a scalar).
// Math is float32; exp as 2^x in one MUFU instruction (detail::ex2_approx: results below 2^-126
// flush to 0, negligible against a row sum >= 1), with the log2(e) scaling.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/activation.h"
#include "core/device_vector.cuh"
#include "cross_entropy/cross_entropy_config.h"

namespace fusekit::cross_entropy::kernels {

using detail::ex2_approx;
using detail::device::allow_dependent_launch;
using detail::device::bulk_copy_to_shared;
using detail::device::mbarrier_arrive_expect_tx;
using detail::device::mbarrier_init;
using detail::device::mbarrier_init_fence;
using detail::device::mbarrier_wait;
using detail::device::from_float;
using detail::device::pack16;
using detail::device::to_float;
using detail::device::unpack16;
using detail::device::wait_for_prerequisite_grid;

inline constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Everything the kernels read besides the template arguments, filled by the launcher.
struct KernelParams {
  const void* logits = nullptr;
  std::int64_t logits_row_stride = 0;
  void* dlogits = nullptr;  // row kernel: null in the forward
  std::int64_t dlogits_row_stride = 0;
  const void* targets = nullptr;
  float* row_loss = nullptr;  // row kernel: each row's loss (the output for none, else the workspace)
  float* lse = nullptr;       // row kernel: written where non-null; backward kernel: read
  // The gradient's scale of row r: grad_scale[r * grad_scale_stride], or 1 where null.
  const float* grad_scale = nullptr;
  std::int64_t grad_scale_stride = 0;
  std::int64_t rows = 0;
  int cols = 0;
  std::int64_t ignore_index = -100;
  float one_minus_smoothing = 1.0f;  // 1 - s
  float smoothing_per_class = 0.0f;  // s / V
  float z_loss = 0.0f;
  bool sum_logits = false;  // s > 0: the loss needs the sum of the logits
  bool vector_ok = true;    // 16-byte accesses (else every element is a scalar)
  int parts = 1;            // blocks per row
  int staged_vectors = 0;   // staged kernel: the row's vectors its shared memory holds (the rest streams)
};

// ---- a row's layout ------------------------------------------------------------------------

// `head` scalars, `vectors` aligned 16-byte vectors, then the tail: `scalars` = head + tail.
struct RowSpan {
  int head = 0, vectors = 0, scalars = 0;
  // The column of scalar i (head first, then tail); VEC elements per vector.
  __device__ __forceinline__ int scalar_column(int i, int vec) const {
    return i < head ? i : head + vectors * vec + (i - head);
  }
};

template <typename T>
__device__ __forceinline__ RowSpan row_span(const T* row, int cols, bool vector_ok) {
  constexpr int VEC = kVectorBytes / sizeof(T);
  RowSpan s;
  if (!vector_ok) {
    s.head = cols;
    s.scalars = cols;
    return s;
  }
  const int misaligned = static_cast<int>((reinterpret_cast<std::uintptr_t>(row) % kVectorBytes) / sizeof(T));
  s.head = min(cols, misaligned == 0 ? 0 : VEC - misaligned);
  s.vectors = (cols - s.head) / VEC;
  s.scalars = cols - s.vectors * VEC;
  return s;
}

// Part k of [0, n) split over `parts`.
struct Range {
  int begin, end;
};
__device__ __forceinline__ Range part_of(int n, int k, int parts) {
  return {static_cast<int>(std::int64_t(n) * k / parts), static_cast<int>(std::int64_t(n) * (k + 1) / parts)};
}

// ---- row statistics --------------------------------------------------------------------------

// A running max, the sum of exp(x - max) and the sum of the logits over some of a row's columns.
struct Stats {
  float max;
  float sum;
  float logits;
};

__device__ __forceinline__ Stats empty_stats() { return {negative_infinity(), 0.0f, 0.0f}; }

// The statistics of the union of a's and b's columns.
__device__ __forceinline__ Stats combine(const Stats& a, const Stats& b) {
  Stats c;
  c.max = fmaxf(a.max, b.max);
  if (c.max == negative_infinity()) {
    c.sum = a.sum + b.sum;  // both empty (or all -inf): 0
  } else {
    c.sum = a.sum * ex2_approx((a.max - c.max) * kLog2e) + b.sum * ex2_approx((b.max - c.max) * kLog2e);
  }
  c.logits = a.logits + b.logits;
  return c;
}

// Adds one value to `st` (the scalar head and tail).
__device__ __forceinline__ void accumulate_one(Stats& st, float x, bool sum_logits) {
  if (sum_logits) st.logits += x;
  const float m = fmaxf(st.max, x);
  if (m == negative_infinity()) return;  // nothing but -inf so far: no terms
  const float rescale = st.max == m ? 1.0f : ex2_approx((st.max - m) * kLog2e);
  st.sum = fmaf(st.sum, rescale, ex2_approx((x - m) * kLog2e));
  st.max = m;
}

__device__ __forceinline__ Stats shuffle_xor(const Stats& v, int mask) {
  return {__shfl_xor_sync(0xffffffffu, v.max, mask), __shfl_xor_sync(0xffffffffu, v.sum, mask),
          __shfl_xor_sync(0xffffffffu, v.logits, mask)};
}

// The block's statistics in every thread: a butterfly in each warp (lane 0's result stands for
// the warp), then the warps' results in warp order, combined alike by every thread. A fixed order
// throughout: the same inputs give the same bits. `slots` holds one Stats per warp. Call once per
// block (the slots are not reused).
__device__ __forceinline__ Stats block_stats(Stats v, Stats* slots) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) v = combine(v, shuffle_xor(v, mask));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) slots[warp] = v;
  __syncthreads();
  Stats total = slots[0];
  for (int w = 1; w < warps; ++w) total = combine(total, slots[w]);
  return total;
}

// One sweep of a thread over a slice's vectors: vectors base, base + threads, ... (U of them, those
// below `end`), loaded together so that U 16-byte loads are in flight per thread. The values are
// unpacked from the raw words again for each use (for 16-bit types a shift or a mask per element)
// rather than held as floats, which keeps U = 8 loads within the registers of four blocks per SM.
template <typename T>
struct Sweep {
  static constexpr int VEC = kVectorBytes / sizeof(T), U = kVectorsPerThread;
  uint4 raw[U];
  int base = 0, end = 0, threads = 0;

  __device__ __forceinline__ bool has(int u) const { return base + u * threads < end; }

  // EVICT_FIRST: the loads are the data's last use (streamed past L2's other lines).
  template <bool EVICT_FIRST = false>
  __device__ __forceinline__ void load(const uint4* __restrict__ body) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (has(u)) raw[u] = EVICT_FIRST ? __ldcs(body + base + u * threads) : body[base + u * threads];
  }

  // The largest of the sweep's values (-inf for none). 16-bit types take it on packed pairs (one
  // max instruction per two values, no conversion): max is exact in any format.
  __device__ __forceinline__ float max_value() const {
    if constexpr (std::is_same_v<T, float>) {
      float m = negative_infinity();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!has(u)) continue;
        m = fmaxf(m, fmaxf(fmaxf(__uint_as_float(raw[u].x), __uint_as_float(raw[u].y)),
                           fmaxf(__uint_as_float(raw[u].z), __uint_as_float(raw[u].w))));
      }
      return m;
    } else {
      using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      const Pair lowest = detail::device::bit_copy<Pair>(0xfc00fc00u * std::is_same_v<T, __half> +
                                                         0xff80ff80u * std::is_same_v<T, __nv_bfloat16>);
      Pair m = lowest;  // -inf, -inf
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!has(u)) continue;
        const Pair a = __hmax2(detail::device::bit_copy<Pair>(raw[u].x), detail::device::bit_copy<Pair>(raw[u].y));
        const Pair b = __hmax2(detail::device::bit_copy<Pair>(raw[u].z), detail::device::bit_copy<Pair>(raw[u].w));
        m = __hmax2(m, __hmax2(a, b));
      }
      const float2 f = std::is_same_v<T, __half> ? __half22float2(detail::device::bit_copy<__half2>(m))
                                                 : __bfloat1622float2(detail::device::bit_copy<__nv_bfloat162>(m));
      return fmaxf(f.x, f.y);
    }
  }

  // Adds the sweep's values to `st`: their max first, then one rescale of the running sum.
  __device__ __forceinline__ void accumulate(Stats& st, bool sum_logits) const {
    const float batch_max = max_value();
    const float m = fmaxf(st.max, batch_max);
    if (m != negative_infinity()) {
      float part = 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!has(u)) continue;
        float v[VEC];
        unpack16<T>(raw[u], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) part += ex2_approx((v[i] - m) * kLog2e);
      }
      const float rescale = st.max == m ? 1.0f : ex2_approx((st.max - m) * kLog2e);
      st.sum = fmaf(st.sum, rescale, part);
      st.max = m;
    }
    if (sum_logits) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!has(u)) continue;
        float v[VEC];
        unpack16<T>(raw[u], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) st.logits += v[i];
      }
    }
  }
};

// The statistics of this block's scalars of a row (its part of the head and tail).
template <typename T>
__device__ __forceinline__ Stats scalar_stats(const T* __restrict__ x, const RowSpan& span, Range scalars,
                                              bool sum_logits) {
  constexpr int VEC = kVectorBytes / sizeof(T);
  Stats st = empty_stats();
  for (int i = scalars.begin + static_cast<int>(threadIdx.x); i < scalars.end; i += blockDim.x)
    accumulate_one(st, to_float(x[span.scalar_column(i, VEC)]), sum_logits);
  return st;
}

// Sweep 1 over this block's part of a row: its scalars, then its vectors one sweep at a time.
template <typename T>
__device__ __forceinline__ Stats slice_stats(const T* __restrict__ x, const RowSpan& span, Range scalars,
                                             Range vectors, bool sum_logits) {
  Stats st = scalar_stats(x, span, scalars, sum_logits);
  const uint4* __restrict__ body = reinterpret_cast<const uint4*>(x + span.head);
  Sweep<T> sweep;
  sweep.end = vectors.end;
  sweep.threads = blockDim.x;
  for (int base = vectors.begin + static_cast<int>(threadIdx.x); base < vectors.end;
       base += kVectorsPerThread * sweep.threads) {
    sweep.base = base;
    sweep.load(body);
    sweep.accumulate(st, sum_logits);
  }
  return st;
}

// ---- the gradient ----------------------------------------------------------------------------

// d = g (softmax (1 + 2 z lse) - s / V) - g (1 - s) [col == target], softmax = exp(x - lse).
struct GradientTerms {
  float a;  // g (1 + 2 z lse)
  float b;  // g s / V
  float c;  // g (1 - s), subtracted at the target
  float lse;
  std::int64_t target;
  // The gradient at a column other than the target.
  __device__ __forceinline__ float off_target(float x) const { return fmaf(a, ex2_approx((x - lse) * kLog2e), -b); }
  __device__ __forceinline__ float at(float x, std::int64_t col) const {
    const float d = off_target(x);
    return col == target ? d - c : d;
  }
};

// The row's gradient terms. The row's scale is read after the kernel that produced it (if any)
// has completed; an invalid target makes the row's gradient NaN.
__device__ __forceinline__ GradientTerms gradient_terms(const KernelParams& p, std::int64_t row, std::int64_t target,
                                                        bool in_range, float lse) {
  wait_for_prerequisite_grid();  // the scale may come from mean_scale_kernel (a no-op otherwise)
  float g = p.grad_scale ? p.grad_scale[row * p.grad_scale_stride] : 1.0f;
  if (!in_range) g = quiet_nan();
  GradientTerms terms;
  terms.a = g * fmaf(2.0f * p.z_loss, lse, 1.0f);
  terms.b = g * p.smoothing_per_class;
  terms.c = g * p.one_minus_smoothing;
  terms.lse = lse;
  terms.target = target;
  return terms;
}

// The gradient of one sweep's vectors, stored streaming (dx_body: the row's vectors in dlogits).
template <typename T>
__device__ __forceinline__ void store_gradient(const GradientTerms& terms, const Sweep<T>& sweep, int head,
                                               uint4* __restrict__ dx_body) {
  constexpr int VEC = Sweep<T>::VEC;
#pragma unroll
  for (int u = 0; u < kVectorsPerThread; ++u) {
    if (!sweep.has(u)) continue;
    const int j = sweep.base + u * sweep.threads;
    float v[VEC];
    unpack16<T>(sweep.raw[u], v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = terms.off_target(v[i]);
    // The target's column, in one vector of the row: one test per vector, not per element.
    const std::int64_t at_target = terms.target - (head + std::int64_t(j) * VEC);
    if (at_target >= 0 && at_target < VEC) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (i == at_target) v[i] -= terms.c;
    }
    __stcs(dx_body + j, pack16<T>(v));
  }
}

// Where write_gradient finds a block's vectors again: in memory (read a second time), in the
// registers of the one sweep that covered them (`held`), or in shared memory (`staged`, vector j
// of the row at staged[j]).
enum class VectorSource { memory, held, shared };

// This block's part of a row of dlogits: zeros for an ignored row (nothing is read, `terms` is
// not used), else the gradient of its scalars (read again) and of its vectors from SOURCE.
template <typename T, VectorSource SOURCE>
__device__ __forceinline__ void write_gradient(const KernelParams& p, std::int64_t row, const T* __restrict__ x,
                                               const RowSpan& span, Range scalars, Range vectors, bool ignored,
                                               const GradientTerms& terms, const Sweep<T>& held,
                                               const uint4* staged) {
  constexpr int VEC = kVectorBytes / sizeof(T), U = kVectorsPerThread;
  const int threads = blockDim.x;
  T* __restrict__ dx = static_cast<T*>(p.dlogits) + row * p.dlogits_row_stride;
  uint4* __restrict__ dx_body = reinterpret_cast<uint4*>(dx + span.head);
  if (ignored) {
    for (int i = scalars.begin + static_cast<int>(threadIdx.x); i < scalars.end; i += threads)
      dx[span.scalar_column(i, VEC)] = from_float<T>(0.0f);
    for (int j = vectors.begin + static_cast<int>(threadIdx.x); j < vectors.end; j += threads)
      __stcs(dx_body + j, make_uint4(0u, 0u, 0u, 0u));
    return;
  }
  for (int i = scalars.begin + static_cast<int>(threadIdx.x); i < scalars.end; i += threads) {
    const int col = span.scalar_column(i, VEC);
    dx[col] = from_float<T>(terms.at(to_float(x[col]), col));
  }
  if constexpr (SOURCE == VectorSource::held) {
    store_gradient(terms, held, span.head, dx_body);
  } else {
    // The sweeps in reverse: a second pass over memory then reads first what the first pass read
    // last, which L2 is likeliest still to hold when a slice does not fit entirely.
    const uint4* __restrict__ body = reinterpret_cast<const uint4*>(x + span.head);
    Sweep<T> sweep;
    sweep.end = vectors.end;
    sweep.threads = threads;
    const int stride = U * threads;
    for (int k = (vectors.end - vectors.begin + stride - 1) / stride - 1; k >= 0; --k) {
      sweep.base = vectors.begin + k * stride + static_cast<int>(threadIdx.x);
      if constexpr (SOURCE == VectorSource::shared) sweep.load(staged);
      else sweep.load<true>(body);
      store_gradient(terms, sweep, span.head, dx_body);
    }
  }
}

// The row's loss (0 where ignored, NaN for a target out of range) and, where asked, its lse; by
// one thread of the row.
__device__ __forceinline__ void write_row_loss(const KernelParams& p, std::int64_t row, bool ignored, bool in_range,
                                               float x_target, const Stats& st, float lse) {
  float loss = 0.0f;
  if (!ignored) {
    loss = in_range ? lse - p.one_minus_smoothing * x_target - p.smoothing_per_class * st.logits +
                          p.z_loss * lse * lse
                    : quiet_nan();
  }
  p.row_loss[row] = loss;
  if (p.lse) p.lse[row] = lse;
}

// ---- kernels ---------------------------------------------------------------------------------

// A row's target, whether it is ignore_index (loss and gradient 0) and whether it names a class
// (0 <= target < V; otherwise the row's loss and gradient are NaN).
struct RowTarget {
  std::int64_t target;
  bool ignored, in_range;
};
template <typename Index>
__device__ __forceinline__ RowTarget row_target(const KernelParams& p, std::int64_t row) {
  const auto target = static_cast<std::int64_t>(static_cast<const Index*>(p.targets)[row]);
  return {target, target == p.ignore_index, target >= 0 && target < p.cols};
}

// Forward (GRADIENT = false) and fused forward + backward; grid.x = rows x parts, clusters of
// `parts` blocks along x when parts > 1 (block rank = blockIdx.x % parts).
template <typename T, typename Index, bool GRADIENT>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocksPerSm) row_kernel(const KernelParams p) {
  namespace cg = cooperative_groups;
  __shared__ Stats warp_slots[kMaxThreads / 32];
  __shared__ Stats block_total;  // this block's statistics, read by the cluster's blocks

  const int parts = p.parts;
  const std::int64_t row = blockIdx.x / parts;
  const int rank = static_cast<int>(blockIdx.x - row * parts);
  const T* __restrict__ x = static_cast<const T*>(p.logits) + row * p.logits_row_stride;
  const auto [target, ignored, in_range] = row_target<Index>(p, row);
  // Read before this block reaches the cluster barrier, so before any block of the row writes its
  // gradient (in place, dlogits is the logits).
  float x_target = 0.0f;
  if (rank == 0 && threadIdx.x == 0 && !ignored && in_range) x_target = to_float(x[target]);

  const RowSpan span = row_span(x, p.cols, p.vector_ok);
  const Range scalars = part_of(span.scalars, rank, parts), vectors = part_of(span.vectors, rank, parts);
  // The fused kernel keeps a slice of one sweep in registers from its statistics to its gradient:
  // the logits are read once. Longer slices are read again (from L2, mostly).
  Sweep<T> sweep;
  const bool resident = GRADIENT && vectors.end - vectors.begin <= kVectorsPerThread * static_cast<int>(blockDim.x);
  Stats st;
  if (resident) {
    st = scalar_stats(x, span, scalars, p.sum_logits);
    sweep.base = vectors.begin + static_cast<int>(threadIdx.x);
    sweep.end = vectors.end;
    sweep.threads = blockDim.x;
    sweep.load(reinterpret_cast<const uint4*>(x + span.head));
    sweep.accumulate(st, p.sum_logits);
  } else {
    st = slice_stats(x, span, scalars, vectors, p.sum_logits);
  }
  st = block_stats(st, warp_slots);
  if (parts > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) block_total = st;
    cluster.sync();  // releases each block's total to the cluster
    st = *cluster.map_shared_rank(&block_total, 0);
    for (int k = 1; k < parts; ++k) st = combine(st, *cluster.map_shared_rank(&block_total, k));
    cluster.barrier_arrive();  // done reading the other blocks' shared memory (waited for at the end)
  }
  const float lse = st.max + logf(st.sum);
  if (rank == 0 && threadIdx.x == 0) write_row_loss(p, row, ignored, in_range, x_target, st, lse);
  if constexpr (GRADIENT) {
    const GradientTerms terms = ignored ? GradientTerms{} : gradient_terms(p, row, target, in_range, lse);
    if (resident)
      write_gradient<T, VectorSource::held>(p, row, x, span, scalars, vectors, ignored, terms, sweep, nullptr);
    else
      write_gradient<T, VectorSource::memory>(p, row, x, span, scalars, vectors, ignored, terms, sweep, nullptr);
  }
  // No block leaves (freeing its shared memory) while another may still read its statistics.
  if (parts > 1) cg::this_cluster().barrier_wait();
}

// Forward (GRADIENT = false) and fused forward + backward, one block per row (grid.x = rows), the
// row's first p.staged_vectors aligned vectors in shared memory. Thread 0 issues them as
// kStagedChunks bulk copies, each completing on its own mbarrier; the threads add up the scalar
// head and tail and stream the vectors past shared memory (a row longer than it) meanwhile, then
// each piece as it lands. The gradient is formed from shared memory, and from the streamed vectors
// read again (from L2: one block per SM streams at most a row less its shared part).
template <typename T, typename Index, bool GRADIENT>
__global__ void __launch_bounds__(kMaxThreads) staged_row_kernel(const KernelParams p) {
  extern __shared__ uint4 staged[];
  __shared__ Stats warp_slots[kMaxThreads / 32];
  __shared__ std::uint64_t landed[kStagedChunks];

  const std::int64_t row = blockIdx.x;
  const T* __restrict__ x = static_cast<const T*>(p.logits) + row * p.logits_row_stride;
  const auto [target, ignored, in_range] = row_target<Index>(p, row);
  const RowSpan span = row_span(x, p.cols, p.vector_ok);
  const int held = min(span.vectors, p.staged_vectors);
  const Range scalars{0, span.scalars}, vectors{0, held}, streamed{held, span.vectors};
  const uint4* body = reinterpret_cast<const uint4*>(x + span.head);

  if (threadIdx.x == 0) {
    for (int c = 0; c < kStagedChunks; ++c) mbarrier_init(&landed[c], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int c = 0; c < kStagedChunks; ++c) {
      const Range piece = part_of(held, c, kStagedChunks);
      const unsigned bytes = static_cast<unsigned>(piece.end - piece.begin) * kVectorBytes;
      mbarrier_arrive_expect_tx(&landed[c], bytes);
      if (bytes > 0) bulk_copy_to_shared(staged + piece.begin, body + piece.begin, bytes, &landed[c]);
    }
  }
  // Read before any gradient is written (in place, dlogits is the logits): the writes follow the
  // block's barriers below.
  float x_target = 0.0f;
  if (threadIdx.x == 0 && !ignored && in_range) x_target = to_float(x[target]);

  Stats st = slice_stats(x, span, scalars, streamed, p.sum_logits);
  Sweep<T> sweep;
  sweep.threads = blockDim.x;
  for (int c = 0; c < kStagedChunks; ++c) {
    const Range piece = part_of(held, c, kStagedChunks);
    mbarrier_wait(&landed[c], 0);
    sweep.end = piece.end;
    for (int base = piece.begin + static_cast<int>(threadIdx.x); base < piece.end;
         base += kVectorsPerThread * sweep.threads) {
      sweep.base = base;
      sweep.load(staged);
      sweep.accumulate(st, p.sum_logits);
    }
  }
  st = block_stats(st, warp_slots);
  const float lse = st.max + logf(st.sum);
  if (threadIdx.x == 0) write_row_loss(p, row, ignored, in_range, x_target, st, lse);
  if constexpr (GRADIENT) {
    const GradientTerms terms = ignored ? GradientTerms{} : gradient_terms(p, row, target, in_range, lse);
    // The streamed vectors first: L2 holds them from the statistics' sweep, most recently.
    if (streamed.end > streamed.begin)
      write_gradient<T, VectorSource::memory>(p, row, x, span, Range{0, 0}, streamed, ignored, terms, sweep, nullptr);
    write_gradient<T, VectorSource::shared>(p, row, x, span, scalars, vectors, ignored, terms, sweep, staged);
  }
}

// The gradient from the saved lse; grid (rows, chunks), chunk blockIdx.y a part of the columns.
template <typename T, typename Index>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocksPerSm) backward_kernel(const KernelParams p) {
  const std::int64_t row = blockIdx.x;
  const T* __restrict__ x = static_cast<const T*>(p.logits) + row * p.logits_row_stride;
  const auto [target, ignored, in_range] = row_target<Index>(p, row);
  const RowSpan span = row_span(x, p.cols, p.vector_ok);
  const int part = blockIdx.y, parts = gridDim.y;
  const GradientTerms terms = ignored ? GradientTerms{} : gradient_terms(p, row, target, in_range, p.lse[row]);
  const Sweep<T> none{};
  write_gradient<T, VectorSource::memory>(p, row, x, span, part_of(span.scalars, part, parts),
                                          part_of(span.vectors, part, parts), ignored, terms, none, nullptr);
}

// ---- one-block reductions over the rows ------------------------------------------------------

// A float and a count summed over the block in a fixed order: butterflies in the warps, then the
// warps in order. Thread 0's result is the block's.
struct SumAndCount {
  float sum;
  unsigned long long count;
};

__device__ __forceinline__ SumAndCount block_sum_and_count(SumAndCount v) {
  __shared__ SumAndCount slots[kReduceThreads / 32];
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    v.sum += __shfl_xor_sync(0xffffffffu, v.sum, mask);
    v.count += __shfl_xor_sync(0xffffffffu, v.count, mask);
  }
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
  __syncthreads();
  SumAndCount total = slots[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
    total.sum += slots[w].sum;
    total.count += slots[w].count;
  }
  return total;
}

// scale = dloss / N (dloss null: 1 / N), 0 when every row is ignored.
template <typename Index>
__global__ void __launch_bounds__(kReduceThreads)
    mean_scale_kernel(const Index* __restrict__ targets, std::int64_t rows, std::int64_t ignore_index,
                      const float* __restrict__ dloss, float* __restrict__ scale) {
  allow_dependent_launch();  // the next kernel waits for this grid before it reads the scale
  SumAndCount v{0.0f, 0ull};
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    v.count += static_cast<std::int64_t>(targets[r]) != ignore_index;
  v = block_sum_and_count(v);
  if (threadIdx.x == 0) {
    const float g = dloss ? dloss[0] : 1.0f;
    *scale = v.count > 0 ? g / static_cast<float>(v.count) : 0.0f;
  }
}

// loss = the sum of the row losses, divided by N for the mean (0 when every row is ignored).
template <typename Index>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_losses_kernel(const float* __restrict__ row_loss, const Index* __restrict__ targets, std::int64_t rows,
                         std::int64_t ignore_index, bool mean, float* __restrict__ loss) {
  wait_for_prerequisite_grid();  // the row kernel's losses
  SumAndCount v{0.0f, 0ull};
#pragma unroll 4
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    v.sum += row_loss[r];
    if (mean) v.count += static_cast<std::int64_t>(targets[r]) != ignore_index;
  }
  v = block_sum_and_count(v);
  if (threadIdx.x == 0) {
    float out = v.sum;
    if (mean) out = v.count > 0 ? v.sum / static_cast<float>(v.count) : 0.0f;
    *loss = out;
  }
}

}  // namespace fusekit::cross_entropy::kernels
