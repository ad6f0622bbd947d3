#pragma once

#include "bench/harness/bench.h"

namespace fusekit::bench {

// Adds "attention" rows: bf16, 16384 tokens (B = 16384 / S), model width 2048 as 16 heads of 128
// or 32 heads of 64, S in {1024, 4096}, causal and not; forward and backward (non-deterministic
// dq, the default), in TFLOP/s.
void bench_attention(Report& report);

}  // namespace fusekit::bench
