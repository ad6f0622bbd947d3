#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

// (M, F): Llama-like MLPs at 16384 tokens (F = 5632, 8192, 11008, 14336) and a few smaller
// problems (fewer tokens, narrower F).
const std::vector<std::pair<std::int64_t, std::int64_t>>& gated_act_bench_shapes();
// Adds "gated_act" rows (fwd and bwd, bf16): silu in each input form, gelu_tanh and gelu_erf in halves.
void bench_gated_act(Report& report);

}  // namespace fusekit::bench
