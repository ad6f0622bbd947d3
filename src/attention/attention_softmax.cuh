// The online-softmax update of the attention forwards (the mma.sync forward_kernel and the Hopper
// forward), one copy for both: their accumulators give a thread the same share of a row (pairs of
// adjacent columns, the row spread over the 4 lanes of a quad), only indexed differently.
#pragma once

#include "attention/attention_device.cuh"

namespace fusekit::attention::kernels {

// One row's step over a block of scores: s(c, e) is the thread's score of column pair c
// (kSCols pairs), element e; o(c, e) its O accumulator likewise (kOCols pairs); m and l the row's
// running max (log2 units) and sum. With mult = 1 the scores are logits already (scaled and
// masked); otherwise they are raw and mult > 0 is folded into the exponent's FMA (the max
// commutes with it). The scores become probabilities, O and l are rescaled to the new max.
template <int kSCols, int kOCols, typename Scores, typename Out>
__device__ __forceinline__ void online_softmax_row(Scores&& s, Out&& o, float& m, float& l, float mult) {
  float mx = neg_inf();
#pragma unroll
  for (int c = 0; c < kSCols; ++c) mx = fmaxf(mx, fmaxf(s(c, 0), s(c, 1)));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx * mult);
  const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // a row with nothing visible yet
  const float alpha = fast_exp2(m - m_use);                // 0 when m = -inf
  m = m_new;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < kSCols; ++c)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s(c, e);
      x = fast_exp2(fmaf(x, mult, -m_use));
      sum += x;
    }
  l = l * alpha + sum;
#pragma unroll
  for (int c = 0; c < kOCols; ++c) {
    o(c, 0) *= alpha;
    o(c, 1) *= alpha;
  }
}

}  // namespace fusekit::attention::kernels
