// The dropout mask as the kernels compute it, 8 elements (one chunk) at a time. Host/device code
// so that the tests check it on the CPU against dropout_keeps() (fusekit/dropout.h).
#pragma once

#include <cstdint>

#include "bias_act_dropout/bias_act_dropout_params.h"
#include "fusekit/philox.h"

namespace fusekit::bias_act_dropout {

// Philox's first round depends on the group number only through the counter's low half (n): the
// high half is the offset, fixed for a launch. The offset's multiply and its XORs with the first
// round keys are done once on the host; a kernel call then costs one multiply in round 1.
struct PhiloxPrefix {
  std::uint32_t a = 0, b = 0, c = 0;  // round-1 words: .x ^ n_hi, .y, .z ^ mul_hi(kMul0, n_lo)
};

inline PhiloxPrefix philox_prefix(const Scalars& s) {
  const std::uint32_t off_lo = static_cast<std::uint32_t>(s.offset);
  const std::uint32_t off_hi = static_cast<std::uint32_t>(s.offset >> 32);
  return {philox::mul_hi(philox::kMul1, off_lo) ^ s.key0[0], philox::kMul1 * off_lo, off_hi ^ s.key1[0]};
}

// s.random4(n) (= philox::random4(seed, offset, n)), the first round taken from the prefix.
FUSEKIT_HOST_DEVICE philox::Words4 random4_from(const Scalars& s, const PhiloxPrefix& pre, std::uint64_t n) {
  const std::uint32_t n_lo = static_cast<std::uint32_t>(n), n_hi = static_cast<std::uint32_t>(n >> 32);
  philox::Words4 c{pre.a ^ n_hi, pre.b, philox::mul_hi(philox::kMul0, n_lo) ^ pre.c, philox::kMul0 * n_lo};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 1; i < kPhiloxRounds; ++i) {
#if defined(__CUDA_ARCH__)
    // Each multiply as one 32 x 32 -> 64-bit instruction (ptxas otherwise often splits the high and
    // low halves into two).
    std::uint64_t p0, p1;
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(p0) : "r"(c.x), "r"(philox::kMul0));
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(p1) : "r"(c.z), "r"(philox::kMul1));
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c.y ^ s.key0[i], static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c.w ^ s.key1[i], static_cast<std::uint32_t>(p0)};
#else
    c = philox::round(c, s.key0[i], s.key1[i]);
#endif
  }
  return c;
}

// The random values of a chunk of 8 elements travel as 4 words laid out like one Philox output:
// element 2j in the low half of word j, element 2j + 1 in the high half.
struct MaskWords {
  std::uint32_t w[4];
  // Element i kept: its 16-bit value >= the keep threshold (the definition, for the tests).
  FUSEKIT_HOST_DEVICE bool kept(int i, std::uint32_t threshold) const {
    return ((i % 2) ? w[i / 2] >> 16 : w[i / 2] & 0xFFFFu) >= threshold;
  }
  // Elements 2j and 2j + 1 kept, against `threshold2` = the threshold in both 16-bit halves, with
  // 32-bit compares only: the high half's test is w >= threshold << 16 on the whole word.
  //
  // Not __vibmax_u16x2 (one packed 16-bit max that sets a predicate per half): on nvcc 13.0 /
  // sm_90a, kernels that also convert f16 data miscompile around it (the row-group forward
  // returned wrong y, non-finite values included, in BiasActDropoutGpu.RandomizedGridMatchesCpuReference
  // and RowGroupForwardShapes, f16 only; these compares pass every seed).
  FUSEKIT_HOST_DEVICE void kept_pair(int j, std::uint32_t threshold2, bool& lo, bool& hi) const {
    lo = (w[j] & 0xFFFFu) >= (threshold2 & 0xFFFFu);
    hi = w[j] >= (threshold2 & 0xFFFF0000u);
  }
};

// Without dropout the thresholds are 0 and any words keep every element: no Philox call.
FUSEKIT_HOST_DEVICE MaskWords no_mask() { return {{0u, 0u, 0u, 0u}}; }

// The 8 elements of Philox group `group` (linear indices 8 group .. 8 group + 7): one call.
FUSEKIT_HOST_DEVICE MaskWords aligned_mask(const Scalars& s, const PhiloxPrefix& pre, std::uint64_t group) {
  if (!s.dropout()) return no_mask();
  const philox::Words4 r = random4_from(s, pre, group);
  return {{r.x, r.y, r.z, r.w}};
}

// (hi:lo) >> n for n in {0, 16}: one funnel shift on the GPU.
FUSEKIT_HOST_DEVICE std::uint32_t funnel_right(std::uint32_t lo, std::uint32_t hi, int n) {
  return static_cast<std::uint32_t>(((static_cast<std::uint64_t>(hi) << 32) | lo) >> n);
}

// The 8 elements starting at any linear index `first`: they span one or two Philox groups, whose
// 16 halves h[0..15] (h[2j] the low half of word j of the pair) are re-packed into the chunk
// layout: word j of the chunk holds h[shift + 2j] and h[shift + 2j + 1], shift = first % 8. With
// shift = 2q + r that is a funnel shift by 16 r of words q + j and q + j + 1; q is picked with
// selects, never by indexing a register array at run time (which would go to local memory).
FUSEKIT_HOST_DEVICE MaskWords unaligned_mask(const Scalars& s, const PhiloxPrefix& pre, std::uint64_t first) {
  if (!s.dropout()) return no_mask();
  const int shift = static_cast<int>(first % 8), q = shift / 2;
  const philox::Words4 a = random4_from(s, pre, first / 8);
  philox::Words4 b = a;
  if (shift != 0) b = random4_from(s, pre, first / 8 + 1);
  const std::uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  std::uint32_t v[5];  // v[k] = w[q + k]
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < 5; ++k)
    v[k] = q == 0 ? w[k] : q == 1 ? w[k + 1] : q == 2 ? w[k + 2] : w[k + 3];
  MaskWords m;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 4; ++j) m.w[j] = funnel_right(v[j], v[j + 1], 16 * (shift % 2));
  return m;
}

}  // namespace fusekit::bias_act_dropout
