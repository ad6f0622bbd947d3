// Attention CUDA kernels (f16 / bf16 in, float32 accumulation): flash-style forward and backward
// with tensor-core mma.sync m16n8k16 (sm_80 instructions, run on sm_90a). The S x S score matrix
// never reaches global memory.
//
// ---- Building blocks ----------------------------------------------------------------------------
// Tiles of q, k, v, dout are copied to shared memory with 16-byte cp.async; rows past the
// sequence end and head-dim columns past D (padded to a multiple of 16: the mma's k) are zero
// filled, so padding contributes exact zeros and never NaN. Rows are kD + 8 elements apart (16
// bytes of skew: ldmatrix rows fall into distinct bank groups). Fragments come from ldmatrix
// (x4, plain or .trans) in the standard m16n8k16 layouts; see the fragment helpers.
//
// Masks: for query i of a sequence the visible keys are one interval [lo(i), hi(i)) (MaskRule),
// and lo, hi never decrease with i. So a query block's keys lie in [lo(first), hi(last)), which
// bounds the key blocks visited (causal and windowed attention skip the rest); the element test
// inside a block is exact. Rows past the sequence end have an empty interval.
//
// Dropout: a tile's keep bits are computed once into shared memory, one byte per (query, 8 keys),
// by all threads: one philox::random4 call gives the 8 keys 8m..8m+7 of one query (the
// documented mapping; key blocks start at multiples of 8). The mma fragment owners then look
// their bits up, so no thread computes a Philox call twice and the layout of the consumer
// (S or S^T) does not matter.
//
// ---- Forward (forward_kernel) ---------------------------------------------------------------------
// One CTA per (query block, query head, batch); 4 warps of 32 query rows (two m16 tiles, so each
// K / V fragment read from shared memory feeds two mma; 16 rows for head dims above 128). The Q
// tile stays in shared memory; K and V are pipelined (V(j) loads during S = Q K(j)^T and the
// softmax, K(j + 1) during O += P V(j)). Scores start at bias / scale (bias tiles come through
// shared memory), so one multiply gives the log2-unit logits. Blocks every row sees in full take
// a cheap path (max over raw scores, scale folded into the exponent's FMA, ex2.approx); others
// are scaled and masked per element. Online softmax (running max and sum per row), dropout by
// the keep bits, P rounded to the input dtype, O += P V. At the end O is divided by the row sum
// (times 1 / (1 - p)) and lse = max + log(sum) is stored. A row with no visible key (or only
// -inf bias) has sum 0: out = 0, lse = -inf.
//
// ---- Backward -------------------------------------------------------------------------------------
// preprocess_kernel: delta = rowsum(dout * out) (float32, workspace, laid out like lse); in the
// non-deterministic mode it also zeroes the float32 dq accumulator.
// dkdv_kernel: one CTA per (key block of 64, kv head, batch). K and V stay in shared memory; the
//   CTA walks every query head of its GQA group and every query block that sees its keys (one
//   interval of blocks; the next block's Q, dO and bias tile load during phase 3):
//   phase 1 computes S^T = K Q^T and dP^T = V dO^T (warps own 16 keys x a share of the queries),
//   recomputes P = exp(S - lse) and dS = P * (dP * Z - delta), and stores P * Z and dS (rounded
//   to the input dtype) to shared memory; phase 2 accumulates dV += (P Z)^T dO and dK += dS^T Q in
//   registers (warps own 16 keys x a share of the head dim); phase 3 (non-deterministic mode
//   only) computes this block's dQ part dS K and adds it with float atomics to the float32
//   accumulator. dK and dV of a key block are summed over the group's heads inside one CTA, in a
//   fixed order: they are deterministic in both modes, and every key row (also one no query
//   sees) is written. When dbias needs no reduction (every dim of dbias materialized), phase 1
//   also writes dS into dbias directly: each element has exactly one producer.
// dq_kernel (deterministic mode): one CTA per query block, the forward's loop over key blocks
//   with dS recomputed (S = Q K^T, dP = dO V^T) and dQ += dS K in registers: a fixed order, no
//   atomics. convert_dq_kernel (non-deterministic mode) scales and rounds the accumulator.
// dbias_kernel (dbias reduced over batch, heads and/or queries): one CTA per tile of dbias (64
//   rows x 64 or 32 keys; one row when the query dim is reduced). It loops over every (b, h, query
//   block) that maps to its tile, recomputes dS for it and sums in float32 registers in a fixed
//   order, then writes the tile once (reducing the rows first when the query dim is broadcast,
//   across warps through shared memory, in a fixed order). Elements nothing maps to (variable
//   length padding) are written as 0. No float workspace and no atomics: deterministic, at the
//   price of recomputing S and dP once more. zero_dbias_kernel clears dbias before the direct
//   path writes the elements it produces (masked-out blocks and padding are never visited).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_device.cuh"
#include "attention/attention_dropout.cuh"
#include "attention/attention_lse.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_softmax.cuh"
#include "fusekit/attention.h"

namespace fusekit::attention::kernels {

// ---- bias ---------------------------------------------------------------------------------------

__device__ __forceinline__ float load_bias(const BiasArg& a, int b, int h, int i, int j) {
  const std::int64_t off = static_cast<std::int64_t>(b) * a.b + static_cast<std::int64_t>(h) * a.h +
                           static_cast<std::int64_t>(i) * a.i + j;
  switch (a.dtype) {
    case kBiasF32: return __ldg(static_cast<const float*>(a.data) + off);
    case kBiasF16: return __half2float(__ldg(static_cast<const __half*>(a.data) + off));
    default: return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(a.data) + off));
  }
}

__device__ __forceinline__ void store_bias(const BiasArg& a, int b, int h, int i, int j, float v) {
  const std::int64_t off = static_cast<std::int64_t>(b) * a.b + static_cast<std::int64_t>(h) * a.h +
                           static_cast<std::int64_t>(i) * a.i + j;
  switch (a.dtype) {
    case kBiasF32: static_cast<float*>(a.data)[off] = v; break;
    case kBiasF16: static_cast<__half*>(a.data)[off] = __float2half_rn(v); break;
    default: static_cast<__nv_bfloat16*>(a.data)[off] = __float2bfloat16_rn(v); break;
  }
}

// m16n8k16 fragments (lane = 4 g + t):
//   A (16 x 16, row m, col k): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16 x 8, row k, col n):  b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g)
//   C (16 x 8):                c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
// Each 32-bit register holds two consecutive-k (A, B) or consecutive-n (C) elements, the lower
// index in the low half. ldmatrix x4: lanes 8q..8q+7 give the row addresses of matrix q; matrix
// q lands in register q, lane 4 g + t holding its row g, elements 2t, 2t+1 (with .trans: its
// rows 2t, 2t+1 of column g).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const std::uint32_t (&a)[4],
                                                        std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                 std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A (16 x 16) at (m0, k0) of a row-major [m][k] tile: matrices (m 0-7, k 0-7), (m 8-15, k 0-7),
// (m 0-7, k 8-15), (m 8-15, k 8-15).
template <typename T>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const T* tile, int ld, int m0, int k0) {
  const int lane = threadIdx.x % 32, q = lane / 8, r = lane % 8;
  ldsm_x4(a, tile + (m0 + r + (q & 1) * 8) * ld + k0 + (q >> 1) * 8);
}

