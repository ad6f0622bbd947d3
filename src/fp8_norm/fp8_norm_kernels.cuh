// FP8 RMSNorm CUDA kernels.
//
// Forward, two kernels and no host round trip:
//  1. stats: one pass over fp8 x and its scales. Each row group reduces the row's sum of squares
//     (-> rstd, written out) and max |xd * w|; since y = (xd * w) * rstd, the row's max |y| is
//     that max times rstd (monotone rounding), so the pass needs neither rstd in advance nor a
//     second sweep. Each block writes the max over its rows to the workspace. The weights are
//     staged once per block in shared memory as floats (N <= 16384): with one byte per element
//     the pass is bound by instruction issue (about 8 per element, 5.5 of them the decode,
//     square, product and max) rather than by memory.
//  2. quantize: a persistent grid launched as a programmatic dependent of the stats kernel. Its
//     blocks start while the stats grid drains, copy their first x tiles (which do not depend on
//     the statistics) with cp.async, and only then wait (griddepcontrol.wait) for the stats
//     results: the maxima (max is order-independent: exact and deterministic) give the scale,
//     block 0 writes it. Each block walks 128 x 128 tiles with x staged four tiles deep in
//     shared memory, recomputes y / s from x (second read of x; fp8_norm_math.h quant_value),
//     writes qy row-major with 16-byte stores and overwrites the staged x with the tile's fp8
//     bytes (XOR-swizzled 4-byte words, no bank conflicts either way) to write qy_t with 16-byte
//     stores along its rows. Tiles are taken from the last rows to the first, so that the
//     second read of x can find in L2 what the stats pass read last: the stats pass reads its
//     last rows (40% of L2's size) with an evict-last priority and the others evict-first, and
//     the quantize pass copies x and stores its outputs evict-first, so that they do not push
//     that x out.
//  Bytes moved: x and scales twice (less what L2 serves), qy and qy_t once (plus rstd, w and a
//  few KB of maxima).
//
// Backward: a persistent grid; row groups of threads share a row. A thread owns fixed runs of 8
// columns (8 fp8 bytes of x, 16 bytes of dy and dx, so that every warp-wide access is
// contiguous) and copies its own x and dy bytes of the rows ahead into shared memory with
// cp.async (2 to 4 rows deep: no registers held for prefetching, no barrier needed for them).
// It accumulates dweight partial sums in registers, the row groups of a block are combined in a
// fixed order through shared memory, and each block writes one partial row; a second kernel,
// launched as a programmatic dependent, sums those rows in a fixed order.
//
// "vector" kernels need 16-element vectors that lie in one scale group (group_size >= 16) and
// 16-byte aligned rows; the "generic" kernels handle any group size and alignment, element by
// element (correctness path).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/device_vector.cuh"
#include "fp8_norm/fp8_norm_config.h"
#include "fp8_norm/fp8_norm_math.h"
#include "fp8_norm/fp8_norm_params.h"

namespace fusekit::fp8_norm::kernels {

struct E4M3 {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
  static constexpr bool kIsE4M3 = true;
};
struct E5M2 {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
  static constexpr bool kIsE4M3 = false;
};

// Element conversions and 16-byte vectors: core/device_vector.cuh.
using detail::device::from_float;
using detail::device::pack16;
using detail::device::pack16_from;
using detail::device::to_float;
using detail::device::unpack16;
using detail::device::unpack16_to;

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }
// Read-once data (dy): evict-first.
__device__ __forceinline__ uint4 load16_stream(const void* p) { return __ldcs(static_cast<const uint4*>(p)); }

// One fp8 value.
template <class F>
__device__ __forceinline__ float decode1(std::uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, F::kKind)));
}

// 4 * WORDS fp8 values packed in 32-bit words (first value in the lowest byte), two at a time
// (cvt.rn.f16x2.e4m3x2 / e5m2x2).
template <class F, int WORDS>
__device__ __forceinline__ void decode_words(const std::uint32_t (&words)[WORDS], float (&q)[4 * WORDS]) {
#pragma unroll
  for (int k = 0; k < WORDS; ++k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(words[k] >> (16 * h)), F::kKind);
      const float2 f = __half22float2(__half2(pair));
      q[4 * k + 2 * h] = f.x;
      q[4 * k + 2 * h + 1] = f.y;
    }
  }
}

// 16 fp8 values (one 16-byte vector).
template <class F>
__device__ __forceinline__ void decode16(const uint4& raw, float (&q)[16]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  decode_words<F>(words, q);
}

// 16 floats -> 16 fp8 bytes (round to nearest even, saturate to the finite max), first value in
// the lowest byte.
template <class F>
__device__ __forceinline__ uint4 encode16(const float (&v)[16]) {
  std::uint32_t words[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * k], v[4 * k + 1]), __NV_SATFINITE, F::kKind);
    const std::uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * k + 2], v[4 * k + 3]), __NV_SATFINITE, F::kKind);
    words[k] = lo | (hi << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

template <class F>
__device__ __forceinline__ std::uint8_t encode1(float v) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F::kKind));
}

// 16 consecutive weights (16-byte aligned), as floats; read through the read-only cache (the
// same weights serve every row).
__device__ __forceinline__ void load_w16(const float* w, float (&out)[16]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(w) + k);
    out[4 * k] = v.x;
    out[4 * k + 1] = v.y;
    out[4 * k + 2] = v.z;
    out[4 * k + 3] = v.w;
  }
}
__device__ __forceinline__ void load_w16(const __nv_bfloat16* w, float (&out)[16]) {
  unpack16_to<__nv_bfloat16>(__ldg(reinterpret_cast<const uint4*>(w)), out);
  unpack16_to<__nv_bfloat16>(__ldg(reinterpret_cast<const uint4*>(w) + 1), out + 8);
}

