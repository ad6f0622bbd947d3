// The rotary-embedding CUDA kernel: q and k of a block of tokens in one pass, forward or backward
// (the backward is the forward with the sine negated).
//
// A block takes tokens_per_block consecutive tokens (rope_config.h). Its rows (row = one head of
// one token, q's heads first, then k's) are handled by row groups of lanes_per_row lanes; lane l
// owns units l, l + lanes_per_row, ... of a row. A rotation unit is `W` consecutive elements
// (rotate_half: pairs j .. j + W - 1 with partners r / 2 further on, a second access; interleaved:
// W / 2 whole pairs); a pass unit is W elements of the dims r .. D - 1 (for rotate_half 2W where
// the dims allow: two accesses, as a rotation unit makes), copied when the output is not the input. A lane works through batches of rows_in_flight rows of one unit:
//  1. it issues the loads of its first batch;
//  2. while they are in flight, the block's threads compute m cos a_i and m sin a_i of every
//     (token, pair i) into shared memory: one accurate sincosf per token and pair (sincosf, not
//     __sincosf: angles reach 1e5 rad and more at long positions), shared by all heads of q and k;
//  3. after one barrier, each lane rotates and stores its batch, then loads the next.
// The config sizes blocks so that their rows are mostly one batch per lane: one round trip to
// memory, with the angles computed under it. Accesses are one W * sizeof(T) = 16-, 8- or 4-byte
// load or store where the alignment allows (the config chooses W), element by element otherwise.
// Every element of a row is read and written by the same thread, so the output may be the input.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/device_vector.cuh"
#include "rope/rope_config.h"
#include "rope/rope_math.h"
#include "rope/rope_params.h"

namespace fusekit::rope::kernels {

using detail::device::bit_copy;
using detail::device::from_float;
using detail::device::pack2;
using detail::device::to_float;

// The launch (rope_config.h's Launch) as the kernel reads it.
struct Geometry {
  int lanes_log2 = 0;        // log2(lanes_per_row)
  int tokens_per_block = 1;
  int rotation_units = 0;    // units of the rotated dims per row
  int units_q = 0, units_k = 0;  // units visited per row of q and of k (rotation + copied pass units)
  int cos_sin_stride = 0;    // float2 entries per token in shared memory (even)
  int slots_t = 0, slots_h = 0;  // row groups per block as tokens and heads: slots_t * heads + slots_h
  int pass_accesses = 1;     // accesses of W elements per pass unit: 1, or 2 (rotate_half only)
};

// ---- W consecutive elements: one access, or W element accesses --------------------------------

template <typename T, int W, bool ELEMENTWISE>
struct Piece;

// One access of W * sizeof(T) bytes (16, 8 or 4: 4, 2 or 1 words), W * sizeof(T)-byte aligned.
template <typename T, int W>
struct Piece<T, W, false> {
  static constexpr int kWords = W * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords == 1 || kWords == 2 || kWords == 4, "16-, 8- or 4-byte accesses");
  std::uint32_t word[kWords];

  __device__ __forceinline__ void load(const T* at) {
    if constexpr (kWords == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(at);
      word[0] = v.x, word[1] = v.y, word[2] = v.z, word[3] = v.w;
    } else if constexpr (kWords == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(at);
      word[0] = v.x, word[1] = v.y;
    } else {
      word[0] = *reinterpret_cast<const std::uint32_t*>(at);
    }
  }
  __device__ __forceinline__ void to_floats(float (&f)[W]) const {
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        f[j] = __uint_as_float(word[j]);
      } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f[2 * j] = __uint_as_float(word[j] << 16);  // bf16 is the high half of a float
        f[2 * j + 1] = __uint_as_float(word[j] & 0xFFFF0000u);
      } else {
        static_assert(std::is_same_v<T, __half>, "float, half or bfloat16");
        const float2 h = __half22float2(bit_copy<__half2>(word[j]));
        f[2 * j] = h.x;
        f[2 * j + 1] = h.y;
      }
    }
  }
  __device__ __forceinline__ void store_bits(T* at) const {
    if constexpr (kWords == 4) *reinterpret_cast<uint4*>(at) = make_uint4(word[0], word[1], word[2], word[3]);
    else if constexpr (kWords == 2) *reinterpret_cast<uint2*>(at) = make_uint2(word[0], word[1]);
    else *reinterpret_cast<std::uint32_t*>(at) = word[0];
  }
  static __device__ __forceinline__ void store(T* at, const float (&f)[W]) {
    std::uint32_t w[kWords];
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      if constexpr (std::is_same_v<T, float>) w[j] = __float_as_uint(f[j]);
      else w[j] = pack2<T>(f[2 * j], f[2 * j + 1]);
    }
    if constexpr (kWords == 4) *reinterpret_cast<uint4*>(at) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (kWords == 2) *reinterpret_cast<uint2*>(at) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<std::uint32_t*>(at) = w[0];
  }
};

