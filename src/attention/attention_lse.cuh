// The layout of the log-sum-exp (and of the backward's delta, laid out alike): (B, Hq, Sq) with
// fixed lengths, (Hq, Tq) with variable lengths.
#pragma once

#include <cstdint>

#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"

namespace fusekit::attention::kernels {

// Index of row i of (b, h) in lse / delta: (B, Hq, Sq) or (Hq, Tq).
__device__ __forceinline__ std::int64_t lse_index(const KernelParams& p, const Seq& s, int b, int h, int i) {
  return p.cu_q != nullptr ? static_cast<std::int64_t>(h) * p.total_q + s.q_base + i
                           : (static_cast<std::int64_t>(b) * p.heads_q + h) * p.seqlen_q + i;
}

}  // namespace fusekit::attention::kernels