// Max over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats; the trailing barrier lets the caller reuse it.
__device__ __forceinline__ float block_max(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  float m = 0.0f;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// Sum over the row group of 2^log2_tpr threads (aligned in the block); every thread of the group
// gets the bitwise-same total (xor butterfly, then warps added in index order). `scratch` holds
// one float per warp of the block and must not be rewritten before the group's next barrier
// (callers alternate two buffers). When the group spans warps it synchronizes the group: with
// __syncthreads() if the group is the whole block, else with its own hardware barrier
// (1 + group index); every thread of the group must call it. Groups of at most 256 threads.
__device__ __forceinline__ float row_sum(float v, int log2_tpr, float* scratch) {
  const int tpr = 1 << log2_tpr;
  const int width = tpr < 32 ? tpr : 32;
  for (int off = width >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (tpr > 32) {
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    if (tpr == static_cast<int>(blockDim.x)) {
      __syncthreads();
    } else {
      // Only this row group waits (hardware barrier 1 + group): the block's other row groups go
      // on with their own rows instead of lining up behind the slowest one every row.
      detail::device::group_barrier(1 + (threadIdx.x >> log2_tpr), tpr);
    }
    const int warps = tpr >> 5, first = (threadIdx.x >> log2_tpr) * warps;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w)  // groups of at most 256 threads
      if (w < warps) s += scratch[first + w];
    v = s;
  }
  return v;
}


// ---- asynchronous copies and programmatic dependent launch ------------------------------------

using detail::device::elect_one_lane;
using detail::device::fence_proxy_async_shared;
using detail::device::mbarrier_arrive_expect_tx;
using detail::device::mbarrier_init;
using detail::device::mbarrier_init_fence;
using detail::device::mbarrier_wait;
using detail::device::shared_address;
// Streaming data read once: 16 bytes bypass L1.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(smem)), "l"(gmem) : "memory");
}
// L2 eviction priorities (createpolicy): a 64-bit policy operand for the cache_hint forms.
__device__ __forceinline__ std::uint64_t l2_policy_evict_last() {
  std::uint64_t pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ std::uint64_t l2_policy_evict_first() {
  std::uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// 16 read-only bytes with an L2 eviction priority.
__device__ __forceinline__ uint4 load16_policy(const void* p, std::uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void cp_async16_policy(void* smem, const void* gmem, std::uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
               "l"(pol)
               : "memory");
}
__device__ __forceinline__ void store16_policy(void* p, uint4 v, std::uint64_t pol) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w), "l"(pol)
               : "memory");
}
// 8-byte copies must go through L1 (.ca); a warp's 32 of them cover 256 contiguous bytes.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(shared_address(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8_policy(void* smem, const void* gmem, std::uint64_t pol) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2;\n" ::"r"(shared_address(smem)), "l"(gmem),
               "l"(pol)
               : "memory");
}
// A streaming ("evict first") 16-byte store: for outputs that nothing reads back soon.
__device__ __forceinline__ void store16_streaming(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Programmatic dependent launch: core/device_vector.cuh.
using detail::device::allow_dependent_launch;
using detail::device::wait_for_prerequisite_grid;

// 8 fp8 values (one 8-byte word pair).
template <class F>
__device__ __forceinline__ void decode8(const uint2& raw, float (&q)[8]) {
  const std::uint32_t words[2] = {raw.x, raw.y};
  decode_words<F>(words, q);
}

// Stages the weights in shared memory as floats, in units of 4 * quads weights:
// w4[k * count + u] holds weights 4 (quads u + k) .. + 3, so that consecutive threads reading
// consecutive units touch consecutive 16-byte words (no bank conflicts). Units u in
// [units, count) are zero. The weights (units * quads * 4 of them) must be 16-byte aligned, as
// every vector path checks. All threads of the block take part; the caller synchronizes.
//
// stage_weights issues a batch of 16-byte loads per thread before it converts any of them: one
// round trip to L2 per batch (the statistics kernels; bench: fp8_rms_norm fwd (8192, 8192)).
// stage_weights_by_quads loads four weights, stores them and only then loads the next four; the
// backward keeps it (bench: fp8_rms_norm bwd, every shape, slower with the batched staging).
template <typename W>
__device__ __forceinline__ void stage_weights(const W* __restrict__ weight, int units, int quads, int count,
                                              float4* w4) {
  constexpr int kPerPiece = 16 / static_cast<int>(sizeof(W));  // weights per 16-byte piece: 8 or 4
  constexpr int kGroupsPerPiece = kPerPiece / 4;                // float4 groups per piece
  constexpr int kBatch = 4;                                     // pieces in flight per thread
  static_assert(kGroupsPerPiece >= 1, "float or 16-bit weights");
  auto store_group = [&](int idx, float4 v) {
    const int u = idx / quads, k = idx - u * quads;
    w4[k * count + u] = v;
  };
  const uint4* __restrict__ src = reinterpret_cast<const uint4*>(weight);
  const int pieces = units * quads / kGroupsPerPiece;
  for (int base = threadIdx.x; base < pieces; base += kBatch * blockDim.x) {
    uint4 raw[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int piece = base + j * blockDim.x;
      if (piece < pieces) raw[j] = __ldg(src + piece);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int piece = base + j * blockDim.x;
      if (piece < pieces) {
        float f[kPerPiece];
        unpack16_to<W>(raw[j], f);
#pragma unroll
        for (int g = 0; g < kGroupsPerPiece; ++g)
          store_group(piece * kGroupsPerPiece + g, make_float4(f[4 * g], f[4 * g + 1], f[4 * g + 2], f[4 * g + 3]));
      }
    }
  }
  for (int idx = units * quads + threadIdx.x; idx < count * quads; idx += blockDim.x)
    store_group(idx, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
}

template <typename W>
__device__ __forceinline__ void stage_weights_by_quads(const W* __restrict__ weight, int units, int quads, int count,
                                                       float4* w4) {
  for (int idx = threadIdx.x; idx < count * quads; idx += blockDim.x) {
    const int u = idx / quads, k = idx - u * quads;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (u < units) {
      const W* src = weight + std::int64_t(idx) * 4;
      v = make_float4(to_float(src[0]), to_float(src[1]), to_float(src[2]), to_float(src[3]));
    }
    w4[k * count + u] = v;
  }
}

// The 16 weights of vector v from stage_weights' interleaved layout (quads = 4, count units).
__device__ __forceinline__ void staged_weights16(const float4* w4, int count, int v, float (&w)[16]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float4 f = w4[k * count + v];
    w[4 * k] = f.x;
    w[4 * k + 1] = f.y;
    w[4 * k + 2] = f.z;
    w[4 * k + 3] = f.w;
  }
}

// bf16 scales and bf16 weights: products of an fp8 value, a scale and a weight are exact in
// float32 as long as they stay in its normal range (|q * w| >= 2^-126), so the statistics can
// take max |q w| per vector and multiply by |scale| once.
template <typename SC, typename W>
inline constexpr bool kExactProducts = std::is_same_v<SC, __nv_bfloat16> && std::is_same_v<W, __nv_bfloat16>;

// One 16-element vector's share of its row's statistics (every statistics pass uses it, so that
// all designs give the same rstd and max). q^2 is exact in float32 (at most 8 significant bits);
// the 16 squares are summed in float32 (four chains of four, then a pairwise tree: at most 5
// roundings on any path), then scaled by scale^2 and accumulated in float64 (no overflow or
// underflow for any float32 scale).
template <typename SC, typename W>
__device__ __forceinline__ void accumulate_vector_stats(const float (&q)[16], const float (&w)[16], float sc,
                                                        double& sum_squares, float& max_xw) {
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 16; ++i) a[i & 3] += q[i] * q[i];
  const double scale = sc;
  sum_squares += static_cast<double>((a[0] + a[1]) + (a[2] + a[3])) * (scale * scale);
  if constexpr (kExactProducts<SC, W>) {
    // q * w * scale needs at most 4 + 8 + 8 significant bits: every grouping of the product is
    // exact, so max |q w| * |scale| is exactly max |fl(fl(q scale) w)|.
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(q[i] * w[i]));
    max_xw = fmaxf(max_xw, m * fabsf(sc));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) max_xw = fmaxf(max_xw, fabsf(weighted(dequantize(q[i], sc), w[i])));
  }
}

