#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

// The shapes: three powers of two and one with N not a power of two.
const std::vector<std::pair<std::int64_t, std::int64_t>>& dropout_bench_shapes();
// Adds "bias_act_dropout" rows (fwd and bwd, gelu_tanh and relu, bf16, p = 0.1).
void bench_dropout(Report& report);

}  // namespace fusekit::bench