// A (16 x 16) at (m0, k0) of a tile stored transposed, [k][m]: stored rows k, .trans.
template <typename T>
__device__ __forceinline__ void load_a_trans(std::uint32_t (&a)[4], const T* tile_km, int ld, int m0, int k0) {
  const int lane = threadIdx.x % 32, q = lane / 8, r = lane % 8;
  ldsm_x4_trans(a, tile_km + (k0 + r + (q >> 1) * 8) * ld + m0 + (q & 1) * 8);
}

// B for two n-tiles (n0..n0+7 in b[0], b[1]; n0+8..n0+15 in b[2], b[3]) at k0, from a tile
// stored [n][k] (k contiguous): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
// (n 8-15, k 8-15).
template <typename T>
__device__ __forceinline__ void load_b_nk(std::uint32_t (&b)[4], const T* tile_nk, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, q = lane / 8, r = lane % 8;
  ldsm_x4(b, tile_nk + (n0 + r + (q >> 1) * 8) * ld + k0 + (q & 1) * 8);
}

// The same two n-tiles from a tile stored [k][n] (n contiguous): stored rows k, .trans.
template <typename T>
__device__ __forceinline__ void load_b_kn(std::uint32_t (&b)[4], const T* tile_kn, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, q = lane / 8, r = lane % 8;
  ldsm_x4_trans(b, tile_kn + (k0 + r + (q & 1) * 8) * ld + n0 + (q >> 1) * 8);
}