// 16 words = 16 rows x 4 byte columns of an fp8 tile, transposed in place: afterwards word
// 4 k + c holds column c's bytes of rows 4 k .. 4 k + 3 (first row in the lowest byte).
__device__ __forceinline__ void transpose_bytes_4x4(std::uint32_t (&in)[16]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t a = in[4 * k], b = in[4 * k + 1], c = in[4 * k + 2], d = in[4 * k + 3];
    const std::uint32_t ab_lo = __byte_perm(a, b, 0x5140), cd_lo = __byte_perm(c, d, 0x5140);
    const std::uint32_t ab_hi = __byte_perm(a, b, 0x7362), cd_hi = __byte_perm(c, d, 0x7362);
    in[4 * k] = __byte_perm(ab_lo, cd_lo, 0x5410);
    in[4 * k + 1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    in[4 * k + 2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    in[4 * k + 3] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
}

// =============================================================================================
// Forward 1: statistics (rstd per row, per-block max |y|).

// Block sizes and shared-memory layouts: fp8_norm_config.h.

// The end of a row in the statistics passes: the row group's totals by an xor butterfly (every
// thread of the group gets them), then rstd and the row's max |y|. rstd costs a float64
// division, square root and reciprocal: rather than one thread of the group computing it every
// row while the others wait, thread (row count mod tpr) keeps that row's totals and the group
// finalizes tpr rows at once.
struct RowStatsEnd {
  double kept_sum_squares = 0.0;
  float kept_max_xw = 0.0f;
  std::int64_t kept_row = -1;
  int rows_ended = 0;
  float amax = 0.0f;  // max |y| over the rows this thread finalized

  __device__ __forceinline__ void finalize(const ForwardParams& p) {
    if (kept_row >= 0 && kept_row < p.rows) {
      const float rstd = rstd_from_sum_squares(kept_sum_squares, p.cols, p.eps);
      p.rstd[kept_row] = rstd;
      amax = fmaxf(amax, normalized(kept_max_xw, rstd));
    }
    kept_row = -1;
  }
  // Every thread of the group calls it for every row the group walks, `row` past the end
  // included (its totals are then ignored); `last`: the group has no further row.
  __device__ __forceinline__ void end_row(const ForwardParams& p, int log2_tpr, int t, std::int64_t row,
                                          double sum_squares, float max_xw, bool last) {
    const int tpr = 1 << log2_tpr;
    for (int off = tpr >> 1; off > 0; off >>= 1) {
      sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, off);
      max_xw = fmaxf(max_xw, __shfl_xor_sync(0xffffffffu, max_xw, off));
    }
    const int slot = rows_ended & (tpr - 1);
    if (slot == t) {
      kept_sum_squares = sum_squares;
      kept_max_xw = max_xw;
      kept_row = row;
    }
    if (slot == tpr - 1 || last) finalize(p);
    ++rows_ended;
  }
};

// Row groups of 2^log2_tpr threads (1..32) stride over the row's 16-element vectors. With staged
// weights the block first stages them (dynamic shared memory, 4 N bytes). Whole rounds: the
// row's vectors are a multiple of tpr * kStatsUnroll (the loads and vectors need no bounds tests).
template <class XF, typename SC, typename W, StatsVariant VARIANT>
__global__ void __launch_bounds__(kStatsThreads, 4)
    stats_vector_kernel(ForwardParams p, int log2_tpr, float* __restrict__ block_amax_out) {
  constexpr bool kSmemWeights = VARIANT != StatsVariant::global_weights;
  constexpr bool kWholeRounds = VARIANT == StatsVariant::staged_weights_whole_rounds;
  extern __shared__ float4 stats_w4[];
  __shared__ float scratch[32];
  // The quantize kernel may start launching now: it copies x tiles until it needs our results.
  allow_dependent_launch();
  const int tpr = 1 << log2_tpr;
  const int rows_per_block = kStatsThreads >> log2_tpr;
  const int group = threadIdx.x >> log2_tpr, t = threadIdx.x & (tpr - 1);
  const int nvec = static_cast<int>(p.cols >> 4);
  const int scale_shift = p.log2_group - 4;  // vector index -> group index
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  if constexpr (kSmemWeights) {
    stage_weights(weight, nvec, 4, nvec, stats_w4);
    __syncthreads();
  }
  RowStatsEnd row_end;

  // One round: this thread's kStatsUnroll vectors v0, v0 + tpr, ... of a row. Past the row's end
  // (only without kWholeRounds) the loads repeat its last vector and the math skips it.
  // Rows the quantize pass will find in L2 evict-last, the others evict-first (plain loads for
  // those push out kept rows; bench: fp8_rms_norm fwd).
  const std::uint64_t keep_policy = l2_policy_evict_last(), pass_policy = l2_policy_evict_first();
  auto load_round = [&](std::int64_t row, int v0, uint4 (&raw)[kStatsUnroll], SC (&sc)[kStatsUnroll]) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * p.x_row_stride);
    const SC* sr = scales + row * p.scale_row_stride;
    const std::uint64_t pol = row >= p.l2_keep_from_row ? keep_policy : pass_policy;
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u) {
      const int v = kWholeRounds ? v0 + u * tpr : min(v0 + u * tpr, nvec - 1);
      raw[u] = load16_policy(xr + v, pol);
      sc[u] = sr[v >> scale_shift];
    }
  };
  auto accumulate_round = [&](int v0, const uint4 (&raw)[kStatsUnroll], const SC (&scr)[kStatsUnroll],
                              double& sum_squares, float& max_xw) {
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u) {
      const int v = v0 + u * tpr;
      if (!kWholeRounds && v >= nvec) continue;
      const float sc = to_float(scr[u]);
      float q[16], w[16];
      decode16<XF>(raw[u], q);
      if constexpr (kSmemWeights) staged_weights16(stats_w4, nvec, v, w);
      else load_w16(weight + std::int64_t(v) * 16, w);
      accumulate_vector_stats<SC, W>(q, w, sc, sum_squares, max_xw);
    }
  };
  const std::int64_t row_step = std::int64_t(gridDim.x) * rows_per_block;
  for (std::int64_t base = std::int64_t(blockIdx.x) * rows_per_block; base < p.rows; base += row_step) {
    const std::int64_t row = base + group;
    double sum_squares = 0.0;
    float max_xw = 0.0f;
    if (row < p.rows) {
      for (int v0 = t; v0 < nvec; v0 += tpr * kStatsUnroll) {
        uint4 raw[kStatsUnroll];
        SC sc[kStatsUnroll];
        load_round(row, v0, raw, sc);
        accumulate_round(v0, raw, sc, sum_squares, max_xw);
      }
    }
    row_end.end_row(p, log2_tpr, t, row, sum_squares, max_xw, base + row_step >= p.rows);
  }
  const float amax = block_max(row_end.amax, scratch);
  if (threadIdx.x == 0) block_amax_out[blockIdx.x] = amax;
}

// Forward 1, bulk-copy variant: the same statistics with x and its scales brought into shared
// memory by bulk copies (TMA) instead of register loads.
//
// One warp per row, and lane t takes vectors t, t + 32, t + 64 and t + 96 of every 128-vector
// round of its row: the vectors, the order of additions and the row end of stats_vector_kernel
// with log2_tpr = 5 and whole rounds, so that rstd and the block maxima are bitwise that kernel's.
// What differs is how the bytes arrive. Each warp owns a ring of `slots` slots of one chunk
// (`rounds` rounds: 2 KB of x each, then the chunk's scales), which it fills up to `slots - 1`
// chunks ahead with two bulk copies per chunk (a "full" mbarrier per slot counts the bytes in).
// The copies run during all of the arithmetic and a lane's addresses are shared-memory offsets,
// where the register kernel has loads in flight only while it waits on them and pays 64-bit
// address arithmetic per 16-byte load.
//
// The whole warp runs the copier (sources, slot, barrier), so its state is warp-uniform and the
// compiler keeps it in uniform registers; one elected lane issues each copy (a copier in one
// lane's registers costs a loop per copy to move its addresses into uniform registers). A slot
// is refilled after a __syncwarp (its only readers are the warp's own lanes) and a proxy fence
// (generic reads before an async-proxy write), not after an "empty" mbarrier. Chunks of two
// rounds halve what issuing the copies costs.
//
// Launch contract (choose_forward checks it): N a multiple of 2048 * rounds and at most
// kStatsSmemWeightCols, 16-byte aligned x and scale rows, and a round's scales a multiple of 16
// bytes (stats_bulk_round_scale_bytes). Dynamic shared memory: the staged weights (4 N bytes),
// then 8 rings of `slots` slots (stats_bulk_smem_bytes).

enum class L2Priority : int { evict_first, evict_last };

// Two bulk copies that complete on one mbarrier, with one L2 policy for both, made inside the asm
// statement: no policy register is chosen at run time (ptxas 13.0 mis-encodes a cp.async whose
// policy is picked at run time).
template <L2Priority PRIORITY>
__device__ __forceinline__ void bulk_copy_pair_l2(unsigned dst_a, const void* src_a, unsigned bytes_a, unsigned dst_b,
                                                  const void* src_b, unsigned bytes_b, unsigned bar) {
#define FUSEKIT_BULK_COPY_PAIR(PRIORITY)                                                                    \
  asm volatile("{\n .reg .b64 policy;\n createpolicy.fractional.L2::" PRIORITY ".b64 policy, 1.0;\n"       \
               " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"          \
               " [%0], [%1], %2, [%6], policy;\n"                                                           \
               " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"          \
               " [%3], [%4], %5, [%6], policy;\n}\n" ::"r"(dst_a),                                          \
               "l"(src_a), "r"(bytes_a), "r"(dst_b), "l"(src_b), "r"(bytes_b), "r"(bar)                    \
               : "memory")
  if constexpr (PRIORITY == L2Priority::evict_last) FUSEKIT_BULK_COPY_PAIR("evict_last");
  else FUSEKIT_BULK_COPY_PAIR("evict_first");
#undef FUSEKIT_BULK_COPY_PAIR
}