// W element accesses: any alignment.
template <typename T, int W>
struct Piece<T, W, true> {
  T v[W];
  __device__ __forceinline__ void load(const T* at) {
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = at[i];
  }
  __device__ __forceinline__ void to_floats(float (&f)[W]) const {
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = to_float(v[i]);
  }
  __device__ __forceinline__ void store_bits(T* at) const {
#pragma unroll
    for (int i = 0; i < W; ++i) at[i] = v[i];
  }
  static __device__ __forceinline__ void store(T* at, const float (&f)[W]) {
#pragma unroll
    for (int i = 0; i < W; ++i) at[i] = from_float<T>(f[i]);
  }
};

// NP (cos, sin) pairs from shared memory; 16-byte reads when NP is even (the unit's first pair is
// then even and every token's entries start at an even index).
template <int NP>
__device__ __forceinline__ void load_cos_sin(const float2* at, float (&c)[NP], float (&s)[NP]) {
  if constexpr (NP % 2 == 0) {
#pragma unroll
    for (int j = 0; j < NP / 2; ++j) {
      const float4 v = reinterpret_cast<const float4*>(at)[j];
      c[2 * j] = v.x, s[2 * j] = v.y, c[2 * j + 1] = v.z, s[2 * j + 1] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const float2 v = at[j];
      c[j] = v.x, s[j] = v.y;
    }
  }
}

// The pair (x, y) rotated: x c - y s and y c + x s, each as one rounded product and one fused
// multiply-add, written out so that every instantiation (access width, unrolling) rounds alike.
__device__ __forceinline__ float rotated_first(float x, float y, float c, float s) {
  return __fmaf_rn(x, c, -__fmul_rn(y, s));
}
__device__ __forceinline__ float rotated_second(float x, float y, float c, float s) {
  return __fmaf_rn(y, c, __fmul_rn(x, s));
}

// The token's position: its sequence index, or position_ids[b, s].
__device__ __forceinline__ std::int64_t position_of(const Params& p, int b, int s) {
  if (!p.positions) return s;
  const std::int64_t i = b * p.pos_b_stride + s * p.pos_s_stride;
  return p.position_dtype == DType::i32 ? static_cast<std::int64_t>(static_cast<const std::int32_t*>(p.positions)[i])
                                        : static_cast<const std::int64_t*>(p.positions)[i];
}

// Where each token of the block starts in q_in, k_in (in[0], in[1]) and q_out, k_out: computed
// once per block, so that a row's address is a shared-memory read and one multiply.
template <typename T>
struct TokenBases {
  const T* in[2];
  T* out[2];
};

// Walks the rows row0, row0 + slots, ... of a batch as (token t, head h) without a division per
// row: slots = slots_t * heads + slots_h (Geometry).
struct RowWalk {
  int t, h;
  __device__ __forceinline__ RowWalk(int row0, int heads) : t(row0 / heads), h(row0 - (row0 / heads) * heads) {}
  __device__ __forceinline__ void next(const Geometry& g, int heads) {
    t += g.slots_t;
    h += g.slots_h;
    if (h >= heads) h -= heads, ++t;
  }
};

// A batch of K rows of one unit (the unit's first element `first` in the row): its loads, then its
// rotation and stores.
template <typename T, RopeStyle STYLE, int W, bool ELEMENTWISE>
struct RowBatch {
  using P = Piece<T, W, ELEMENTWISE>;
  static constexpr int K = rows_in_flight(STYLE);
  static constexpr int NP = STYLE == RopeStyle::rotate_half ? W : W / 2;  // pairs per rotation unit
  static constexpr bool kHalf = STYLE == RopeStyle::rotate_half;