// acc[kNT][4] (a 16 x 8 kNT block) += A (16 rows at m0 of a [m][k] tile) x B^T (8 kNT rows at n0
// of a [n][k] tile), over k in [0, k_len) (k_len a multiple of 16, at most kK).
template <typename T, int kNT, int kK>
__device__ __forceinline__ void mma_abt(float (&acc)[kNT][4], const T* a_tile, int lda, int m0, const T* b_tile,
                                        int ldb, int n0, int k_len) {
  static_assert(kNT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    if (kk * 16 < k_len) {
      std::uint32_t a[4];
      load_a(a, a_tile, lda, m0, kk * 16);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        std::uint32_t b[4];
        load_b_nk(b, b_tile, ldb, n0 + np * 16, kk * 16);
        mma16816<T>(acc[2 * np], a, b[0], b[1]);
        mma16816<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc[kNT][4] += A (16 rows at m0 of a [m][k] tile, k in [0, kK)) x B (a [k][n] tile, columns
// n0 .. n0 + 8 kNT), skipping column pairs at or past n_len.
template <typename T, int kNT, int kK>
__device__ __forceinline__ void mma_ab(float (&acc)[kNT][4], const T* a_tile, int lda, int m0, const T* b_tile,
                                       int ldb, int n0, int n_len) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    std::uint32_t a[4];
    load_a(a, a_tile, lda, m0, kk * 16);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      if (n0 + np * 16 < n_len) {
        std::uint32_t b[4];
        load_b_kn(b, b_tile, ldb, n0 + np * 16, kk * 16);
        mma16816<T>(acc[2 * np], a, b[0], b[1]);
        mma16816<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc[kNT][4] += P (registers: the C fragments of a 16 x kK block, kK / 8 n-tiles, rounded to T
// as A fragments) x B (a [k][n] tile, columns n0 .. n0 + 8 kNT, skipping pairs at or past n_len).
// Two adjacent C n-tiles form one A k-step: a0 = c[2s][0..1], a1 = c[2s][2..3], a2 = c[2s+1][0..1],
// a3 = c[2s+1][2..3].
template <typename T, int kNT, int kK>
__device__ __forceinline__ void mma_regs_b(float (&acc)[kNT][4], const float (&p)[kK / 8][4], const T* b_tile,
                                           int ldb, int n0, int n_len) {
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    const std::uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                                pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                                pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      if (n0 + np * 16 < n_len) {
        std::uint32_t b[4];
        load_b_kn(b, b_tile, ldb, n0 + np * 16, ks * 16);
        mma16816<T>(acc[2 * np], a, b[0], b[1]);
        mma16816<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

template <int kN, int kM>
__device__ __forceinline__ void zero(float (&acc)[kN][kM]) {
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[n][m] = 0.0f;
}

// ---- tile loads -----------------------------------------------------------------------------------

// Rows [0, kRows) of a tile whose row r starts at row0 + r * row_stride (elements), columns
// [0, cols_pad) with cols_pad a multiple of 16 and cols (the real head dim, a multiple of 8) <=
// cols_pad; rows >= valid_rows and columns >= cols are zero filled. 16-byte pieces: the alignment
// rule of fusekit/attention.h makes every global piece 16-byte aligned.
template <typename T, int kRows, int kCols, int kLd, int kThreads>
__device__ __forceinline__ void load_tile(T* tile, const T* row0, std::int64_t row_stride, int valid_rows,
                                          int cols, int cols_pad) {
  constexpr int kChunks = kCols / 8;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (c * 8 >= cols_pad) continue;
    T* dst = tile + r * kLd + c * 8;
    if (r < valid_rows && c * 8 < cols) {
      cp_async16(dst, row0 + r * row_stride + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}


// ---- bias tiles in shared memory ------------------------------------------------------------------

// A (rows x kCols) tile of bias rows [i0, ..) x keys [j0, j0 + kCols) of (b, h), any bias dtype,
// rows kBiasPitch bytes apart. 16-byte pieces fully inside the valid rows and keys go by cp.async;
// pieces straddling the key end are copied element by element; the rest is zero (masked later).
template <int kCols>
struct BiasTile {
  static constexpr int kPitch = kCols * 4 + 16;  // bytes; room for f32, +16 bytes of bank skew
};

__device__ __forceinline__ int bias_elt_bytes(int dtype) { return dtype == kBiasF32 ? 4 : 2; }

template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_bias_tile(unsigned char* tile, const BiasArg& a, int b, int h, int i0, int j0,
                                               int valid_rows, int valid_cols) {
  constexpr int kPitch = BiasTile<kCols>::kPitch;
  const int elt = bias_elt_bytes(a.dtype), per_chunk = 16 / elt, chunks = kCols / per_chunk;
  const unsigned char* base = static_cast<const unsigned char*>(a.data) +
                              (static_cast<std::int64_t>(b) * a.b + static_cast<std::int64_t>(h) * a.h +
                               static_cast<std::int64_t>(i0) * a.i + j0) * elt;
  for (int idx = threadIdx.x; idx < kRows * chunks; idx += kThreads) {
    const int r = idx / chunks, c = idx % chunks, jc = c * per_chunk;
    unsigned char* dst = tile + r * kPitch + c * 16;
    const unsigned char* src = base + (static_cast<std::int64_t>(r) * a.i + jc) * elt;
    if (r < valid_rows && jc + per_chunk <= valid_cols) {
      cp_async16(dst, src);
    } else {
      for (int e = 0; e < 16; ++e) dst[e] = (r < valid_rows && jc + e / elt < valid_cols) ? src[e] : 0;
    }
  }
}

__device__ __forceinline__ float bias_from_tile(const unsigned char* tile, int pitch, int dtype, int r, int c) {
  const unsigned char* at = tile + r * pitch;
  if (dtype == kBiasF32) return reinterpret_cast<const float*>(at)[c];
  if (dtype == kBiasF16) return __half2float(reinterpret_cast<const __half*>(at)[c]);
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(at)[c]);
}

// ---- the forward ----------------------------------------------------------------------------------


__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// kMT m-tiles of 16 query rows per warp: two for head dims up to 128, so that every K / V
// fragment read from shared memory feeds two mma (shared-memory bandwidth, not the tensor
// cores, limits a one-tile warp); one for 256, where the O accumulator would not fit twice.
template <int kD, int kBN>
struct ForwardShape {
  static constexpr int kMT = kD <= 128 ? 2 : 1;
  // D = 64 at three CTAs per SM (170 registers) measured no faster than two (255): 216 vs 217.
  static constexpr int kWarps = 4, kThreads = 128, kBM = 16 * kMT * kWarps, kLd = kD + 8;
  static constexpr int smem_bytes() { return (kBM + 2 * kBN) * kLd * 2 + kBM * BiasTile<kBN>::kPitch + kBM * kBN / 8; }
};

// The score accumulators start at bias / scale, so that after S += Q K^T they hold
// (Q K^T + bias / scale) and one multiply by scale * log2(e) gives the log2-unit logits: the bias
// costs no registers beyond the accumulators. Elements past the sequence ends stay 0 (masked later).
template <typename BT, int kMT, int kNT>
__device__ __forceinline__ void scores_from_bias(float (&sc)[kMT][kNT][4], const BiasArg& bias, float inv_scale,
                                                 int b, int h, int row0, int j0, int sq, int sk) {
  const int t = threadIdx.x % 4;
  const BT* base = static_cast<const BT*>(bias.data) + static_cast<std::int64_t>(b) * bias.b +
                   static_cast<std::int64_t>(h) * bias.h;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row0 + mt * 16 + 8 * r;
      const BT* row = base + static_cast<std::int64_t>(i) * bias.i;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = j0 + nt * 8 + 2 * t + c;
          float x = 0.0f;
          if (i < sq && j < sk) {
            if constexpr (std::is_same_v<BT, float>) x = __ldg(row + j);
            else x = static_cast<float>(row[j]);
          }
          sc[mt][nt][2 * r + c] = x * inv_scale;
        }
    }
}

// Scores -> log2-unit logits with the mask and the sequence ends applied (-inf where hidden).
template <int kMT, int kNT>
__device__ __forceinline__ void mask_scores(float (&sc)[kMT][kNT][4], const MaskRule& rule, int row0, int j0,
                                            float mult) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int lo, hi;
      rule.range(row0 + mt * 16 + 8 * r, lo, hi);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = j0 + nt * 8 + 2 * t + c;
          float& x = sc[mt][nt][2 * r + c];
          x = (j >= lo && j < hi) ? x * mult : neg_inf();
        }
    }
}

// One CTA per (query block of kBM rows, query head, batch), 4 warps of kMT x 16 rows. K and V
// have one shared-memory buffer each and are software-pipelined: V(j) is in flight while S =
// Q K(j)^T and the softmax run, K(j + 1) (and bias tile j + 1) while O += P V(j) runs. Tiles are zero-filled up to the
// bucket's head dim, so the mma loops run branch-free (a head dim below the bucket's pays for
// its padding in mma, not in a branch per k-step that would stop the fragment prefetching).
// One body past 150 lines: the two loads in flight span the whole key loop (issued in one step,
// awaited in the next), so its steps cannot become separate functions without moving the waits.
template <typename T, int kD, int kBN>
__global__ void __launch_bounds__(128) forward_kernel(const KernelParams p) {
  using Shape = ForwardShape<kD, kBN>;
  constexpr int kBM = Shape::kBM, kLd = Shape::kLd, kThreads = Shape::kThreads, kMT = Shape::kMT;
  constexpr int kNT = kBN / 8, kDT = kD / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = qs + kBM * kLd;
  T* vs = ks + kBN * kLd;
  unsigned char* bias_s = reinterpret_cast<unsigned char*>(vs + kBN * kLd);
  std::uint8_t* keep = bias_s + kBM * BiasTile<kBN>::kPitch;

  // Query blocks in reverse order: under a causal mask the last blocks see the most keys, and
  // starting them first shortens the tail of the grid.
  const int b = blockIdx.z, h = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * kBM;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wrow = warp * 16 * kMT;  // the warp's first row in the block
  const int row0 = i0 + wrow + g;    // the thread's row of m-tile 0, r = 0

  const MaskRule rule = mask_rule(p, s);
  int jb_begin, jb_end, all_lo, all_hi;
  rule.key_blocks<kBN>(i0, min(i0 + kBM, s.sq), jb_begin, jb_end, all_lo, all_hi);
  // logits = (S + bias / scale) * mult. scale = 0 (allowed, if odd) skips Q K^T: logits = bias.
  const bool has_qk = p.scale != 0.0f;
  const float mult0 = has_qk ? p.scale_log2 : kLog2e;
  const float inv_scale = has_qk ? 1.0f / p.scale : 1.0f;

  float o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero(o[mt]);
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mt][r] = neg_inf();
      l[mt][r] = 0.0f;
    }

  if (jb_begin < jb_end) {
    load_tile<T, kBM, kD, kLd, kThreads>(qs, row_ptr<const T>(p.q, b, s.q_base + i0, h), p.q.s, s.sq - i0, p.d, kD);
    const int j0 = jb_begin * kBN;
    load_tile<T, kBN, kD, kLd, kThreads>(ks, row_ptr<const T>(p.k, b, s.k_base + j0, hk), p.k.s, s.sk - j0, p.d, kD);
    if (p.bias_tile) load_bias_tile<kBM, kBN, kThreads>(bias_s, p.bias, b, h, i0, j0, s.sq - i0, s.sk - j0);
    cp_async_commit();
  }

  for (int jb = jb_begin; jb < jb_end; ++jb) {
    const int j0 = jb * kBN;
    cp_async_wait_all();
    __syncthreads();  // K(j) landed; every warp is done with V(j - 1) and the keep bits
    load_tile<T, kBN, kD, kLd, kThreads>(vs, row_ptr<const T>(p.v, b, s.k_base + j0, hk), p.v.s, s.sk - j0, p.dv, kD);
    cp_async_commit();
    if (p.dropout) compute_keep_bits<kBM, kBN, kThreads>(keep, p, b, h, i0, j0);

    float sc[kMT][kNT][4];
    if (p.bias.data == nullptr) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) zero(sc[mt]);
    } else if (p.bias_tile) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sc[mt][nt][e] = inv_scale * bias_from_tile(bias_s, BiasTile<kBN>::kPitch, p.bias.dtype,
                                                       wrow + mt * 16 + g + 8 * (e / 2), nt * 8 + 2 * t + (e & 1));
    } else if (p.bias.dtype == kBiasF32) {
      scores_from_bias<float>(sc, p.bias, inv_scale, b, h, row0, j0, s.sq, s.sk);
    } else if (p.bias.dtype == kBiasF16) {
      scores_from_bias<__half>(sc, p.bias, inv_scale, b, h, row0, j0, s.sq, s.sk);
    } else {
      scores_from_bias<__nv_bfloat16>(sc, p.bias, inv_scale, b, h, row0, j0, s.sq, s.sk);
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      if (has_qk) {
        std::uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) load_a(a[mt], qs, kLd, wrow + mt * 16, kk * 16);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          std::uint32_t bf[4];
          load_b_nk(bf, ks, kLd, np * 16, kk * 16);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma16816<T>(sc[mt][2 * np], a[mt], bf[0], bf[1]);
            mma16816<T>(sc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }

    // Scores -> probabilities. A block inside every row's visible range keeps the raw scores and
    // folds the multiplier into the exponent's FMA (valid for mult > 0: the max commutes with it);
    // other blocks are scaled and masked first.
    float mult = mult0;
    if (!(mult > 0.0f && j0 >= all_lo && j0 + kBN <= all_hi)) {
      mask_scores<kMT, kNT>(sc, rule, row0, j0, mult);
      mult = 1.0f;
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        online_softmax_row<kNT, kDT>([&](int c, int e) -> float& { return sc[mt][c][2 * r + e]; },
                                     [&](int c, int e) -> float& { return o[mt][c][2 * r + e]; }, m[mt][r], l[mt][r],
                                     mult);

    cp_async_wait_all();
    __syncthreads();  // V(j) and the keep bits landed; every warp is done with K(j)
    if (jb + 1 < jb_end) {
      const int jn = j0 + kBN;
      load_tile<T, kBN, kD, kLd, kThreads>(ks, row_ptr<const T>(p.k, b, s.k_base + jn, hk), p.k.s, s.sk - jn, p.d, kD);
      if (p.bias_tile) load_bias_tile<kBM, kBN, kThreads>(bias_s, p.bias, b, h, i0, jn, s.sq - i0, s.sk - jn);
      cp_async_commit();
    }
    if (p.dropout) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!kept<kBN>(keep, wrow + mt * 16 + g + 8 * (e / 2), nt * 8 + 2 * t + (e & 1))) sc[mt][nt][e] = 0.0f;
    }
#pragma unroll
    for (int ks_ = 0; ks_ < kBN / 16; ++ks_) {
      std::uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<T>(sc[mt][2 * ks_][0], sc[mt][2 * ks_][1]);
        a[mt][1] = pack2<T>(sc[mt][2 * ks_][2], sc[mt][2 * ks_][3]);
        a[mt][2] = pack2<T>(sc[mt][2 * ks_ + 1][0], sc[mt][2 * ks_ + 1][1]);
        a[mt][3] = pack2<T>(sc[mt][2 * ks_ + 1][2], sc[mt][2 * ks_ + 1][3]);
      }
#pragma unroll
      for (int np = 0; np < kDT / 2; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, vs, kLd, np * 16, ks_ * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(o[mt][2 * np], a[mt], bf[0], bf[1]);
          mma16816<T>(o[mt][2 * np + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
  }
  cp_async_wait_all();  // nothing may stay in flight

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r] + __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = row0 + mt * 16 + 8 * r;
      const float inv = sum > 0.0f ? p.keep_scale / sum : 0.0f;
      if (i < s.sq) {
        T* out = row_ptr<T>(p.out, b, s.q_base + i, h);
#pragma unroll
        for (int nt = 0; nt < kDT; ++nt) {
          const int c = nt * 8 + 2 * t;
          if (c < p.dv)
            *reinterpret_cast<std::uint32_t*>(out + c) =
                pack2<T>(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
        }
        if (t == 0) p.lse[lse_index(p, s, b, h, i)] = sum > 0.0f ? m[mt][r] * kLn2 + logf(sum) : neg_inf();
      }
    }
}

// ---- backward: delta = rowsum(dout * out), dq accumulator zeroing, dq conversion -------------------
//
// Memory-bound row kernels over the (token, head) rows: kRowThreads threads per row, each taking
// 16-byte pieces (8 elements of out / dout / dq, 4 or 8 floats of the accumulator), so that short
// rows (D = 64) still give every lane full-width accesses; 256 threads per block.
// The launcher takes kRowThreads = (head-dim bucket) / 8: 8 for D <= 64, 16 up to 128, 32 above.

struct RowOf {
  std::int64_t row;  // token * heads_q + h
  int b, h;
  std::int64_t tok;  // within the sequence (or the packed token with variable lengths)
};

__device__ __forceinline__ RowOf row_of(const KernelParams& p, std::int64_t row) {
  const std::int64_t token = row / p.heads_q;
  RowOf r{row, 0, static_cast<int>(row % p.heads_q), token};
  if (p.cu_q == nullptr) {
    r.b = static_cast<int>(token / p.seqlen_q);
    r.tok = token % p.seqlen_q;
  }
  return r;
}

template <typename T, int kRowThreads>
__global__ void __launch_bounds__(256) preprocess_kernel(const KernelParams p) {
  constexpr int kRowsPerBlock = 256 / kRowThreads;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int part = threadIdx.x % kRowThreads;
  const bool valid = row < p.total_q * p.heads_q;
  const RowOf r = row_of(p, valid ? row : 0);
  float sum = 0.0f;
  if (valid) {
    const T* o = row_ptr<const T>(p.out, r.b, r.tok, r.h);
    const T* g = row_ptr<const T>(p.dout, r.b, r.tok, r.h);
    for (int c = part * 8; c < p.dv; c += kRowThreads * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c), gv = *reinterpret_cast<const uint4*>(g + c);
      const std::uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 a = unpack2<T>(ow[k]), d = unpack2<T>(gw[k]);
        sum += a.x * d.x + a.y * d.y;
      }
    }
  }
