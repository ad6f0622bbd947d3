#pragma once

#include <cstdint>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

struct LinearCrossEntropyBenchShape {
  std::int64_t tokens, vocab, hidden;
};

// (T, V, H) over the range: T 8192-32768, V 32000-262144, H 2048-8192.
const std::vector<LinearCrossEntropyBenchShape>& linear_cross_entropy_bench_shapes();
// Adds "linear_cross_entropy" rows: the call with dh and a float32 dW (fwd+bwd) and the loss-only
// call (fwd), each beside the plain cuBLAS GEMMs of the same shapes (cublas_plain), timed
// interleaved in the same run; prints each shape's workspace against the logits it replaces.
void bench_linear_cross_entropy(Report& report);

}  // namespace fusekit::bench
