// The rotary-embedding CUDA kernel: q and k of a block of tokens in one pass, forward or backward
// (the backward is the forward with the sine negated).
//
// A block takes tokens_per_block consecutive tokens (rope_config.h):
//  1. Its threads compute m cos a_i and m sin a_i of every (token, pair i) into shared memory:
//     one accurate sincosf per token and pair (sincosf, not __sincosf: angles reach 1e5 rad and
//     more at long positions), shared by all heads of q and k.
//  2. After one barrier, the block streams its tokens' head rows (row = one head of one token,
//     q's heads first, then k's). A row group of lanes_per_row lanes handles a row; lane l owns
//     units l, l + lanes_per_row, ... of the row. A rotation unit is `W` consecutive elements
//     (rotate_half: pairs j .. j + W - 1 with partners r / 2 further on, a second access;
//     interleaved: W / 2 whole pairs); a pass unit is W elements of the dims r .. D - 1, copied
//     when the output is not the input. Each lane loads its unit of kRowsInFlight rows before
//     rotating and storing any of them. Accesses are one W * sizeof(T) = 16-, 8- or 4-byte load
//     or store where the alignment allows (the config chooses W), element by element otherwise.
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

template <typename T, RopeStyle STYLE, int W, bool ELEMENTWISE>
__global__ void __launch_bounds__(kThreads) rope_kernel(const __grid_constant__ Params p, const Geometry g) {
  static_assert(STYLE == RopeStyle::rotate_half || W % 2 == 0, "an interleaved unit holds whole pairs");
  using P = Piece<T, W, ELEMENTWISE>;
  constexpr int K = kRowsInFlight;
  constexpr int NP = STYLE == RopeStyle::rotate_half ? W : W / 2;  // pairs per rotation unit
  constexpr bool kHalf = STYLE == RopeStyle::rotate_half;

  extern __shared__ __align__(16) unsigned char smem[];
  float2* cos_sin = reinterpret_cast<float2*>(smem);
  int* token_b = reinterpret_cast<int*>(cos_sin + g.tokens_per_block * g.cos_sin_stride);
  int* token_s = token_b + g.tokens_per_block;

  // Tokens < 2^31 (checked by the entry point): 32-bit token coordinates.
  const int seqlen = static_cast<int>(p.seqlen);
  const int first_token = static_cast<int>(blockIdx.x) * g.tokens_per_block;
  const int tokens = min(g.tokens_per_block, static_cast<int>(p.batch * p.seqlen) - first_token);
  const int half = static_cast<int>(p.rotary_dim / 2);

  // ---- 1. m cos a_i, m sin a_i (sine negated backward) of the block's tokens ----
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
    if (i == 0) token_b[t] = b, token_s[t] = s;
  }
  __syncthreads();

  // ---- 2. the head rows ----
  const int lanes = 1 << g.lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int slot = threadIdx.x >> g.lanes_log2;
  const int slots = blockDim.x >> g.lanes_log2;
  const int heads_q = static_cast<int>(p.heads_q);
  const int heads = heads_q + static_cast<int>(p.heads_k);
  const int rows = tokens * heads;
  const int units = max(g.units_q, p.heads_k > 0 ? g.units_k : 0);

  for (int u = lane; u < units; u += lanes) {
    const bool rotation = u < g.rotation_units;
    // The unit's first element in the row and its first pair.
    const int first = rotation ? u * W : static_cast<int>(p.rotary_dim) + (u - g.rotation_units) * W;
    const int pair0 = kHalf ? u * W : u * (W / 2);
    for (int row0 = slot; row0 < rows; row0 += K * slots) {
      P a[K], b[K];
      T* out[K];
      int token[K];
      bool live[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int row = row0 + k * slots;
        live[k] = false;
        if (row >= rows) continue;
        const int t = row / heads, h = row - t * heads;
        const bool is_k = h >= heads_q;
        if (u >= (is_k ? g.units_k : g.units_q)) continue;  // a pass unit of an in-place tensor
        const int head = is_k ? h - heads_q : h;
        const std::int64_t tb = token_b[t], ts = token_s[t];
        const Operand in_op = is_k ? p.k_in : p.q_in;  // by value: selects, no parameter addresses
        const Operand out_op = is_k ? p.k_out : p.q_out;
        const T* in = static_cast<const T*>(in_op.data) + (tb * in_op.b_stride + ts * in_op.s_stride +
                                                         head * in_op.h_stride + first);
        out[k] = static_cast<T*>(out_op.data) + (tb * out_op.b_stride + ts * out_op.s_stride +
                                                 head * out_op.h_stride + first);
        token[k] = t;
        live[k] = true;
        a[k].load(in);
        if (kHalf && rotation) b[k].load(in + half);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!live[k]) continue;
        float x[W];
        a[k].to_floats(x);
        if (!rotation) {
          P::store(out[k], x);
          continue;
        }
        float c[NP], s[NP];
        load_cos_sin<NP>(cos_sin + token[k] * g.cos_sin_stride + pair0, c, s);
        if constexpr (kHalf) {
          float y[W], x_out[W], y_out[W];
          b[k].to_floats(y);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            x_out[e] = rotated_first(x[e], y[e], c[e], s[e]);
            y_out[e] = rotated_second(x[e], y[e], c[e], s[e]);
          }
          P::store(out[k], x_out);
          P::store(out[k] + half, y_out);
        } else {
          float o[W];
#pragma unroll
          for (int m = 0; m < NP; ++m) {
            o[2 * m] = rotated_first(x[2 * m], x[2 * m + 1], c[m], s[m]);
            o[2 * m + 1] = rotated_second(x[2 * m], x[2 * m + 1], c[m], s[m]);
          }
          P::store(out[k], o);
        }
      }
    }
  }
}

}  // namespace fusekit::rope::kernels