#pragma unroll
  for (int s = kRowThreads / 2; s >= 1; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (!valid) return;
  if (part == 0)
    p.delta[p.cu_q != nullptr ? static_cast<std::int64_t>(r.h) * p.total_q + r.tok
                               : (static_cast<std::int64_t>(r.b) * p.heads_q + r.h) * p.seqlen_q + r.tok] = sum;
  if (p.dq_accum != nullptr) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + row * p.d);
    for (int c = part; c < p.d / 4; c += kRowThreads) acc[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// dq = scale * accumulator, rounded.
template <typename T, int kRowThreads>
__global__ void __launch_bounds__(256) convert_dq_kernel(const KernelParams p) {
  constexpr int kRowsPerBlock = 256 / kRowThreads;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int part = threadIdx.x % kRowThreads;
  if (row >= p.total_q * p.heads_q) return;
  const RowOf r = row_of(p, row);
  T* dq = row_ptr<T>(p.grad_q, r.b, r.tok, r.h);
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum + row * p.d);
  for (int c = part * 8; c < p.d; c += kRowThreads * 8) {
    const float4 a = acc[c / 4], b = acc[c / 4 + 1];
    *reinterpret_cast<uint4*>(dq + c) =
        make_uint4(pack2<T>(a.x * p.scale, a.y * p.scale), pack2<T>(a.z * p.scale, a.w * p.scale),
                   pack2<T>(b.x * p.scale, b.y * p.scale), pack2<T>(b.z * p.scale, b.w * p.scale));
  }
}

