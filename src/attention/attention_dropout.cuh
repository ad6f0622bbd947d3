// Dropout keep bits of the attention kernels. One philox::random4 call gives the keep bits of the
// 8 keys 8 m .. 8 m + 7 of one query (the mapping of attention_dropout_keeps, shared with the CPU
// reference); key blocks start at multiples of 8, so no call is made twice. The mma.sync kernels
// make a tile's bits into shared memory (compute_keep_bits); the Hopper kernels make them in the
// accumulator layouts of their wgmma, exchanging bytes by shuffles (keep_byte and below).
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/attention_params.h"
#include "fusekit/dropout.h"
#include "fusekit/philox.h"

namespace fusekit::attention::kernels {

// Keep bits of the (kBM queries at i0) x (kBN keys at j0) tile of (b, h): byte [il][jg] holds
// keys j0 + 8 jg + e (bit e) of query i0 + il. j0 is a multiple of 8: one Philox call per byte.
template <int kBM, int kBN, int kThreads>
__device__ __forceinline__ void compute_keep_bits(std::uint8_t* keep, const KernelParams& p, int b, int h, int i0,
                                                  int j0) {
  const std::uint64_t subsequence = attention_dropout_subsequence(
      p.offset, static_cast<std::uint64_t>(b), static_cast<std::uint64_t>(h), static_cast<std::uint64_t>(p.heads_q));
  constexpr int kGroups = kBN / 8;
  for (int idx = threadIdx.x; idx < kBM * kGroups; idx += kThreads) {
    const int il = idx / kGroups, jg = idx % kGroups;
    const std::uint64_t i = static_cast<std::uint64_t>(i0 + il);
    const std::uint64_t group = static_cast<std::uint64_t>(j0 / 8 + jg);
    const philox::Words4 w = philox::random4(p.seed, subsequence, (i << 29) + group);
    std::uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      bits |= static_cast<std::uint32_t>(dropout_random16_of_group(w, static_cast<std::uint64_t>(e)) >= p.threshold)
              << e;
    keep[idx] = static_cast<std::uint8_t>(bits);
  }
}

template <int kBN>
__device__ __forceinline__ bool kept(const std::uint8_t* keep, int il, int jl) {
  return (keep[il * (kBN / 8) + jl / 8] >> (jl % 8)) & 1u;
}

}  // namespace fusekit::attention::kernels

namespace fusekit::attention::sm90 {

// ---- dropout keep bits in the accumulator layouts ------------------------------------------------
//
// One philox::random4 call gives one byte: the keep bits of keys 8 m .. 8 m + 7 of one query (the
// mapping of attention_dropout_keeps, the one the mma.sync kernels and the CPU reference use). A
// byte's bits belong to several lanes of an accumulator, so every lane computes a share of the
// calls and the bytes are exchanged by shuffles: no call is made twice, nothing goes through
// shared memory, and the calls run while the tensor cores compute the step's scores.
__device__ __forceinline__ std::uint32_t keep_byte(const kernels::KernelParams& p, std::uint64_t subsequence, int i,
                                                   int key_group) {
  const philox::Words4 w =
      philox::random4(p.seed, subsequence, (static_cast<std::uint64_t>(i) << 29) + static_cast<std::uint64_t>(key_group));
  // Element e is half e % 2 of word e / 2 (dropout_random16_of_group); both halves of a word are
  // compared at once (per-halfword >=, 1 or 0), and the halves' bits folded into one byte.
  const std::uint32_t threshold2 = p.threshold * 0x10001u;  // threshold <= 0xFFFF in both halves
  const std::uint32_t v = __vsetgeu2(w.x, threshold2) | (__vsetgeu2(w.y, threshold2) << 2) |
                          (__vsetgeu2(w.z, threshold2) << 4) | (__vsetgeu2(w.w, threshold2) << 6);
  return (v | (v >> 15)) & 0xFFu;
}

// Forward, queries as rows: lane (g, t) holds rows row0 + 8 r and keys j0 + 8 c + 2 t + e of a
// 128-key block (c < 16). The byte of (r, c) is made by lane c % 4 of the quad, as byte c / 4 of
// its word for row r; words[r][s] is lane s's word, so the element's bit is
// (words[r][c % 4] >> (8 (c / 4) + 2 t + e)) & 1.
__device__ __forceinline__ void forward_keep_words(std::uint32_t (&words)[2][4], const kernels::KernelParams& p,
                                                   std::uint64_t subsequence, int row0, int j0, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    std::uint32_t own = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) own |= keep_byte(p, subsequence, row0 + 8 * r, j0 / 8 + t + 4 * m) << (8 * m);
#pragma unroll
    for (int src = 0; src < 4; ++src) words[r][src] = __shfl_sync(0xffffffffu, own, (lane & ~3) | src);
  }
}

// Backward, keys as rows: lane (g, t) holds keys 8 key_group0 + g + 8 r and queries
// i0 + 8 c + 2 t + e. The byte of (query, r) has one bit for each of the 8 lanes g of that t; the
// kBM / 2 bytes of a t are made kBM / 16 per lane (call k = 4 c + 2 e + r by lane k / (kBM / 16))
// and transposed by shuffles: bit k of the result is the keep bit of the lane's element (r, c, e).
// The mask's type: 32 bits with 64 queries per step (the common case: no 64-bit shifts).
template <int kBM>
using KeepMask = std::conditional_t<(kBM / 2 <= 32), std::uint32_t, std::uint64_t>;

template <int kBM>
__device__ __forceinline__ KeepMask<kBM> backward_keep_mask(const kernels::KernelParams& p, std::uint64_t subsequence,
                                                            int i0, int key_group0, int lane) {
  constexpr int kCalls = kBM / 16, kWords = kCalls / 4;
  static_assert(kCalls % 4 == 0 && kBM / 2 <= 64, "calls pack into whole words, the mask into 64 bits");
  const int g = lane / 4, t = lane % 4;
  std::uint32_t own[kWords] = {};
#pragma unroll
  for (int m = 0; m < kCalls; ++m) {
    const int k = g * kCalls + m, c = k >> 2, e = (k >> 1) & 1, r = k & 1;
    own[m / 4] |= keep_byte(p, subsequence, i0 + 8 * c + 2 * t + e, key_group0 + r) << (8 * (m % 4));
  }
  KeepMask<kBM> mask = 0;
#pragma unroll
  for (int src = 0; src < 8; ++src)
#pragma unroll
    for (int wi = 0; wi < kWords; ++wi) {
      const std::uint32_t w = __shfl_sync(0xffffffffu, own[wi], src * 4 + t);
      // bit g of each of the word's four bytes, gathered into four bits (the product's bits
      // 24-27 are exactly those bytes' low bits; no other partial products reach them)
      const std::uint32_t four = (((w >> g) & 0x01010101u) * 0x01020408u) >> 24;
      mask |= static_cast<KeepMask<kBM>>(four) << (src * kCalls + 4 * wi);
    }
  return mask;
}

}  // namespace fusekit::attention::sm90
