// FP8 RMSNorm CUDA kernels.
//
// Forward, two kernels and no host round trip:
//  1. stats: one pass over fp8 x and its scales. Each row group reduces the row's sum of squares
//     (-> rstd, written out) and max |xd * w|; since y = (xd * w) * rstd, the row's max |y| is
//     that max times rstd (monotone rounding), so the pass needs neither rstd in advance nor a
//     second sweep. Each block writes the max over its rows to the workspace.
//  2. quantize: every block first reduces the stats blocks' maxima (max is order-independent, so
//     the result is exact and deterministic) into the scale; block 0 writes it. Then it walks
//     128 x 128 tiles: recomputes y from x (second read of x), writes qy row-major with 16-byte
//     stores, and keeps the tile's fp8 bytes in shared memory (XOR-swizzled 4-byte words, no bank
//     conflicts either way) to write qy_t with 16-byte stores along its rows.
//  Bytes moved: x and scales twice, qy and qy_t once (plus rstd, w and a few KB of maxima).
//
// Backward: a persistent grid; row groups hold a row's fp8 x, bf16 dy and scales in registers
// (the next row's are prefetched while the current one is reduced), accumulate dweight partial
// sums in registers, combine the row groups of a block in a fixed order through shared memory,
// and write one partial row per block; a second kernel sums those rows in a fixed order.
//
// "vector" kernels need 16-element vectors that lie in one scale group (group_size >= 16) and
// 16-byte aligned rows; the "generic" kernels handle any group size and alignment, element by
// element (correctness path).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

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

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }
// Read-once data (dy): evict-first.
__device__ __forceinline__ uint4 load16_stream(const void* p) { return __ldcs(static_cast<const uint4*>(p)); }

// One fp8 value.
template <class F>
__device__ __forceinline__ float decode1(std::uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, F::kKind)));
}

// 16 fp8 values (one 16-byte vector), two at a time (cvt.rn.f16x2.e4m3x2 / e5m2x2).
template <class F>
__device__ __forceinline__ void decode16(const uint4& raw, float (&q)[16]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
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

__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float* out) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = __uint_as_float(words[k] << 16);
    out[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float* v) {
  std::uint32_t words[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    words[k] = *reinterpret_cast<const std::uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
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
  unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(w)), out);
  unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(w) + 1), out + 8);
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
// one float per warp of the block and must not be rewritten before the next __syncthreads()
// (callers alternate two buffers). Contains __syncthreads() when the group spans warps: every
// thread of the block must call it.
__device__ __forceinline__ float row_sum(float v, int log2_tpr, float* scratch) {
  const int tpr = 1 << log2_tpr;
  const int width = tpr < 32 ? tpr : 32;
  for (int off = width >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (tpr > 32) {
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    const int warps = tpr >> 5, first = (threadIdx.x >> log2_tpr) * warps;
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += scratch[first + w];
    v = s;
  }
  return v;
}

// =============================================================================================
// Forward 1: statistics (rstd per row, per-block max |y|).

inline constexpr int kStatsThreads = 256;
inline constexpr int kStatsUnroll = 4;  // 16-byte vectors in flight per thread

// bf16 scales and bf16 weights: products of an fp8 value, a scale and a weight are exact in
// float32 as long as they stay in its normal range (|q * w| >= 2^-126), so the stats pass can
// take max |q w| per vector and multiply by |scale| once.
template <typename SC, typename W>
inline constexpr bool kExactProducts = std::is_same_v<SC, __nv_bfloat16> && std::is_same_v<W, __nv_bfloat16>;

// Row groups of 2^log2_tpr threads (1..32) stride over the row's 16-element vectors.
template <class XF, typename SC, typename W>
__global__ void __launch_bounds__(kStatsThreads, 4)
    stats_vector_kernel(ForwardParams p, int log2_tpr, float* __restrict__ block_amax_out) {
  __shared__ float scratch[32];
  const int tpr = 1 << log2_tpr;
  const int rows_per_block = kStatsThreads >> log2_tpr;
  const int group = threadIdx.x >> log2_tpr, t = threadIdx.x & (tpr - 1);
  const int nvec = static_cast<int>(p.cols >> 4);
  const int scale_shift = p.log2_group - 4;  // vector index -> group index
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  float amax = 0.0f;

  for (std::int64_t base = std::int64_t(blockIdx.x) * rows_per_block; base < p.rows;
       base += std::int64_t(gridDim.x) * rows_per_block) {
    const std::int64_t row = base + group;
    double sum_squares = 0.0;
    float max_xw = 0.0f;
    if (row < p.rows) {
      const std::uint8_t* xr = x + row * p.x_row_stride;
      const SC* sr = scales + row * p.scale_row_stride;
      for (int v0 = t; v0 < nvec; v0 += tpr * kStatsUnroll) {
        uint4 raw[kStatsUnroll];
        float sc[kStatsUnroll];
#pragma unroll
        for (int u = 0; u < kStatsUnroll; ++u) {
          const int v = v0 + u * tpr;
          raw[u] = make_uint4(0, 0, 0, 0);
          sc[u] = 0.0f;
          if (v < nvec) {
            raw[u] = load16(xr + std::int64_t(v) * 16);
            sc[u] = to_float(sr[v >> scale_shift]);
          }
        }
#pragma unroll
        for (int u = 0; u < kStatsUnroll; ++u) {
          const int v = v0 + u * tpr;
          if (v >= nvec) continue;
          float q[16], w[16];
          decode16<XF>(raw[u], q);
          load_w16(weight + std::int64_t(v) * 16, w);
          // q^2 is exact in float32 (at most 8 significant bits); the 16 squares are summed in
          // float32 (four chains of four, then a pairwise tree: at most 5 roundings on any
          // path), then scaled by scale^2 and accumulated in float64 (no overflow or underflow
          // for any float32 scale).
          float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int i = 0; i < 16; ++i) a[i & 3] += q[i] * q[i];
          const double scale = sc[u];
          sum_squares += static_cast<double>((a[0] + a[1]) + (a[2] + a[3])) * (scale * scale);
          if constexpr (kExactProducts<SC, W>) {
            // q * w * scale needs at most 4 + 8 + 8 significant bits: every grouping of the
            // product is exact, so max |q w| * |scale| is exactly max |fl(fl(q scale) w)|.
            float m = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(q[i] * w[i]));
            max_xw = fmaxf(max_xw, m * fabsf(sc[u]));
          } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) max_xw = fmaxf(max_xw, fabsf(weighted(dequantize(q[i], sc[u]), w[i])));
          }
        }
      }
    }
    for (int off = tpr >> 1; off > 0; off >>= 1) {
      sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, off);
      max_xw = fmaxf(max_xw, __shfl_xor_sync(0xffffffffu, max_xw, off));
    }
    if (row < p.rows && t == 0) {
      const float rstd = rstd_from_sum_squares(sum_squares, p.cols, p.eps);
      p.rstd[row] = rstd;
      amax = fmaxf(amax, normalized(max_xw, rstd));
    }
  }
  amax = block_max(amax, scratch);
  if (threadIdx.x == 0) block_amax_out[blockIdx.x] = amax;
}