// Every logical element of dbias set to 0 (the direct path then overwrites what it produces).
// One row (b, h, i) per block iteration, threads along the keys.
// static: a kernel that is no template, defined in a header.
static __global__ void __launch_bounds__(256) zero_dbias_kernel(const BiasArg db) {
  const std::int64_t rows = db.shape[0] * db.shape[1] * db.shape[2];
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int i = static_cast<int>(row % db.shape[2]);
    const std::int64_t rest = row / db.shape[2];
    const int h = static_cast<int>(rest % db.shape[1]), b = static_cast<int>(rest / db.shape[1]);
    for (int j = threadIdx.x; j < db.shape[3]; j += blockDim.x) store_bias(db, b, h, i, j, 0.0f);
  }
}

// ---- backward: dS of a (64 queries) x (kBN keys) tile in the S layout ---------------------------

// Per-row state of the S-layout backward kernels: rows g (r = 0) and g + 8 (r = 1) of a warp.
struct RowState {
  int lo[2], hi[2];      // visible keys
  float lse2[2];         // lse * log2(e); +inf for rows with nothing visible or past the end
  float delta[2];
};

__device__ __forceinline__ RowState row_state(const KernelParams& p, const Seq& s, const MaskRule& rule, int b,
                                              int h, int i_first) {
  RowState st;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i_first + 8 * r;
    rule.range(i, st.lo[r], st.hi[r]);
    st.lse2[r] = pos_inf();
    st.delta[r] = 0.0f;
    if (i < s.sq) {
      const std::int64_t index = lse_index(p, s, b, h, i);
      const float lse = p.lse[index];
      // A fully masked row (lse = -inf) contributes nothing: P = exp(S - inf) = 0, never NaN.
      st.lse2[r] = lse == neg_inf() ? pos_inf() : lse * kLog2e;
      st.delta[r] = p.delta[index];
    }
  }
  return st;
}

// ds[kNT][4] = dS of the warp's 16 query rows (i0 + 16 warp ..) against keys j0 .. j0 + kBN,
// recomputed from the tiles in shared memory: S = Q K^T, P = exp(S - lse), dP = dO V^T,
// dS = P * (dP * Z - delta). Entries of masked elements and rows or keys past the end are 0.
template <typename T, int kD, int kBN, int kLd>
__device__ __forceinline__ void ds_tile(float (&ds)[kBN / 8][4], const KernelParams& p, const T* qs, const T* dos,
                                        const T* ks, const T* vs, const std::uint8_t* keep, const RowState& st,
                                        int b, int h, int i0, int j0) {
  constexpr int kNT = kBN / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float dp[kNT][4];
  zero(ds);
  zero(dp);
  mma_abt<T, kNT, kD>(ds, qs, kLd, warp * 16, ks, kLd, 0, p.dp);
  mma_abt<T, kNT, kD>(dp, dos, kLd, warp * 16, vs, kLd, 0, p.dvp);
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, jl = nt * 8 + 2 * t + (e & 1), j = j0 + jl, il = warp * 16 + g + 8 * r;
      float x = neg_inf();
      if (j >= st.lo[r] && j < st.hi[r]) {
        x = ds[nt][e] * p.scale_log2;
        if (p.bias.data != nullptr) x += kLog2e * load_bias(p.bias, b, h, i0 + il, j);
      }
      const float prob = exp2f(x - st.lse2[r]);
      float dpv = dp[nt][e];
      if (p.dropout) dpv = kept<kBN>(keep, il, jl) ? dpv * p.keep_scale : 0.0f;
      ds[nt][e] = prob * (dpv - st.delta[r]);
    }
}

template <int kD, int kBN>
struct BwdRowShape {  // dq_kernel and dbias_kernel
  static constexpr int kWarps = 4, kThreads = 128, kBM = 64, kLd = kD + 8;
  static constexpr int smem_bytes() {
    return (2 * kBM + 2 * kBN) * kLd * 2 + kBM * kBN / 8 + kWarps * kBN * 4;
  }
};

// ---- backward: dq (deterministic mode) ------------------------------------------------------------

template <typename T, int kD, int kBN>
__global__ void __launch_bounds__(128) dq_kernel(const KernelParams p) {
  using Shape = BwdRowShape<kD, kBN>;
  constexpr int kBM = Shape::kBM, kLd = Shape::kLd, kThreads = Shape::kThreads;
  constexpr int kDT = kD / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* dos = qs + kBM * kLd;
  T* ks = dos + kBM * kLd;
  T* vs = ks + kBN * kLd;
  std::uint8_t* keep = reinterpret_cast<std::uint8_t*>(vs + kBN * kLd);

  const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * kBM;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  load_tile<T, kBM, kD, kLd, kThreads>(qs, row_ptr<const T>(p.q, b, s.q_base + i0, h), p.q.s, s.sq - i0, p.d, p.dp);
  load_tile<T, kBM, kD, kLd, kThreads>(dos, row_ptr<const T>(p.dout, b, s.q_base + i0, h), p.dout.s, s.sq - i0,
                                       p.dv, p.dvp);
  const MaskRule rule = mask_rule(p, s);
  const RowState st = row_state(p, s, rule, b, h, i0 + warp * 16 + g);
  int jb_begin = 0, jb_end = 0;
  {
    int lo0, hi0, lo1, hi1;
    rule.range(i0, lo0, hi0);
    rule.range(min(i0 + kBM, s.sq) - 1, lo1, hi1);
    if (hi1 > lo0) {
      jb_begin = lo0 / kBN;
      jb_end = (hi1 + kBN - 1) / kBN;
    }
  }

  float dq[kDT][4];
  zero(dq);
  for (int jb = jb_begin; jb < jb_end; ++jb) {
    const int j0 = jb * kBN;
    __syncthreads();
    load_tile<T, kBN, kD, kLd, kThreads>(ks, row_ptr<const T>(p.k, b, s.k_base + j0, hk), p.k.s, s.sk - j0, p.d,
                                         p.dp);
    load_tile<T, kBN, kD, kLd, kThreads>(vs, row_ptr<const T>(p.v, b, s.k_base + j0, hk), p.v.s, s.sk - j0, p.dv,
                                         p.dvp);
    if (p.dropout) compute_keep_bits<kBM, kBN, kThreads>(keep, p, b, h, i0, j0);
    cp_async_wait_all();
    __syncthreads();
    float ds[kBN / 8][4];
    ds_tile<T, kD, kBN, kLd>(ds, p, qs, dos, ks, vs, keep, st, b, h, i0, j0);
    mma_regs_b<T, kDT, kBN>(dq, ds, ks, kLd, 0, p.dp);  // dQ += dS K (K stored [key][d])
  }
  cp_async_wait_all();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + warp * 16 + g + 8 * r;
    if (i >= s.sq) continue;
    T* out = row_ptr<T>(p.grad_q, b, s.q_base + i, h);
#pragma unroll
    for (int nt = 0; nt < kDT; ++nt) {
      const int c = nt * 8 + 2 * t;
      if (c < p.d)
        *reinterpret_cast<std::uint32_t*>(out + c) =
            pack2<T>(dq[nt][2 * r] * p.scale, dq[nt][2 * r + 1] * p.scale);
    }
  }
}

// ---- backward: dbias reduced over broadcast dims ----------------------------------------------------

