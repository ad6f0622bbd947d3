#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "bench/harness/bench.h"

namespace fusekit::bench {

// (tokens, vocabulary): 8192 and 16384 tokens over the vocabularies of Llama 2 (32000), GPT-2
// (50257), Llama 3 (128256), Qwen 2 (151936) and Gemma (262144).
const std::vector<std::pair<std::int64_t, std::int64_t>>& cross_entropy_bench_shapes();
// Adds "cross_entropy" rows (fwd, bwd, fwd+bwd in place; bf16 logits, int64 targets, mean).
void bench_cross_entropy(Report& report);

}  // namespace fusekit::bench
