// The dropout mask as the kernels compute it, 8 elements (one chunk) at a time. Host/device code
// so that the tests check it on the CPU against dropout_keeps() (fusekit/dropout.h).
#pragma once

#include <cstdint>

#include "dropout/dropout_params.h"
#include "fusekit/philox.h"

namespace fusekit::dropout {

// The random values of a chunk of 8 elements travel as 4 words laid out like one Philox output:
// element 2j in the low half of word j, element 2j + 1 in the high half. The high half is
// compared in place (w >= threshold << 16), the low half after a mask.
struct MaskWords {
  std::uint32_t w[4];
  FUSEKIT_HOST_DEVICE bool kept(int i, const Scalars& s) const {
    return (i % 2) ? w[i / 2] >= s.keep_threshold_high : (w[i / 2] & 0xFFFFu) >= s.keep_threshold;
  }
};

// Without dropout the thresholds are 0 and any words keep every element: no Philox call.
FUSEKIT_HOST_DEVICE MaskWords no_mask() { return {{0u, 0u, 0u, 0u}}; }

// The 8 elements starting at linear index `first`, a multiple of 8: exactly one Philox call.
FUSEKIT_HOST_DEVICE MaskWords aligned_mask(const Scalars& s, std::uint64_t first) {
  if (!s.dropout()) return no_mask();
  const philox::Words4 r = s.random4(first / 8);
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
FUSEKIT_HOST_DEVICE MaskWords unaligned_mask(const Scalars& s, std::uint64_t first) {
  if (!s.dropout()) return no_mask();
  const int shift = static_cast<int>(first % 8), q = shift / 2;
  const philox::Words4 a = s.random4(first / 8);
  philox::Words4 b = a;
  if (shift != 0) b = s.random4(first / 8 + 1);
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

}  // namespace fusekit::dropout