// Grid: one CTA per dbias tile, blockIdx.x = ((b' * nh' + h') * n_row_tiles + row tile) * n_key_tiles
// + key tile. A dim of size 1 in dbias is summed over (all batches, all heads, all query rows).
template <typename T, int kD, int kBN>
__global__ void __launch_bounds__(128) dbias_kernel(const KernelParams p) {
  using Shape = BwdRowShape<kD, kBN>;
  constexpr int kBM = Shape::kBM, kLd = Shape::kLd, kThreads = Shape::kThreads, kWarps = Shape::kWarps;
  constexpr int kNT = kBN / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* dos = qs + kBM * kLd;
  T* ks = dos + kBM * kLd;
  T* vs = ks + kBN * kLd;
  std::uint8_t* keep = reinterpret_cast<std::uint8_t*>(vs + kBN * kLd);
  float* colsum = reinterpret_cast<float*>(keep + kBM * kBN / 8);  // [kWarps][kBN]

  const BiasArg& db = p.dbias;
  const bool sum_b = db.shape[0] == 1, sum_h = db.shape[1] == 1, sum_i = db.shape[2] == 1;
  const int n_key_tiles = static_cast<int>((db.shape[3] + kBN - 1) / kBN);
  const int n_row_tiles = sum_i ? 1 : static_cast<int>((db.shape[2] + kBM - 1) / kBM);
  int tile = blockIdx.x;
  const int jt = tile % n_key_tiles;
  tile /= n_key_tiles;
  const int it = tile % n_row_tiles;
  tile /= n_row_tiles;
  const int hh = static_cast<int>(tile % db.shape[1]), bb = static_cast<int>(tile / db.shape[1]);
  const int j0 = jt * kBN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  float acc[kNT][4];
  zero(acc);
  const int b_begin = sum_b ? 0 : bb, b_end = sum_b ? p.batch : min(bb + 1, p.batch);
  const int h_begin = sum_h ? 0 : hh, h_end = sum_h ? p.heads_q : min(hh + 1, p.heads_q);
  for (int b = b_begin; b < b_end; ++b) {
    const Seq s = seq_of(p, b);
    if (j0 >= s.sk) continue;
    const MaskRule rule = mask_rule(p, s);
    const int j1 = min(j0 + kBN, s.sk);
    for (int h = h_begin; h < h_end; ++h) {
      const int hk = h / p.group;
      const int ib_begin = sum_i ? 0 : it, ib_end = sum_i ? (s.sq + kBM - 1) / kBM : it + 1;
      for (int ib = ib_begin; ib < ib_end; ++ib) {
        const int i0 = ib * kBM;
        if (i0 >= s.sq) break;
        if (!rule.block_visible(i0, min(i0 + kBM, s.sq), j0, j1)) continue;
        __syncthreads();
        // K and V are reloaded per query block: simple, and this path is rare (broadcast dbias).
        load_tile<T, kBN, kD, kLd, kThreads>(ks, row_ptr<const T>(p.k, b, s.k_base + j0, hk), p.k.s, s.sk - j0,
                                             p.d, p.dp);
        load_tile<T, kBN, kD, kLd, kThreads>(vs, row_ptr<const T>(p.v, b, s.k_base + j0, hk), p.v.s, s.sk - j0,
                                             p.dv, p.dvp);
        load_tile<T, kBM, kD, kLd, kThreads>(qs, row_ptr<const T>(p.q, b, s.q_base + i0, h), p.q.s, s.sq - i0,
                                             p.d, p.dp);
        load_tile<T, kBM, kD, kLd, kThreads>(dos, row_ptr<const T>(p.dout, b, s.q_base + i0, h), p.dout.s,
                                             s.sq - i0, p.dv, p.dvp);
        if (p.dropout) compute_keep_bits<kBM, kBN, kThreads>(keep, p, b, h, i0, j0);
        const RowState st = row_state(p, s, rule, b, h, i0 + warp * 16 + g);
        cp_async_wait_all();
        __syncthreads();
        float ds[kNT][4];
        ds_tile<T, kD, kBN, kLd>(ds, p, qs, dos, ks, vs, keep, st, b, h, i0, j0);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] += ds[nt][e];
      }
    }
  }

  if (!sum_i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = it * kBM + warp * 16 + g + 8 * r;
      if (i >= db.shape[2]) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = j0 + nt * 8 + 2 * t + c;
          if (j < db.shape[3]) store_bias(db, bb, hh, i, j, acc[nt][2 * r + c]);
        }
    }
    return;
  }
  // Query dim reduced: sum the 64 rows of the tile. Rows g and g + 8 in the thread, then the 8
  // values of g across the warp (lane bits 2..4), then the warps in order.
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float v = acc[nt][c] + acc[nt][2 + c];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (g == 0) colsum[warp * kBN + nt * 8 + 2 * t + c] = v;
    }
  __syncthreads();
  for (int jl = threadIdx.x; jl < kBN; jl += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += colsum[w * kBN + jl];
    if (j0 + jl < db.shape[3]) store_bias(db, bb, hh, 0, j0 + jl, v);
  }
}

// ---- backward: dk, dv (and dq through atomics, dbias directly) ----------------------------------

// kWarps warps; phase 1 splits the kBN keys into kBN / 16 warp rows and the kBM queries into
// kWD = kWarps / (kBN / 16) parts; phase 2 the kBN keys likewise and the head dim into kWD parts;
// phase 3 the kBM queries into kBM / 16 warp rows and the head dim into the remaining factor.
// The S^T-layout counterpart of scores_from_bias: acc rows are 16 keys at jw (g, g + 8), columns
// kNT x 8 queries at iw (2t, 2t + 1 within each n-tile).
template <typename BT, int kNT>
__device__ __forceinline__ void scores_t_from_bias(float (&st)[kNT][4], const BiasArg& bias, float inv_scale, int b,
                                                   int h, int iw, int jw, int sq, int sk) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const BT* base = static_cast<const BT*>(bias.data) + static_cast<std::int64_t>(b) * bias.b +
                   static_cast<std::int64_t>(h) * bias.h;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = iw + nt * 8 + 2 * t + (e & 1), j = jw + g + 8 * (e / 2);
      float x = 0.0f;
      if (i < sq && j < sk) {
        const BT* at = base + static_cast<std::int64_t>(i) * bias.i + j;
        if constexpr (std::is_same_v<BT, float>) x = __ldg(at);
        else x = static_cast<float>(*at);
      }
      st[nt][e] = x * inv_scale;
    }
}

template <int kD, int kWarps_, int kBM_, int kBN_>
struct DkdvShape {
  static constexpr int kWarps = kWarps_, kThreads = kWarps * 32, kBM = kBM_, kBN = kBN_;
  static constexpr int kLd = kD + 8, kLdp = kBM + 8;
  // Resident CTAs per SM the register allocation must allow. D = 128: two 8-warp CTAs (128
  // registers, no spill) hide each other's load and barrier waits: H200, S=4096, backward 103.5
  // TFLOP/s with one CTA per SM (192 registers), 131 with two. D = 256 spills at 128 registers
  // and its shared memory admits one CTA anyway. D = 64 (4 warps): three CTAs (170 registers)
  // instead of two at 228: backward 104 -> 126 TFLOP/s at S=4096.
  static constexpr int kMinBlocks = kD == 128 ? 2 : kD == 64 ? 3 : 1;
  static constexpr int kWN = kBN / 16, kWD = kWarps / kWN, kQW = kBM / kWD, kDW = kD / kWD;
  static constexpr int kRG = kBM / 16, kWD3 = kWarps / kRG, kDW3 = kD / kWD3;
  static_assert(kWarps % kWN == 0 && kQW % 16 == 0 && kDW % 16 == 0, "phase 1 / 2 split");
  static_assert(kWarps % kRG == 0 && kDW3 % 16 == 0, "phase 3 split");
  static constexpr int smem_bytes() {
    return (2 * kBN + 2 * kBM) * kLd * 2 + 2 * kBN * kLdp * 2 + kBM * BiasTile<kBN>::kPitch + 4 * kBM * 4 +
           kBM * kBN / 8;
  }
};