template <class XF, typename SC, typename W>
__global__ void __launch_bounds__(kStatsThreads, 2)
    stats_bulk_kernel(ForwardParams p, StatsRing ring_shape, float* __restrict__ block_amax_out) {
  extern __shared__ float4 stats_w4[];
  __shared__ float scratch[32];
  __shared__ std::uint64_t full_bar[kStatsBulkWarps * kStatsBulkMaxSlots];
  // The quantize kernel may start launching now: it copies x tiles until it needs our results.
  allow_dependent_launch();
  // The warp index through a shuffle from lane 0: the compiler then knows it is warp-uniform.
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int nvec = static_cast<int>(p.cols >> 4);
  const int slots = ring_shape.slots, rounds = ring_shape.rounds;
  const int chunks = nvec / (kStatsBulkRoundVectors * rounds);  // per row
  const int scale_shift = p.log2_group - 4;                     // vector index -> group index
  const unsigned chunk_x_bytes = rounds * kStatsBulkRoundBytes;
  const unsigned chunk_scale_bytes = rounds * stats_bulk_round_scale_bytes(p.log2_group, static_cast<int>(sizeof(SC)));
  const unsigned slot_bytes = chunk_x_bytes + chunk_scale_bytes;
  std::uint8_t* ring = reinterpret_cast<std::uint8_t*>(stats_w4 + 4 * nvec) + std::size_t(warp) * slots * slot_bytes;
  std::uint64_t* full = full_bar + warp * kStatsBulkMaxSlots;
  const std::int64_t row_step = std::int64_t(gridDim.x) * kStatsBulkWarps;
  const std::int64_t first_row = std::int64_t(blockIdx.x) * kStatsBulkWarps + warp;

  if (lane < slots) mbarrier_init(&full[lane], 1);
  mbarrier_init_fence();
  __syncthreads();

  // The copies walk the warp's chunks in the order the loop below reads them:
  // chunk c of row first_row + k row_step into slot (k chunks + c) mod slots. Sources and
  // destinations advance by additions.
  struct Copier {
    const std::uint8_t* x;       // the next chunk's fp8 bytes
    const std::uint8_t* scales;  // and its scales
    std::int64_t row;
    int chunk, slot;
    unsigned dst, bar;  // shared-window addresses of the next slot and its "full" barrier
  } copier{static_cast<const std::uint8_t*>(p.x) + first_row * p.x_row_stride,
           static_cast<const std::uint8_t*>(p.scales) + first_row * p.scale_row_stride * std::int64_t(sizeof(SC)),
           first_row, 0, 0, shared_address(ring), shared_address(full)};
  const unsigned ring_address = copier.dst, full_address = copier.bar;
  // Every lane of the warp calls it; one issues the copies.
  auto copy_next_chunk = [&] {
    if (copier.row >= p.rows) return;
    if (elect_one_lane()) {
      mbarrier_arrive_expect_tx(copier.bar, slot_bytes);
      // Rows the quantize pass will find in L2 evict-last, the others evict-first (as in
      // stats_vector_kernel).
      if (copier.row >= p.l2_keep_from_row)
        bulk_copy_pair_l2<L2Priority::evict_last>(copier.dst, copier.x, chunk_x_bytes, copier.dst + chunk_x_bytes,
                                                  copier.scales, chunk_scale_bytes, copier.bar);
      else
        bulk_copy_pair_l2<L2Priority::evict_first>(copier.dst, copier.x, chunk_x_bytes, copier.dst + chunk_x_bytes,
                                                   copier.scales, chunk_scale_bytes, copier.bar);
    }
    copier.x += chunk_x_bytes;
    copier.scales += chunk_scale_bytes;
    if (++copier.chunk == chunks) {
      copier.chunk = 0;
      copier.row += row_step;
      copier.x += ring_shape.x_row_jump;
      copier.scales += ring_shape.scale_row_jump;
    }
    copier.dst += slot_bytes;
    copier.bar += sizeof(std::uint64_t);
    if (++copier.slot == slots) {
      copier.slot = 0;
      copier.dst = ring_address;
      copier.bar = full_address;
    }
  };
  for (int i = 0; i < slots - 1; ++i) copy_next_chunk();

  stage_weights(static_cast<const W*>(p.weight), nvec, 4, nvec, stats_w4);
  __syncthreads();

  RowStatsEnd row_end;
  int slot = 0;
  unsigned parity = 0;
  bool first_chunk = true;
  for (std::int64_t row = first_row; row < p.rows; row += row_step) {
    double sum_squares = 0.0;
    float max_xw = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      // The chunk copied now goes to the slot the warp read last: every lane has read it.
      if (!first_chunk) {
        __syncwarp();
        fence_proxy_async_shared();
      }
      copy_next_chunk();
      first_chunk = false;
      mbarrier_wait(&full[slot], parity);
      const std::uint8_t* chunk_x = ring + slot * slot_bytes;
      const SC* chunk_scales = reinterpret_cast<const SC*>(chunk_x + chunk_x_bytes);
      for (int r = 0; r < rounds; ++r) {
#pragma unroll
        for (int u = 0; u < kStatsUnroll; ++u) {
          const int j = (r * kStatsUnroll + u) * 32 + lane;  // the vector within the chunk
          const uint4 raw = *reinterpret_cast<const uint4*>(chunk_x + 16 * j);
          const float sc = to_float(chunk_scales[j >> scale_shift]);
          float q[16], w[16];
          decode16<XF>(raw, q);
          staged_weights16(stats_w4, nvec, (c * rounds) * kStatsBulkRoundVectors + j, w);
          accumulate_vector_stats<SC, W>(q, w, sc, sum_squares, max_xw);
        }
      }
      if (++slot == slots) {
        slot = 0;
        parity ^= 1;
      }
    }
    row_end.end_row(p, 5, lane, row, sum_squares, max_xw, row + row_step >= p.rows);
  }
  const float amax = block_max(row_end.amax, scratch);
  if (threadIdx.x == 0) block_amax_out[blockIdx.x] = amax;
}

// One warp per row, element by element; the sum of squares in float64.

template <class XF, typename SC, typename W>
__global__ void __launch_bounds__(kStatsThreads)
    stats_generic_kernel(ForwardParams p, float* __restrict__ block_amax_out) {
  __shared__ float scratch[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  float amax = 0.0f;
  for (std::int64_t base = std::int64_t(blockIdx.x) * kGenericStatsRowsPerBlock; base < p.rows;
       base += std::int64_t(gridDim.x) * kGenericStatsRowsPerBlock) {
    const std::int64_t row = base + warp;
    double sum_squares = 0.0;
    float max_xw = 0.0f;
    if (row < p.rows) {
      for (std::int64_t c = lane; c < p.cols; c += 32) {
        const float q = decode1<XF>(x[row * p.x_row_stride + c]);
        const float sc = to_float(scales[row * p.scale_row_stride + (c >> p.log2_group)]);
        const double v = static_cast<double>(q) * static_cast<double>(sc);
        sum_squares += v * v;
        max_xw = fmaxf(max_xw, fabsf(weighted(dequantize(q, sc), to_float(weight[c]))));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, off);
      max_xw = fmaxf(max_xw, __shfl_xor_sync(0xffffffffu, max_xw, off));
    }
    if (row < p.rows && lane == 0) {
      const float rstd = rstd_from_sum_squares(sum_squares, p.cols, p.eps);
      p.rstd[row] = rstd;
      amax = fmaxf(amax, normalized(max_xw, rstd));
    }
  }
  amax = block_max(amax, scratch);
  if (threadIdx.x == 0) block_amax_out[blockIdx.x] = amax;
}


// =============================================================================================
// Forward 2: quantize + transpose.

// x tiles are staged kQuantStages deep in shared memory. A tile's fp8 output overwrites its x in
// place (same bytes, same thread), so the transpose needs no buffer of its own.

// The global max from the stats blocks' maxima; writes y_scale once (block 0) and returns the
// multiplier applied before the fp8 conversion.
template <class QF>
__device__ __forceinline__ float scale_from_partials(const ForwardParams& p,
                                                     const float* __restrict__ block_amax,
                                                     int count, float* scratch) {
  float a = 0.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) a = fmaxf(a, block_amax[i]);
  a = block_max(a, scratch);
  const float max_finite = fp8_max(QF::kIsE4M3);
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.y_scale = tensor_scale(a, max_finite);
  return quant_multiplier(a, max_finite);
}

