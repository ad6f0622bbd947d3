#pragma once

#include "bench/harness/bench.h"

namespace fusekit::bench {

// Adds "rope" rows: Llama-like q and k (B * S = 16384 tokens, Hq = 32, Hk = 8, bf16), forward and
// backward, at D = 128, D = 64, partial rotary r = 32 of D = 128, and interleaved pairs.
void bench_rope(Report& report);

}  // namespace fusekit::bench