// One body past 150 lines: its three phases share the shared-memory tiles, the barrier sequence
// between them and the register-resident dK / dV accumulators across the whole query loop.
template <typename T, int kD, int kWarps, int kBM, int kBN>
__global__ void __launch_bounds__(kWarps * 32, (DkdvShape<kD, kWarps, kBM, kBN>::kMinBlocks)) dkdv_kernel(const KernelParams p) {
  using Shape = DkdvShape<kD, kWarps, kBM, kBN>;
  constexpr int kThreads = Shape::kThreads, kLd = Shape::kLd, kLdp = Shape::kLdp;
  constexpr int kWN = Shape::kWN, kQW = Shape::kQW, kDW = Shape::kDW, kRG = Shape::kRG, kDW3 = Shape::kDW3;
  extern __shared__ __align__(16) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kBN * kLd;
  T* qs = vs + kBN * kLd;
  T* dos = qs + kBM * kLd;
  T* ps = dos + kBM * kLd;   // (P Z)^T: [key][query]
  T* dss = ps + kBN * kLdp;  // dS^T: [key][query]
  unsigned char* bias_s = reinterpret_cast<unsigned char*>(dss + kBN * kLdp);  // [query][key]
  float* lse_s = reinterpret_cast<float*>(bias_s + kBM * BiasTile<kBN>::kPitch);
  float* delta_s = lse_s + kBM;
  int* lo_s = reinterpret_cast<int*>(delta_s + kBM);
  int* hi_s = lo_s + kBM;
  std::uint8_t* keep = reinterpret_cast<std::uint8_t*>(hi_s + kBM);

  const int b = blockIdx.z, hk = blockIdx.y, j0 = blockIdx.x * kBN;
  const Seq s = seq_of(p, b);
  if (j0 >= s.sk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wn = warp % kWN, wq = warp / kWN;   // phases 1 and 2
  const int wm = warp % kRG, wd3 = warp / kRG;  // phase 3
  const int j1 = min(j0 + kBN, s.sk);

  load_tile<T, kBN, kD, kLd, kThreads>(ks, row_ptr<const T>(p.k, b, s.k_base + j0, hk), p.k.s, s.sk - j0, p.d, kD);
  load_tile<T, kBN, kD, kLd, kThreads>(vs, row_ptr<const T>(p.v, b, s.k_base + j0, hk), p.v.s, s.sk - j0, p.dv, kD);
  const MaskRule rule = mask_rule(p, s);
  // logits = (S + bias / scale) * mult, as in the forward.
  const bool has_qk = p.scale != 0.0f;
  const float mult0 = has_qk ? p.scale_log2 : kLog2e;
  const float inv_scale = has_qk ? 1.0f / p.scale : 1.0f;

  float dk[kDW / 8][4], dv[kDW / 8][4];
  zero(dk);
  zero(dv);
  int ib_first, ib_last;
  rule.query_blocks<kBM>(j0, j1, ib_first, ib_last);
  // Q, dO (and the bias tile) of query block i0 of head h. Issued one block ahead, while the
  // previous block's phase 3 runs.
  auto issue_loads = [&](int h, int i0) {
    load_tile<T, kBM, kD, kLd, kThreads>(qs, row_ptr<const T>(p.q, b, s.q_base + i0, h), p.q.s, s.sq - i0, p.d, kD);
    load_tile<T, kBM, kD, kLd, kThreads>(dos, row_ptr<const T>(p.dout, b, s.q_base + i0, h), p.dout.s, s.sq - i0,
                                         p.dv, kD);
    if (p.bias_tile) load_bias_tile<kBM, kBN, kThreads>(bias_s, p.bias, b, h, i0, j0, s.sq - i0, s.sk - j0);
    cp_async_commit();
  };
  if (ib_first <= ib_last) issue_loads(hk * p.group, ib_first * kBM);
  for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
    for (int ib = ib_first; ib <= ib_last; ++ib) {
      const int i0 = ib * kBM;
      for (int il = threadIdx.x; il < kBM; il += kThreads) {
        const int i = i0 + il;
        float lse2 = pos_inf(), delta = 0.0f;
        if (i < s.sq) {
          const std::int64_t index = lse_index(p, s, b, h, i);
          const float lse = p.lse[index];
          lse2 = lse == neg_inf() ? pos_inf() : lse * kLog2e;
          delta = p.delta[index];
        }
        lse_s[il] = lse2;
        delta_s[il] = delta;
        rule.range(i, lo_s[il], hi_s[il]);
      }
      if (p.dropout) compute_keep_bits<kBM, kBN, kThreads>(keep, p, b, h, i0, j0);
      cp_async_wait_all();
      __syncthreads();  // this block's tiles landed; every warp is done with the previous dS
      // Keys every query row of the block sees (lo and hi never decrease with the row).
      int blk_lo, blk_hi, unused_lo, unused_hi;
      rule.range(min(i0 + kBM, s.sq) - 1, blk_lo, unused_hi);
      rule.range(i0, unused_lo, blk_hi);

      // Phase 1: S^T and dP^T for keys 16 wn .. (rows), queries q0w .. q0w + kQW (columns).
      const int q0w = wq * kQW;
      float st[kQW / 8][4], dpt[kQW / 8][4];
      if (p.bias.data == nullptr) {
        zero(st);
      } else if (p.bias_tile) {
#pragma unroll
        for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            st[nt][e] = inv_scale * bias_from_tile(bias_s, BiasTile<kBN>::kPitch, p.bias.dtype,
                                                   q0w + nt * 8 + 2 * t + (e & 1), wn * 16 + g + 8 * (e / 2));
      } else if (p.bias.dtype == kBiasF32) {
        scores_t_from_bias<float, kQW / 8>(st, p.bias, inv_scale, b, h, i0 + q0w, j0 + wn * 16, s.sq, s.sk);
      } else if (p.bias.dtype == kBiasF16) {
        scores_t_from_bias<__half, kQW / 8>(st, p.bias, inv_scale, b, h, i0 + q0w, j0 + wn * 16, s.sq, s.sk);
      } else {
        scores_t_from_bias<__nv_bfloat16, kQW / 8>(st, p.bias, inv_scale, b, h, i0 + q0w, j0 + wn * 16, s.sq, s.sk);
      }
      zero(dpt);
      if (has_qk) mma_abt<T, kQW / 8, kD>(st, ks, kLd, wn * 16, qs, kLd, q0w, kD);
      mma_abt<T, kQW / 8, kD>(dpt, vs, kLd, wn * 16, dos, kLd, q0w, kD);
      // The thread's query columns: lse (log2 units) and delta from shared memory once.
      float lse2[kQW / 8][2], dlt[kQW / 8][2];
#pragma unroll
      for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          lse2[nt][c] = lse_s[q0w + nt * 8 + 2 * t + c];
          dlt[nt][c] = delta_s[q0w + nt * 8 + 2 * t + c];
        }
      // As in the forward: a block every query row sees in full keeps the raw scores and folds
      // the multiplier into the exponent's FMA; other blocks scale and mask first.
      float mult = mult0;
      if (!(mult > 0.0f && j0 >= blk_lo && j0 + kBN <= blk_hi)) {
#pragma unroll
        for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jl = wn * 16 + g + 8 * (e / 2), il = q0w + nt * 8 + 2 * t + (e & 1);
            const int j = j0 + jl;
            st[nt][e] = (j >= lo_s[il] && j < hi_s[il]) ? st[nt][e] * mult : neg_inf();
          }
        mult = 1.0f;
      }
#pragma unroll
      for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = e & 1;
          const float prob = fast_exp2(fmaf(st[nt][e], mult, -lse2[nt][c]));
          float z = 1.0f;
          if (p.dropout) {
            const int jl = wn * 16 + g + 8 * (e / 2), il = q0w + nt * 8 + 2 * t + c;
            z = kept<kBN>(keep, il, jl) ? p.keep_scale : 0.0f;
          }
          st[nt][e] = prob * z;
          dpt[nt][e] = prob * (dpt[nt][e] * z - dlt[nt][c]);
        }
      if (p.dbias_direct && !p.dbias_tile) {
#pragma unroll
        for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = i0 + q0w + nt * 8 + 2 * t + (e & 1), j = j0 + wn * 16 + g + 8 * (e / 2);
            if (i < s.sq && j < s.sk) store_bias(p.dbias, b, h, i, j, dpt[nt][e]);
          }
      }