// Tile layout in shared memory: 128 rows of 32 four-byte words; word w of row r is stored at
// w ^ (((r >> 4) & 7) << 2). Row-major 16-byte stores (8 threads per row) and the transposing
// 4-byte loads (8 row segments x 4 words per warp) then both hit 32 distinct banks.
__device__ __forceinline__ int tile_word(int r, int w) { return r * 32 + (w ^ (((r >> 4) & 7) << 2)); }

// 16 weights as raw 16-byte words (2 for bf16, 4 for float), so that they can be loaded a tile
// ahead and converted only when used.
template <typename W>
struct RawWeights16 {
  static constexpr int kWords = static_cast<int>(sizeof(W));
  uint4 word[kWords];
  __device__ __forceinline__ void load(const W* w) {
#pragma unroll
    for (int r = 0; r < kWords; ++r) word[r] = __ldg(reinterpret_cast<const uint4*>(w) + r);
  }
  __device__ __forceinline__ void unpack(float (&out)[16]) const {
    if constexpr (std::is_same_v<W, float>) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        out[4 * r] = __uint_as_float(word[r].x);
        out[4 * r + 1] = __uint_as_float(word[r].y);
        out[4 * r + 2] = __uint_as_float(word[r].z);
        out[4 * r + 3] = __uint_as_float(word[r].w);
      }
    } else {
      unpack16_to<__nv_bfloat16>(word[0], out);
      unpack16_to<__nv_bfloat16>(word[1], out + 8);
    }
  }
};

// What a thread needs of one tile besides x: its 16 weights, and the scale (raw, converted when
// used) and rstd of its 4 rows.
template <typename W, typename SC>
struct TileRows {
  RawWeights16<W> w;
  SC sc[4];
  float rstd[4];
};

// Walks a block's tiles b, b + G, b + 2 G, ... (G = gridDim.x) of a tiles_m x tiles_n grid
// without dividing per step: (q, r) = divmod(index, tiles_n). Tile rows are taken from the last
// to the first.
struct TileCursor {
  int q, r;
  __device__ __forceinline__ void advance(int step_q, int step_r, int tiles_n) {
    q += step_q;
    r += step_r;
    if (r >= tiles_n) {
      r -= tiles_n;
      ++q;
    }
  }
  __device__ __forceinline__ std::int64_t row0(int tiles_m) const { return std::int64_t(tiles_m - 1 - q) * kTile; }
  __device__ __forceinline__ std::int64_t col0() const { return std::int64_t(r) * kTile; }
};