  P a[K], b[K];

  // The row (t, h) of unit u: false where it is past the block's tokens or u is a pass unit of an
  // in-place tensor (not visited).
  static __device__ __forceinline__ bool live(const Params& p, const Geometry& g, int tokens, const RowWalk& r, int u) {
    if (r.t >= tokens) return false;
    return u < (r.h >= static_cast<int>(p.heads_q) ? g.units_k : g.units_q);
  }
  static __device__ __forceinline__ std::int64_t head_offset(const Params& p, const RowWalk& r, bool in) {
    const int heads_q = static_cast<int>(p.heads_q);
    const bool is_k = r.h >= heads_q;
    const std::int64_t stride = in ? (is_k ? p.k_in.h_stride : p.q_in.h_stride)
                                   : (is_k ? p.k_out.h_stride : p.q_out.h_stride);
    return static_cast<std::int64_t>(is_k ? r.h - heads_q : r.h) * stride;
  }

  __device__ __forceinline__ void load(const Params& p, const Geometry& g, const TokenBases<T>* bases, int tokens,
                                       int row0, int u, int first, bool rotation, int half) {
    const int heads = static_cast<int>(p.heads_q + p.heads_k);
    // rotate_half's second access: the partner r / 2 on, or a pass unit's second W elements.
    const bool second = rotation || g.pass_accesses == 2;
    const int second_at = rotation ? half : W;
    RowWalk r(row0, heads);
#pragma unroll
    for (int k = 0; k < K; ++k, r.next(g, heads)) {
      if (!live(p, g, tokens, r, u)) continue;
      const T* in = bases[r.t].in[r.h >= static_cast<int>(p.heads_q)] + head_offset(p, r, true) + first;
      a[k].load(in);
      if (kHalf && second) b[k].load(in + second_at);
    }
  }

  __device__ __forceinline__ void rotate_and_store(const Params& p, const Geometry& g, const TokenBases<T>* bases,
                                                   const float2* cos_sin, int tokens, int row0, int u, int first,
                                                   bool rotation, int half, int pair0) const {
    const int heads = static_cast<int>(p.heads_q + p.heads_k);
    RowWalk r(row0, heads);
#pragma unroll
    for (int k = 0; k < K; ++k, r.next(g, heads)) {
      if (!live(p, g, tokens, r, u)) continue;
      T* out = bases[r.t].out[r.h >= static_cast<int>(p.heads_q)] + head_offset(p, r, false) + first;
      if (!rotation) {  // a copied pass unit: the bits as loaded
        a[k].store_bits(out);
        if (kHalf && g.pass_accesses == 2) b[k].store_bits(out + W);
        continue;
      }
      float x[W];
      a[k].to_floats(x);
      float c[NP], s[NP];
      load_cos_sin<NP>(cos_sin + r.t * g.cos_sin_stride + pair0, c, s);
      if constexpr (kHalf) {
        float y[W], x_out[W], y_out[W];
        b[k].to_floats(y);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          x_out[e] = rotated_first(x[e], y[e], c[e], s[e]);
          y_out[e] = rotated_second(x[e], y[e], c[e], s[e]);
        }
        P::store(out, x_out);
        P::store(out + half, y_out);
      } else {
        float o[W];
#pragma unroll
        for (int m = 0; m < NP; ++m) {
          o[2 * m] = rotated_first(x[2 * m], x[2 * m + 1], c[m], s[m]);
          o[2 * m + 1] = rotated_second(x[2 * m], x[2 * m + 1], c[m], s[m]);
        }
        P::store(out, o);
      }
    }
  }
};