#pragma unroll
      for (int nt = 0; nt < kQW / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int at = (wn * 16 + g + 8 * r) * kLdp + q0w + nt * 8 + 2 * t;
          *reinterpret_cast<std::uint32_t*>(ps + at) = pack2<T>(st[nt][2 * r], st[nt][2 * r + 1]);
          *reinterpret_cast<std::uint32_t*>(dss + at) = pack2<T>(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
        }
      __syncthreads();

      // dbias = dS (every element has exactly this producer): 16-byte rows out of the dS^T tile.
      // Lanes pair up on the two 8-key halves of a 32-byte sector; 16 query rows per warp.
      if (p.dbias_tile) {
        constexpr int kPieces = kBN / 8;
        const std::uint16_t* d16 = reinterpret_cast<const std::uint16_t*>(dss);
        for (int idx = threadIdx.x; idx < kBM * kPieces; idx += kThreads) {
          const int il = (idx >> 1) % kBM, c = 2 * ((idx >> 1) / kBM) + (idx & 1), jc = c * 8, i = i0 + il;
          if (i >= s.sq) continue;
          std::uint32_t w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            w[e] = d16[(jc + 2 * e) * kLdp + il] | (static_cast<std::uint32_t>(d16[(jc + 2 * e + 1) * kLdp + il]) << 16);
          std::uint16_t* dst = static_cast<std::uint16_t*>(p.dbias.data) + static_cast<std::int64_t>(b) * p.dbias.b +
                               static_cast<std::int64_t>(h) * p.dbias.h + static_cast<std::int64_t>(i) * p.dbias.i +
                               j0 + jc;
          if (j0 + jc + 8 <= s.sk) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
          } else {
            for (int e = 0; e < 8 && j0 + jc + e < s.sk; ++e)
              dst[e] = static_cast<std::uint16_t>(w[e / 2] >> (16 * (e % 2)));
          }
        }
      }

      // Phase 2: dV += (P Z)^T dO, dK += dS^T Q for keys 16 wn .., head-dim columns wq * kDW ..
      if (p.want_dv) mma_ab<T, kDW / 8, kBM>(dv, ps, kLdp, wn * 16, dos, kLd, wq * kDW, kD);
      if (p.want_dk) mma_ab<T, kDW / 8, kBM>(dk, dss, kLdp, wn * 16, qs, kLd, wq * kDW, kD);
      __syncthreads();  // Q, dO and the bias tile are consumed: the next block's loads may start
      {
        const bool more_here = ib < ib_last;
        const int hn = more_here ? h : h + 1, ibn = more_here ? ib + 1 : ib_first;
        if (hn < (hk + 1) * p.group) issue_loads(hn, ibn * kBM);
      }

      // Phase 3: dQ part = dS K for queries 16 wm .., head-dim columns wd3 * kDW3 ..; float atomics.
      if (p.atomic_dq) {
        float dq[kDW3 / 8][4];
        zero(dq);
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          std::uint32_t a[4];
          load_a_trans(a, dss, kLdp, wm * 16, kk * 16);
#pragma unroll
          for (int np = 0; np < kDW3 / 16; ++np) {
            std::uint32_t bf[4];
            load_b_kn(bf, ks, kLd, wd3 * kDW3 + np * 16, kk * 16);
            mma16816<T>(dq[2 * np], a, bf[0], bf[1]);
            mma16816<T>(dq[2 * np + 1], a, bf[2], bf[3]);
          }
        }
        // 16-byte vector atomics (sm_90): lanes t and t ^ 1 swap halves so that the even lane
        // holds four consecutive columns of row g and the odd lane four of row g + 8 (a quarter
        // of the scalar atomics).
        const bool odd = t & 1;
        const int i = i0 + wm * 16 + g + (odd ? 8 : 0);
        float* row = i < s.sq ? p.dq_accum + (q_token(p, s, b, i) * p.heads_q + h) * p.d : nullptr;
#pragma unroll
        for (int nt = 0; nt < kDW3 / 8; ++nt) {
          const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[nt][0] : dq[nt][2], 1);
          const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[nt][1] : dq[nt][3], 1);
          const int c = wd3 * kDW3 + nt * 8 + 2 * (t & ~1);
          if (row != nullptr && c < p.d) {
            const float4 v = odd ? make_float4(r0, r1, dq[nt][2], dq[nt][3]) : make_float4(dq[nt][0], dq[nt][1], r0, r1);
            atomicAdd(reinterpret_cast<float4*>(row + c), v);
          }
        }
      }
    }
  }
  cp_async_wait_all();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = j0 + wn * 16 + g + 8 * r;
    if (j >= s.sk) continue;
#pragma unroll
    for (int nt = 0; nt < kDW / 8; ++nt) {
      const int c = wq * kDW + nt * 8 + 2 * t;
      if (p.want_dk && c < p.d)
        *reinterpret_cast<std::uint32_t*>(row_ptr<T>(p.grad_k, b, s.k_base + j, hk) + c) =
            pack2<T>(dk[nt][2 * r] * p.scale, dk[nt][2 * r + 1] * p.scale);
      if (p.want_dv && c < p.dv)
        *reinterpret_cast<std::uint32_t*>(row_ptr<T>(p.grad_v, b, s.k_base + j, hk) + c) =
            pack2<T>(dv[nt][2 * r], dv[nt][2 * r + 1]);
    }
  }
}

}  // namespace fusekit::attention::kernels
