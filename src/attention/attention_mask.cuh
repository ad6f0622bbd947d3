// Sequence bounds and masks of the attention kernels (mma.sync and Hopper): where a sequence's
// tokens start (variable lengths) and how long it is, and the interval of keys each query row
// sees under the causal mask and the window (MaskRule).
#pragma once

#include <cstdint>

#include "attention/attention_params.h"

namespace fusekit::attention::kernels {

struct Seq {
  std::int64_t q_base = 0, k_base = 0;  // packed token of row 0 (varlen), else 0
  int sq = 0, sk = 0;
};

__device__ __forceinline__ Seq seq_of(const KernelParams& p, int b) {
  Seq s;
  if (p.cu_q != nullptr) {
    const int q0 = p.cu_q[b], q1 = p.cu_q[b + 1], k0 = p.cu_k[b], k1 = p.cu_k[b + 1];
    s.q_base = q0;
    s.k_base = k0;
    // The lengths are trusted (they are not read on the host); clamping keeps a bad vector
    // inside the grid and the padded bias.
    s.sq = min(max(q1 - q0, 0), p.seqlen_q);
    s.sk = min(max(k1 - k0, 0), p.seqlen_k);
  } else {
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  return s;
}

// The packed token of query row i (the dq accumulator is (token, h, d)).
__device__ __forceinline__ std::int64_t q_token(const KernelParams& p, const Seq& s, int b, int i) {
  return p.cu_q != nullptr ? s.q_base + i : static_cast<std::int64_t>(b) * p.seqlen_q + i;
}

// The visible keys of each query row of one sequence (fusekit/attention.h, "Masks and windows").
struct MaskRule {
  int sq = 0, sk = 0;
  std::int64_t diag = 0;
  bool causal = false;
  std::int64_t wl = -1, wr = -1;

  // [lo, hi) within [0, sk); empty (hi <= lo) when nothing is visible or i is not a row.
  __device__ __forceinline__ void range(int i, int& lo, int& hi) const {
    if (i < 0 || i >= sq) {
      lo = 0;
      hi = 0;
      return;
    }
    const std::int64_t di = i + diag;
    std::int64_t first = 0, last = static_cast<std::int64_t>(sk) - 1;
    if (causal) last = min(last, di);
    if (wr >= 0) last = min(last, di + wr);
    if (wl >= 0) first = max(first, di - wl);
    first = min(first, static_cast<std::int64_t>(sk));
    lo = static_cast<int>(first);
    hi = static_cast<int>(max(first, last + 1));
  }
  // Whether query rows [i0, i1) (i1 <= sq) see any key of [j0, j1).
  __device__ __forceinline__ bool block_visible(int i0, int i1, int j0, int j1) const {
    if (i1 <= i0) return false;
    int lo0, hi0, lo1, hi1;
    range(i0, lo0, hi0);
    range(i1 - 1, lo1, hi1);
    return max(lo0, j0) < min(hi1, j1);
  }
  // For the query rows [i0, i1) (i1 <= sq): the blocks of kBN keys any of them sees,
  // [jb_begin, jb_end) (empty if none), and the keys every one of them sees, [all_lo, all_hi)
  // (lo and hi never decrease with the row, so the first and the last row decide).
  template <int kBN>
  __device__ __forceinline__ void key_blocks(int i0, int i1, int& jb_begin, int& jb_end, int& all_lo,
                                             int& all_hi) const {
    int lo0, hi0, lo1, hi1;
    range(i0, lo0, hi0);
    range(i1 - 1, lo1, hi1);
    jb_begin = jb_end = 0;
    if (hi1 > lo0) {
      jb_begin = lo0 / kBN;
      jb_end = (hi1 + kBN - 1) / kBN;
    }
    all_lo = lo1;
    all_hi = hi0;
  }
  // The blocks of kBM query rows that see keys [j0, j1): one interval [ib_first, ib_last] (lo
  // and hi never decrease with the row); ib_last < ib_first when none does.
  template <int kBM>
  __device__ __forceinline__ void query_blocks(int j0, int j1, int& ib_first, int& ib_last) const {
    const int n_query_blocks = (sq + kBM - 1) / kBM;
    ib_first = n_query_blocks;
    ib_last = -1;
    for (int ib = 0; ib < n_query_blocks; ++ib)
      if (block_visible(ib * kBM, min(ib * kBM + kBM, sq), j0, j1)) {
        ib_first = min(ib_first, ib);
        ib_last = ib;
      }
  }
};

__device__ __forceinline__ MaskRule mask_rule(const KernelParams& p, const Seq& s) {
  MaskRule r;
  r.sq = s.sq;
  r.sk = s.sk;
  r.diag = p.top_left ? 0 : static_cast<std::int64_t>(s.sk) - s.sq;
  r.causal = p.causal != 0;
  r.wl = p.window_left;
  r.wr = p.window_right;
  return r;
}

}  // namespace fusekit::attention::kernels