template <typename T, RopeStyle STYLE, int W, bool ELEMENTWISE>
__global__ void __launch_bounds__(kThreads) rope_kernel(const __grid_constant__ Params p, const Geometry g) {
  static_assert(STYLE == RopeStyle::rotate_half || W % 2 == 0, "an interleaved unit holds whole pairs");
  using Batch = RowBatch<T, STYLE, W, ELEMENTWISE>;
  constexpr int K = Batch::K;
  constexpr bool kHalf = Batch::kHalf;

  extern __shared__ __align__(16) unsigned char smem[];
  float2* cos_sin = reinterpret_cast<float2*>(smem);
  TokenBases<T>* bases = reinterpret_cast<TokenBases<T>*>(cos_sin + g.tokens_per_block * g.cos_sin_stride);

  // Tokens < 2^31 (checked by the entry point): 32-bit token coordinates.
  const int seqlen = static_cast<int>(p.seqlen);
  const int first_token = static_cast<int>(blockIdx.x) * g.tokens_per_block;
  const int tokens = min(g.tokens_per_block, static_cast<int>(p.batch * p.seqlen) - first_token);
  const int half = static_cast<int>(p.rotary_dim / 2);

  // ---- 1. where the block's tokens start in each tensor ----
  if (threadIdx.x < tokens) {
    const int token = first_token + static_cast<int>(threadIdx.x);
    const std::int64_t b = token / seqlen, s = token - (token / seqlen) * seqlen;
    auto at = [&](const Operand& op) { return static_cast<T*>(op.data) + (b * op.b_stride + s * op.s_stride); };
    TokenBases<T> t;
    t.in[0] = at(p.q_in), t.out[0] = at(p.q_out);
    t.in[1] = p.heads_k > 0 ? at(p.k_in) : nullptr;
    t.out[1] = p.heads_k > 0 ? at(p.k_out) : nullptr;
    bases[threadIdx.x] = t;
  }
  __syncthreads();

  const int lanes = 1 << g.lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int slot = threadIdx.x >> g.lanes_log2;
  const int slots = blockDim.x >> g.lanes_log2;
  const int rows = tokens * static_cast<int>(p.heads_q + p.heads_k);
  const int units = max(g.units_q, p.heads_k > 0 ? g.units_k : 0);

  // The lane's work is a sequence of (unit u, batch row0) items. The unit's first element in the
  // row and its first pair:
  auto first_of = [&](int u) {
    return u < g.rotation_units ? u * W
                                : static_cast<int>(p.rotary_dim) + (u - g.rotation_units) * W * g.pass_accesses;
  };
  auto pair0_of = [&](int u) { return kHalf ? u * W : u * (W / 2); };

  // ---- 2. the first batch's loads, in flight while the angles are computed ----
  Batch batch;
  int u = lane, row0 = slot;
  if (u < units) batch.load(p, g, bases, tokens, row0, u, first_of(u), u < g.rotation_units, half);

  // ---- 3. m cos a_i, m sin a_i (sine negated backward) of the block's tokens ----
  for (int e = threadIdx.x; e < tokens * half; e += blockDim.x) {
    const int t = e / half, i = e - t * half;
    const int token = first_token + t;
    const int b = token / seqlen, s = token - b * seqlen;
    const std::int64_t position = position_of(p, b, s);
    float c, sn;
    if (p.source == AngleSource::cos_sin) {
      if (position >= 0 && position < p.table_rows) {
        c = p.cos_table[position * p.cos_row_stride + i];
        sn = p.sin_table[position * p.sin_row_stride + i];
      } else {  // outside the tables: NaN rather than a read out of bounds (fusekit/rope.h)
        c = sn = __int_as_float(0x7fc00000);
      }
    } else {
      const float inv_freq = p.source == AngleSource::theta ? p.inv_freq[i] : p.inv_freq_table[i];
      sincosf(rotary_angle(position_as_float(position), inv_freq), &sn, &c);
    }
    c *= p.attention_scaling;
    sn *= p.attention_scaling;
    cos_sin[t * g.cos_sin_stride + i] = make_float2(c, p.transpose ? -sn : sn);
  }
  __syncthreads();

  // ---- 4. rotate and store each batch, loading the next ----
  while (u < units) {
    const bool rotation = u < g.rotation_units;
    batch.rotate_and_store(p, g, bases, cos_sin, tokens, row0, u, first_of(u), rotation, half, pair0_of(u));
    row0 += K * slots;
    if (row0 >= rows) row0 = slot, u += lanes;
    if (u < units) batch.load(p, g, bases, tokens, row0, u, first_of(u), u < g.rotation_units, half);
  }
}

}  // namespace fusekit::rope::kernels