// One warp per row, element by element; the sum of squares in float64.
inline constexpr int kGenericStatsRowsPerBlock = kStatsThreads / 32;

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

inline constexpr int kQuantThreads = 256;
inline constexpr int kTile = 128;  // rows and columns of a vector-path tile
inline constexpr int kGenericTile = 64;

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

template <class XF, class QF, typename SC, typename W>
__global__ void __launch_bounds__(kQuantThreads, 3)
    quantize_vector_kernel(ForwardParams p, const float* __restrict__ block_amax, int block_count,
                           bool qy_t_vector_stores) {
  __shared__ __align__(16) std::uint32_t tile[kTile * kTile / 4];
  __shared__ float scratch[32];
  const float multiplier = scale_from_partials<QF>(p, block_amax, block_count, scratch);

  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  std::uint8_t* __restrict__ qy = static_cast<std::uint8_t*>(p.qy);
  std::uint8_t* __restrict__ qy_t = static_cast<std::uint8_t*>(p.qy_t);
  __nv_bfloat16* __restrict__ y = static_cast<__nv_bfloat16*>(p.y);

  const std::int64_t tiles_n = (p.cols + kTile - 1) / kTile;
  const std::int64_t tiles = (p.rows + kTile - 1) / kTile * tiles_n;
  // Phase 1 roles: 8 threads per row cover its 128 columns (16 each), 32 rows at a time.
  const int vec = threadIdx.x & 7, row_base = threadIdx.x >> 3;
  // Phase 2 roles: a warp owns 4 words (16 columns); its lanes take 8 segments of 16 rows.
  const int lane = threadIdx.x & 31;
  const int word = (threadIdx.x >> 5) * 4 + (lane & 3), segment = lane >> 2;

  for (std::int64_t tile_id = blockIdx.x; tile_id < tiles; tile_id += gridDim.x) {
    const std::int64_t row0 = tile_id / tiles_n * kTile, col0 = tile_id % tiles_n * kTile;

    const std::int64_t col = col0 + vec * 16;
    if (col < p.cols) {
      float w[16];
      load_w16(weight + col, w);
      uint4 raw[4];
      float sc[4], rstd[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const std::int64_t row = row0 + row_base + 32 * k;
        raw[k] = make_uint4(0, 0, 0, 0);
        sc[k] = rstd[k] = 0.0f;
        if (row < p.rows) {
          raw[k] = load16(x + row * p.x_row_stride + col);
          sc[k] = to_float(scales[row * p.scale_row_stride + (col >> p.log2_group)]);
          rstd[k] = p.rstd[row];
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int r = row_base + 32 * k;
        const std::int64_t row = row0 + r;
        if (row >= p.rows) continue;
        float v[16];
        decode16<XF>(raw[k], v);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = normalized(weighted(dequantize(v[i], sc[k]), w[i]), rstd[k]);
        if (y) {
          uint4* dst = reinterpret_cast<uint4*>(y + row * p.y_row_stride + col);
          dst[0] = pack_bf16x8(v);
          dst[1] = pack_bf16x8(v + 8);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] *= multiplier;
        const uint4 packed = encode16<QF>(v);
        *reinterpret_cast<uint4*>(qy + row * p.qy_row_stride + col) = packed;
        *reinterpret_cast<uint4*>(&tile[tile_word(r, vec * 4)]) = packed;
      }
    }
    __syncthreads();

    // qy_t rows col0 + 4 * word + j (j < 4), bytes row0 + 16 * segment .. + 15.
    const std::int64_t t_row = col0 + 4 * word, t_col = row0 + 16 * segment;
    if (t_row < p.cols && t_col < p.rows) {
      std::uint32_t in[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) in[i] = tile[tile_word(16 * segment + i, word)];
      // 4x4 byte transposes: out[j][k] holds column j's bytes of rows 4k .. 4k + 3.
      std::uint32_t out[4][4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const std::uint32_t a = in[4 * k], b = in[4 * k + 1], c = in[4 * k + 2], d = in[4 * k + 3];
        const std::uint32_t ab_lo = __byte_perm(a, b, 0x5140), cd_lo = __byte_perm(c, d, 0x5140);
        const std::uint32_t ab_hi = __byte_perm(a, b, 0x7362), cd_hi = __byte_perm(c, d, 0x7362);
        out[0][k] = __byte_perm(ab_lo, cd_lo, 0x5410);
        out[1][k] = __byte_perm(ab_lo, cd_lo, 0x7632);
        out[2][k] = __byte_perm(ab_hi, cd_hi, 0x5410);
        out[3][k] = __byte_perm(ab_hi, cd_hi, 0x7632);
      }
      const bool full = qy_t_vector_stores && t_col + 16 <= p.rows;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint8_t* dst = qy_t + (t_row + j) * p.qy_t_row_stride + t_col;
        if (full) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
        } else {
          for (int b = 0; b < 16 && t_col + b < p.rows; ++b)
            dst[b] = static_cast<std::uint8_t>(out[j][b >> 2] >> (8 * (b & 3)));
        }
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
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
      const float v = normalized(weighted(dequantize(q, sc), to_float(weight[col])), p.rstd[row]);
      if (y) y[row * p.y_row_stride + col] = __float2bfloat16_rn(v);
      const std::uint8_t byte = encode1<QF>(v * multiplier);
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

inline constexpr int kBwdThreads = 512;
inline constexpr int kCombineFloats = 8192;  // row-group combine buffer (32 KB): 512 vector slots

template <int ITERS>
struct RowData {
  uint4 x[ITERS];
  uint4 dy[ITERS][2];
  float scale[ITERS];
  float rstd;
};

// Row groups of 2^log2_tpr threads (32..512); thread t of a group owns vectors it * tpr + t.
template <class XF, typename SC, typename W, int ITERS>
__global__ void __launch_bounds__(kBwdThreads, 1)
    backward_vector_kernel(BackwardParams p, int log2_tpr, float* __restrict__ partial_dw) {
  __shared__ float scratch[2][kBwdThreads / 32];
  __shared__ float combine[kCombineFloats];
  const int tpr = 1 << log2_tpr;
  const int rows_per_block = kBwdThreads >> log2_tpr;
  const int group = threadIdx.x >> log2_tpr, t = threadIdx.x & (tpr - 1);
  const int nvec = static_cast<int>(p.cols >> 4);
  const int scale_shift = p.log2_group - 4;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  const std::uint8_t* __restrict__ x = static_cast<const std::uint8_t*>(p.x);
  const __nv_bfloat16* __restrict__ dy = static_cast<const __nv_bfloat16*>(p.dy);
  const SC* __restrict__ scales = static_cast<const SC*>(p.scales);
  const W* __restrict__ weight = static_cast<const W*>(p.weight);
  __nv_bfloat16* __restrict__ dx = static_cast<__nv_bfloat16*>(p.dx);

  float acc[ITERS][16];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[it][i] = 0.0f;

  auto load_row = [&](std::int64_t row, RowData<ITERS>& d) {
    if (row >= p.rows) return;
    d.rstd = p.rstd[row];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * tpr + t;
      if (v < nvec) {
        d.x[it] = load16(x + row * p.x_row_stride + std::int64_t(v) * 16);
        const __nv_bfloat16* dyp = dy + row * p.dy_row_stride + std::int64_t(v) * 16;
        d.dy[it][0] = load16_stream(dyp);
        d.dy[it][1] = load16_stream(dyp + 8);
        d.scale[it] = to_float(scales[row * p.scale_row_stride + (v >> scale_shift)]);
      }
    }
  };
  // x_hat, g = dy * w and dy of vector `it` of the current row.
  auto prepare = [&](const RowData<ITERS>& d, int it, float (&xh)[16], float (&g)[16], float (&dv)[16]) {
    float w[16];
    decode16<XF>(d.x[it], xh);
    load_w16(weight + std::int64_t(it * tpr + t) * 16, w);
    unpack_bf16x8(d.dy[it][0], dv);
    unpack_bf16x8(d.dy[it][1], dv + 8);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      xh[i] = dequantize(xh[i], d.scale[it]) * d.rstd;
      g[i] = dv[i] * w[i];
    }
  };

  const std::int64_t stride = std::int64_t(gridDim.x) * rows_per_block;
  std::int64_t base = std::int64_t(blockIdx.x) * rows_per_block;
  RowData<ITERS> cur, next;
  load_row(base + group, cur);
  int phase = 0;
  for (; base < p.rows; base += stride) {
    const std::int64_t row = base + group;
    const bool valid = row < p.rows;
    load_row(row + stride, next);  // in flight while this row is reduced

    float sum_gx = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (!valid || it * tpr + t >= nvec) continue;
      float xh[16], g[16], dv[16];
      prepare(cur, it, xh, g, dv);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        sum_gx += g[i] * xh[i];
        acc[it][i] += dv[i] * xh[i];
      }
    }
    sum_gx = row_sum(sum_gx, log2_tpr, scratch[phase]);
    phase ^= 1;
    if (valid && dx) {
      const float mean_gx = sum_gx * inv_cols;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int v = it * tpr + t;
        if (v >= nvec) continue;
        float xh[16], g[16], dv[16];
        prepare(cur, it, xh, g, dv);
#pragma unroll
        for (int i = 0; i < 16; ++i) dv[i] = cur.rstd * (g[i] - xh[i] * mean_gx);
        uint4* dst = reinterpret_cast<uint4*>(dx + row * p.dx_row_stride + std::int64_t(v) * 16);
        dst[0] = pack_bf16x8(dv);
        dst[1] = pack_bf16x8(dv + 8);
      }
    }
    cur = next;
  }
  if (partial_dw == nullptr) return;

  // Row groups 1.. hand their sums to group 0 through shared memory, highest group first (a
  // fixed order). Element i of vector slot s sits at combine[i * slots + s]: conflict-free.
  if (rows_per_block > 1) {
    const int slots = ITERS * tpr;  // <= kCombineFloats / 16: rows_per_block > 1 means tpr <= 256
    for (int src = rows_per_block - 1; src >= 1; --src) {
      if (group == src) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            float& cell = combine[i * slots + it * tpr + t];
            cell = (src == rows_per_block - 1) ? acc[it][i] : cell + acc[it][i];
          }
      }
      __syncthreads();
    }
    if (group != 0) return;
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[it][i] += combine[i * slots + it * tpr + t];
  }
  float* out = partial_dw + std::int64_t(blockIdx.x) * p.cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * tpr + t;
    if (v >= nvec) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      reinterpret_cast<float4*>(out + std::int64_t(v) * 16)[k] =
          make_float4(acc[it][4 * k], acc[it][4 * k + 1], acc[it][4 * k + 2], acc[it][4 * k + 3]);
  }
}

// One block per row (grid-stride), element by element. Each block accumulates its partial
// dweight in its own workspace row; each thread always owns the same columns (no races).
inline constexpr int kGenericBwdThreads = 256;

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

// Sums partial[slots][cols] over slots in a fixed order into dweight. Block (32, 32): x picks the
// column (coalesced), y strides over slots; the 32 column partials are then added in y order.
template <typename W>
__global__ void __launch_bounds__(1024)
    reduce_dweight_kernel(const float* __restrict__ partial, int slots, std::int64_t cols,
                          W* __restrict__ dweight) {
  __shared__ float sums[32][33];
  const std::int64_t col = std::int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols)
    for (int slot = threadIdx.y; slot < slots; slot += 32) s += partial[std::int64_t(slot) * cols + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; ++k) total += sums[k][threadIdx.x];
    dweight[col] = from_float<W>(total);
  }
}

}  // namespace fusekit::fp8_norm::kernels