// Persistent: block b takes tiles b, b + gridDim.x, ... in an order that walks the rows from the
// last tile row to the first. Launched with programmatic stream serialization after the stats
// kernel (see the file comment). The launcher guarantees tiles_m * tiles_n < 2^31.
//
// Per element the work is the fp8 decode, two multiplies (quant_value), the fp8 encode and a
// share of the transpose; everything per row (scale, rstd, their factor) or per tile (origins,
// weights) is hoisted out of the element loops, and tiles that lie wholly inside the tensor take
// a path without bounds tests. QuantizeTiles::whole (M and N multiples of the tile, qy_t stores
// of 16 bytes allowed, no y output) compiles only that path, in 80 registers without spills.
template <class XF, class QF, typename SC, typename W, QuantizeTiles TILES>
__global__ void __launch_bounds__(kQuantThreads, 3)
    quantize_vector_kernel(ForwardParams p, const float* __restrict__ block_amax, int block_count,
                           bool qy_t_vector_stores) {
  constexpr bool kWholeTiles = TILES == QuantizeTiles::whole;
  // x is read here for the last time and the outputs are not read back: both evict-first, which
  // also takes the evict-last priority off the rows the statistics pass kept in L2 (so that the
  // op leaves no lines pinned for the kernels after it).
  const std::uint64_t last_use = l2_policy_evict_first();
  auto copy16 = [&](void* dst, const void* src) { cp_async16_policy(dst, src, last_use); };
  auto store16 = [&](void* dst, uint4 v) { store16_policy(dst, v, last_use); };
  extern __shared__ uint4 quant_smem[];
  // Stage s holds a tile in the tile_word layout: x as copied, then (row by row, by the thread
  // that copied it) its fp8 output, which the transpose reads.
  auto stage_words = [&](int j) {
    return reinterpret_cast<std::uint32_t*>(quant_smem) + (j % kQuantStages) * (kTile * kTile / 4);
  };
  __shared__ float scratch[32];

  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  std::uint8_t* __restrict__ qy = static_cast<std::uint8_t*>(p.qy);
  std::uint8_t* __restrict__ qy_t = static_cast<std::uint8_t*>(p.qy_t);
  __nv_bfloat16* __restrict__ y = static_cast<__nv_bfloat16*>(p.y);

  const int tiles_m = static_cast<int>((p.rows + kTile - 1) / kTile);
  const int tiles_n = static_cast<int>((p.cols + kTile - 1) / kTile);
  const int tiles = tiles_m * tiles_n;
  const int block = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
  const int my_tiles = tiles > block ? (tiles - block + grid - 1) / grid : 0;
  const int step_q = grid / tiles_n, step_r = grid - step_q * tiles_n;
  // Phase 1 roles: 8 threads per row cover its 128 columns (16 each), 32 rows at a time.
  const int vec = threadIdx.x & 7, row_base = threadIdx.x >> 3;
  // Phase 2 roles: a warp owns 4 words (16 columns); its lanes take 8 segments of 16 rows.
  const int lane = threadIdx.x & 31;
  const int word = (threadIdx.x >> 5) * 4 + (lane & 3), segment = lane >> 2;

  // This thread's offsets inside a tile (a tile adds its origin once).
  const std::int64_t x_off = row_base * p.x_row_stride + vec * 16, x_step = 32 * p.x_row_stride;
  const std::int64_t sc_off = row_base * p.scale_row_stride, sc_step = 32 * p.scale_row_stride;
  const std::int64_t qy_off = row_base * p.qy_row_stride + vec * 16, qy_step = 32 * p.qy_row_stride;
  const std::int64_t qt_off = 4 * word * p.qy_t_row_stride + 16 * segment;
  const bool full_cols = p.cols % kTile == 0, full_rows = p.rows % kTile == 0;
  auto tile_is_full = [&](const TileCursor& c) {
    return kWholeTiles || ((full_rows || c.q != 0) && (full_cols || c.r != tiles_n - 1));
  };

  // This thread's 16 bytes of tile row r (r = row_base + 32 k) in a stage.
  auto slot_of = [&](std::uint32_t* stage, int k) {
    return reinterpret_cast<uint4*>(stage + tile_word(row_base + 32 * k, vec * 4));
  };
  // Copies this thread's x bytes of the tile at `c` (the block's j-th) into its slots of stage
  // j % kQuantStages (one commit group per tile, empty past the last one: the wait counts stay
  // uniform).
  auto issue = [&](int j, const TileCursor& c) {
    if (j < my_tiles) {
      const std::int64_t row0 = c.row0(tiles_m), col0 = c.col0();
      std::uint32_t* stage = stage_words(j);
      const std::uint8_t* src = x + row0 * p.x_row_stride + col0 + x_off;
      if (tile_is_full(c)) {
#pragma unroll
        for (int k = 0; k < 4; ++k) copy16(slot_of(stage, k), src + k * x_step);
      } else if (col0 + vec * 16 < p.cols) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (row0 + row_base + 32 * k < p.rows) copy16(slot_of(stage, k), src + k * x_step);
      }
    }
    cp_async_commit();
  };
  // Weights, scales and rstd of the tile at `c` (rstd: only after the stats grid has completed).
  auto load_rows = [&](const TileCursor& c, TileRows<W, SC>& d) {
    const std::int64_t row0 = c.row0(tiles_m), col = c.col0() + vec * 16;
    if (!kWholeTiles && col >= p.cols) return;
    d.w.load(weight + col);
    const SC* sc = scales + row0 * p.scale_row_stride + sc_off + (col >> p.log2_group);
    const float* rs = p.rstd + row0 + row_base;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (kWholeTiles || row0 + row_base + 32 * k < p.rows) {
        d.sc[k] = sc[k * sc_step];
        d.rstd[k] = rs[32 * k];
      }
    }
  };

  // Cursors at this block's tiles j (processed), j + 1 (scalars loaded), j + 2 and j + 3 (x
  // copied).
  TileCursor at{block / tiles_n, block % tiles_n};
  TileCursor at1 = at;
  at1.advance(step_q, step_r, tiles_n);
  TileCursor at2 = at1;
  at2.advance(step_q, step_r, tiles_n);
  TileCursor at3 = at2;
  at3.advance(step_q, step_r, tiles_n);

  // x does not depend on the stats kernel: start copying before waiting for it.
  issue(0, at);
  issue(1, at1);
  issue(2, at2);
  static_assert(kQuantStages == 4, "the cursors cover the current tile and three ahead");
  wait_for_prerequisite_grid();
  const float multiplier = scale_from_partials<QF>(p, block_amax, block_count, scratch);

  // One tile; kFull: the tile lies inside the tensor (no bounds tests).
  auto process = [&](auto full_tag, int j, const TileRows<W, SC>& rows) {
    constexpr bool kFull = decltype(full_tag)::value;
    const std::int64_t row0 = at.row0(tiles_m), col0 = at.col0();
    const std::int64_t col = col0 + vec * 16;
    if (kFull || col < p.cols) {
      float w[16];
      rows.w.unpack(w);
      std::uint32_t* stage = stage_words(j);
      std::uint8_t* qy_row = qy + row0 * p.qy_row_stride + col0 + qy_off;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int r = row_base + 32 * k;
        if (!kFull && row0 + r >= p.rows) continue;
        float q[16];
        uint4* slot = slot_of(stage, k);
        decode16<XF>(*slot, q);
        const float sc = to_float(rows.sc[k]);
        if (!kWholeTiles && y) {
          float v[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] = normalized(weighted(dequantize(q[i], sc), w[i]), rows.rstd[k]);
          uint4* dst = reinterpret_cast<uint4*>(y + (row0 + r) * p.y_row_stride + col);
          dst[0] = pack16_from<__nv_bfloat16>(v);
          dst[1] = pack16_from<__nv_bfloat16>(v + 8);
        }
        const float f = quant_factor(sc, rows.rstd[k], multiplier);
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = quant_value(q[i], w[i], f);
        const uint4 packed = encode16<QF>(v);
        store16(qy_row + k * qy_step, packed);
        *slot = packed;  // in place: the transpose below reads the fp8 tile
      }
    }
    __syncthreads();

    // qy_t rows col0 + 4 * word + c (c < 4), bytes row0 + 16 * segment .. + 15.
    const std::uint32_t* tile = stage_words(j);
    const std::int64_t t_row = col0 + 4 * word, t_col = row0 + 16 * segment;
    if (kFull || (t_row < p.cols && t_col < p.rows)) {
      std::uint32_t in[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) in[i] = tile[tile_word(16 * segment + i, word)];
      transpose_bytes_4x4(in);  // in[4 k + c]: column c's bytes of rows 4 k .. 4 k + 3
      std::uint8_t* dst0 = qy_t + col0 * p.qy_t_row_stride + row0 + qt_off;
      const bool vector_stores = kWholeTiles || (qy_t_vector_stores && (kFull || t_col + 16 <= p.rows));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        std::uint8_t* dst = dst0 + c * p.qy_t_row_stride;
        if (vector_stores) {
          store16(dst, make_uint4(in[c], in[4 + c], in[8 + c], in[12 + c]));
        } else {
          for (int b = 0; b < 16 && t_col + b < p.rows; ++b)
            dst[b] = static_cast<std::uint8_t>(in[4 * (b >> 2) + c] >> (8 * (b & 3)));
        }
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration's copies
  };

  TileRows<W, SC> cur{}, next{};
  if (my_tiles > 0) load_rows(at, cur);
  for (int j = 0; j < my_tiles; ++j) {
    issue(j + 3, at3);
    if (j + 1 < my_tiles) load_rows(at1, next);
    cp_async_wait<kQuantStages - 1>();  // this thread's copies of tile j have landed
    if constexpr (kWholeTiles) {
      process(std::true_type{}, j, cur);
    } else {
      if (tile_is_full(at)) process(std::true_type{}, j, cur);
      else process(std::false_type{}, j, cur);
    }
    cur = next;
    at = at1;
    at1 = at2;
    at2 = at3;
    at3.advance(step_q, step_r, tiles_n);
  }
  cp_async_wait<0>();
}

// Element by element through a 64 x 64 byte tile (rows padded to 65 bytes).
template <class XF, class QF, typename SC, typename W>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_generic_kernel(ForwardParams p, const float* __restrict__ block_amax, int block_count) {
  __shared__ std::uint8_t tile[kGenericTile][kGenericTile + 1];
  __shared__ float scratch[32];
  const float multiplier = scale_from_partials<QF>(p, block_amax, block_count, scratch);

  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  std::uint8_t* __restrict__ qy = static_cast<std::uint8_t*>(p.qy);
  std::uint8_t* __restrict__ qy_t = static_cast<std::uint8_t*>(p.qy_t);
  __nv_bfloat16* __restrict__ y = static_cast<__nv_bfloat16*>(p.y);

  const std::int64_t tiles_n = (p.cols + kGenericTile - 1) / kGenericTile;
  const std::int64_t tiles = (p.rows + kGenericTile - 1) / kGenericTile * tiles_n;
  for (std::int64_t tile_id = blockIdx.x; tile_id < tiles; tile_id += gridDim.x) {
    const std::int64_t row0 = tile_id / tiles_n * kGenericTile, col0 = tile_id % tiles_n * kGenericTile;
    for (int idx = threadIdx.x; idx < kGenericTile * kGenericTile; idx += kQuantThreads) {
      const int r = idx / kGenericTile, c = idx % kGenericTile;
      const std::int64_t row = row0 + r, col = col0 + c;
      if (row >= p.rows || col >= p.cols) continue;
      const float q = decode1<XF>(x[row * p.x_row_stride + col]);
      const float sc = to_float(scales[row * p.scale_row_stride + (col >> p.log2_group)]);
      const float w = to_float(weight[col]), rstd = p.rstd[row];
      if (y) y[row * p.y_row_stride + col] = __float2bfloat16_rn(normalized(weighted(dequantize(q, sc), w), rstd));
      const std::uint8_t byte = encode1<QF>(quant_value(q, w, quant_factor(sc, rstd, multiplier)));
      qy[row * p.qy_row_stride + col] = byte;
      tile[r][c] = byte;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kGenericTile * kGenericTile; idx += kQuantThreads) {
      const int c = idx / kGenericTile, r = idx % kGenericTile;
      const std::int64_t row = row0 + r, col = col0 + c;
      if (row < p.rows && col < p.cols) qy_t[col * p.qy_t_row_stride + row] = tile[r][c];
    }
    __syncthreads();
  }
}


// =============================================================================================
// Backward.

// dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * w and x_hat = q * (scale * rstd), and
// dweight += dy * x_hat. Per element: u = dy * q; dweight += u * (scale rstd); the row sum
// gathers u * w per run and multiplies by scale rstd once.
//
// Row groups of tpr = 2^LOG2_TPR threads (32..256); thread t of a group owns runs kk * tpr + t
// (kk < K): columns 8 (kk tpr + t) .. + 7. Both are compile-time constants: with a run-time
// group size the per-row index arithmetic costs about as many instructions as the math.
// VARIANT (BackwardVariant):
//  - exact_rows: the row has exactly K * tpr runs (every thread owns K of them: no per-run tests).
//  - staged_scales (exact rows, group size 16, scale rows 16-byte aligned): the row's scales come
//    through the cp.async pipeline with its x and dy, each warp copying the 16 scales per run
//    slot that its lanes use, instead of a register load one row ahead whose conversion makes
//    every warp wait out a global load latency per row.
//  - staged_scales_streaming: and x and dy copied with an L2 evict-first priority and dx stored
//    streaming (BackwardTuning::two_runs_streaming). Only the staged kernels have it: in the
//    others ptxas 13.0 places the copies' policy in an odd uniform register (LDGSTS ...
//    desc[UR1]), which raises "illegal instruction" on an H100; the staged kernels' copies take
//    even ones, and the GPU tests force this variant on any device.
template <class XF, typename SC, typename W, int K, int LOG2_TPR, BackwardVariant VARIANT>
__global__ void __launch_bounds__(kBwdThreads, 2)
    backward_vector_kernel(BackwardParams p, float* __restrict__ partial_dw) {
  constexpr bool kExactRows = VARIANT != BackwardVariant::bounds_checked;
  constexpr bool kStagedScales =
      VARIANT == BackwardVariant::staged_scales || VARIANT == BackwardVariant::staged_scales_streaming;
  constexpr bool kStreamHints = VARIANT == BackwardVariant::staged_scales_streaming;
  constexpr int S = backward_stages(K);
  constexpr int log2_tpr = LOG2_TPR;
  constexpr int tpr = 1 << log2_tpr;
  constexpr int rows_per_block = kBwdThreads >> log2_tpr;
  constexpr int count = K * tpr;  // run slots of a row (>= row_runs)
  static_assert(tpr >= 32 && tpr <= kBwdThreads, "row groups of 32 to 256 threads");
  extern __shared__ uint4 bwd_smem[];
  __shared__ float scratch[2][kBwdThreads / 32];
  // The dweight reduction may start launching now; it waits for our partial rows.
  allow_dependent_launch();
  const int group = threadIdx.x >> log2_tpr, t = threadIdx.x & (tpr - 1);
  const int row_runs = static_cast<int>(p.cols >> 3);
  float4* w4 = reinterpret_cast<float4*>(bwd_smem);                         // [2][count]
  uint2* x_stage = reinterpret_cast<uint2*>(bwd_smem + 2 * count);          // [S][K][threads]
  uint4* dy_stage = bwd_smem + 2 * count + S * K * kBwdThreads / 2;         // [S][K][threads]
  SC* sc_stage = reinterpret_cast<SC*>(dy_stage + S * K * kBwdThreads);     // [S][warps][K][16]
  static_assert(!kStagedScales || kExactRows, "staged scales read whole scale rows");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const __nv_bfloat16* __restrict__ dy = static_cast<const __nv_bfloat16*>(p.dy);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  __nv_bfloat16* __restrict__ dx = static_cast<__nv_bfloat16*>(p.dx);

  const std::int64_t stride = std::int64_t(gridDim.x) * rows_per_block;
  const std::int64_t first = std::int64_t(blockIdx.x) * rows_per_block + group;
  // Iterations of this block (uniform across it: row_sum may synchronize the block).
  const int iters = blockIdx.x * rows_per_block < p.rows
                        ? static_cast<int>((p.rows - std::int64_t(blockIdx.x) * rows_per_block + stride - 1) / stride)
                        : 0;
  // This thread's runs: kk * tpr + t for kk < K; those past the row's end are skipped.
  unsigned run_valid = kExactRows ? (1u << K) - 1 : 0u;
  if (!kExactRows) {
#pragma unroll
    for (int kk = 0; kk < K; ++kk) run_valid |= (kk * tpr + t < row_runs ? 1u : 0u) << kk;
  }
  const int run_col = 8 * t;            // first column of run 0 (run kk adds 8 kk tpr)
  const int run_step = 8 * tpr;

  // Rows are visited in increasing iteration order by three cursors: the copies (S - 1 rows
  // ahead), the scalars (one row ahead) and the computation.
  std::int64_t copy_row = first;
  const std::uint8_t* copy_x = x + first * p.x_row_stride;
  const __nv_bfloat16* copy_dy = dy + first * p.dy_row_stride;
  const std::int64_t copy_x_step = stride * p.x_row_stride, copy_dy_step = stride * p.dy_row_stride;
  // Staged scales: lane L < K * chunks copies 16 bytes, scales (L / chunks) * tpr / 2 + 16 * (warp
  // in group) + 16 / sizeof(SC) * (L % chunks) of the row (a warp's lanes use 16 per run slot).
  constexpr int kScaleChunks = 16 * sizeof(SC) / 16;
  const SC* copy_sc = scales + first * p.scale_row_stride;
  const std::int64_t copy_sc_step = stride * p.scale_row_stride;
  const int sc_copy_kk = lane / kScaleChunks;
  const int sc_copy_src = sc_copy_kk * (tpr / 2) + 16 * (t >> 5) + (lane % kScaleChunks) * (16 / int(sizeof(SC)));
  const int sc_copy_dst = (warp * K + sc_copy_kk) * 16 + (lane % kScaleChunks) * (16 / int(sizeof(SC)));
  int copy_stage = 0;
  [[maybe_unused]] const std::uint64_t copy_policy = kStreamHints ? l2_policy_evict_first() : 0;
  // Copies this thread's bytes of the next row (iteration k, in order) into its slots of stage
  // k % S; one commit group per iteration, empty ones included, so that the wait counts stay
  // uniform.
  auto issue = [&](int k) {
    if (k < iters && copy_row < p.rows) {
      const int base = copy_stage * K * kBwdThreads + threadIdx.x;
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        if (run_valid & (1u << kk)) {
          const int c = run_col + kk * run_step;
          if constexpr (kStreamHints) {
            cp_async8_policy(x_stage + base + kk * kBwdThreads, copy_x + c, copy_policy);
            cp_async16_policy(dy_stage + base + kk * kBwdThreads, copy_dy + c, copy_policy);
          } else {
            cp_async8(x_stage + base + kk * kBwdThreads, copy_x + c);
            cp_async16(dy_stage + base + kk * kBwdThreads, copy_dy + c);
          }
        }
      }
      if constexpr (kStagedScales) {
        if (lane < K * kScaleChunks)
          cp_async16(sc_stage + copy_stage * (kBwdThreads / 32) * K * 16 + sc_copy_dst, copy_sc + sc_copy_src);
      }
    }
    cp_async_commit();
    copy_row += stride;
    copy_x += copy_x_step;
    copy_dy += copy_dy_step;
    copy_sc += copy_sc_step;
    copy_stage = copy_stage == S - 1 ? 0 : copy_stage + 1;
  };
  std::int64_t scalar_row = first;
  const SC* scalar_sc = scales + first * p.scale_row_stride;
  const std::int64_t scalar_sc_step = stride * p.scale_row_stride;
  // Scales and rstd of the next row (iteration k, in order), loaded one iteration ahead.
  auto load_row_scalars = [&](int k, float (&sc)[K], float& rstd) {
    rstd = 0.0f;
#pragma unroll
    for (int kk = 0; kk < K; ++kk) sc[kk] = 0.0f;
    if (k < iters && scalar_row < p.rows) {
      rstd = p.rstd[scalar_row];
      if constexpr (!kStagedScales) {
#pragma unroll
        for (int kk = 0; kk < K; ++kk)
          if (run_valid & (1u << kk)) sc[kk] = to_float(scalar_sc[(run_col + kk * run_step) >> p.log2_group]);
      }
    }
    scalar_row += stride;
    scalar_sc += scalar_sc_step;
  };
  // Run kk of stage st: q, dy and w as floats.
  auto read_run = [&](int st, int kk, float (&q)[8], float (&d)[8], float (&w)[8]) {
    const int slot = (st * K + kk) * kBwdThreads + threadIdx.x;
    decode8<XF>(x_stage[slot], q);
    unpack16<__nv_bfloat16>(dy_stage[slot], d);
    const int j = kk * tpr + t;
    const float4 lo = w4[j], hi = w4[count + j];
    w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w;
    w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(s);
  stage_weights_by_quads(weight, row_runs, 2, count, w4);
  __syncthreads();

  float acc[K][8];
#pragma unroll
  for (int kk = 0; kk < K; ++kk)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[kk][i] = 0.0f;

  float sc[K], rstd, next_sc[K], next_rstd;
  load_row_scalars(0, sc, rstd);
  std::int64_t row = first;
  __nv_bfloat16* dx_row = dx ? dx + first * p.dx_row_stride : nullptr;
  const std::int64_t dx_step = stride * p.dx_row_stride;
  int st = 0;
  int phase = 0;
  for (int k = 0; k < iters; ++k) {
    // Staged scales: the warp's lanes have read row k - 1's scales before any lane refills them.
    if constexpr (kStagedScales) __syncwarp();
    issue(k + S - 1);
    load_row_scalars(k + 1, next_sc, next_rstd);
    cp_async_wait<S - 1>();  // this thread's copies of row k have landed
    const bool valid = row < p.rows;
    if constexpr (kStagedScales) {
      __syncwarp();  // and those of the warp's other lanes (its scales) are visible
      const SC* row_sc = sc_stage + (st * (kBwdThreads / 32) + warp) * K * 16 + (lane >> 1);
#pragma unroll
      for (int kk = 0; kk < K; ++kk) sc[kk] = to_float(row_sc[kk * 16]);
    }

    float sum_gx = 0.0f;
    if (valid) {
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        if (!(run_valid & (1u << kk))) continue;
        float q[8], d[8], w[8];
        read_run(st, kk, q, d, w);
        const float xs = sc[kk] * rstd;
        float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          const float u0 = d[i] * q[i], u1 = d[i + 1] * q[i + 1];
          acc[kk][i] = fmaf(u0, xs, acc[kk][i]);
          acc[kk][i + 1] = fmaf(u1, xs, acc[kk][i + 1]);
          a0 = fmaf(u0, w[i], a0);
          a1 = fmaf(u1, w[i + 1], a1);
        }
        sum_gx = fmaf(a0 + a1, xs, sum_gx);
      }
    }
    sum_gx = row_sum(sum_gx, log2_tpr, scratch[phase]);
    phase ^= 1;
    if (valid && dx) {
      const float mean_gx = sum_gx * inv_cols;
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        if (!(run_valid & (1u << kk))) continue;
        float q[8], d[8], w[8];
        read_run(st, kk, q, d, w);
        const float c = (sc[kk] * rstd) * mean_gx;  // x_hat * mean = q * c
#pragma unroll
        for (int i = 0; i < 8; ++i) d[i] = fmaf(-q[i], c, d[i] * w[i]) * rstd;
        if constexpr (kStreamHints)
          store16_streaming(dx_row + run_col + kk * run_step, pack16<__nv_bfloat16>(d));
        else
          *reinterpret_cast<uint4*>(dx_row + run_col + kk * run_step) = pack16<__nv_bfloat16>(d);
      }
    }
#pragma unroll
    for (int kk = 0; kk < K; ++kk) sc[kk] = next_sc[kk];
    rstd = next_rstd;
    row += stride;
    if (dx) dx_row += dx_step;
    st = st == S - 1 ? 0 : st + 1;
  }
  cp_async_wait<0>();
  if (partial_dw == nullptr) return;

  // Row groups 1.. hand their sums to group 0 through shared memory (the staging buffers, now
  // idle), highest group first (a fixed order). Element i of run slot s sits at
  // combine[i * count + s]: conflict-free.
  if (rows_per_block > 1) {
    float* combine = reinterpret_cast<float*>(x_stage);  // 8 * count floats <= the staging bytes
    __syncthreads();
    for (int src = rows_per_block - 1; src >= 1; --src) {
      if (group == src) {
#pragma unroll
        for (int kk = 0; kk < K; ++kk)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float& cell = combine[i * count + kk * tpr + t];
            cell = (src == rows_per_block - 1) ? acc[kk][i] : cell + acc[kk][i];
          }
      }
      __syncthreads();
    }
    if (group != 0) return;
#pragma unroll
    for (int kk = 0; kk < K; ++kk)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[kk][i] += combine[i * count + kk * tpr + t];
  }
  float* out = partial_dw + std::int64_t(blockIdx.x) * p.cols;
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    const int j = kk * tpr + t;
    if (j >= row_runs) continue;
    float4* dst = reinterpret_cast<float4*>(out + std::int64_t(j) * 8);
    dst[0] = make_float4(acc[kk][0], acc[kk][1], acc[kk][2], acc[kk][3]);
    dst[1] = make_float4(acc[kk][4], acc[kk][5], acc[kk][6], acc[kk][7]);
  }
}

// One block per row (grid-stride), element by element. Each block accumulates its partial
// dweight in its own workspace row; each thread always owns the same columns (no races).

template <class XF, typename SC, typename W>
__global__ void __launch_bounds__(kGenericBwdThreads)
    backward_generic_kernel(BackwardParams p, float* __restrict__ partial_dw) {
  __shared__ float scratch[2][kGenericBwdThreads / 32];
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const __nv_bfloat16* __restrict__ dy = static_cast<const __nv_bfloat16*>(p.dy);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  __nv_bfloat16* __restrict__ dx = static_cast<__nv_bfloat16*>(p.dx);
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  float* my_dw = partial_dw ? partial_dw + std::int64_t(blockIdx.x) * p.cols : nullptr;
  if (my_dw)
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericBwdThreads) my_dw[c] = 0.0f;
  int phase = 0;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float rstd = p.rstd[row];
    auto element = [&](std::int64_t c, float* xh, float* g, float* d) {
      const float q = decode1<XF>(x[row * p.x_row_stride + c]);
      const float sc = to_float(scales[row * p.scale_row_stride + (c >> p.log2_group)]);
      *xh = dequantize(q, sc) * rstd;
      *d = __bfloat162float(dy[row * p.dy_row_stride + c]);
      *g = *d * to_float(weight[c]);
    };
    float sum_gx = 0.0f;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericBwdThreads) {
      float xh, g, d;
      element(c, &xh, &g, &d);
      sum_gx += g * xh;
    }
    sum_gx = row_sum(sum_gx, 8, scratch[phase]);  // 2^8 = kGenericBwdThreads: the whole block
    phase ^= 1;
    const float mean_gx = sum_gx * inv_cols;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kGenericBwdThreads) {
      float xh, g, d;
      element(c, &xh, &g, &d);
      if (dx) dx[row * p.dx_row_stride + c] = __float2bfloat16_rn(rstd * (g - xh * mean_gx));
      if (my_dw) my_dw[c] += d * xh;
    }
  }
}

}  // namespace fusekit::fp8_norm::kernels
